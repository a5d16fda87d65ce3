"""``TimeToTarget``: the callback that measures time to a fixed quality target, where it happens."""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lightning_sync.benchmark.memory import MemoryCount
from lightning_sync.benchmark.ttt import lower_is_better
from lightning_sync.core.validation import check_bool, check_choice, check_real

__all__ = ["TimeToTarget"]


def _digest(batch: Any) -> str:
    """A short SHA-1 of every tensor in ``batch`` (nested tuples, lists and dicts): tells data orders apart."""
    h = hashlib.sha1()

    def walk(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            h.update(obj.detach().cpu().contiguous().numpy().tobytes())
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item)
        elif isinstance(obj, dict):
            for key in sorted(obj, key=str):
                walk(obj[key])

    walk(batch)
    return h.hexdigest()[:16]


class TimeToTarget(Callback):
    """Record the wall time and the metric of every evaluation, and stop the run once the target is met.

    MLPerf-style time to target: the clock starts when ``fit`` sets up (the ``setup`` hook, after the process group
    exists and before the strategy wraps the model or starts its servers) and the time to target is the wall time at
    the **end** of the first evaluation whose ``metric`` meets ``target`` (``>=`` for ``mode="max"``, ``<=`` for
    ``"min"``; NaN never does). Evaluation time is included, for every method alike; the evaluation frequency is the
    Trainer's (``check_val_every_n_epoch``, epochs sized with ``limit_train_batches``), part of the workload's config.

    Rank 0 appends one JSON object per line to ``path`` as things happen (a run that is killed keeps what it
    recorded):

    * ``{"event": "start", "metric", "target", "mode", "seed", "world_size", "strategy"}`` at setup;
    * ``{"event": "data", "first_batch": digest}`` at the first training batch (tells data orders apart);
    * ``{"event": "eval", "epoch", "step", "wall_s", "eval_s", "value", "reached", "metrics", "comm",
      "eval_blocked_s"}`` at the end of every evaluation (not the sanity check): ``comm`` is the strategy's
      ``sync_metrics()`` then (bytes sent, blocked seconds, LSSR, ... — every strategy of the pack and
      ``CountedDDPStrategy`` have it), ``eval_blocked_s`` the blocked seconds during the evaluation (FSDP2's
      all-gathers to evaluate; NaN without ``blocked_s``);
    * ``{"event": "end", "wall_s", "step", "reached", "comm", "memory"}`` when training ends: ``memory`` is rank 0's
      training state in bytes (parameters, gradients, optimizer and outer-optimizer state, local shards under FSDP2)
      and its peak resident set size (:class:`~lightning_sync.benchmark.memory.MemoryCount`); with ``record_steps`` also
      ``"step_wall_s"``: the wall time at the end of every optimizer step (entry ``i``: step ``i + 1``), what
      ``compare --project-ddp`` times DDP's steps at a slow link by (:mod:`~lightning_sync.benchmark.projection`).

    With ``stop=True`` the Trainer stops after the evaluation that met the target. The decision is taken together
    (``strategy.reduce_boolean_decision``, as ``EarlyStopping`` does), so ranks stop at the same point.

    Args:
        metric: a metric logged at validation, e.g. ``"val/acc"`` or ``"val/ppl"``.
        target: the value to reach, a finite number.
        mode: ``"max"`` (higher is better), ``"min"``, or ``"auto"``: ``"min"`` when the name says loss, perplexity
            or error, else ``"max"``.
        stop: stop the run at the evaluation that reached the target.
        path: the JSON-lines file (``None``: ``<trainer.log_dir or default_root_dir>/time_to_target.jsonl``).
        record_steps: also record the wall time at the end of every optimizer step (in the ``end`` record).
    """

    def __init__(
        self,
        metric: str,
        target: float,
        mode: str = "auto",
        stop: bool = True,
        path: str | None = None,
        record_steps: bool = False,
    ) -> None:
        if not isinstance(metric, str) or not metric:
            raise ValueError(f"metric must be the non-empty name of a logged metric, e.g. 'val/acc'; got {metric!r}")
        self.metric = metric
        self.target = check_real("target", target)
        check_choice("mode", mode, ("auto", "max", "min"))
        self.mode = ("min" if lower_is_better(metric) else "max") if mode == "auto" else mode
        self.stop = check_bool("stop", stop)
        if path is not None and (not isinstance(path, (str, os.PathLike)) or not str(path)):
            raise ValueError(f"path must be a file path (a non-empty string) or None, got {path!r}")
        self.path = None if path is None else str(path)
        self.record_steps = check_bool("record_steps", record_steps)
        self._step_walls: list[float] = []
        self._last_step = 0
        self._t0 = time.perf_counter()
        self._eval_started: float | None = None
        self._blocked_at_eval_start = math.nan  # rank 0's blocked seconds when the evaluation began
        self._reached_at: float | None = None
        self._saw_batch = False
        self._file: Path | None = None
        self._memory = MemoryCount()

    # ------------------------------------------------------------------ helpers
    def meets(self, value: float) -> bool:
        """Whether ``value`` meets the target (NaN never does)."""
        if math.isnan(value):
            return False
        return value >= self.target if self.mode == "max" else value <= self.target

    def _write(self, trainer: pl.Trainer, record: dict[str, Any]) -> None:
        if trainer.global_rank != 0 or self._file is None:
            return
        with self._file.open("a") as f:
            f.write(json.dumps(record) + "\n")

    @staticmethod
    def _comm(trainer: pl.Trainer) -> dict[str, float]:
        sync_metrics = getattr(trainer.strategy, "sync_metrics", None)
        return {k: float(v) for k, v in sync_metrics().items()} if callable(sync_metrics) else {}

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._t0 = time.perf_counter()
        self._reached_at = None
        self._saw_batch = False
        self._step_walls = []
        self._last_step = trainer.global_step
        self._memory = MemoryCount()
        if trainer.global_rank == 0:
            path = self.path or os.path.join(trainer.log_dir or trainer.default_root_dir, "time_to_target.jsonl")
            self._file = Path(path)
            self._file.parent.mkdir(parents=True, exist_ok=True)
            self._file.write_text("")
        self._write(
            trainer,
            {
                "event": "start",
                "metric": self.metric,
                "target": self.target,
                "mode": self.mode,
                "seed": int(os.environ.get("PL_GLOBAL_SEED", "0") or 0),
                "world_size": trainer.world_size,
                "strategy": type(trainer.strategy).__name__,
            },
        )

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._saw_batch:
            self._saw_batch = True
            if trainer.global_rank == 0:
                self._write(trainer, {"event": "data", "first_batch": _digest(batch)})

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.record_steps and trainer.global_step != self._last_step:  # an optimizer step ended
            self._last_step = trainer.global_step
            self._step_walls.append(time.perf_counter() - self._t0)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        # the gradients exist now (what the end record's memory counts of them); at steps 0, 1, 2, 4, 8, ... only, so
        # that a timed run does not walk the parameters every step for a size that stops changing
        step = trainer.global_step
        if trainer.global_rank == 0 and step & (step - 1) == 0:
            self._memory.observe_grads(pl_module)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_started = time.perf_counter()
        self._blocked_at_eval_start = self._comm(trainer).get("blocked_s", math.nan)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        if self.metric not in trainer.callback_metrics:
            logged = sorted(trainer.callback_metrics)
            raise ValueError(
                f"TimeToTarget: the metric {self.metric!r} was not logged at validation; logged: {logged}. Log it "
                "in validation_step (with sync_dist=True, or a torchmetrics metric) or name another metric."
            )
        now = time.perf_counter()
        value = float(trainer.callback_metrics[self.metric])
        reached = trainer.strategy.reduce_boolean_decision(self.meets(value), all=False)
        first = reached and self._reached_at is None
        if first:
            self._reached_at = now - self._t0
        self._write(
            trainer,
            {
                "event": "eval",
                "epoch": trainer.current_epoch,
                "step": trainer.global_step,
                "wall_s": now - self._t0,
                "eval_s": now - self._eval_started if self._eval_started is not None else math.nan,
                "value": value,
                "reached": bool(reached),
                "first": bool(first),
                "metrics": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val")},
                "comm": (comm := self._comm(trainer)),
                "eval_blocked_s": comm.get("blocked_s", math.nan) - self._blocked_at_eval_start,
            },
        )
        if reached and self.stop:
            trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        record: dict[str, Any] = {
            "event": "end",
            "wall_s": time.perf_counter() - self._t0,
            "step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "reached": self._reached_at is not None,
            "comm": self._comm(trainer),
        }
        if trainer.global_rank == 0:
            record["memory"] = self._memory.record(pl_module, trainer.optimizers, trainer.strategy)
        if self.record_steps:
            record["step_wall_s"] = list(self._step_walls)
        self._write(trainer, record)
