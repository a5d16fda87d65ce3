"""Make chosen ranks stragglers: each slowed batch takes ``slowdown`` times the rank's own step time."""

from __future__ import annotations

import time
from collections.abc import Sequence
from numbers import Integral
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from lightning_sync.core.validation import check_int, check_optional_int, check_real


class StragglerInjection(Callback):
    """Slow down the global ranks ``ranks`` by a factor ``slowdown`` of their own measured step time.

    For experiments and tests with heterogeneous clusters, e.g. ALADDIN §5.4, where some workers are ×2, ×10 or
    ×100 slower than the others. On a chosen rank, every training batch whose index is in
    ``[start, start + duration)`` (``duration=None``: until the end of the fit) is timed from
    ``on_train_batch_start`` to ``on_train_batch_end`` (forward, backward, optimizer step and whatever the
    strategy communicates in between), and after it the rank sleeps ``(slowdown - 1)`` times that time, so a
    ``slowdown=4`` straggler takes 4× its natural step time. Because the factor applies to the rank's own
    measured step time, it holds on any machine, however fast, without hand-tuned delays. Other ranks are
    untouched, and ``slowdown=1.0`` is a no-op.

    The batch index is this rank's own count of the training batches the callback has seen in this fit
    (0-based, across epochs), not ``batch_idx`` or ``global_step``: with gradient accumulation every
    micro-batch counts, and a rank that runs more or fewer batches than the others (dynamic work assignment)
    keeps its own count.

    How the cluster reacts is the strategy's business: with a synchronous strategy (BSP) every collective waits
    for the straggler, so the whole cluster runs at its pace; asynchronous ones (ASP, SSP, ALADDIN with dynamic
    work assignment) let the other ranks go on. The callback itself never communicates: it only sleeps.

    Attributes (this rank's, for experiments and tests):

    ====================  ============================================================================
    ``batches_seen``      training batches seen in this fit
    ``slowed_steps``      batches slowed on this rank (those in the window, on a chosen rank)
    ``measured_seconds``  total natural wall time of the slowed batches, before sleeping
    ``injected_seconds``  total sleep added: ``(slowdown - 1) * measured_seconds``
    ====================  ============================================================================

    :meth:`state_dict` / :meth:`load_state_dict` carry these counters across a resume. Lightning saves callback
    state from rank 0 only, so after a resume every rank starts from rank 0's counters: ``batches_seen`` is
    right when all ranks run the same number of batches, while ``slowed_steps``, ``measured_seconds`` and
    ``injected_seconds`` are rank 0's (zero on a straggler rank other than 0, if rank 0 is not a straggler).

    Args:
        ranks: the global ranks (``trainer.global_rank``) to slow down: one integer >= 0 or a non-empty
            sequence of them.
        slowdown: the factor, a number >= 1.0 (1.0 adds no delay).
        start: index of the first batch to slow, an integer >= 0.
        duration: how many batches to slow from ``start``, an integer >= 1, or ``None`` for all of them.
    """

    def __init__(
        self,
        ranks: int | Sequence[int] = (0,),
        slowdown: float = 4.0,
        start: int = 0,
        duration: int | None = None,
    ) -> None:
        self.ranks: tuple[int, ...] = _check_ranks(ranks)
        self.slowdown = check_real("slowdown", slowdown, low=1.0)
        self.start = check_int("start", start, 0)
        self.duration: int | None = check_optional_int("duration", duration, 1, "until the end of the fit")
        self.batches_seen = 0
        self.slowed_steps = 0
        self.measured_seconds = 0.0
        self.injected_seconds = 0.0
        self._t0: float | None = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(
            ranks=self.ranks, slowdown=self.slowdown, start=self.start, duration=self.duration
        )

    def is_straggler(self, rank: int) -> bool:
        """Whether global rank ``rank`` is one this callback slows down."""
        return rank in self.ranks

    def _in_window(self, index: int) -> bool:
        return index >= self.start and (self.duration is None or index < self.start + self.duration)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # a new fit counts from 0 (a resume then restores the counters: Lightning loads them after setup)
        if stage == "fit":
            self.batches_seen = 0
            self.slowed_steps = 0
            self.measured_seconds = 0.0
            self.injected_seconds = 0.0
        self._t0 = None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        slow = self.is_straggler(trainer.global_rank) and self._in_window(self.batches_seen)
        self._t0 = time.perf_counter() if slow else None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.batches_seen += 1
        if self._t0 is None:
            return
        elapsed = time.perf_counter() - self._t0
        self._t0 = None
        delay = (self.slowdown - 1.0) * elapsed
        if delay > 0.0:
            time.sleep(delay)
        self.slowed_steps += 1
        self.measured_seconds += elapsed
        self.injected_seconds += delay

    def state_dict(self) -> dict[str, Any]:
        return {
            "batches_seen": self.batches_seen,
            "slowed_steps": self.slowed_steps,
            "measured_seconds": self.measured_seconds,
            "injected_seconds": self.injected_seconds,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.batches_seen = int(state_dict["batches_seen"])
        self.slowed_steps = int(state_dict["slowed_steps"])
        self.measured_seconds = float(state_dict.get("measured_seconds", 0.0))
        self.injected_seconds = float(state_dict["injected_seconds"])


def _check_ranks(ranks: Any) -> tuple[int, ...]:
    """An integer >= 0, or a non-empty sequence of them (not bools, not a string): a sorted tuple without
    duplicates."""
    allowed = "ranks must be an integer >= 0 or a non-empty sequence of integers >= 0"
    if isinstance(ranks, Integral) and not isinstance(ranks, bool):
        items: Sequence[Any] = (ranks,)
    elif isinstance(ranks, Sequence) and not isinstance(ranks, (str, bytes)) and len(ranks) > 0:
        items = ranks
    else:
        raise ValueError(f"{allowed}, got {ranks!r}")
    try:
        return tuple(sorted({check_int("ranks", r, 0) for r in items}))
    except ValueError:
        raise ValueError(f"{allowed}, got {ranks!r}") from None
