"""`lightning-sync compare` end to end on a tiny grid: 2 links x 2 seeds of ddp (and an unknown strategy, reported),
2 processes, real Lightning runs; the tables per link, every run's CSV, the bandwidth plot and the DDP row. (Each run
costs a few seconds of training and ~15 s of process start-up on 2 cores: the grid is kept to 4 runs.)"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest

from lightning_sync.benchmark.ttt import read_records
from lightning_sync.compare import main as compare_main

LINKS = ("100mbit,1ms", "1gbit,1ms")
pytestmark = pytest.mark.timeout(900)  # the fixture's 4 runs, on a loaded 2-core machine


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    result = compare_main(
        [
            "--workload",
            "digits",
            "--strategies",
            "ddp,nope",
            "--devices",
            "2",
            "--seeds",
            "2",
            *[arg for link in LINKS for arg in ("--link", link)],
            "--target",
            "0.4",
            "--out",
            str(out),
            "--trainer.max_epochs=3",
            "--trainer.limit_train_batches=4",
        ]
    )
    return out, result


def test_compare_writes_a_table_per_link_every_run_and_the_bandwidth_plot(compared):
    out, result = compared
    for link in LINKS:
        folder = out / link.replace(",", "-")
        for name in ("table.md", "table.csv", "metric_vs_time.png", "sync_over_steps.png"):
            assert (folder / name).stat().st_size > 0, (link, name)
        table = (folder / "table.md").read_text()
        assert "| ddp | 2/2 |" in table
        assert "| nope | failed: unknown or not yet implemented strategy 'nope'" in table  # the others still ran
        assert "Target: val/acc >= 0.4" in table
    assert (out / "time_to_target_vs_bandwidth.png").stat().st_size > 0
    with (out / "runs.csv").open() as f:
        runs = list(csv.DictReader(f))
    assert len(runs) == len(LINKS) * 2 * 2
    assert {(r["link"], r["method"], r["seed"]) for r in runs if r["ok"] == "True"} == {
        (link, "ddp", s) for link in LINKS for s in ("0", "1")
    }
    assert json.loads((out / "summary.json").read_text())["target"] == {
        "metric": "val/acc",
        "value": 0.4,
        "mode": "max",
    }


def test_the_ddp_row_has_the_metrics_of_every_row_and_is_the_reference(compared):
    _, result = compared
    for link in LINKS:
        ddp = next(r for r in result["tables"][link] if r["method"] == "ddp")
        assert ddp["speedup"] == 1.0 and ddp["reached"] == 2 and ddp["mean_s"] > 0
        assert ddp["steps"] in (4, 8, 12)  # at an evaluation (every 4 steps)
        assert ddp["bytes_per_rank"] > 0 and ddp["blocked_s"] > 0 and ddp["lssr"] == 0.0 and ddp["eval_s"] > 0


def test_table_numbers_are_the_runs_own_records(compared):
    out, result = compared
    for r in result["runs"]:
        if not r.ok:
            continue
        records = read_records(r.run_dir / "time_to_target.jsonl")
        first = next(rec for rec in records if rec["event"] == "eval" and rec["reached"])
        assert r.outcome.time_s == first["wall_s"] and r.outcome.bytes_per_rank == first["comm"]["bytes_sent"]
        assert (r.run_dir / "overlay.yaml").exists() and (r.run_dir / "command.txt").exists()


def test_seeds_give_different_data_orders_and_the_same_target(compared):
    _, result = compared
    ok = [r for r in result["runs"] if r.ok]
    order = {(r.link, r.label, r.seed): r.outcome.first_batch for r in ok}
    for link in LINKS:
        assert order[(link, "ddp", 0)] != order[(link, "ddp", 1)]  # another seed, another data order
    # one seed is one data order, whatever the link
    for seed in (0, 1):
        assert len({v for (_, _, s), v in order.items() if s == seed}) == 1
    for r in ok:
        start = read_records(r.run_dir / "time_to_target.jsonl")[0]
        assert start["event"] == "start" and start["seed"] == r.seed
        assert (start["metric"], start["target"], start["mode"]) == ("val/acc", 0.4, "max")


def test_strategy_names_include_sync_switch_as_the_papers_write_it_and_ddp():
    from lightning_sync.compare import _strategy_class_path

    assert _strategy_class_path("sync-switch") == "lightning_sync.strategies.sync_switch.SyncSwitchStrategy"
    assert _strategy_class_path("sync_switch") == _strategy_class_path("sync-switch")
    assert _strategy_class_path("ddp") == "lightning_sync.strategies.ddp.CountedDDPStrategy"
    with pytest.raises(ValueError, match="available"):
        _strategy_class_path("sync-swich")


def test_the_fsdp2_row_is_lightnings_fsdp2_on_words_with_its_bytes_and_memory_per_rank(tmp_path):
    """``--strategies ddp,fsdp2`` on ``words`` (2 processes, 2 steps): the fsdp2 row is Lightning's
    ``ModelParallelStrategy`` over both ranks (``CountedFSDP2Strategy``, the words model sharding itself in
    ``configure_model``); FSDP2 equals DDP on the validation perplexity to float rounding; its reduce-scatters send
    what DDP's all-reduces send (gloo's reduce-scatter is an all-reduce of the whole gradient: with 2 ranks and
    every dim 0 even, no padding), its all-gathers come on top; each rank holds half the parameters, gradients and
    momentum of DDP's, and the table shows the memory per rank. Codecs and variants of the row are refused."""
    from lightning_sync.compare import _strategy_class_path, build_rows, parse_args

    assert _strategy_class_path("fsdp2") == "lightning_sync.strategies.fsdp2.CountedFSDP2Strategy"
    args, _, parser = parse_args(["--strategies", "fsdp2+bf16,fsdp2@x=1"])
    codec, variant = build_rows(args, "words", 0.1, parser)
    assert (
        "Lightning's own ModelParallelStrategy" in codec.error and "the reference; it has no variants" in variant.error
    )

    out = tmp_path / "out"
    argv = ["--workload", "words", "--strategies", "ddp,fsdp2", "--devices", "2", "--seeds", "1", "--out", str(out)]
    result = compare_main(
        argv + ["--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1"]
    )
    ddp, fsdp2 = (read_records(out / "none" / name / "seed0" / "time_to_target.jsonl") for name in ("ddp", "fsdp2"))
    assert fsdp2[0]["strategy"] == "CountedFSDP2Strategy" and fsdp2[-1]["step"] == ddp[-1]["step"] == 2
    assert fsdp2[-2]["value"] == pytest.approx(ddp[-2]["value"], rel=1e-5)
    comm_ddp, comm_fsdp = ddp[-1]["comm"], fsdp2[-1]["comm"]
    assert comm_fsdp["bytes_fsdp_reduce_scatter"] == comm_ddp["bytes_grads"] > 0
    assert comm_fsdp["bytes_sent"] == comm_fsdp["bytes_fsdp_reduce_scatter"] + comm_fsdp["bytes_fsdp_all_gather"]
    mem_ddp, mem_fsdp = ddp[-1]["memory"], fsdp2[-1]["memory"]
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert 2 * mem_fsdp[key] == mem_ddp[key] > 0, key
    header = (out / "none" / "table.md").read_text().splitlines()[0]
    assert "state MB / rank" in header and "peak RSS MB" in header
    assert [row["method"] for row in result["tables"]["none"]] == ["ddp", "fsdp2"]


