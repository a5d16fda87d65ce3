"""Time-to-target arithmetic: one run's outcome from its recorded evaluations, and the summary over seeds.

Pure Python (no torch, no Lightning), tested on synthetic histories. The rules (MLPerf Training's, for a fixed
quality target):

* a run's **time to target** is the wall time at the end of its first evaluation that met the target; a run that
  never met it (its budget ran out, it diverged, it failed) has **no** time: it is *missed*, never a number;
* over ``N`` runs of one method (seeds), the runs are ordered by time with missed runs last (as +infinity); when
  ``N >= 5`` the fastest and the slowest are dropped; the **mean** is over the runs left and exists only if every one
  of them reached the target (so with ``N >= 5`` one missed run is tolerated, as the slowest, and two are not);
  ``min`` is the fastest run that reached, ``max`` the slowest (missed if any run missed);
* a **speedup** is the reference's mean over the method's mean, both of which must exist.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DROP_EXTREMES_FROM",
    "MEMORY_KEYS",
    "Outcome",
    "Summary",
    "lower_is_better",
    "outcome",
    "read_packed",
    "read_records",
    "speedup",
    "summarize_runs",
]

#: from this many runs on, the fastest and the slowest are dropped before the mean
DROP_EXTREMES_FROM = 5
#: the ``end`` record's memory counts (:mod:`~lightning_sync.benchmark.memory`), fields of :class:`Outcome`
MEMORY_KEYS = ("params_bytes", "grads_bytes", "optimizer_bytes", "outer_bytes", "peak_rss_bytes")


def lower_is_better(metric: str) -> bool:
    """Loss, perplexity and error decrease; accuracy-like metrics increase."""
    return any(word in metric.lower() for word in ("loss", "ppl", "perplexity", "error"))


#: a committed report's run folders, packed into one file (``benchmarks/pack_records.py`` writes it)
PACKED = "records.jsonl.gz"


def read_packed(folder: str | Path) -> list[dict[str, Any]]:
    """The runs packed in ``folder/records.jsonl.gz`` (``[]`` if there is none), one dict per run: ``run`` (its
    folder relative to ``folder``), ``records`` (its ``time_to_target.jsonl``), ``summary`` and ``files`` (the run
    folder's other text files)."""
    path = Path(folder) / PACKED
    if not path.exists():
        return []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The JSON-lines records a :class:`~lightning_sync.benchmark.TimeToTarget` wrote (``[]`` if there is no file);
    a last line cut short by a killed run is ignored."""
    p = Path(path)
    if not p.exists():
        return []
    records = []
    for line in p.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


@dataclass
class Outcome:
    """What one run achieved against the target."""

    reached: bool
    #: wall seconds from the start of fit to the end of the first evaluation that met the target (None: missed)
    time_s: float | None = None
    #: optimizer steps (rank 0's), bytes sent per rank, seconds blocked in communication, LSSR and seconds spent in
    #: evaluation, at the target (or at the end of the run when it was missed)
    steps: float = math.nan
    bytes_per_rank: float = math.nan
    #: with replica groups (``replica_size``): what rank 0 — the first replica's leader — sent between replicas
    #: (``bytes_inter``: the method's syncs and every rank's control traffic, not the traffic inside the replica);
    #: NaN for a run without replica groups
    inter_bytes: float = math.nan
    blocked_s: float = math.nan
    #: with replica groups: rank 0's seconds blocked inside its replica (``blocked_intra_s``) and between replicas
    #: (``blocked_inter_s``); NaN for a run without replica groups
    blocked_intra_s: float = math.nan
    blocked_inter_s: float = math.nan
    lssr: float = math.nan
    eval_s: float = math.nan
    #: the best value of the metric over the run's evaluations, and how many evaluations there were
    best: float = math.nan
    evaluations: int = 0
    #: wall seconds of the whole run (to the end of training) and its steps
    wall_s: float = math.nan
    end_steps: float = math.nan
    first_batch: str = ""
    seed: int | None = None
    metric: str = ""
    target: float = math.nan
    #: rank 0's training state in bytes at the end of the run (the ``end`` record's ``memory``:
    #: :mod:`~lightning_sync.benchmark.memory`): parameters, gradients, optimizer and outer-optimizer state (local
    #: shards under FSDP2), and its peak resident set size; NaN for a run that recorded none (killed, or older)
    params_bytes: float = math.nan
    grads_bytes: float = math.nan
    optimizer_bytes: float = math.nan
    outer_bytes: float = math.nan
    peak_rss_bytes: float = math.nan

    @property
    def state_bytes(self) -> float:
        """Parameters, gradients, optimizer and outer-optimizer state: the training state a rank holds."""
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.outer_bytes


def outcome(records: Sequence[dict[str, Any]], target: float | None = None, mode: str | None = None) -> Outcome:
    """The outcome of one run from its records. ``target``/``mode`` default to what the run recorded at its start;
    given, the first evaluation meeting them is searched afresh (the same history against another target)."""
    start = next((r for r in records if r.get("event") == "start"), {})
    metric = start.get("metric", "")
    target = start.get("target", math.nan) if target is None else target
    if mode is None:
        mode = start.get("mode") or ("min" if lower_is_better(metric) else "max")
    if mode not in ("max", "min"):
        raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
    evals = [r for r in records if r.get("event") == "eval"]
    end = next((r for r in records if r.get("event") == "end"), None)
    data = next((r for r in records if r.get("event") == "data"), {})
    memory = (end or {}).get("memory") or {}

    def meets(value: float) -> bool:
        if value is None or math.isnan(value) or math.isnan(target):
            return False
        return value >= target if mode == "max" else value <= target

    hit = next((r for r in evals if meets(float(r["value"]))), None)
    values = [float(r["value"]) for r in evals if not math.isnan(float(r["value"]))]
    best = (max(values) if mode == "max" else min(values)) if values else math.nan
    at = hit or end or (evals[-1] if evals else None)
    comm = (at or {}).get("comm", {})
    eval_upto = [r for r in evals if hit is None or r["wall_s"] <= hit["wall_s"]]
    return Outcome(
        reached=hit is not None,
        time_s=float(hit["wall_s"]) if hit is not None else None,
        steps=float(at["step"]) if at is not None else math.nan,
        bytes_per_rank=float(comm.get("bytes_sent", math.nan)),
        inter_bytes=float(comm.get("bytes_inter", math.nan)),
        blocked_s=float(comm.get("blocked_s", math.nan)),
        blocked_intra_s=float(comm.get("blocked_intra_s", math.nan)),
        blocked_inter_s=float(comm.get("blocked_inter_s", math.nan)),
        lssr=float(comm.get("lssr", math.nan)),
        eval_s=sum(float(r.get("eval_s", 0.0)) for r in eval_upto) if eval_upto else math.nan,
        best=best,
        evaluations=len(evals),
        wall_s=float(end["wall_s"]) if end is not None else (float(evals[-1]["wall_s"]) if evals else math.nan),
        end_steps=float(end["step"]) if end is not None else math.nan,
        first_batch=str(data.get("first_batch", "")),
        seed=start.get("seed"),
        metric=metric,
        target=float(target),
        **{key: float(memory.get(key, math.nan)) for key in MEMORY_KEYS},
    )


@dataclass
class Summary:
    """A method's runs against the target (see the module docstring for the rules)."""

    runs: int
    reached: int
    mean_s: float | None  #: None: missed (a run kept for the mean did not reach the target)
    min_s: float | None  #: None: no run reached
    max_s: float | None  #: None: some run missed
    dropped_extremes: bool
    kept: list[float | None] = field(default_factory=list)  #: the times the mean is over (None: missed)

    @property
    def all_missed(self) -> bool:
        return self.reached == 0


def summarize_runs(times: Iterable[float | None]) -> Summary:
    """Summary of one method's times to target (``None`` or NaN for a run that missed)."""
    clean = [None if t is None or (isinstance(t, float) and math.isnan(t)) else float(t) for t in times]
    n = len(clean)
    if n == 0:
        raise ValueError("summarize_runs needs at least one run")
    ordered = sorted(clean, key=lambda t: math.inf if t is None else t)
    drop = n >= DROP_EXTREMES_FROM
    kept = ordered[1:-1] if drop else ordered
    reached = [t for t in clean if t is not None]
    mean = None if any(t is None for t in kept) else sum(kept) / len(kept)  # type: ignore[arg-type]
    return Summary(
        runs=n,
        reached=len(reached),
        mean_s=mean,
        min_s=min(reached) if reached else None,
        max_s=None if len(reached) < n else max(reached),
        dropped_extremes=drop,
        kept=kept,
    )


def speedup(reference: Summary | None, other: Summary) -> float | None:
    """``reference.mean / other.mean`` when both exist (``None`` otherwise: never a number from a missed run)."""
    if reference is None or reference.mean_s is None or other.mean_s is None or other.mean_s <= 0:
        return None
    return reference.mean_s / other.mean_s
