"""``compare --project-ddp LINK`` (issue 60): DDP's time to target at a slow link projected from its steps without a
link and its step and evaluation times at the link (``lightning_sync/benchmark/projection.py``).

In-process: the arithmetic on synthetic records (per-step time with the warm-up and the evaluations left out, the
projected time of every evaluation), the rows of each group, the legend. End to end (one ``compare`` in worker
processes, 2 ranks, the emulated WAN link ``25mbit,50ms``, 1 seed, tiny fits): the steps run without a link, the
step-timing and the measured DDP runs at the link beside a local SGD row; the projected row is the reference of its
table, its time the formula's over the runs' own records, marked in the table, ``summary.json`` and the legend."""

from __future__ import annotations

import json

import pytest

from lightning_sync.benchmark.projection import (
    MEASURED,
    PROJECTED,
    STEPS_GROUP,
    TIMING,
    ProjectionPlan,
    StepTiming,
    measured_label,
    project,
    project_records,
    projected_label,
    projection_legend,
    step_timing,
    timing_label,
)
from lightning_sync.benchmark.runs import FSDP2, REFERENCE, Row, RunResult
from lightning_sync.benchmark.ttt import outcome

WAN = "25mbit,50ms"
pytestmark = pytest.mark.timeout(900)


def _timing_records() -> list[dict]:
    """8 steps at 1 s each after a slow start (setup 4 s, the first two steps 1 s and 1.5 s), an evaluation of
    0.5 s after step 4 and one after step 8 (the end of each 4-step epoch); rank 0 blocked 4 s in all."""
    walls = [5.0, 6.5, 7.5, 8.5, 10.0, 11.0, 12.0, 13.0]  # step 5 ends 1 s after the 0.5 s evaluation at 9.0
    return [
        {"event": "start", "metric": "val/acc", "target": 0.9, "mode": "max", "seed": 0},
        {"event": "eval", "step": 4, "wall_s": 9.0, "eval_s": 0.5, "value": 0.5, "comm": {}},
        {"event": "eval", "step": 8, "wall_s": 13.5, "eval_s": 0.5, "value": 0.6, "comm": {}},
        {"event": "end", "step": 8, "wall_s": 13.6, "comm": {"blocked_s": 4.0}, "step_wall_s": walls},
    ]


def _steps_records() -> list[dict]:
    """DDP without a link: evaluations after steps 4, 8 and 12, the target (0.9) met at the third."""
    comm = {"bytes_sent": 1000.0, "blocked_s": 0.1}
    return [
        {"event": "start", "metric": "val/acc", "target": 0.9, "mode": "max", "seed": 0},
        {"event": "data", "first_batch": "abc"},
        *[
            {"event": "eval", "step": 4 * j, "wall_s": 1.0 * j, "eval_s": 0.1, "value": v, "comm": dict(comm)}
            for j, v in ((1, 0.5), (2, 0.8), (3, 0.95))
        ],
        {"event": "end", "step": 12, "wall_s": 3.1, "comm": dict(comm)},
    ]


def test_the_step_time_leaves_out_the_warm_up_and_the_evaluations():
    t = step_timing(_timing_records())
    # (13.0 - 6.5 - the 0.5 s evaluation between) / 6 steps; the setup and the slow first steps are the fixed part
    assert t == StepTiming(step_s=1.0, eval_s=0.5, fixed_s=4.5, steps=8, evaluations=2, blocked_per_step_s=0.5)
    assert t.at(8, 2) == 13.5  # the timing run's own last evaluation, reproduced
    with pytest.raises(ValueError, match="no end with its step times"):
        step_timing(_timing_records()[:-1])
    with pytest.raises(ValueError, match="evaluated nothing"):
        step_timing([r for r in _timing_records() if r["event"] != "eval"])
    short = _timing_records()
    short[-1] = dict(short[-1], step_wall_s=[5.0, 6.5, 7.5])
    with pytest.raises(ValueError, match="trained 3 steps; timing needs 4 or more"):
        step_timing(short)


