"""A bound on how long a rank waits for a DataLoader's workers.

A DataLoader with workers and ``timeout=0`` (PyTorch's default) waits for a batch for as long as its worker is
alive: a worker that never starts (a fork that hung, issue 61) or stalls keeps the rank waiting forever while its
peers sit in their next collective. The strategies give such a loader the strategy's ``timeout`` (the collectives'
timeout, 30 minutes by default), so a rank whose loader never delivers stops with PyTorch's ``RuntimeError:
DataLoader timed out after N seconds`` within the same bound as a collective that never completes. A loader with a
``timeout`` of its own, or without workers (it loads in the training process: nothing to wait for), is left as it is.
"""

from __future__ import annotations

from datetime import timedelta

from torch.utils.data import DataLoader

__all__ = ["bound_worker_waits"]


def bound_worker_waits(dataloader: object, timeout: timedelta) -> bool:
    """Give ``dataloader`` a wait bound of ``timeout`` when it has workers and no bound of its own; returns whether
    it did."""
    if not isinstance(dataloader, DataLoader) or dataloader.num_workers == 0 or dataloader.timeout > 0:
        return False
    dataloader.timeout = timeout.total_seconds()
    return True
