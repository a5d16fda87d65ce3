r"""The periodic-averaging family's base: local SGD, FedAvg, ADPSGD and DiLoCo.

Every rank takes local steps with the user's optimizer; at the steps its schedule names, a method averages the
replicas' parameters and buffers (:meth:`~lightning_sync.strategies.SyncStrategy.average_state`, or DiLoCo's
fragments). What the four share is here, once: the three arguments ``outer_optimizer``, ``average_at_end`` and
``evaluate`` (checked and documented on :class:`PeriodicAveraging`), the step's frame (the method's
:meth:`PeriodicAveraging._sync_if_due`, then the SIGTERM check at syncs only and the step counted), and what fault
tolerance asks of a method: the arguments every replica group must agree on, declared in
:attr:`PeriodicAveraging.ft_config_fields`.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from torch.optim import Optimizer

from lightning_sync.core.outer import OuterSGD, parse_outer_optimizer
from lightning_sync.core.validation import check_bool
from lightning_sync.strategies.base import SyncStrategy
from lightning_sync.strategies.evaluation import check_evaluate

__all__ = ["PeriodicAveraging"]


class PeriodicAveraging(SyncStrategy):
    r"""Base of the strategies that average parameters on a schedule, with local steps in between.

    After each optimizer update the method's :meth:`_sync_if_due` averages when its schedule says so; SIGTERM is then
    checked at those syncs only (:attr:`carries_sigterm`: local steps stay free of collectives, so with a long period a
    signal is acted on at the next sync), and the step is counted as a sync or a local step. Every method of the
    family runs with ``fault_tolerance`` (each sync after a torchft quorum), with replica groups and with compression.

    With ``average_at_end`` (default) the replicas are averaged once more when training ends (tag ``"final"``, one
    all-reduce), so the model Lightning hands back and later evaluates is the global model, not rank 0's replica;
    with an outer optimizer, its step on the local steps since the last sync (over all ranks), skipped when there
    were none (:meth:`~lightning_sync.strategies.outer.OuterAveraging.final_sync_due`).

    Args:
        average_at_end: average once more when training ends (a bool).
        evaluate: what validation during fit and the main checkpoint file hold: ``"average"`` (default: the
            replicas' exact average, one all-reduce of the model per validation) or ``"last_sync"`` (the global model
            of the last sync, kept on every rank: no communication, one model-sized copy per rank; see
            :mod:`~lightning_sync.strategies.evaluation`).
        outer_optimizer: ``None`` (plain averaging: every rank takes the mean) or an outer optimizer spec such as
            ``{"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True}`` (DiLoCo's): at each averaging the mean
            of the replicas gives the pseudo-gradient :math:`\Delta = \theta_{global} - \text{mean}`, the outer
            optimizer steps :math:`\theta_{global}`, every rank takes it (see
            :meth:`~lightning_sync.strategies.base.SyncStrategy.average_state`); buffers keep the plain mean.
            DiLoCo's default, ``"auto"``, is chosen from the inner optimizer.
        **kwargs: :class:`~lightning_sync.strategies.SyncStrategy`'s arguments.
    """

    carries_sigterm = True
    fault_tolerance_refusal = None
    #: The method's arguments every replica group of a fault-tolerant run must agree on (attribute names), checked
    #: when the quorum changes (:meth:`_ft_method_config`), besides ``outer_optimizer`` and ``average_at_end``.
    ft_config_fields: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        average_at_end: bool = True,
        evaluate: Literal["average", "last_sync"] = "average",
        outer_optimizer: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.outer_config = self._parse_outer_optimizer(outer_optimizer)
        self.average_at_end = check_bool("average_at_end", average_at_end)
        self.evaluate = check_evaluate(evaluate)
        super().__init__(**kwargs)

    def _parse_outer_optimizer(self, spec: Any) -> OuterSGD | None:
        """The ``outer_optimizer`` argument as :attr:`outer_config` (DiLoCo extends it with ``"auto"``)."""
        return parse_outer_optimizer(spec)

    def _after_update(self, optimizer: Optimizer) -> None:
        synced = self._sync_if_due(optimizer)
        if synced:
            self.sigterm.check()
        self.step_counter.record(synced)

    @abstractmethod
    def _sync_if_due(self, optimizer: Optimizer) -> bool:
        """After the optimizer's update: advance the schedule, average if this step syncs, and say whether it did."""

    @abstractmethod
    def _ft_next_step_syncs(self) -> bool:
        """Fault-tolerant: whether the next optimizer step ends with a sync, decided from state every replica group
        shares (the schedule); its quorum is held at this step's end (:mod:`~lightning_sync.strategies.ft_topology`)."""

    def _ft_method_config(self) -> dict[str, Any]:
        """What must be equal in every replica group of a fault-tolerant run, checked when the quorum changes: the
        outer optimizer, ``average_at_end`` and the method's :attr:`ft_config_fields`."""
        outer = self.outer_config
        config: dict[str, Any] = {"outer_optimizer": None if outer is None else outer.spec()}
        config["average_at_end"] = self.average_at_end
        config.update((name, getattr(self, name)) for name in self.ft_config_fields)
        return config