def test_the_projection_puts_every_evaluation_at_its_projected_time():
    timing = step_timing(_timing_records())
    records = project_records(_steps_records(), timing, {"steps_run": "a", "timing_run": "b"})
    assert [r["event"] for r in records] == ["start", "projection", "data", "eval", "eval", "eval", "end"]
    about = records[1]
    assert (about["steps_run"], about["step_s"], about["eval_s"], about["fixed_s"]) == ("a", 1.0, 0.5, 4.5)
    evals = [r for r in records if r["event"] == "eval"]
    # fixed + k * step + j * eval: 4.5 + 4 + 0.5, 4.5 + 8 + 1.0, 4.5 + 12 + 1.5
    assert [r["wall_s"] for r in evals] == [9.0, 13.5, 18.0]
    assert all(r["eval_s"] == 0.5 and r["projected"] for r in evals)
    assert [r["comm"]["blocked_s"] for r in evals] == [2.0, 4.0, 6.0]  # 0.5 s blocked a step at the link
    assert all(r["comm"]["bytes_sent"] == 1000.0 for r in evals)  # the same steps send the same bytes
    # records that say how long each evaluation blocked (FSDP2's all-gathers to evaluate): that part is left out of
    # the per-step figure and added per evaluation, so a projected row's blocked time is not inflated by them
    timed = _timing_records()
    for r in timed:
        if r["event"] == "eval":
            r["eval_blocked_s"] = 0.4
    split = step_timing(timed)
    assert (split.blocked_per_step_s, split.eval_blocked_s) == pytest.approx((3.2 / 8, 0.4))
    evals = [r for r in project_records(_steps_records(), split) if r["event"] == "eval"]
    assert [r["comm"]["blocked_s"] for r in evals] == pytest.approx([4 * 0.4 + 0.4, 8 * 0.4 + 0.8, 12 * 0.4 + 1.2])
    o = outcome(records)
    assert o.reached and o.time_s == 18.0 and o.steps == 12 and o.eval_s == 1.5
    assert records[-1]["wall_s"] == 18.0  # the end: after the third evaluation


def test_each_group_has_its_rows():
    ddp = Row(REFERENCE, REFERENCE, "x.DDP", False)
    local = Row("localsgd", "localsgd", "x.LocalSGD", True)
    plan = ProjectionPlan((WAN,), epochs=2, measured=1, seeds=(0, 1))
    assert plan.groups([("100mbit,1ms", "100mbit,1ms"), (WAN, WAN)]) == [
        (STEPS_GROUP, None),
        ("100mbit,1ms", "100mbit,1ms"),
        (WAN, WAN),
    ]
    rows_of = plan.rows_for([ddp, local])
    assert [r.label for r in rows_of(STEPS_GROUP, 1)] == [REFERENCE]
    assert [r.label for r in rows_of("100mbit,1ms", 1)] == [REFERENCE, "localsgd"]  # measured as usual
    assert [r.label for r in rows_of(WAN, 0)] == [TIMING, MEASURED, "localsgd"]  # the first seed checks
    assert [r.label for r in rows_of(WAN, 1)] == [TIMING, "localsgd"]
    timing = rows_of(WAN, 1)[0]
    assert timing.ttt_args == {"stop": False, "record_steps": True} and timing.last == ["--trainer.max_epochs=2"]
    assert ddp.ttt_args == {} and ddp.extra == []  # the reference row itself is untouched
    assert plan.group_labels([REFERENCE, "localsgd"]) == {
        STEPS_GROUP: [REFERENCE],
        WAN: [PROJECTED, MEASURED, "localsgd"],
    }


