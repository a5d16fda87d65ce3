"""``lightning-sync demo``: README's main job. Its arguments are a valid ``compare`` grid (the packaged ``demo``
workload, DDP and the two slow-link rows, the emulated link), and a cut-down run of it (one seed, three steps, two
validation batches) writes the table with DDP as the reference row, the plots, and says which command runs the full
grid. Its measured wall time and table are in docs/results/index.md ("The demo"), not asserted here."""

from __future__ import annotations

import pytest

from lightning_sync.demo import DEMO_ARGS, main

pytestmark = pytest.mark.timeout(600)


def test_the_demo_is_a_compare_grid_of_ddp_and_the_slow_link_rows():
    from lightning_sync.compare import build_rows, parse_args

    args, extra, parser = parse_args([*DEMO_ARGS, "--out", "/nonexistent/never-written"])
    assert args.workload == "demo" and args.link == ["100mbit,1ms"] and args.workers and not extra
    rows = build_rows(args, args.workload, 0.1, parser)
    assert [r.label for r in rows] == ["ddp", "localsgd+bf16", "diloco+bf16"]
    assert all(not r.error for r in rows)
    assert "compression=bf16" in rows[1].cli_args and "period=32" in rows[1].cli_args


def test_a_cut_down_demo_writes_the_table_the_plots_and_the_full_grid_command(tmp_path, capsys):
    out = tmp_path / "demo"
    result = main(
        [
            "--seeds",
            "1",
            "--out",
            str(out),
            "--no-stop",
            "--trainer.max_epochs=1",
            "--trainer.limit_train_batches=3",
            "--trainer.limit_val_batches=2",
        ]
    )
    table = {r["method"]: r for r in result["tables"]["100mbit,1ms"]}
    assert list(table) == ["ddp", "localsgd+bf16", "diloco+bf16"]
    assert all(r["runs"] == 1 for r in table.values())
    for name in ("table.md", "metric_vs_time.png", "time_to_target.png"):
        assert (out / "100mbit-1ms" / name).stat().st_size > 0
    printed = capsys.readouterr().out
    assert printed.startswith("lightning-sync demo = lightning-sync compare --workload demo")
    assert "s so far" in printed and "The full grid" in printed and "lightning-sync compare --workload words" in printed
