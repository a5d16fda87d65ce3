"""Callbacks that steer and log lightning_sync strategies (they never communicate behind the strategy's back)."""

from lightning_sync.callbacks.progress import EpochPrinter
from lightning_sync.callbacks.seldp import SelDP
from lightning_sync.callbacks.stats import SyncStats
from lightning_sync.callbacks.straggler import StragglerInjection
from lightning_sync.callbacks.sync_switch import SyncSwitch

__all__ = ["EpochPrinter", "SelDP", "StragglerInjection", "SyncStats", "SyncSwitch"]