def test_the_fsdp2_row_is_projected_beside_ddp_and_steps_time_one_short_epoch():
    """With ``fsdp2`` compared (Lightning's FSDP2 over all ranks), both of Lightning's rows are projected, each from its
    own runs; ``--project-steps N`` times one epoch of N batches instead of whole epochs."""
    ddp = Row(REFERENCE, REFERENCE, "x.DDP", False)
    fsdp = Row(FSDP2, FSDP2, "x.FSDP2", False)
    local = Row("localsgd", "localsgd", "x.LocalSGD", True)
    plan = ProjectionPlan((WAN,), measured=1, seeds=(0, 1), references=(REFERENCE, FSDP2), steps=6)
    rows_of = plan.rows_for([ddp, fsdp, local])
    assert [r.label for r in rows_of(STEPS_GROUP, 0)] == [REFERENCE, FSDP2]
    assert [r.label for r in rows_of(WAN, 0)] == [
        TIMING,
        MEASURED,
        timing_label(FSDP2),
        measured_label(FSDP2),
        "localsgd",
    ]
    assert [r.label for r in rows_of(WAN, 1)] == [TIMING, timing_label(FSDP2), "localsgd"]
    timing = rows_of(WAN, 1)[1]
    assert timing.strategy == FSDP2 and timing.ttt_args == {"stop": False, "record_steps": True}
    assert timing.extra == [] and timing.last == ["--trainer.max_epochs=1", "--trainer.limit_train_batches=6"]
    assert plan.group_labels([REFERENCE, FSDP2, "localsgd"]) == {
        STEPS_GROUP: [REFERENCE, FSDP2],
        WAN: [PROJECTED, MEASURED, projected_label(FSDP2), measured_label(FSDP2), "localsgd"],
    }


def test_a_projected_fsdp2_row_has_its_own_projection(tmp_path):
    steps = RunResult(FSDP2, 0, STEPS_GROUP, tmp_path / "s", ok=True)
    steps.packed = {"records": _steps_records()}
    timing = RunResult(timing_label(FSDP2), 0, WAN, tmp_path / "t", ok=True)
    timing.packed = {"records": _timing_records()}
    plan = ProjectionPlan((WAN,), measured=0, seeds=(0,), references=(FSDP2,))
    (result,) = project([steps, timing], plan, tmp_path / "out")
    assert result.ok and result.label == projected_label(FSDP2) and result.outcome.time_s == 18.0
    assert (tmp_path / "out" / "25mbit-50ms" / "fsdp2-projected" / "seed0" / "projection.json").exists()
    missing = project([steps], plan, tmp_path / "out2")[0]
    assert not missing.ok and missing.error == "projection: fsdp2's step-timing run failed: no run"
    text = projection_legend([result])
    assert text.startswith("fsdp2 (projected): fsdp2 (Lightning's FSDP2 over all ranks) projected the same way")
    assert "seed 0: 1.00 s/step, 0.50 s/evaluation" in text


def test_the_legend_says_how_and_how_far_off_the_measured_seed_is(tmp_path):
    projected = RunResult(PROJECTED, 0, WAN, tmp_path, ok=True)
    projected.packed = {"records": project_records(_steps_records(), step_timing(_timing_records()))}
    projected.outcome = outcome(projected.records)
    measured = RunResult(MEASURED, 0, WAN, tmp_path, ok=True)
    measured.outcome = outcome([dict(r, wall_s=r.get("wall_s", 0) * 20) for r in _steps_records()])  # reached at 60 s
    text = projection_legend([projected, measured])
    assert "seed 0: 1.00 s/step, 0.50 s/evaluation" in text
    assert "seed 0: measured 60.0 s, projected 18.0 s (projection -70.0 %), steps 12 measured, 12 projected" in text
    assert "Speedups in this table are against the projection" in text
    assert projection_legend([measured]) is None


# ----------------------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def projected(tmp_path_factory):
    from lightning_sync.compare import main as compare_main

    out = tmp_path_factory.mktemp("projection")
    argv = ["--workload", "digits", "--strategies", "ddp,localsgd", "--devices", "2", "--seeds", "1"]
    argv += ["--link", WAN, "--project-ddp", WAN, "--project-epochs", "3", "--target", "0.4", "--out", str(out)]
    argv += ["--trainer.max_epochs=3", "--trainer.limit_train_batches=4"]
    return out, compare_main(argv)


