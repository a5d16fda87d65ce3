"""Optimizer hyperparameters changed for one optimizer step only (Sync-Switch's learning-rate factor, the
asynchronous workers' momentum)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch.optim import Optimizer


@contextmanager
def for_the_step(optimizer: Optimizer, key: str, value: Callable[[Any], Any]) -> Iterator[list[Any]]:
    """Inside the block, every parameter group that has ``key`` holds ``value(its own)``; afterwards (also on an
    error) each holds its own again, so schedulers, logs of ``param_groups`` and checkpoints see the user's values.
    Yields the user's values, one per group that has ``key`` (empty: the optimizer has no such hyperparameter)."""
    saved = [(group, group[key]) for group in optimizer.param_groups if key in group]
    for group, own in saved:
        group[key] = value(own)
    try:
        yield [own for _, own in saved]
    finally:
        for group, own in saved:
            group[key] = own
