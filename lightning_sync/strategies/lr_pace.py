"""A step-interval learning-rate schedule that follows the data all ranks consumed, not one rank's step count.

With dynamic work assignment (the parameter-server strategies) a fast rank takes more batches of an epoch than a
slow one. A user's per-step schedule (``OneCycleLR``, warm-up then decay, sized for ``epochs * batches / ranks``
steps) counts this rank's own steps, so on a fast rank it runs ahead of the training: it finishes its cycle early
and trains the rest at the final rate. On benchmarks/dropin.py's script with the other rank a x4 straggler
(``--straggler 4``, 10 seeds, docs/results/other.md) the fast rank took about 80 of the 96 batches, and ASP, ALADDIN
and Sync-Switch ended 7.4-15.0 points below DDP's mean on their own counts, 0.3-1.8 above it at the global pace.

:class:`GlobalPaceScheduler` wraps such a scheduler: each of Lightning's ``scheduler.step()`` calls advances it to
the step the strategy reports for the batch just trained, ``ceil(batches consumed by all ranks so far / (ranks *
accumulation))`` -- none on a rank ahead of that count, several on a rank behind it -- so every rank's rate is the
one DDP's schedule would have after the same amount of data. At equal pace the count is each rank's own step count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class GlobalPaceScheduler:
    """``scheduler`` (a ``torch.optim.lr_scheduler.LRScheduler``, stepped once per optimizer step) advanced to
    ``target()`` steps at each :meth:`step`; everything else (``optimizer``, ``get_last_lr``, ``state_dict``...) is
    the wrapped scheduler's, so a checkpoint holds the user's scheduler state unchanged.

    ``target()`` returns the number of steps the schedule should have taken once this step's update is applied, or
    ``None`` where it is not known (the scheduler then steps once, as Lightning would).
    """

    def __init__(self, scheduler: Any, target: Callable[[], int | None]) -> None:
        if not isinstance(getattr(scheduler, "last_epoch", None), int):
            raise ValueError(
                f"lr_pace='global' advances a step-interval scheduler by its step count (`last_epoch`), which "
                f"{type(scheduler).__name__} does not keep. Use lr_pace='local' (each rank's own step count) or a "
                "torch.optim.lr_scheduler.LRScheduler."
            )
        self.__dict__["scheduler"] = scheduler
        self.__dict__["_target"] = target

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Advance to the target step (a call with arguments, e.g. an explicit epoch, is passed through)."""
        if args or kwargs:
            self.scheduler.step(*args, **kwargs)
            return
        target = self._target()
        if target is None:
            self.scheduler.step()
            return
        for _ in range(target - self.scheduler.last_epoch):
            self.scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name in ("scheduler", "_target"):  # not yet set (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.scheduler, name, value)

    def __repr__(self) -> str:
        return f"GlobalPaceScheduler({self.scheduler!r})"


def paced_steps(batches_before: int, position: int, world_size: int, accumulation: int = 1) -> int:
    """Optimizer steps of a schedule after the batch at ``position`` of the current epoch (``batches_before``
    batches in the epochs before it): ``ceil((batches_before + position + 1) / (world_size * accumulation))``, the
    step DDP's schedule is at after that much data. At equal pace rank r's k-th batch of an epoch (from 0) sits at
    position ``k * world_size + j`` for some ``0 <= j < world_size``, and this is ``k + 1``, its own step count."""
    return -(-(batches_before + position + 1) // (world_size * accumulation))