def test_the_projected_row_is_the_reference_of_its_table(projected):
    out, result = projected
    rows = {row["method"]: row for row in result["tables"][WAN]}
    assert list(rows) == [PROJECTED, MEASURED, "localsgd"]  # the step-timing run is in no table
    assert all("error" not in row for row in rows.values()), rows
    assert rows[PROJECTED]["speedup"] == 1.0 and rows[PROJECTED]["projected"]
    assert rows["localsgd"]["speedup"] == pytest.approx(rows[PROJECTED]["mean_s"] / rows["localsgd"]["mean_s"])
    assert rows[MEASURED]["speedup"] == pytest.approx(rows[PROJECTED]["mean_s"] / rows[MEASURED]["mean_s"])
    assert {row["speedup_vs"] for row in rows.values()} == {PROJECTED}
    # DDP's trajectory does not depend on the link: the measured run reached the target at the projected steps
    assert rows[MEASURED]["steps"] == rows[PROJECTED]["steps"]
    assert [row["method"] for row in result["tables"][STEPS_GROUP]] == [REFERENCE]
    table = (out / "25mbit-50ms" / "table.md").read_text()
    assert "speedup vs ddp (projected)" in table and "| ddp (projected) | 1/1 |" in table
    assert "ddp (measured): DDP run to the target at this link, to check the projection — seed 0: measured" in table
    summary = json.loads((out / "summary.json").read_text())
    assert summary["group_labels"][WAN] == [PROJECTED, MEASURED, "localsgd"]
    assert summary["tables"][WAN][0]["projected"] is True


def test_the_projected_time_is_the_formula_over_the_runs_own_records(projected):
    from lightning_sync.benchmark.ttt import read_records

    out, result = projected
    runs = {(r.link, r.label): r for r in result["runs"]}
    steps, timing, proj = runs[(STEPS_GROUP, REFERENCE)], runs[(WAN, TIMING)], runs[(WAN, PROJECTED)]
    assert steps.ok and timing.ok and proj.ok
    timing_records = read_records(timing.run_dir / "time_to_target.jsonl")
    end = next(r for r in timing_records if r["event"] == "end")
    assert len(end["step_wall_s"]) == 12 and end["step"] == 12  # 3 epochs of 4 steps, not stopped at the target
    measured = step_timing(timing_records)
    # at least a step's gradient all-reduce at the link: 50 ms of latency and the 38,378 fp32 gradients (2 ranks:
    # gloo's ring sends the buffer once) at 25 Mbit/s
    assert measured.step_s > 0.05 + 8 * 38_378 * 4 / 25e6
    evals = [r for r in read_records(steps.run_dir / "time_to_target.jsonl") if r["event"] == "eval"]
    hit = next(r for r in evals if r["reached"])
    assert proj.outcome.time_s == pytest.approx(measured.at(hit["step"], evals.index(hit) + 1), rel=1e-12)
    assert proj.outcome.steps == steps.outcome.steps and proj.outcome.bytes_per_rank == steps.outcome.bytes_per_rank
    assert (proj.run_dir / "projection.json").exists()


def test_a_merged_projection_renders_the_same_table(projected, tmp_path):
    from lightning_sync.compare import main as compare_main

    out, result = projected
    merged = compare_main(["--merge", str(out), "--out", str(tmp_path / "merged")])
    assert [row["method"] for row in merged["tables"][WAN]] == [PROJECTED, MEASURED, "localsgd"]
    assert merged["tables"][WAN][0]["mean_s"] == result["tables"][WAN][0]["mean_s"]


