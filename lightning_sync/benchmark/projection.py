"""Lightning's rows' time to target at a slow link, projected rather than run (``lightning-sync compare --project-ddp
LINK``): DDP's, and FSDP2's over all ranks (the ``fsdp2`` row) when it is in the comparison.

At 25 Mbit/s a step of Lightning's DDP on ``words`` sends 56 MB a rank (the ring all-reduce of 38 MB of gradients),
18 s of transfer: a run to the target takes the better part of an hour per seed. DDP's trajectory does not depend on
the link (the same steps, the same sums, bit for bit: only the waits change), so its time there can be projected from
two shorter runs of the same ``compare``, seed by seed:

* a **steps run**: DDP to the target without a link (the table ``none``), which gives ``S``, the steps to the
  target, ``K``, the evaluations up to and including the one that met it, and the bytes sent (the same at any link);
* a **step-timing run** at the slow link, interleaved with the other rows' runs of that seed (the same load on the
  machine): DDP trained for ``--project-epochs`` epochs with its evaluations, never stopped at the target, recording
  the wall time at the end of every step (:class:`~lightning_sync.benchmark.TimeToTarget`'s ``record_steps``). From
  its step times ``t_1 .. t_n`` and its evaluations (``eval_s`` each):

  - ``step`` = (t_n − t_W − the evaluations between them) / (n − W): everything a step does (data, forward,
    backward, the all-reduce at the link, the optimizer, an epoch's start), evaluations excluded, the first
    :data:`WARMUP_STEPS` = W steps left out (DDP rebuilds its buckets after the first);
  - ``eval`` = the mean of its evaluations' seconds (at the link: validation also goes through DDP's module);
  - ``fixed`` = t_W − W · step − the evaluations before t_W: the setup (DDP's parameter broadcast at the link) and
    the first steps' excess.

  The projected time at an evaluation with ``k`` steps that is the ``j``-th is ``fixed + k · step + j · eval``; the
  time to target is it at the target's evaluation, ``fixed + S · step + K · eval``.

The projection is a row of its own, ``ddp (projected)``, the reference of that link's table (its speedups say ``vs
ddp (projected)``, its rows in ``summary.json`` ``"speedup_vs": "ddp (projected)"``), written as a run folder with
the projected records (``time_to_target.jsonl``, its first records saying how it was made), so ``--merge`` renders it
again. ``--project-measured N`` (default 1) also runs DDP to the target at the link for the first ``N`` seeds, the row
``ddp (measured)``: the table's legend states each such seed's projected and measured times and their difference.

The ``fsdp2`` row (Lightning's ``ModelParallelStrategy``, FSDP2 over all ranks) is projected the same way, as
``fsdp2 (projected)``, from its own steps run and step-timing run: its trajectory does not depend on the link
either (its all-gathers and reduce-scatters are blocking and the same at any link; only their waits change). Its step
at 100 Mbit/s on ``words_wide`` (issue 62) carries 480 MB a rank, 38 s: a run to the target would take an hour per
seed. ``--project-steps N`` times N steps (one epoch of N batches and its evaluation) instead of
``--project-epochs`` whole epochs: an epoch's start is then in ``fixed``, not spread over the steps.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lightning_sync.benchmark.runs import REFERENCE, Row, RunResult, slug
from lightning_sync.benchmark.ttt import outcome, read_records

__all__ = [
    "MEASURED",
    "PROJECTED",
    "STEPS_GROUP",
    "TIMING",
    "WARMUP_STEPS",
    "ProjectionPlan",
    "StepTiming",
    "measured_label",
    "project",
    "project_records",
    "projected_label",
    "projection_legend",
    "step_timing",
    "timing_label",
]


def projected_label(reference: str) -> str:
    """The projected row of ``reference`` (``ddp``, ``fsdp2``): ``"ddp (projected)"``."""
    return f"{reference} (projected)"


def measured_label(reference: str) -> str:
    """``reference`` run end to end at a projected link, to check the projection: ``"ddp (measured)"``."""
    return f"{reference} (measured)"


def timing_label(reference: str) -> str:
    """``reference``'s step-timing run at a projected link (in no table): ``"ddp (step timing)"``."""
    return f"{reference} (step timing)"


