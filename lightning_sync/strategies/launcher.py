"""What a spawn (or fork) launch hands back to the launching process.

``Trainer(strategy="selsync")`` launches like Lightning's ``ddp``: the script is run again for every other rank
(``start_method="popen"``, Lightning's ``_SubprocessScriptLauncher``), so the launching process *is* rank 0 and every
value read after ``fit`` — predictions, ``trainer.global_step``, callback state, the strategy's counters — is rank
0's own. With ``start_method="spawn"`` (``"<name>_spawn"``, pytest) or ``"fork"`` (``"<name>_notebook"``) the ranks
are child processes and the launching process's objects never trained. Lightning's
:class:`_MultiProcessingLauncher` brings back ``callback_metrics``, ``trainer.state``, the best checkpoint path and the
weights; :class:`SyncLauncher` also brings back, from rank 0:

* the strategy's :meth:`~lightning_sync.strategies.SyncStrategy.launch_summary` — ``sync_metrics()``,
  ``sync_event_metrics()``, the communication totals, the step counter and public result attributes such as the
  parameter server's ``server_summary`` — adopted by the launching process's strategy;
* the fit loop's progress, so ``trainer.global_step`` and ``trainer.current_epoch`` are the workers';
* every callback's state (``ModelCheckpoint.best_model_score``, ``best_k_models``, ``last_model_path``,
  ``EarlyStopping``'s counters...), loaded into the launching process's callback of the same ``state_key``;
* the loggers' versions (a ``CSVLogger`` would otherwise pick the next free ``version_N`` when its ``log_dir`` is
  first read in the launching process).

What cannot come back is refused rather than returned stale: the strategy's communicator, flat state and
:meth:`~lightning_sync.strategies.SyncStrategy.strategy_state` raise in the launching process after a spawn fit.
``trainer.predict`` returns ``None`` under spawn (Lightning's rule for spawn-based strategies; a warning says so):
launch with popen, or write predictions with a ``BasePredictionWriter``.
"""

from __future__ import annotations

import io
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loops import _Loop
from lightning.pytorch.loops.progress import _BaseProgress
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

__all__ = ["SyncLauncher"]

#: the key of Lightning's ``extra`` results dict that holds this launcher's payload (bytes)
EXTRA_KEY = "lightning_sync_bytes"


def _to_bytes(obj: Any) -> bytes:
    """Serialise with ``torch.save``: tensors travel as bytes, not as shared memory (as Lightning sends
    ``callback_metrics``)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _loop_progress(loop: _Loop, prefix: str = "") -> dict[str, Any]:
    """Every progress counter of ``loop`` and its child loops (what ``global_step`` and ``current_epoch`` read)."""
    out: dict[str, Any] = {}
    for key, value in vars(loop).items():
        if isinstance(value, _BaseProgress):
            out[prefix + key] = value.state_dict()
        elif isinstance(value, _Loop):
            out.update(_loop_progress(value, f"{prefix}{key}."))
    return out


def _load_loop_progress(loop: _Loop, state: dict[str, Any], prefix: str = "") -> None:
    """Load counters saved by :func:`_loop_progress` without marking the loop as restarting."""
    for key, value in vars(loop).items():
        if isinstance(value, _BaseProgress) and prefix + key in state:
            value.load_state_dict(state[prefix + key])
        elif isinstance(value, _Loop):
            _load_loop_progress(value, state, f"{prefix}{key}.")


class SyncLauncher(_MultiProcessingLauncher):
    """Lightning's spawn/fork launcher, shipping rank 0's strategy summary, loop progress, callback state and
    logger versions back to the launching process (see the module docstring)."""

    def launch(self, function: Any, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        result = super().launch(function, *args, trainer=trainer, **kwargs)
        if trainer is not None and trainer.state.fn == TrainerFn.PREDICTING and result is None:
            rank_zero_warn(
                f"trainer.predict returns None with start_method={self._start_method!r}: Lightning does not bring "
                "predictions back from spawned or forked processes. Launch by re-running the script "
                "(strategy='<name>', start_method='popen', as Lightning's 'ddp') or write predictions from the "
                "workers with a lightning.pytorch.callbacks.BasePredictionWriter."
            )
        return result

    def get_extra_results(self, trainer: pl.Trainer) -> dict[str, Any]:
        extra = super().get_extra_results(trainer)
        strategy = trainer.strategy
        payload: dict[str, Any] = {
            "strategy": strategy.launch_summary() if hasattr(strategy, "launch_summary") else None,
            "callbacks": {cb.state_key: cb.state_dict() for cb in trainer.callbacks},
            "loggers": [getattr(logger, "version", None) for logger in trainer.loggers],
        }
        if trainer.state.fn == TrainerFn.FITTING:
            payload["fit_loop"] = _loop_progress(trainer.fit_loop)
        extra[EXTRA_KEY] = _to_bytes(payload)
        return extra

    def update_main_process_results(self, trainer: pl.Trainer, extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        if EXTRA_KEY not in extra:
            return
        payload = _from_bytes(extra[EXTRA_KEY])
        strategy = trainer.strategy
        if payload["strategy"] is not None and hasattr(strategy, "adopt_launch_summary"):
            strategy.adopt_launch_summary(payload["strategy"])
        if "fit_loop" in payload:
            _load_loop_progress(trainer.fit_loop, payload["fit_loop"])
        states = payload["callbacks"]
        for cb in trainer.callbacks:
            state = states.get(cb.state_key)
            if not state:
                continue
            if isinstance(cb, ModelCheckpoint):
                # the workers resolved the directory at setup, which the launching process never ran
                cb.dirpath = state.get("dirpath", cb.dirpath)
                cb.current_score = state.get("current_score")
            cb.load_state_dict(state)
        for logger, version in zip(trainer.loggers, payload["loggers"]):
            if version is not None and getattr(logger, "_version", "absent") is None:
                logger._version = version  # CSVLogger / TensorBoardLogger resolve it lazily
