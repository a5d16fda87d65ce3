"""Log LSSR and communication totals: :class:`SyncStats` (defined beside the strategies, which add it by themselves:
:mod:`lightning_sync.strategies.sync_stats`)."""

from lightning_sync.strategies.sync_stats import SyncStats

__all__ = ["SyncStats"]