#: the projected reference row, DDP run end to end at a projected link, and the step-timing runs (in no table)
PROJECTED, MEASURED, TIMING = projected_label(REFERENCE), measured_label(REFERENCE), timing_label(REFERENCE)
#: the group of the steps runs: DDP without a link
STEPS_GROUP = "none"
#: the first steps of a timing run left out of the per-step time (DDP rebuilds its buckets after the first step)
WARMUP_STEPS = 2


@dataclass(frozen=True)
class StepTiming:
    """What a step-timing run measured at the link (see the module docstring)."""

    step_s: float  #: seconds per step, evaluations excluded
    eval_s: float  #: seconds per evaluation
    fixed_s: float  #: setup and the first steps' excess over ``step_s``
    steps: int  #: steps the run trained
    evaluations: int
    blocked_per_step_s: float  #: rank 0's blocked seconds over the run's steps (its evaluations' left out), per step
    #: rank 0's blocked seconds per evaluation (0 where the records do not say: those of an earlier version, whose
    #: ``blocked_per_step_s`` then includes the evaluations')
    eval_blocked_s: float = 0.0

    def at(self, steps: float, evaluations: int) -> float:
        """Projected wall seconds at the end of the ``evaluations``-th evaluation, after ``steps`` steps."""
        return self.fixed_s + steps * self.step_s + evaluations * self.eval_s


def step_timing(records: Sequence[dict[str, Any]], warmup: int = WARMUP_STEPS) -> StepTiming:
    """The :class:`StepTiming` of a step-timing run's records. ``ValueError`` if it cannot give one: no ``end``
    record with its step times (the run did not finish), fewer than ``warmup + 2`` steps, or no evaluation."""
    end = next((r for r in records if r.get("event") == "end"), None)
    if end is None or "step_wall_s" not in end:
        raise ValueError("the step-timing run recorded no end with its step times (it did not finish)")
    t = [float(x) for x in end["step_wall_s"]]
    n = len(t)
    if warmup < 1 or n < warmup + 2:
        raise ValueError(f"the step-timing run trained {n} steps; timing needs {warmup + 2} or more (warm-up {warmup})")
    evals = [r for r in records if r.get("event") == "eval"]
    if not evals:
        raise ValueError("the step-timing run evaluated nothing: --project-epochs must cover an evaluation")
    inside = sum(float(e["eval_s"]) for e in evals if warmup <= int(e["step"]) < n)
    before = sum(float(e["eval_s"]) for e in evals if int(e["step"]) < warmup)
    step_s = (t[n - 1] - t[warmup - 1] - inside) / (n - warmup)
    blocked = float(end.get("comm", {}).get("blocked_s", math.nan))
    in_evals = [float(e["eval_blocked_s"]) for e in evals if math.isfinite(float(e.get("eval_blocked_s", math.nan)))]
    if len(in_evals) != len(evals):
        in_evals = []  # records of an earlier version: the evaluations' blocked time stays in the per-step figure
    return StepTiming(
        step_s=step_s,
        eval_s=sum(float(e["eval_s"]) for e in evals) / len(evals),
        fixed_s=t[warmup - 1] - warmup * step_s - before,
        steps=n,
        evaluations=len(evals),
        blocked_per_step_s=(blocked - sum(in_evals)) / n,
        eval_blocked_s=sum(in_evals) / len(in_evals) if in_evals else 0.0,
    )