def test_recipes_make_tuned_rows_next_to_the_default_rows(tmp_path):
    from lightning_sync.benchmark.recipes import Recipe, write_recipe
    from lightning_sync.compare import build_rows, parse_args

    write_recipe(tmp_path / "vgg" / "selsync.yaml", Recipe("selsync", {"delta": 0.1}, lr_scale=0.5, args=("--x=1",)))
    args, _, parser = parse_args(
        ["--workload", "vgg", "--strategies", "ddp,selsync,bsp", "--recipes", "--recipes-dir", str(tmp_path)]
    )
    rows = build_rows(args, "vgg", 0.2, parser)
    assert [r.label for r in rows] == ["ddp", "selsync", "selsync (tuned)", "bsp"]
    tuned = rows[2]
    assert tuned.init_args == {"delta": 0.1} and tuned.extra == ["--x=1", "--model.init_args.lr=0.1"]
    args, _, parser = parse_args(
        ["--workload", "vgg", "--strategies", "ddp,selsync,bsp", "--recipes", "only", "--recipes-dir", str(tmp_path)]
    )
    assert [r.label for r in build_rows(args, "vgg", 0.2, parser)] == ["ddp", "selsync (tuned)", "bsp"]
    # --strategy-arg applies to the method's rows, the tuned one included (on top of the recipe's arguments)
    args, _, parser = parse_args(
        ["--workload", "vgg", "--strategies", "ddp,selsync", "--recipes", "--recipes-dir", str(tmp_path)]
        + ["--strategy-arg", "selsync.evaluate=last_sync"]
    )
    rows = build_rows(args, "vgg", 0.2, parser)
    assert [(r.label, r.cli_args) for r in rows] == [
        ("ddp", []),
        ("selsync", ["evaluate=last_sync"]),
        ("selsync (tuned)", ["evaluate=last_sync"]),
    ]
    assert rows[2].init_args == {"delta": 0.1}


