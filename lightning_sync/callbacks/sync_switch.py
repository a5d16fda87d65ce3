"""Sync-Switch's controller: :class:`SyncSwitch` (defined beside its strategy, which adds it when none is given:
:mod:`lightning_sync.strategies.sync_switch_control`)."""

from lightning_sync.strategies.sync_switch_control import SyncSwitch

__all__ = ["SyncSwitch"]