def project_records(
    steps_records: Sequence[dict[str, Any]], timing: StepTiming, about: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """The steps run's records at the link: every evaluation (and the end) at its projected wall time, each
    evaluation's seconds the timing run's mean, blocked seconds the timing run's per step times the steps plus its
    per evaluation times the evaluations; the bytes
    are the steps run's (the same steps send the same bytes at any link). A ``projection`` record after ``start``
    says how (``about``: where its inputs are)."""
    out: list[dict[str, Any]] = []
    j = 0
    for record in steps_records:
        event = record.get("event")
        if event not in ("eval", "end"):
            out.append(dict(record))
            if event == "start":
                out.append({"event": "projection", **(about or {}), **_fields(timing)})
            continue
        j += event == "eval"
        step = float(record["step"])
        blocked = timing.blocked_per_step_s * step + timing.eval_blocked_s * j
        comm = dict(record.get("comm", {}), blocked_s=blocked)
        projected = dict(record, wall_s=timing.at(step, j), comm=comm, projected=True)
        if event == "eval":
            projected["eval_s"] = timing.eval_s
        out.append(projected)
    return out


def _fields(timing: StepTiming) -> dict[str, Any]:
    return {
        "step_s": timing.step_s,
        "eval_s": timing.eval_s,
        "fixed_s": timing.fixed_s,
        "timed_steps": timing.steps,
        "timed_evaluations": timing.evaluations,
        "warmup_steps": WARMUP_STEPS,
        "blocked_per_step_s": timing.blocked_per_step_s,
        "eval_blocked_s": timing.eval_blocked_s,
        "formula": "wall_s = fixed_s + step * step_s + j * eval_s at the j-th evaluation",
    }


@dataclass(frozen=True)
class ProjectionPlan:
    """Which links project which of Lightning's rows (``references``: ``ddp``, and ``fsdp2`` when it is compared),
    how long each step-timing run trains (``epochs`` whole epochs, or ``steps`` steps in one epoch of that many
    batches), and how many seeds also run each reference to the target at those links (validating the projection)."""

    links: tuple[str, ...]
    epochs: int = 1
    measured: int = 1
    seeds: tuple[int, ...] = field(default_factory=tuple)
    references: tuple[str, ...] = (REFERENCE,)
    steps: int | None = None

    def groups(self, groups: list[tuple[str, str | None]]) -> list[tuple[str, str | None]]:
        """The comparison's groups with the steps runs' first (fast: the references without a link)."""
        return [(STEPS_GROUP, None), *groups]

    def _timing_extra(self) -> list[str]:
        if self.steps is None:
            return [f"--trainer.max_epochs={self.epochs}"]
        return ["--trainer.max_epochs=1", f"--trainer.limit_train_batches={self.steps}"]

    def rows_for(self, rows: list[Row]) -> Callable[[str, int], list[Row]]:
        """The rows of each (group, seed): the references alone in the steps group; at a projected link each
        reference's step-timing run in its row's place (and, for the first ``measured`` seeds, the reference to the
        target beside it); the rows elsewhere."""
        refs = [r for r in rows if r.label in self.references]
        timings = {
            r.label: replace(
                r,
                label=timing_label(r.label),
                last=self._timing_extra(),  # after compare's pass-through --trainer.*: the timing run's length wins
                ttt_args={"stop": False, "record_steps": True},
            )
            for r in refs
        }
        measured = {r.label: replace(r, label=measured_label(r.label)) for r in refs}
        others = [r for r in rows if r.label not in self.references]

        def rows_of(group: str, seed: int) -> list[Row]:
            if group == STEPS_GROUP:
                return refs
            if group in self.links:
                check = seed in self.seeds[: self.measured]
                at_link = [[timings[r.label], *([measured[r.label]] if check else [])] for r in refs]
                return [*(row for pair in at_link for row in pair), *others]
            return rows

        return rows_of

    def group_labels(self, labels: list[str]) -> dict[str, list[str]]:
        """The rows of each group's table: the references alone in the steps group; at a projected link each
        projection (and its measured run) in its reference's place."""
        refs = [x for x in labels if x in self.references]
        at_link = [
            *(y for x in refs for y in (projected_label(x), *([measured_label(x)] if self.measured else []))),
            *(x for x in labels if x not in self.references),
        ]
        return {STEPS_GROUP: refs, **{link: list(at_link) for link in self.links}}


def project(results: Sequence[RunResult], plan: ProjectionPlan, out: Path) -> list[RunResult]:
    """A ``<reference> (projected)`` result per reference, projected link and seed, from that seed's steps run and
    step-timing run (failed, saying why, when either failed or cannot give its numbers); each written as a run folder
    under ``out`` whose ``time_to_target.jsonl`` holds the projected records and ``projection.json`` the timing."""
    find = {(r.link, r.label, r.seed): r for r in results}
    projected: list[RunResult] = []
    for ref in plan.references:
        name = "DDP" if ref == REFERENCE else ref
        for link in plan.links:
            for seed in plan.seeds:
                run_dir = out / slug(link) / slug(projected_label(ref)) / f"seed{seed}"
                result = RunResult(projected_label(ref), seed, link, run_dir)
                steps, timing = find.get((STEPS_GROUP, ref, seed)), find.get((link, timing_label(ref), seed))
                result.seconds = sum(r.seconds for r in (steps, timing) if r is not None)
                try:
                    if steps is None or not steps.ok:
                        raise ValueError(
                            f"{name}'s steps run without a link failed: {getattr(steps, 'error', 'no run')}"
                        )
                    if timing is None or not timing.ok:
                        raise ValueError(f"{name}'s step-timing run failed: {getattr(timing, 'error', 'no run')}")
                    measured = step_timing(timing.records)
                except ValueError as err:
                    result.error = f"projection: {err}"
                    projected.append(result)
                    continue
                about = {"steps_run": str(steps.run_dir), "timing_run": str(timing.run_dir), "link": link}
                records = project_records(steps.records, measured, about)
                run_dir.mkdir(parents=True, exist_ok=True)
                (run_dir / "time_to_target.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
                (run_dir / "projection.json").write_text(json.dumps({**about, **_fields(measured)}, indent=1) + "\n")
                result.outcome = outcome(read_records(run_dir / "time_to_target.jsonl"))
                result.ok = True
                projected.append(result)
    return projected


def projection_legend(runs: Sequence[RunResult]) -> str | None:
    """What a projected table's legend says: how the projection is made, its per-step time per seed, and for each
    seed measured end to end its projected and measured times and steps (``None`` without a projected row). A
    projected ``fsdp2`` row (Lightning's FSDP2 over all ranks) gets the same sentences after DDP's."""
    parts = [_legend(runs, ref) for ref in (REFERENCE, *sorted({_reference_of(r.label) for r in runs} - {REFERENCE}))]
    text = " ".join(p for p in parts if p)
    return text or None


def _reference_of(label: str) -> str:
    return label[: -len(" (projected)")] if label.endswith(" (projected)") else REFERENCE


def _legend(runs: Sequence[RunResult], ref: str) -> str | None:
    label, check = projected_label(ref), measured_label(ref)
    name = "Lightning's DDP" if ref == REFERENCE else f"{ref} (Lightning's FSDP2 over all ranks)"
    short = "DDP" if ref == REFERENCE else ref
    proj = {r.seed: r for r in runs if r.label == label and r.ok and r.outcome is not None}
    if not any(r.label == label for r in runs):
        return None
    timings = []
    for seed, r in sorted(proj.items()):
        about = next((x for x in r.records if x.get("event") == "projection"), {})
        if "step_s" in about:
            timings.append(f"seed {seed}: {about['step_s']:.2f} s/step, {about['eval_s']:.2f} s/evaluation")
    if ref == REFERENCE:
        text = (
            f"{label}: {name} not run to the target at this link; its time per seed is projected as fixed + "
            f"S x step + K x eval (S, K: the steps and evaluations to the target of DDP's run of the same seed "
            f"without a link, table '{STEPS_GROUP}' — DDP's trajectory does not depend on the link; step, eval, "
            f"fixed: measured at this link, in this compare, by a run of DDP for --project-epochs epochs (or "
            f"--project-steps steps), its first {WARMUP_STEPS} steps left out of the per-step time: "
            f"{'; '.join(timings) or 'none'}). Its bytes are the run without a link's, its blocked seconds the timing "
            "run's per step times S plus its per evaluation times K. Speedups in this table are against the projection."
        )
    else:
        text = (
            f"{label}: {name} projected the same way, from its own run without a link and its own step timing "
            f"at this link: {'; '.join(timings) or 'none'}."
        )
    checks = []
    for r in runs:
        if r.label != check:
            continue
        p = proj.get(r.seed)
        if not (r.ok and r.outcome is not None and r.outcome.reached and p is not None and p.outcome is not None):
            checks.append(f"seed {r.seed}: {'missed' if r.ok else 'failed'}, no comparison")
            continue
        measured_s, projected_s = r.outcome.time_s or math.nan, p.outcome.time_s or math.nan
        checks.append(
            f"seed {r.seed}: measured {measured_s:.1f} s, projected {projected_s:.1f} s (projection "
            f"{100 * (projected_s - measured_s) / measured_s:+.1f} %), steps {r.outcome.steps:.0f} measured, "
            f"{p.outcome.steps:.0f} projected"
        )
    if checks:
        text += (
            f" {check}: {short} run to the target at this link, to check the projection — " + "; ".join(checks) + "."
        )
    return text