def test_recipes_from_a_missing_folder_are_refused_not_replaced_by_the_default_rows(tmp_path, monkeypatch, capsys):
    from lightning_sync.benchmark.recipes import Recipe, write_recipe
    from lightning_sync.compare import build_rows, parse_args

    # the default --recipes-dir is relative: run from elsewhere, `--recipes only` used to print one line and run the
    # default rows under a table the user asked to be tuned
    monkeypatch.chdir(tmp_path)
    argv = ["--workload", "words", "--strategies", "ddp,fedavg", "--recipes", "only", "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit):
        compare_main(argv)
    err = capsys.readouterr().err
    assert "examples/recipes/words" in err and "--recipes-dir" in err and str(tmp_path) in err
    assert not (tmp_path / "out").exists()  # refused before the output folder or its base config is written
    # a folder for the workload that lacks one method's recipe keeps that method's default row (documented)
    write_recipe(tmp_path / "examples" / "recipes" / "words" / "fedavg.yaml", Recipe("fedavg", {"syncs_per_epoch": 2}))
    args, _, parser = parse_args(["--workload", "words", "--strategies", "ddp,fedavg,selsync", "--recipes", "only"])
    assert [r.label for r in build_rows(args, "words", 0.1, parser)] == ["ddp", "fedavg (tuned)", "selsync"]
    # without --recipes the folder is never read
    monkeypatch.chdir(tmp_path / "examples")
    args, _, parser = parse_args(["--strategies", "ddp,fedavg"])
    assert [r.label for r in build_rows(args, "words", 0.1, parser)] == ["ddp", "fedavg"]


def test_a_codec_suffix_adds_the_compressed_row_with_its_compression_argument(tmp_path):
    from lightning_sync.benchmark.recipes import Recipe, write_recipe
    from lightning_sync.compare import build_rows, parse_args

    write_recipe(tmp_path / "words" / "localsgd.yaml", Recipe("localsgd", {"period": 4}))
    argv = ["--workload", "words", "--strategies", "ddp,localsgd,localsgd+bf16,diloco+int8", "--recipes"]
    argv += ["--recipes-dir", str(tmp_path)]
    args, _, parser = parse_args(argv)
    rows = build_rows(args, "words", 0.1, parser)
    labels = [r.label for r in rows]
    assert labels == ["ddp", "localsgd", "localsgd (tuned)", "localsgd+bf16", "localsgd+bf16 (tuned)", "diloco+int8"]
    by_label = {r.label: r for r in rows}
    assert by_label["localsgd"].cli_args == []  # the uncompressed row is untouched
    assert by_label["localsgd+bf16"].cli_args == ["compression=bf16"]
    assert by_label["localsgd+bf16 (tuned)"].cli_args == ["compression=bf16"]
    assert by_label["localsgd+bf16 (tuned)"].init_args == {"period": 4}
    assert by_label["diloco+int8"].cli_args == ["compression=int8"] and by_label["diloco+int8"].strategy == "diloco"
    # rows that cannot run say why in the table; the others still run
    args, _, parser = parse_args(
        ["--strategies", "ddp+bf16,bsp+fp8,bsp+bf16", "--strategy-arg", "bsp.compression=fp16"]
    )
    rows = build_rows(args, "words", 0.1, parser)
    assert [r.label for r in rows] == ["ddp+bf16", "bsp+fp8", "bsp+bf16"]
    assert "Lightning's own DDPStrategy" in rows[0].error
    assert "must be one of bf16, fp16, int8, int4, int2" in rows[1].error
    assert "set it once" in rows[2].error


def test_a_sparse_row_with_narrow_values_reaches_the_strategy():
    """``NAME+topk:0.02+int2``: the row's suffix is everything after the first ``+``, the fraction written one way;
    LightningCLI hands the string to the strategy unchanged."""
    from pathlib import Path

    from lightning_sync.cli import cli_main
    from lightning_sync.compare import build_rows, parse_args

    args, _, parser = parse_args(["--strategies", "localsgd+topk:0.02+int2,diloco+topk:2e-2+int4,bsp+topk:0.02+fp8"])
    rows = build_rows(args, "words", 0.1, parser)
    assert [r.label for r in rows] == ["localsgd+topk:0.02+int2", "diloco+topk:0.02+int4", "bsp+topk:0.02+fp8"]
    assert rows[0].cli_args == ["compression=topk:0.02+int2"] and rows[1].cli_args == ["compression=topk:0.02+int4"]
    assert "optionally with narrow values +int8, +int4 or +int2" in rows[2].error
    config = Path(__file__).resolve().parent.parent / "examples" / "configs" / "localsgd.yaml"
    cli = cli_main(["--config", str(config), "--trainer.strategy.init_args.compression=topk:0.02+int2"], run=False)
    assert cli.trainer.strategy.compression == "topk:0.02+int2"
    assert cli.trainer.strategy.compressor.fmt.value_code is not None


def test_bad_arguments_fail_before_any_run(tmp_path, capsys):
    import re

    for argv, message in (
        (["--seeds", "0"], "--seeds must be >= 1"),
        (["--link", "fast"], "bandwidth must look like"),
        (["--cluster", "4x1gbit", "--link", "1gbit"], "kernel rate-limited"),
        (["--config", str(tmp_path / "none.yaml")], "no such file"),
    ):
        with pytest.raises(SystemExit):
            compare_main([*argv, "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert re.search(message, err), (argv, err)
    assert not (tmp_path / "out").exists()  # nothing ran


class _LocalHosts:
    """A stand-in for :class:`~lightning_sync.cluster.NamespaceCluster`: its "hosts" are plain local processes."""

    hosts = 2

    def env(self, i: int, port: int, local_rank: int = 0, procs_per_host: int = 1) -> dict[str, str]:
        return {**os.environ, "NODE_RANK": str(i), "LOCAL_RANK": str(local_rank)}

    def popen(self, i: int, cmd, env, **kwargs) -> subprocess.Popen:
        return subprocess.Popen(cmd, env=env, start_new_session=True, **kwargs)


def test_a_cluster_run_that_fails_on_another_host_says_which_host_and_why(tmp_path):
    """Only rank 0's output is streamed; a failure on another host is reported from that host's own log, kept in
    the run's folder (a cluster row once failed with rank 0's last lines as its only explanation)."""
    from lightning_sync.benchmark.runs import RunResult, run_one

    script = "import os, sys; node = os.environ['NODE_RANK']; print('host', node, 'broke' if node == '1' else 'ok'); "
    script += "sys.exit(3 if node == '1' else 0)"
    result = RunResult("ddp", 0, "cluster", tmp_path / "run")
    run_one(result, [sys.executable, "-c", script], "test", cluster=_LocalHosts())
    assert not result.ok
    assert result.error == "run.host1.log: host 1 broke", result.error
    assert (tmp_path / "run" / "run.log").read_text().strip() == "host 0 ok"


def test_a_row_variant_runs_a_strategy_with_other_arguments_beside_its_default_row():
    from lightning_sync.compare import build_rows, parse_args

    args, _, parser = parse_args(["--strategies", "ddp,selsync,selsync+bf16@vote=exact@window=5,ddp@x=1,bsp@nokey"])
    rows = build_rows(args, "words", 0.1, parser)
    assert [r.label for r in rows] == ["ddp", "selsync", "selsync+bf16 (vote=exact, window=5)", "ddp@x=1", "bsp@nokey"]
    assert rows[2].cli_args == ["compression=bf16", "vote=exact", "window=5"] and not rows[1].cli_args
    assert "the reference; it has no variants" in rows[3].error and "NAME@KEY=VALUE" in rows[4].error


# ----------------------------------------------------------------------------------------------- replica groups
def test_a_grouped_row_beside_the_flat_one():
    """Issue 49's rows: ``localsgd+bf16@replica_size=2`` runs local SGD with bf16 syncs as 2-rank replicas beside
    ``localsgd+bf16`` (every rank a replica); the argument reaches the strategy through LightningCLI as an integer,
    ``node`` as the string."""
    from pathlib import Path

    from lightning_sync.cli import cli_main
    from lightning_sync.compare import build_rows, parse_args

    args, _, parser = parse_args(["--strategies", "ddp,localsgd+bf16,localsgd+bf16@replica_size=2"])
    rows = build_rows(args, "words", 0.1, parser)
    assert [r.label for r in rows] == ["ddp", "localsgd+bf16", "localsgd+bf16 (replica_size=2)"]
    assert rows[2].cli_args == ["compression=bf16", "replica_size=2"]
    config = Path(__file__).resolve().parent.parent / "examples" / "configs" / "localsgd.yaml"
    for value, expected in (("2", 2), ("node", "node")):
        cli = cli_main(
            ["--config", str(config), f"--trainer.strategy.init_args.replica_size={value}", "--trainer.devices=4"],
            run=False,
        )
        assert cli.trainer.strategy.replica_size == expected


def test_cluster_spec_with_processes_per_host(capsys):
    import argparse

    from lightning_sync.compare import parse_cluster

    parser = argparse.ArgumentParser()
    assert parse_cluster("4x1gbit", parser) == (4, 1, "1gbit")
    assert parse_cluster("2x2x100mbit", parser) == (2, 2, "100mbit")
    for bad in ("2xx1gbit", "2x0x1gbit", "ax1gbit", "2x2x", "2x2x2x1gbit"):
        with pytest.raises(SystemExit):
            parse_cluster(bad, parser)
        assert "HOSTSxPROCSxRATE" in capsys.readouterr().err


def test_a_cluster_run_starts_every_process_of_every_host(tmp_path):
    """``--cluster 2x2x...``: each host runs 2 processes with their own LOCAL_RANK, every one told ``num_nodes=2``
    and ``devices=2``; rank 0's output is streamed, the others' kept per host and process."""
    from lightning_sync.benchmark.runs import RunResult, run_one

    script = "import os, sys; print(os.environ['NODE_RANK'], os.environ['LOCAL_RANK'], *sys.argv[1:])"
    result = RunResult("localsgd", 0, "cluster", tmp_path / "run")
    run_one(result, [sys.executable, "-c", script], "test", cluster=_LocalHosts(), procs_per_host=2)
    run = tmp_path / "run"
    args = "--trainer.num_nodes=2 --trainer.devices=2"
    assert (run / "run.log").read_text().strip() == f"0 0 {args}"
    for host, local in ((0, 1), (1, 0), (1, 1)):
        assert (run / f"run.host{host}.proc{local}.log").read_text().strip() == f"{host} {local} {args}"


def test_the_table_shows_bytes_between_replicas_when_a_row_runs_grouped(tmp_path):
    """A grouped row's columns are rank 0's ``bytes_inter`` and its blocked seconds inside / between replicas; a
    flat row (every rank a replica) sent all its bytes and was blocked only between replicas; a table without
    grouped rows has none of these columns."""
    from lightning_sync.benchmark import tables
    from lightning_sync.benchmark.runs import RunResult, Target
    from lightning_sync.benchmark.ttt import Outcome

    nan = float("nan")

    def run(label: str, seed: int, inter: float, intra_s: float = nan, inter_s: float = nan) -> RunResult:
        r = RunResult(label, seed, "1gbit", tmp_path / label, ok=True)
        r.outcome = Outcome(
            reached=True, time_s=10.0, steps=100, bytes_per_rank=1000.0, inter_bytes=inter, blocked_s=9.0,
            blocked_intra_s=intra_s, blocked_inter_s=inter_s,
        )  # fmt: skip
        return r

    target = Target("val_acc", 0.5, "max")
    grouped_runs = [run("localsgd (replica_size=2)", s, 40.0 + 2 * s, 2.0 + s, 6.0 + s) for s in (0, 1)]
    results = [run("ddp", s, nan) for s in (0, 1)] + grouped_runs
    rows = tables.table_rows(["ddp", "localsgd (replica_size=2)"], results)
    assert [row["inter_bytes"] for row in rows] == [1000.0, 41.0]
    assert [row["blocked_inter_s"] for row in rows] == [9.0, 6.5] and rows[1]["blocked_intra_s"] == 2.5
    header, _, ddp, grouped = tables.markdown(rows, target).splitlines()
    assert "| bytes sent / rank | bytes between replicas / replica |" in header
    assert "| blocked s | blocked s inside replica | blocked s between replicas |" in header
    assert "| 1,000 | 1,000 |" in ddp and "| 1,000 | 41 |" in grouped
    assert "| 9.0 | – | 9.0 |" in ddp and "| 9.0 | 2.5 | 6.5 |" in grouped
    assert "Bytes between replicas / replica" in tables.legend(target, 2, rows)
    tables.write_csv(rows, tmp_path / "table.csv")
    tables.write_runs(results, tmp_path / "runs.csv")
    for name in ("table.csv", "runs.csv"):
        head = (tmp_path / name).read_text().splitlines()[0]
        assert "inter_bytes" in head and "blocked_intra_s" in head and "blocked_inter_s" in head
    flat = tables.table_rows(["ddp"], results[:2])
    assert not {"inter_bytes", "blocked_intra_s", "blocked_inter_s"} & set(flat[0])
    assert "between replicas" not in tables.markdown(flat, target)
    assert "between replicas" not in tables.legend(target, 2, flat)
    tables.write_runs(results[:2], tmp_path / "flat_runs.csv")
    assert "inter_bytes" not in (tmp_path / "flat_runs.csv").read_text()
    assert "blocked_inter_s" not in (tmp_path / "flat_runs.csv").read_text()


def test_runs_are_listed_as_they_finish_so_a_compare_stopped_before_its_report_can_be_merged(tmp_path, monkeypatch):
    """``summary.json`` (marked incomplete) is written before the first run and ``runs.csv`` after each run, so a
    compare that stops before its report (here: a plot that fails) leaves what ran, and ``--merge`` renders it."""
    from lightning_sync.benchmark import grid, plots
    from lightning_sync.benchmark.runs import finish_run

    out = tmp_path / "out"
    seen: list[tuple[int, bool]] = []

    def fake_run_one(result, cmd, progress, *args, **kwargs):
        summary = json.loads((out / "summary.json").read_text())
        listed = (out / "runs.csv").read_text().splitlines()[1:] if (out / "runs.csv").exists() else []
        seen.append((len(listed), summary.get("complete", True)))
        result.run_dir.mkdir(parents=True, exist_ok=True)
        values = [0.5, 0.95] if result.label == "ddp" else [0.95]
        records = [{"event": "start", "metric": "val/acc", "target": 0.9, "mode": "max"}]
        records += [{"event": "eval", "step": 10 * i, "wall_s": float(i), "value": v} for i, v in enumerate(values, 1)]
        (result.run_dir / "time_to_target.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        finish_run(result, 0, "", None)
        return result

    def broken_plot(*args, **kwargs):
        raise RuntimeError("the plot failed")

    monkeypatch.setattr(grid, "run_one", fake_run_one)
    monkeypatch.setattr(plots, "plot_curves", broken_plot)
    argv = ["--workload", "digits", "--strategies", "ddp,localsgd", "--seeds", "2", "--no-workers", "--target", "0.9"]
    with pytest.raises(RuntimeError, match="the plot failed"):
        compare_main([*argv, "--out", str(out)])
    assert seen == [(0, False), (1, False), (2, False), (3, False)]  # each run saw the ones before it listed
    assert len((out / "runs.csv").read_text().splitlines()) == 1 + 4
    assert json.loads((out / "summary.json").read_text())["complete"] is False
    monkeypatch.undo()
    merged = compare_main(["--merge", str(out), "--out", str(tmp_path / "merged")])
    (rows,) = merged["tables"].values()
    assert [(row["method"], row["reached"], row["mean_s"]) for row in rows] == [("ddp", 2, 2.0), ("localsgd", 2, 1.0)]
    assert "tables" in json.loads((tmp_path / "merged" / "summary.json").read_text())