def test_bad_projection_arguments_fail_before_any_run(tmp_path, capsys):
    from lightning_sync.compare import main as compare_main

    for argv, message in (
        (["--link", "100mbit", "--project-ddp", WAN], "not one of the --link values"),
        (["--link", WAN, "--project-ddp", WAN, "--project-measured", "4", "--seeds", "3"], "in 0..--seeds"),
        (["--link", WAN, "--project-ddp", WAN, "--project-epochs", "0"], "--project-epochs must be >= 1"),
        (["--link", WAN, "--project-ddp", WAN, "--project-steps", "3"], "--project-steps must be >= 4"),
        (["--cluster", "4x25mbit,50ms"], "rate-limited only"),
        (["--link", WAN, "--project-ddp", WAN, "--strategies", "localsgd"], "add ddp to --strategies"),
    ):
        with pytest.raises(SystemExit):
            compare_main([*argv, "--out", str(tmp_path / "out")])
        assert message in capsys.readouterr().err, argv


def test_the_wan_link_costs_its_latency_and_the_bytes_at_its_rate():
    """``25mbit,50ms`` through the emulated link: DDP's step on ``words`` (4 ranks: the ring all-reduce of its
    9,381,632 fp32 gradients) is 56 MB a rank, 18 s at 25 Mbit/s — a run to the target takes the better part of an
    hour, which ``--project-ddp`` replaces."""
    from lightning_sync.comm import LinkModel
    from lightning_sync.comm.cost import ring_allreduce_bytes

    link = LinkModel.parse(WAN)
    assert (link.bits_per_second, link.latency_seconds) == (25e6, 0.05)
    step = ring_allreduce_bytes(9_381_632, 4, 4)
    assert step == 56_289_792
    assert link.delay(step) == pytest.approx(0.05 + 18.0127, abs=1e-4)


def test_the_fsdp2_row_is_projected_end_to_end_from_a_short_step_timing(tmp_path):
    """``--strategies ddp,fsdp2 --project-ddp LINK --project-steps 4`` on ``demo`` (the small words model, which
    shards itself for the fsdp2 row; 2 ranks, 1 seed, an easy target met at the first evaluation, step 25): both of
    Lightning's rows run without a link and are timed over one epoch of 4 steps at the link; both projected rows are
    in the table, the projected fsdp2's steps and bytes its run without a link's, its time the formula's over its own
    timing run. A pass-through ``--trainer.max_epochs=2`` is the budget of every other run, not the timing run's: its
    own length (one epoch of 4 batches) comes after and wins."""
    from lightning_sync.benchmark.ttt import read_records
    from lightning_sync.compare import main as compare_main

    out = tmp_path / "out"
    argv = ["--workload", "demo", "--strategies", "ddp,fsdp2", "--devices", "2", "--seeds", "1", "--out", str(out)]
    argv += ["--link", WAN, "--project-ddp", WAN, "--project-steps", "4", "--project-measured", "0"]
    argv += ["--target", "1e9", "--trainer.limit_val_batches=1", "--trainer.max_epochs=2"]
    result = compare_main(argv)
    assert [row["method"] for row in result["tables"][WAN]] == [PROJECTED, projected_label(FSDP2)]
    assert [row["method"] for row in result["tables"][STEPS_GROUP]] == [REFERENCE, FSDP2]
    runs = {(r.link, r.label): r for r in result["runs"]}
    timing = runs[(WAN, timing_label(FSDP2))]
    records = read_records(timing.run_dir / "time_to_target.jsonl")
    end = next(r for r in records if r["event"] == "end")
    assert timing.ok and len(end["step_wall_s"]) == 4 and end["comm"]["bytes_fsdp_all_gather"] > 0
    proj, steps = runs[(WAN, projected_label(FSDP2))], runs[(STEPS_GROUP, FSDP2)]
    assert proj.ok and proj.outcome.steps == steps.outcome.steps == 25  # the target met at the first evaluation
    assert proj.outcome.bytes_per_rank == steps.outcome.bytes_per_rank
    assert proj.outcome.time_s == pytest.approx(step_timing(records).at(25, 1), rel=1e-12)
    table = (out / "25mbit-50ms" / "table.md").read_text()
    assert "fsdp2 (projected): fsdp2 (Lightning's FSDP2 over all ranks) projected the same way" in table
