"""Time-to-target arithmetic on synthetic histories, the table's rendering of missed runs, recipes, the target in
the workload configs, and the reset of a model's init_args when `compare` changes its class (in-process, fast)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from lightning_sync.benchmark.recipes import Recipe, load_recipe, recipe_path, write_recipe
from lightning_sync.benchmark.runs import Target, apply_class_overrides, base_lr, find_target, load_config
from lightning_sync.benchmark.ttt import DROP_EXTREMES_FROM, outcome, speedup, summarize_runs


def _history(values: list[float], target: float = 0.9, mode: str = "max", step: int = 10) -> list[dict]:
    """The records of a run evaluated every ``step`` steps, one second apart, with ``values`` of the metric."""
    records: list[dict] = [
        {"event": "start", "metric": "val/acc" if mode == "max" else "val/ppl", "target": target, "mode": mode},
        {"event": "data", "first_batch": "abc"},
    ]
    for i, v in enumerate(values, 1):
        records.append(
            {
                "event": "eval",
                "epoch": i - 1,
                "step": i * step,
                "wall_s": float(i),
                "eval_s": 0.1,
                "value": v,
                "reached": False,
                "comm": {"bytes_sent": 1000.0 * i, "blocked_s": 0.5 * i, "lssr": 0.25},
            }
        )
    records.append({"event": "end", "wall_s": len(values) + 0.5, "step": len(values) * step, "comm": {}})
    return records


def test_never_reached_is_missed_not_a_number():
    o = outcome(_history([0.5, 0.7, 0.89]))
    assert not o.reached and o.time_s is None
    assert o.best == 0.89 and o.evaluations == 3
    s = summarize_runs([o.time_s, None, None])
    assert s.reached == 0 and s.mean_s is None and s.min_s is None and s.max_s is None


def test_reached_at_the_first_evaluation():
    o = outcome(_history([0.95, 0.97]))
    assert o.reached and o.time_s == 1.0  # the end of the first evaluation
    assert o.steps == 10 and o.bytes_per_rank == 1000.0 and o.blocked_s == 0.5 and o.eval_s == pytest.approx(0.1)


def test_first_evaluation_that_meets_the_target_counts_even_if_a_later_one_falls_back():
    o = outcome(_history([0.5, 0.91, 0.85, 0.95]))
    assert o.time_s == 2.0 and o.steps == 20 and o.eval_s == pytest.approx(0.2)


def test_perplexity_targets_are_reached_from_above_and_nan_never_reaches():
    o = outcome(_history([40.0, math.nan, 19.0], target=20.0, mode="min"))
    assert o.reached and o.time_s == 3.0 and o.best == 19.0
    assert not outcome(_history([math.nan, math.nan], target=20.0, mode="min")).reached


def test_the_same_history_against_another_target():
    records = _history([0.5, 0.91, 0.97])
    assert outcome(records, target=0.96).time_s == 3.0
    assert outcome(records, target=0.99).time_s is None


def test_drop_fastest_and_slowest_with_five_runs():
    assert DROP_EXTREMES_FROM == 5
    s = summarize_runs([30.0, 10.0, 100.0, 40.0, 20.0])
    assert s.dropped_extremes and s.kept == [20.0, 30.0, 40.0] and s.mean_s == 30.0
    assert s.min_s == 10.0 and s.max_s == 100.0 and s.reached == 5
    # one missed run is the slowest, dropped; the mean stands, the max is missed
    s = summarize_runs([30.0, 10.0, None, 40.0, 20.0])
    assert s.mean_s == 30.0 and s.reached == 4 and s.max_s is None and s.min_s == 10.0
    # two missed runs: one is kept, so the mean is missed
    s = summarize_runs([30.0, None, None, 40.0, 20.0])
    assert s.mean_s is None and s.reached == 3


def test_fewer_than_five_runs_keep_every_run():
    s = summarize_runs([1.0, 2.0, 6.0])
    assert not s.dropped_extremes and s.mean_s == 3.0
    assert summarize_runs([1.0, math.nan, 2.0]).mean_s is None  # a missed run among 3: missed


def test_speedup_only_between_two_means():
    ddp, fast, missed = summarize_runs([10.0, 12.0]), summarize_runs([2.0, 2.4]), summarize_runs([1.0, None])
    assert speedup(ddp, fast) == pytest.approx(5.0)
    assert speedup(ddp, missed) is None and speedup(missed, fast) is None and speedup(None, fast) is None


def test_table_shows_missed_runs_as_missed(tmp_path):
    from lightning_sync.benchmark.runs import RunResult
    from lightning_sync.benchmark.tables import markdown, table_rows

    def result(label, seed, values, ok=True):
        r = RunResult(label, seed, "1gbit,1ms", tmp_path / label / str(seed), ok=ok)
        r.outcome = outcome(_history(values)) if ok else None
        r.error = "" if ok else "boom | bad"
        return r

    results = [
        result("ddp", 0, [0.5, 0.95]),
        result("ddp", 1, [0.95]),
        result("selsync", 0, [0.97]),
        result("selsync", 1, [0.5, 0.6]),
        result("fedavg", 0, [0.99]),
        result("fedavg", 1, [0.99]),
        result("broken", 0, [], ok=False),
    ]
    rows = table_rows(["ddp", "selsync", "fedavg", "broken"], results)
    by = {r["method"]: r for r in rows}
    assert by["ddp"]["mean_s"] == 1.5 and by["ddp"]["speedup"] == 1.0
    assert by["selsync"]["mean_s"] is None and by["selsync"]["reached"] == 1 and by["selsync"]["speedup"] is None
    assert by["fedavg"]["speedup"] == pytest.approx(1.5)
    table = markdown(rows, Target("val/acc", 0.9, "max"))
    assert "| selsync | 1/2 | missed | 1.0 | missed | – |" in table
    assert "| fedavg | 2/2 | 1.0 | 1.0 | 1.0 | 1.50x |" in table
    assert "| broken | failed: boom / bad |" in table


def test_every_workload_config_names_its_target_and_evaluates_every_epoch():
    from lightning_sync.compare import WORKLOADS, packaged_config

    for workload in WORKLOADS:
        config = load_config(packaged_config(workload))
        target = find_target(config)
        assert target.metric.startswith("val/") and math.isfinite(target.value), workload
        assert target.mode == ("min" if "ppl" in target.metric else "max")
        trainer = config["trainer"]
        assert trainer.get("check_val_every_n_epoch", 1) == 1 and "val_check_interval" not in trainer, workload
        assert isinstance(trainer.get("limit_train_batches", 1), int), workload  # PS strategies need whole epochs
        assert trainer["max_epochs"] >= 5, workload  # the budget cap
    with pytest.raises(ValueError, match="names no target"):
        find_target({"trainer": {"callbacks": []}})
    assert find_target({"trainer": {}}, "val/loss", 0.5) == Target("val/loss", 0.5, "min")


def test_a_changed_model_class_does_not_inherit_the_old_classs_init_args(tmp_path):
    """Issue 16, item 7: jsonargparse carries same-named init_args over to a new class_path (DigitsCNN's hidden=64
    into a WideMLP); compare resets them when the class changes."""
    from lightning_sync.cli import cli_main
    from lightning_sync.compare import packaged_config

    config = load_config(packaged_config("digits"))
    config["model"]["init_args"] = {"hidden": 64, "lr": 0.05}
    for extra in (
        ["--model.class_path=lightning_sync.models.WideMLP"],
        ["--model.class_path", "lightning_sync.models.WideMLP"],
        ["--model=WideMLP"],
    ):
        new, rest, notes = apply_class_overrides(config, [*extra, "--trainer.max_epochs=2"])
        assert new["model"] == {"class_path": extra[-1].split("=")[-1]} and rest == ["--trainer.max_epochs=2"]
        assert notes and "reset" in notes[0]
    same, rest, notes = apply_class_overrides(config, ["--model=DigitsCNN", "--model.init_args.lr=0.1"])
    assert same["model"]["init_args"] == {"hidden": 64, "lr": 0.05} and rest == ["--model.init_args.lr=0.1"]
    assert not notes
    # what LightningCLI then builds: the WideMLP's own default width, not DigitsCNN's 64
    import yaml

    new, _, _ = apply_class_overrides(config, ["--model.class_path=lightning_sync.models.WideMLP"])
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump(new))
    cli = cli_main(["--config", str(path), "--trainer.logger=false"], run=False)
    assert type(cli.model).__name__ == "WideMLP" and cli.model.hparams.hidden == 2048


def test_base_lr_from_the_config_or_the_model_default():
    assert base_lr({"model": {"class_path": "lightning_sync.models.DigitsCNN", "init_args": {"lr": 0.2}}}) == 0.2
    assert base_lr({"model": {"class_path": "lightning_sync.models.DigitsCNN"}}) == 0.05
    assert base_lr({"model": {"class_path": "torch.nn.Identity"}}) is None


def test_recipes_round_trip_and_reject_bad_files(tmp_path):
    path = recipe_path(tmp_path, "vgg", "sync-switch")
    assert path == tmp_path / "vgg" / "sync_switch.yaml"
    write_recipe(path, Recipe("sync_switch", {"asp_lr_scale": 0.5}, lr_scale=0.25, tuned={"link": "1gbit,1ms"}), "x")
    recipe = load_recipe(path)
    assert recipe.init_args == {"asp_lr_scale": 0.5} and recipe.lr_scale == 0.25 and recipe.tuned["link"]
    assert path.read_text().startswith("# x\n")
    bad = tmp_path / "vgg" / "selsync.yaml"
    for text, message in (
        ("strategy: selsync\ndelta: 0.1\n", "unknown keys"),
        ("strategy: localsgd\n", "does not match the file name"),
        ("strategy: selsync\nlr_scale: 0\n", "lr_scale must be a number > 0"),
        ("strategy: selsync\nargs: [max_epochs=3]\n", "args must be a list"),
    ):
        bad.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_recipe(bad)


def test_time_to_target_callback_validates_its_arguments():
    from lightning_sync.benchmark import TimeToTarget

    cb = TimeToTarget("val/ppl", 20.0)
    assert cb.mode == "min" and cb.meets(19.0) and not cb.meets(math.nan) and not cb.meets(21.0)
    assert TimeToTarget("val/acc", 0.9).mode == "max"
    for kwargs, message in (
        ({"metric": "", "target": 1.0}, "metric must be"),
        ({"metric": "val/acc", "target": math.nan}, "target must be a number"),
        ({"metric": "val/acc", "target": math.inf}, "target must be a number"),
        ({"metric": "val/acc", "target": 0.9, "mode": "up"}, "mode must be one of"),
        ({"metric": "val/acc", "target": 0.9, "stop": 1}, "stop must be a bool"),
        ({"metric": "val/acc", "target": 0.9, "path": ""}, "path must be"),
    ):
        with pytest.raises(ValueError, match=message):
            TimeToTarget(**kwargs)


def test_recipes_shipped_for_the_workloads_load():
    examples = Path(__file__).resolve().parent.parent / "examples"
    files = sorted(examples.glob("recipes*/*/*.yaml"))  # recipes/ (tuned at 1 Gbit/s) and recipes_<link>/
    assert files
    for path in files:
        recipe = load_recipe(path)
        assert path.parent.name in ("digits", "text", "vgg", "words"), path
        assert recipe.tuned.get("command"), f"{path}: say how it was chosen"


def test_the_cli_demo_defaults_do_not_leak_into_another_class(tmp_path):
    """The demo CNN and digits are selected only when nothing else is: as parser defaults, jsonargparse carried
    their same-named init_args into the class a config chose (the text data got the digits' test_fraction=0.2)."""
    from lightning_sync.cli import DEFAULT_DATA, DEFAULT_MODEL, cli_main, with_default_classes
    from lightning_sync.compare import packaged_config

    text = str(packaged_config("text"))
    assert with_default_classes(["fit", "--config", text], {"fit"}) == ["fit", "--config", text]
    assert with_default_classes(["fit", "--trainer.max_epochs=1"], {"fit"}) == [
        "fit",
        f"--model={DEFAULT_MODEL}",
        f"--data={DEFAULT_DATA}",
        "--trainer.max_epochs=1",
    ]
    assert with_default_classes(["--model=WideMLP", "--model.hidden=8"]) == [
        f"--data={DEFAULT_DATA}",
        "--model=WideMLP",
        "--model.hidden=8",
    ]
    cli = cli_main(["--config", text, "--trainer.logger=false"], run=False)
    assert (cli.datamodule.val_fraction, cli.datamodule.test_fraction) == (0.05, 0.05)  # its own, not the digits'
    cli = cli_main(["--model=WideMLP", "--trainer.logger=false"], run=False)
    assert cli.model.hparams.hidden == 2048 and type(cli.datamodule).__name__ == "DigitsDataModule"
    cli = cli_main(["--model.hidden=32", "--trainer.logger=false"], run=False)
    assert type(cli.model).__name__ == "DigitsCNN" and cli.model.hparams.hidden == 32


def test_the_overlay_of_a_run_sets_its_seed_strategy_link_and_recorder(tmp_path):
    from lightning_sync.benchmark.runs import build_command, make_row, overlay

    config = {"trainer": {"callbacks": [{"class_path": "lightning_sync.callbacks.SyncStats"}, "x.Printer"]}}
    target = Target("val/acc", 0.9, "max")
    ours = overlay(config, make_row("selsync", ["delta=0.1"]), 3, tmp_path, 4, "1gbit,1ms", target, True)
    ddp = overlay(config, make_row("ddp"), 3, tmp_path, 4, None, target, False)
    assert ours["seed_everything"] == 3 and ours["trainer"]["devices"] == 4
    assert ours["trainer"]["strategy"] == {
        "class_path": "lightning_sync.strategies.selsync.SelSyncStrategy",
        "init_args": {"link": "1gbit,1ms"},
    }
    assert ddp["trainer"]["strategy"]["class_path"] == "lightning_sync.strategies.ddp.CountedDDPStrategy"
    paths = [c if isinstance(c, str) else c["class_path"] for c in ours["trainer"]["callbacks"]]
    assert paths == ["x.Printer", "lightning_sync.callbacks.SyncStats", "lightning_sync.benchmark.TimeToTarget"]
    # SyncStats reads a SyncStrategy's counters: not on the ddp row (its numbers come from TimeToTarget)
    paths = [c if isinstance(c, str) else c["class_path"] for c in ddp["trainer"]["callbacks"]]
    assert paths == ["x.Printer", "lightning_sync.benchmark.TimeToTarget"]
    recorder = ddp["trainer"]["callbacks"][-1]["init_args"]
    assert recorder == {
        "metric": "val/acc",
        "target": 0.9,
        "mode": "max",
        "stop": False,
        "path": str(tmp_path / "time_to_target.jsonl"),
    }
    cmd = build_command(
        tmp_path / "base.yaml", tmp_path / "overlay.yaml", make_row("selsync", ["delta=0.1"]), tmp_path, ["--a=1"]
    )
    assert cmd[-2:] == ["--trainer.strategy.init_args.delta=0.1", "--a=1"] and "--test_after_fit=false" in cmd
    # a row's ``last`` arguments come after compare's pass-through ones and win over them (a step-timing run's length)
    timing = make_row("ddp")
    timing.last = ["--trainer.max_epochs=1"]
    cmd = build_command(tmp_path / "b.yaml", tmp_path / "o.yaml", timing, tmp_path, ["--trainer.max_epochs=5"])
    assert cmd[-2:] == ["--trainer.max_epochs=5", "--trainer.max_epochs=1"]


def _script(name: str):
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tune_grids_scores_and_delta_quantiles(tmp_path):
    from lightning_sync.benchmark.runs import RunResult

    tune = _script("tune")
    assert tune.parse_grid(["selsync.delta=0.1,0.2", "sync-switch.asp_lr_scale=1,0.5"]) == {
        "selsync": ("delta", [0.1, 0.2]),
        "sync_switch": ("asp_lr_scale", [1, 0.5]),
    }
    with pytest.raises(ValueError, match="NAME.KEY=v1,v2"):
        tune.parse_grid(["selsync=0.1"])
    fast, slow, missed = summarize_runs([1.0, 2.0]), summarize_runs([3.0, 3.0]), summarize_runs([1.0, None])
    ranked = sorted([(tune.score(s, 0.9, "max"), name) for s, name in ((missed, "m"), (slow, "s"), (fast, "f"))])
    assert [name for _, name in ranked] == ["f", "s", "m"]  # a missed mean loses to any mean
    assert tune.score(missed, 0.9, "max") < tune.score(summarize_runs([None, None]), 0.95, "max")  # more reached
    run = RunResult("selsync delta=0", 0, "1gbit,1ms", tmp_path)
    (tmp_path / "logs" / "version_0").mkdir(parents=True)
    rows = "step,sync/delta\n" + "".join(f"{i},{d}\n" for i, d in enumerate([0.0, 0.4, 0.1, 0.2, 0.3], 1))
    (tmp_path / "logs" / "version_0" / "metrics.csv").write_text(rows)
    assert tune.delta_quantiles([run]) == [0.2, 0.3, 0.4]  # 25/50/75% of the positive Deltas 0.1..0.4
    # a candidate carries the --strategy-arg values and, for `selsync+bf16`, the compression, beside its grid value
    row = tune.candidate_row("selsync", "sync_fraction", 0.03, 0.1, ["evaluate=last_sync"], "bf16")
    assert row.label == "selsync+bf16 sync_fraction=0.03" and row.init_args == {"sync_fraction": 0.03}
    assert row.cli_args == ["evaluate=last_sync", "compression=bf16"]
    scaled = tune.candidate_row("asp", "lr_scale", 0.5, 0.1)
    assert scaled.cli_args == [] and scaled.extra == ["--model.init_args.lr=0.05"]
    with pytest.raises(ValueError, match="must be one of"):
        tune.candidate_row("selsync", "sync_fraction", 0.03, 0.1, codec="fp8")


def test_time_to_target_script_lists_one_command_per_table():
    script = _script("time_to_target")
    cmds = [" ".join(c) for c in script.commands(["vgg"], 4, "OUT", tune=False, only=[], run_timeout=None)]
    base = "lightning-sync compare --workload vgg --devices 4 --recipes"
    assert cmds[:3] == [
        f"{base} --seeds {seeds} --link {name},1ms --out OUT/vgg/{name}"
        for name, seeds in (("100mbit", 3), ("1gbit", 5), ("10gbit", 3))
    ]
    assert cmds[3] == "lightning-sync compare --merge OUT/vgg/100mbit OUT/vgg/1gbit OUT/vgg/10gbit --out OUT/vgg"
    assert "--cluster 4x1gbit" in cmds[4] and cmds[4].startswith("sudo ") and "comm_share.py" in cmds[5]


def test_merge_renders_earlier_outputs_as_one_report(tmp_path):
    """E.g. 5 seeds at 1 Gbit/s and 3 at 100 Mbit/s, run as two commands, become one report with the bandwidth plot."""
    import json

    from lightning_sync.benchmark.runs import RunResult
    from lightning_sync.benchmark.tables import write_runs
    from lightning_sync.compare import main as compare_main

    def folder(name, link, seeds, ddp_s, fast_s):
        out = tmp_path / name
        results = []
        for label, base in (("ddp", ddp_s), ("localsgd", fast_s)):
            for seed in range(seeds):
                run_dir = out / label / f"seed{seed}"
                run_dir.mkdir(parents=True)
                records = _history([0.5, 0.95])
                for r in records:
                    r["wall_s"] = r.get("wall_s", 0.0) * (base + seed) / 2.0
                (run_dir / "time_to_target.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
                results.append(RunResult(label, seed, link, run_dir, ok=True))
        write_runs(results, out / "runs.csv")
        summary = {"where": "4 processes", "target": {"metric": "val/acc", "value": 0.9, "mode": "max"}}
        summary.update(labels=["ddp", "localsgd"], groups=[[link, link]])
        (out / "summary.json").write_text(json.dumps(summary))
        return str(out)

    slow = folder("slow", "100mbit,1ms", 3, 40.0, 4.0)
    fast = folder("fast", "1gbit,1ms", 5, 8.0, 4.0)
    result = compare_main(["--merge", slow, fast, "--out", str(tmp_path / "all")])
    assert set(result["tables"]) == {"100mbit,1ms", "1gbit,1ms"}
    slow_rows = {r["method"]: r for r in result["tables"]["100mbit,1ms"]}
    fast_rows = {r["method"]: r for r in result["tables"]["1gbit,1ms"]}
    assert slow_rows["localsgd"]["speedup"] == pytest.approx(41.0 / 5.0)  # seeds 0-2: (base + seed) means 41 and 5
    assert fast_rows["ddp"]["dropped_extremes"] and fast_rows["ddp"]["mean_s"] == pytest.approx(10.0)  # 5 seeds
    assert (tmp_path / "all" / "time_to_target_vs_bandwidth.png").stat().st_size > 0
    assert (tmp_path / "all" / "1gbit-1ms" / "table.md").read_text().count("*") >= 2  # trimmed means marked

    # a committed report: its run folders packed into records.jsonl.gz (benchmarks/pack_records.py) merge alike
    def eval_times(runs):
        fast_runs = [r for r in runs if r.link == "1gbit,1ms"]
        return [[rec["wall_s"] for rec in r.records if rec.get("event") == "eval"] for r in fast_runs]

    before = eval_times(result["runs"])
    assert _script("pack_records").pack(fast) == 10 and not (Path(fast) / "localsgd").exists()
    packed = compare_main(["--merge", slow, fast, "--out", str(tmp_path / "packed")])
    assert all(r.packed is not None for r in packed["runs"] if r.link == "1gbit,1ms")  # read from records.jsonl.gz
    assert eval_times(packed["runs"]) == before and len(before) == 10 and all(len(t) == 2 for t in before)
    for link in ("100mbit-1ms", "1gbit-1ms"):
        table = (tmp_path / "all" / link / "table.md").read_text()
        assert (tmp_path / "packed" / link / "table.md").read_text() == table and "0.95" in table
    # a folder whose run records are gone (neither a run folder nor packed) is refused, not shown as missed runs
    (Path(fast) / "records.jsonl.gz").unlink()
    with pytest.raises(ValueError, match="ddp, seed 0.*neither"):
        compare_main(["--merge", slow, fast, "--out", str(tmp_path / "again")])


def test_bandwidth_grid_reads_committed_summaries_one_report_per_link(tmp_path):
    """Committed reports (summary.json only, their run folders gone) become one grid and one bandwidth plot; each
    column's ratios are the ones its own report measured, a method absent at a link is 'not run', a missed mean
    stays missed, and a method given twice at one link or a second target is refused."""
    import json

    grid = _script("bandwidth_grid")

    def report(folder, link, rows, target=17.0):
        folder.mkdir()
        summary = {
            "target": {"metric": "val/ppl", "value": target, "mode": "min"},
            "groups": [[link, link]],
            "tables": {link: rows},
        }
        (folder / "summary.json").write_text(json.dumps(summary))
        return folder

    def row(method, mean, speedup, reached=3, runs=3):
        return {"method": method, "runs": runs, "reached": reached, "mean_s": mean, "min_s": mean, "max_s": mean,
                "dropped_extremes": False, "speedup": speedup}  # fmt: skip

    slow = report(tmp_path / "slow", "100mbit,1ms", [row("ddp", 600.0, 1.0), row("localsgd", 120.0, 5.0)])
    fast = report(
        tmp_path / "fast",
        "1gbit,1ms",
        [
            row("ddp", 60.0, 1.0),
            row("localsgd", 30.0, 2.0),
            row("asp", None, None, reached=2),
            {"method": "osp", "runs": 3},
        ],
    )
    assert grid.main([str(fast), str(slow), "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "grid.md").read_text().splitlines()
    assert text[0] == "| method | 100mbit,1ms | 1gbit,1ms |"  # columns by bandwidth, whatever the order given
    assert "| ddp | 600.0 s (3/3) | 60.0 s (3/3) |" in text
    assert "| localsgd | 5.00x (3/3) | 2.00x (3/3) |" in text
    assert "| asp | not run | missed (2/3) |" in text
    assert "| osp | not run | failed |" in text
    assert (tmp_path / "out" / "speedup_vs_bandwidth.png").stat().st_size > 0
    again = report(tmp_path / "again", "1gbit,1ms", [row("ddp", 50.0, 1.0), row("localsgd", 20.0, 2.5)])
    with pytest.raises(ValueError, match="'localsgd' at link '1gbit,1ms' is in both .*one run"):
        grid.main([str(fast), str(again), "--out", str(tmp_path / "x")])
    other = report(tmp_path / "other", "10gbit,1ms", [row("ddp", 40.0, 1.0)], target=9.0)
    with pytest.raises(ValueError, match="different targets"):
        grid.main([str(fast), str(other), "--out", str(tmp_path / "y")])


def test_bandwidth_grid_link_in_parts_each_cell_against_its_own_reports_ddp(tmp_path):
    """A slow link run in two reports (each with its own DDP): every cell is the ratio its own report measured,
    marked with the report it came from; DDP's cell lists both DDPs; the plot's error bars use the row's own DDP."""
    import json

    grid = _script("bandwidth_grid")

    def report(name, link, rows):
        folder = tmp_path / name
        folder.mkdir()
        summary = {"target": {"metric": "val/acc", "value": 0.95, "mode": "max"}, "groups": [[link, link]],
                   "tables": {link: rows}}  # fmt: skip
        (folder / "summary.json").write_text(json.dumps(summary))
        return str(folder)

    def row(method, mean, speedup):
        return {"method": method, "runs": 3, "reached": 3, "mean_s": mean, "min_s": mean, "max_s": mean,
                "dropped_extremes": False, "speedup": speedup}  # fmt: skip

    first = report("a", "100mbit,1ms", [row("ddp", 1000.0, 1.0), row("localsgd", 200.0, 5.0)])
    second = report("b", "100mbit,1ms", [row("ddp", 900.0, 1.0), row("fedavg", 100.0, 9.0)])
    fast = report("c", "1gbit,1ms", [row("ddp", 100.0, 1.0), row("localsgd", 50.0, 2.0), row("fedavg", 40.0, 2.5)])
    target, links, methods = grid.read_reports([Path(first), Path(fast), Path(second)])
    slow = links[1e8]
    assert slow["sources"] == [first, second] and slow["part"] == {"ddp": 0, "localsgd": 0, "fedavg": 1}
    assert [ref["mean_s"] for ref in slow["refs"]] == [1000.0, 900.0]
    assert grid.reference_of(slow, "fedavg")["mean_s"] == 900.0  # the plot's error bars: fedavg against its own DDP
    assert grid.main([first, fast, second, "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "grid.md").read_text()
    assert "| ddp | 1000.0 s (3/3) [1]; 900.0 s (3/3) [2] | 100.0 s (3/3) |" in text
    assert "| localsgd | 5.00x (3/3) [1] | 2.00x (3/3) |" in text
    assert "| fedavg | 9.00x (3/3) [2] | 2.50x (3/3) |" in text
    assert f"100mbit,1ms: [1] {first}, [2] {second}" in text and f"1gbit,1ms: {fast}." in text
    sources = json.loads((tmp_path / "out" / "summary.json").read_text())["sources"]
    assert sources == {"100mbit,1ms": [first, second], "1gbit,1ms": fast}
    # --methods: only those rows (ddp always), in that order; a row left out is not checked for duplicates
    assert grid.main([first, second, "--methods", "fedavg", "--out", str(tmp_path / "only")]) == 0
    only = (tmp_path / "only" / "grid.md").read_text().splitlines()
    assert only[2].startswith("| ddp |") and only[3] == "| fedavg | 9.00x (3/3) [2] |" and len(only) == 4 + 2
    dup = report("d", "100mbit,1ms", [row("ddp", 950.0, 1.0), row("localsgd", 190.0, 5.0), row("bsp", 900.0, 1.1)])
    with pytest.raises(ValueError, match="one run"):
        grid.read_reports([Path(first), Path(dup)], ["localsgd"])
    _, kept, order = grid.read_reports([Path(first), Path(dup)], ["bsp"])  # dup's localsgd left out: no clash
    assert order == ["ddp", "bsp"] and set(kept[1e8]["rows"]) == {"ddp", "bsp"} and kept[1e8]["part"]["bsp"] == 1
    with pytest.raises(ValueError, match="--methods: diloco in none"):
        grid.read_reports([Path(first), Path(second)], ["diloco"])


def test_bandwidth_grid_drop_leaves_a_reports_rows_out(tmp_path):
    """--drop REPORT=METHOD: that report's row is left out, so a later report that re-measured the method at the same
    link gives the cell (against its own DDP) instead of the duplicate being refused; the grid says what was left out
    (a cell no other report gives reads 'left out');
    DDP, an unknown report or a method not in the report cannot be dropped."""
    import json

    grid = _script("bandwidth_grid")

    def report(name, rows):
        folder = tmp_path / name
        folder.mkdir()
        summary = {"target": {"metric": "val/ppl", "value": 17.0, "mode": "min"}, "groups": [["1gbit,1ms"] * 2],
                   "tables": {"1gbit,1ms": rows}}  # fmt: skip
        (folder / "summary.json").write_text(json.dumps(summary))
        return str(folder)

    def row(method, mean, speedup):
        return {"method": method, "runs": 5, "reached": 5, "mean_s": mean, "min_s": mean, "max_s": mean,
                "dropped_extremes": True, "speedup": speedup}  # fmt: skip

    old = report("old", [row("ddp", 65.0, 1.0), row("localsgd", 32.5, 2.0), row("asp", 72.0, 0.9)])
    new = report("new", [row("ddp", 68.0, 1.0), row("asp", 85.0, 0.8)])
    with pytest.raises(ValueError, match="'asp' at link '1gbit,1ms' is in both"):
        grid.main([old, new, "--out", str(tmp_path / "x")])
    assert grid.main([old, new, "--drop", f"{old}=asp", "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "grid.md").read_text()
    assert "| ddp | 65.0 s (5/5) [1]; 68.0 s (5/5) [2] |" in text
    assert "| localsgd | 2.00x (5/5) [1] |" in text and "| asp | 0.80x (5/5) [2] |" in text
    assert f"Rows left out of a report (--drop): asp of {old}." in text
    command = json.loads((tmp_path / "out" / "summary.json").read_text())["command"]
    assert command.endswith(f"--drop {old}=asp")
    # a dropped row that no other report gives: 'left out', not 'not run'
    assert grid.main([old, "--drop", f"{old}=asp", "--out", str(tmp_path / "alone")]) == 0
    assert "| asp | left out |" in (tmp_path / "alone" / "grid.md").read_text()
    with pytest.raises(ValueError, match="ddp cannot be left out"):
        grid.main([old, new, "--drop", f"{old}=ddp", "--out", str(tmp_path / "y")])
    with pytest.raises(ValueError, match="ssp not in"):
        grid.main([old, new, "--drop", f"{old}=ssp", "--out", str(tmp_path / "y")])
    with pytest.raises(ValueError, match="is not one of the reports"):
        grid.main([old, "--drop", f"{new}=asp", "--out", str(tmp_path / "y")])
    with pytest.raises(ValueError, match="must look like REPORT=METHOD"):
        grid.main([old, "--drop", "asp", "--out", str(tmp_path / "y")])


def _experiment(folder: Path) -> dict[Path, bytes]:
    """A compare --out as it would be committed with its run folders (one a lane's, one run cut short, one flat
    record), and the bytes of every file below it."""
    import json

    from lightning_sync.benchmark.runs import RunResult
    from lightning_sync.benchmark.tables import write_runs

    def row(method, mean, speedup):
        return {"method": method, "runs": 2, "reached": 2, "mean_s": mean, "min_s": mean, "max_s": mean,
                "dropped_extremes": False, "speedup": speedup}  # fmt: skip

    summary = {
        "target": {"metric": "val/acc", "value": 0.9, "mode": "max"},
        "labels": ["ddp", "localsgd"],
        "groups": [["1gbit,1ms", "1gbit,1ms"]],
        "tables": {"1gbit,1ms": [row("ddp", 2.0, 1.0), row("localsgd", 1.0, 2.0)]},
    }
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps(summary))
    results = []
    for label in ("ddp", "localsgd"):
        for seed in (0, 1):
            run_dir = folder / "1gbit-1ms" / label / f"seed{seed}"
            (run_dir / "logs").mkdir(parents=True)
            text = "".join(json.dumps(r) + "\n" for r in _history([0.5, 0.95]))
            if (label, seed) == ("localsgd", 1):
                text += '{"event": "eval", "ste'  # a killed run's last line, cut short
            (run_dir / "time_to_target.jsonl").write_text(text)
            (run_dir / "summary.json").write_text(json.dumps({"global_step": 20, "fit": {"val/acc": 0.95}}, indent=2))
            (run_dir / "overlay.yaml").write_text(f"seed_everything: {seed}\n")
            (run_dir / "command.txt").write_text(f"python -m lightning_sync.cli fit --seed {seed}\n")
            (run_dir / "logs" / "metrics.csv").write_text("step,val/acc\n10,0.5\n20,0.95\n")
            results.append(RunResult(label, seed, "1gbit,1ms", run_dir, ok=True))
    write_runs(results, folder / "runs.csv")
    lane = folder / "tune_a" / "1gbit-1ms" / "asp-lr_scale-2.0" / "seed0"
    lane.mkdir(parents=True)
    (lane / "time_to_target.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _history([0.91])))
    (folder / "tune_a" / "base_config.yaml").write_text("trainer: {}\n")
    (folder / "osp_seed0_time_to_target.jsonl").write_text(json.dumps({"event": "start", "seed": 0}) + "\n")
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_pack_records_one_file_per_experiment_lossless_and_idempotent(tmp_path):
    """The per-run folders go into the experiment's records.jsonl.gz (one JSON object per run: its link, method,
    seed and records) and are removed; --check lists the unpacked folder; packing again changes nothing; --unpack
    gives back every file byte for byte, a cut-short record and the run's other text files included."""
    import gzip
    import json

    packer = _script("pack_records")
    exp = tmp_path / "docs" / "vgg" / "1gbit"
    before = _experiment(exp)
    assert packer.main(["--root", str(tmp_path / "docs"), "--check"]) == 1
    assert packer.pack(exp) == 6
    assert packer.main(["--root", str(tmp_path / "docs"), "--check"]) == 0
    left = sorted(p.relative_to(exp).as_posix() for p in exp.rglob("*") if p.is_file())
    assert left == ["records.jsonl.gz", "runs.csv", "summary.json", "tune_a/base_config.yaml"]
    with gzip.open(exp / "records.jsonl.gz", "rt") as f:  # the standard library reads it
        runs = {r["run"]: r for r in map(json.loads, f)}
    assert runs == {r["run"]: r for r in packer.read_packed(exp)} and len(runs) == 6
    first = runs["1gbit-1ms/ddp/seed0"]
    assert (first["link"], first["method"], first["seed"]) == ("1gbit-1ms", "ddp", 0)
    assert first["records"] == _history([0.5, 0.95]) and first["summary"]["global_step"] == 20
    assert first["files"] == {"command.txt": "python -m lightning_sync.cli fit --seed 0\n",
                              "logs/metrics.csv": "step,val/acc\n10,0.5\n20,0.95\n",
                              "overlay.yaml": "seed_everything: 0\n"}  # fmt: skip
    assert "time_to_target.jsonl" in runs["1gbit-1ms/localsgd/seed1"]["files"]  # kept verbatim: not valid JSON lines
    lane = runs["tune_a/1gbit-1ms/asp-lr_scale-2.0/seed0"]
    assert (lane["link"], lane["method"], lane["seed"]) == ("1gbit-1ms", "asp-lr_scale-2.0", 0)
    flat = runs["osp_seed0_time_to_target.jsonl"]
    assert (flat["link"], flat["method"], flat["seed"]) == (None, "osp", 0)
    packed = (exp / "records.jsonl.gz").read_bytes()
    assert packer.pack(exp) == 0 and (exp / "records.jsonl.gz").read_bytes() == packed  # idempotent
    assert packer.main(["--unpack", str(exp), "--out", str(tmp_path / "back")]) == 0
    back = {p.relative_to(tmp_path / "back"): p.read_bytes() for p in (tmp_path / "back").rglob("*") if p.is_file()}
    assert back == {k: v for k, v in before.items() if k.as_posix() not in left}
    # a run added later joins the file; the same run with other contents is refused
    extra = exp / "1gbit-1ms" / "ddp" / "seed2"
    extra.mkdir(parents=True)
    (extra / "time_to_target.jsonl").write_text(json.dumps({"event": "start", "seed": 2}) + "\n")
    assert packer.pack(exp) == 1 and len(packer.read_packed(exp)) == 7
    clash = exp / "1gbit-1ms" / "ddp" / "seed2"
    clash.mkdir(parents=True)
    (clash / "time_to_target.jsonl").write_text(json.dumps({"event": "start", "seed": 3}) + "\n")
    with pytest.raises(ValueError, match="packed already"):
        packer.pack(exp)
    assert (clash / "time_to_target.jsonl").exists()  # nothing removed


def test_bandwidth_grid_reads_a_packed_experiment(tmp_path):
    """A report whose run folders were packed gives bandwidth_grid the same grid as before (it reads summary.json)."""
    packer, grid = _script("pack_records"), _script("bandwidth_grid")
    exp = tmp_path / "words" / "1gbit"
    _experiment(exp)
    assert grid.main([str(exp), "--out", str(tmp_path / "before")]) == 0
    assert packer.pack(exp) == 6 and not (exp / "1gbit-1ms").exists()
    assert grid.main([str(exp), "--out", str(tmp_path / "after")]) == 0
    text = (tmp_path / "after" / "grid.md").read_text()
    assert text == (tmp_path / "before" / "grid.md").read_text() and "| localsgd | 2.00x (2/2) |" in text


def test_committed_benchmark_records_are_packed():
    """docs/benchmarks/time_to_target keeps no per-run record folders: each experiment's are in its
    records.jsonl.gz (python benchmarks/pack_records.py), and every packed run has its records."""
    packer = _script("pack_records")
    root = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "time_to_target"
    pending = {str(e.relative_to(root)): packer.unpacked(e) for e in packer.experiments(root)}
    assert not {k: v for k, v in pending.items() if v[0] or v[1]}, "run: python benchmarks/pack_records.py"
    packs = sorted(root.glob("*/*/records.jsonl.gz"))
    assert packs and all(run["records"] for p in packs for run in packer.read_packed(p.parent))
