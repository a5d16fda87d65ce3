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

:class:`SyncLaunching` is the strategy's side: the names it registers, the launcher it picks, and the summary it
ships and adopts.
"""

from __future__ import annotations

import io
from functools import partial
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loops import _Loop
from lightning.pytorch.loops.progress import _BaseProgress
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

__all__ = ["SyncLauncher", "SyncLaunching"]

#: the key of Lightning's ``extra`` results dict that holds this launcher's payload (bytes)
EXTRA_KEY = "lightning_sync_bytes"


def refuse_after_spawn(name: str, what: str, *args: Any, **kwargs: Any) -> Any:
    """Raise for what the launching process cannot answer after a spawn launch (``name``: the strategy's class)."""
    raise RuntimeError(
        f"{name}.{what} is not available in the launching process after a spawn launch: the ranks trained in child "
        "processes, and only rank 0's sync_metrics(), sync_event_metrics(), comm_stats, step_counter and result "
        "summaries came back. Read those, or launch by re-running the script (strategy='<name>', start_method="
        "'popen', as Lightning's 'ddp'), where the launching process is rank 0."
    )


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


class SyncLaunching:
    """Mixin of :class:`~lightning_sync.strategies.SyncStrategy`: registering its names, picking the launcher, and the
    summary a spawn launch ships from rank 0 (:meth:`launch_summary`) and the launching process adopts
    (:meth:`adopt_launch_summary`).

    Uses from the strategy: ``strategy_name`` / ``strategy_description`` (the registered names),
    ``sync_metrics()`` / ``sync_event_metrics()``, ``comm_stats`` and ``step_counter`` (the summary).
    """

    #: Public result attributes a spawn launch copies from rank 0 to the launching process (when the strategy has them).
    summary_attributes: ClassVar[tuple[str, ...]] = ("server_summary", "switches")
    _adopted: dict[str, Any] | None  # rank 0's launch summary, in the launching process after spawn

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``strategy_name`` (launched as Lightning's ``ddp``: the script re-run per rank),
        ``<strategy_name>_spawn`` (as ``ddp_spawn``: pytest, scripts that cannot be re-run) and
        ``<strategy_name>_notebook`` (as ``ddp_notebook``: fork, the one start method Lightning allows in notebooks)."""
        if not cls.strategy_name:
            return
        description = cls.strategy_description or cls.__doc__ or ""
        entries = (
            (cls.strategy_name, "popen"),
            (f"{cls.strategy_name}_spawn", "spawn"),
            (f"{cls.strategy_name}_notebook", "fork"),
        )
        for name, start_method in entries:
            if name not in strategy_registry:
                strategy_registry.register(
                    name, cls, description=f"{description} (start_method={start_method!r})", start_method=start_method
                )

    def _configure_launcher(self) -> None:
        """As Lightning's ``DDPStrategy``: ``"popen"`` re-runs the script for every other rank, ``"spawn"``/``"fork"``
        start child processes (with :class:`SyncLauncher`, which ships rank 0's results back). Under torchrun, SLURM
        or any launcher that starts the processes itself (``LOCAL_RANK`` set), launch nothing whatever
        ``start_method`` says; Lightning's ``DDPStrategy`` would spawn again inside each process. So
        ``strategy="selsync"`` goes multi-node by configuration alone."""
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally or self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = SyncLauncher(self, start_method=self._start_method)

    def launch_summary(self) -> dict[str, Any]:
        """What a spawn launch ships from rank 0 to the launching process (:class:`SyncLauncher`):
        :meth:`sync_metrics`, :meth:`sync_event_metrics`, the communication totals, the step counter and the
        :attr:`summary_attributes` this strategy has."""
        return {
            "metrics": self.sync_metrics(),
            "event_metrics": self.sync_event_metrics(),
            "comm": self.comm_stats.state_dict(),
            "steps": self.step_counter.state_dict(),
            "attributes": {n: getattr(self, n) for n in self.summary_attributes if hasattr(self, n)},
        }

    def adopt_launch_summary(self, summary: dict[str, Any]) -> None:
        """In the launching process after a spawn launch: take rank 0's :meth:`launch_summary`. ``sync_metrics()``
        and ``sync_event_metrics()`` then return rank 0's values (subclasses compute theirs from state this process
        never had, so the answers are pinned on the instance); ``comm``, ``flat`` and :meth:`strategy_state` raise."""
        self.comm_stats.load_state_dict(summary["comm"])
        self.step_counter.load_state_dict(summary["steps"])
        for name, value in summary["attributes"].items():
            setattr(self, name, value)
        self._adopted = summary
        self.__dict__.update(  # instance attributes shadow the (subclasses') methods
            sync_metrics=partial(dict, summary["metrics"]),
            sync_event_metrics=partial(dict, summary["event_metrics"]),
            strategy_state=partial(refuse_after_spawn, type(self).__name__, "strategy_state()"),
        )

    def _forget_launch_summary(self) -> None:
        """A new launch of this strategy object trains or evaluates for itself again."""
        if self._adopted is not None:
            for name in ("sync_metrics", "sync_event_metrics", "strategy_state"):
                self.__dict__.pop(name, None)
            self._adopted = None
