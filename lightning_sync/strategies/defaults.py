"""Callbacks a strategy adds by itself when the user passed none, registered by the callbacks layer.

Strategies add a few callbacks of their own: :class:`~lightning_sync.callbacks.SyncStats` (``sync_stats=True``) and
Sync-Switch's controller :class:`~lightning_sync.callbacks.SyncSwitch`. They must not import them: the callbacks
import the strategies, and arrows run callbacks -> strategies only. So each callback module registers its class here
at import (``import lightning_sync`` imports the callbacks package) and the strategy looks it up by name.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

__all__ = ["add_default_callback", "default_callback", "register_default_callback"]

_DEFAULTS: dict[str, type[Callback]] = {}


def register_default_callback(name: str, factory: type[Callback]) -> None:
    """Make ``factory()`` the callback added under ``name`` (``"sync_stats"``, ``"sync_switch"``)."""
    _DEFAULTS[name] = factory


def default_callback(name: str) -> type[Callback] | None:
    """The class registered under ``name``, or ``None`` when its callbacks module was not imported."""
    return _DEFAULTS.get(name)


def add_default_callback(trainer: pl.Trainer, name: str) -> None:
    """Append the callback registered under ``name`` to ``trainer.callbacks`` unless one of its class is there."""
    factory = default_callback(name)
    if factory is None:
        raise RuntimeError(
            f"no {name!r} callback is registered: import lightning_sync.callbacks (`import lightning_sync` does)"
        )
    if not any(isinstance(cb, factory) for cb in trainer.callbacks):
        trainer.callbacks.append(factory())
