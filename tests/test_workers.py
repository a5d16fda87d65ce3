"""``compare``'s worker processes (``--workers``, the default): the same runs as one ``lightning-sync fit`` per run.

* **Same trajectory**: a run trains the same data, the same steps and the same metric values (bit for bit: the
  evaluations' values, the steps at each, the bytes sent) in a worker that ran other fits before it as in a process
  of its own — so what a worker changes is when start-up is paid, not what is trained (timing:
  ``lightning_sync/benchmark/workers.py``'s docstring). The workers begin with the untimed warm-up fit, in a folder
  of their own.
* **Failures**: a row that fails at construction on every rank ends the workers; it is reported with its error, and
  new workers run the rows after it. A run past ``--run-timeout`` is killed, what it recorded counts, and the next
  run starts in new workers.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from lightning_sync.benchmark.ttt import read_records
from lightning_sync.compare import main as compare_main

pytestmark = pytest.mark.timeout(900)
GRID = [
    "--workload",
    "digits",
    "--devices",
    "2",
    "--seeds",
    "1",
    "--target",
    "0.5",
    "--no-stop",
    "--trainer.max_epochs=2",
    "--trainer.limit_train_batches=4",
]


def _trajectory(run_dir: Path) -> list[tuple]:
    records = read_records(run_dir / "time_to_target.jsonl")
    data = [r["first_batch"] for r in records if r["event"] == "data"]
    evals = [(r["step"], r["value"], r["comm"].get("bytes_sent")) for r in records if r["event"] == "eval"]
    return data + evals


def _runs(out: Path) -> dict[str, dict[str, str]]:
    with (out / "runs.csv").open() as f:
        return {r["method"]: r for r in csv.DictReader(f)}


def test_a_run_in_a_worker_trains_what_it_trains_in_its_own_process(tmp_path):
    rows = "ddp,localsgd,selsync"
    # folders of names of one length: Lightning broadcasts the run's log directory (counted bytes)
    compare_main([*GRID, "--strategies", rows, "--no-workers", "--out", str(tmp_path / "procs")])
    compare_main([*GRID, "--strategies", rows, "--workers", "--out", str(tmp_path / "works")])
    for row in rows.split(","):
        own = _trajectory(tmp_path / "procs" / "none" / row / "seed0")
        warm = _trajectory(tmp_path / "works" / "none" / row / "seed0")
        assert len(own) == 3 and own == warm, row  # the first batch, and both evaluations: step, value, bytes
    assert (tmp_path / "works" / "workers" / "warmup" / "time_to_target.jsonl").exists()  # its own folder
    assert not (tmp_path / "procs" / "workers").exists()  # no worker in the subprocess mode


def test_a_failed_row_is_reported_and_new_workers_run_the_next(tmp_path, capsys):
    out = tmp_path / "out"
    result = compare_main(
        [*GRID, "--strategies", "localsgd,ddp", "--strategy-arg", "localsgd.period=0", "--out", str(out)]
    )
    runs = _runs(out)
    assert runs["localsgd"]["ok"] == "False" and "period" in runs["localsgd"]["error"]
    assert runs["ddp"]["ok"] == "True" and len(_trajectory(out / "none" / "ddp" / "seed0")) == 3
    table = {r["method"]: r for r in result["tables"]["none"]}
    assert table["ddp"]["reached"] == 1
    printed = capsys.readouterr().out
    assert "(1/2) none localsgd seed 0: FAILED" in printed and "s so far" in printed


def test_a_run_past_the_run_timeout_is_killed_and_the_next_starts(tmp_path):
    out = tmp_path / "out"
    # both runs are far longer than the timeout on any machine (digits: ~0.06 s an epoch on a 2-core CPU, so 10**5
    # epochs are well over an hour; 400 epochs, as here before, finished inside the timeout on a faster machine)
    compare_main(
        [
            *GRID[:-2],
            "--trainer.max_epochs=100000",
            "--trainer.limit_train_batches=4",
            "--strategies",
            "ddp",
            "--seeds",
            "2",
            "--run-timeout",
            "25",
            "--out",
            str(out),
        ]
    )
    with (out / "runs.csv").open() as f:
        runs = list(csv.DictReader(f))
    assert [r["killed"] for r in runs] == ["True", "True"]  # each killed, the second in new workers
    assert all(r["error"].startswith("stopped after the run timeout") for r in runs)
    assert all(read_records(Path(r["run_dir"]) / "time_to_target.jsonl") for r in runs)  # what it recorded counts


def test_ranks_laid_out_as_one_device_nodes_train_what_one_node_of_ranks_trains(tmp_path):
    """``--accelerator gpu`` on a one-GPU machine lays the ranks out as one-device nodes (``NODE_RANK=r``,
    ``LOCAL_RANK=0``, ``devices=1``, ``num_nodes`` = ranks, gloo). The same layout on the CPU trains what the ranks of
    one node train: the same first batch, steps and metric values."""
    from lightning_sync.benchmark.grid import run_grid
    from lightning_sync.benchmark.merge import write_report
    from lightning_sync.compare import build_rows, parse_args, prepare

    def grid_of(name: str, nodes: bool):
        args, extra, parser = parse_args([*GRID, "--strategies", "ddp,localsgd", "--out", str(tmp_path / name)])
        grid = prepare(args, extra, parser)
        if nodes:
            grid.accelerator, grid.shared_gpu = "cpu", True
        rows = build_rows(args, args.workload, None, parser)
        results = run_grid(grid, [("none", None)], rows)
        write_report(grid.out, [("none", None)], [r.label for r in rows], results, grid.target, "test", "test")
        return grid

    grid_of("local", nodes=False)
    grid = grid_of("nodes", nodes=True)
    overlay = (grid.out / "none" / "localsgd" / "seed0" / "overlay.yaml").read_text()
    assert "num_nodes: 2" in overlay and "devices: 1" in overlay and "process_group_backend: gloo" in overlay
    for row in ("ddp", "localsgd"):
        one_node = _trajectory(tmp_path / "local" / "none" / row / "seed0")
        as_nodes = _trajectory(tmp_path / "nodes" / "none" / row / "seed0")
        assert len(one_node) == 3 and [t[:2] if isinstance(t, tuple) else t for t in one_node] == [
            t[:2] if isinstance(t, tuple) else t for t in as_nodes
        ], row  # bytes may differ by the folder name's length (broadcast): steps and values must not
