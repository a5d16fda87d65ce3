r"""The outer optimizer of parameter averaging (DiLoCo's Algorithm 1 outer step), on the strategy's side.

Strategies that take an ``outer_optimizer`` argument (local SGD, FedAvg, ADPSGD, SelSync with
``aggregation="parameters"``, DiLoCo) set :attr:`OuterAveraging.outer_config`; then every
:meth:`~lightning_sync.strategies.SyncStrategy.average_state` turns the replicas' mean into the pseudo-gradient
:math:`\Delta = \theta_{global} - \text{mean}`, steps :math:`\theta_{global}` with
:class:`~lightning_sync.core.outer.OuterOptimizer` (the math) and every rank takes it. This module holds the glue:
building the optimizer at setup, the step after the mean, the final sync (``average_at_end``) and its state in every
rank's checkpoint part.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from lightning_sync.core.outer import OuterOptimizer, OuterSGD, parse_outer_optimizer
from lightning_sync.core.validation import check_bool
from lightning_sync.strategies.evaluation import check_evaluate


class OuterAveraging:
    """Mixin of :class:`~lightning_sync.strategies.SyncStrategy`. The strategy's ``__init__`` sets ``outer`` and
    ``_updates_since_average``; ``configure_ddp`` calls :meth:`_setup_outer`, ``average_state`` :meth:`_outer_step`,
    ``on_train_end`` :meth:`_average_at_end` (with ``average_at_end``), and ``strategy_state`` /
    ``load_strategy_state`` :meth:`_outer_state` / :meth:`_load_outer_state`."""

    #: The outer optimizer of parameter averaging (DiLoCo), parsed by the strategies that take an ``outer_optimizer``
    #: argument (``core.outer.parse_outer_optimizer``); None: plain averaging. See :meth:`average_state`.
    outer_config: OuterSGD | None = None
    #: with :attr:`outer_config`: the global parameters and outer momentum (built when the flat state exists)
    outer: OuterOptimizer | None
    _updates_since_average: int  # optimizer updates since the last parameter averaging (outer step)

    def _averaging_options(self, outer_optimizer: Mapping[str, Any] | None, average_at_end: Any, evaluate: Any) -> None:
        """In ``__init__``, before ``super().__init__``: validate and set the arguments every parameter-averaging
        strategy takes alike (local SGD, FedAvg, ADPSGD) — :attr:`outer_config`, ``average_at_end``, ``evaluate``."""
        self.outer_config = parse_outer_optimizer(outer_optimizer)
        self.average_at_end = check_bool("average_at_end", average_at_end)
        self.evaluate = check_evaluate(evaluate)

    def _setup_outer(self) -> None:
        """At setup: the global parameters start as the (identical) replicas; a resume then loads the saved ones."""
        if self.outer_config is not None:
            self.outer = OuterOptimizer(self.outer_config, [g.state[: g.param_numel] for g in self.flat.groups])

    def _inner_lr(self) -> float | None:
        r""":math:`\gamma_t` for the outer momentum's ``inner_lr_scaling``: the learning rate of the first optimizer's
        first parameter group now (the rate of the round's last inner step; schedulers scale every group alike).
        None before the optimizers exist."""
        optimizers = getattr(self, "optimizers", None)
        if not optimizers or not optimizers[0].param_groups:
            return None
        return float(optimizers[0].param_groups[0]["lr"])

    def _outer_step(self, tensors: list[Tensor]) -> None:
        r"""In :meth:`average_state`, with the flat buffers (``tensors``) holding the mean: the outer step on every
        group's parameters (buffers keep the mean), and every rank holds the new :math:`\theta_{global}`."""
        if self.outer is None:
            return
        inner_lr = self._inner_lr()
        for index, g in enumerate(self.flat.groups):
            if g.param_numel:
                self.outer.step(g.state[: g.param_numel], index, inner_lr=inner_lr)
        self._updates_since_average = 0
        self.codec.take_reference(tensors)  # compressed: the next changes are taken from what every rank now holds

    def _average_at_end(self) -> None:
        r"""``average_at_end``: hand back the global model, not rank 0's replica. Without an outer optimizer, the
        average of the replicas (w = W 1/n). With one, the outer step on the inner steps since the last one — the
        global model DiLoCo would hold after one more sync; none when the last step synced (the replicas then hold
        :math:`\theta_{global}`, and a step on a zero pseudo-gradient would still move it by the momentum). Without
        one, none either when the last step synced the whole model (:attr:`_in_sync`): the replicas are identical."""
        if self.outer is None:
            # in sync: the replicas are their average already; fault-tolerant: the other replica groups are elsewhere
            if self.topology.has_peers and not self._in_sync:
                self.average_state(tag="final")
        elif self._updates_since_average > 0:
            self.average_state(tag="final")

    def _outer_state(self) -> dict[str, Any] | None:
        """This rank's part of :meth:`strategy_state` under ``"outer"`` (``None`` without an outer optimizer)."""
        if self.outer is None:
            return None
        return {"optimizer": self.outer.state_dict(), "updates_since_average": self._updates_since_average}

    def _load_outer_state(self, saved: dict[str, Any] | None) -> None:
        if (saved is None) != (self.outer_config is None):
            raise ValueError(
                f"the checkpoint was written {'without' if saved is None else 'with'} an outer optimizer and "
                f"this run has outer_optimizer={None if self.outer_config is None else self.outer_config.spec()}: "
                "resume with the outer_optimizer the checkpoint was written with"
            )
        if self.outer is not None and saved is not None:
            self.outer.load_state_dict(saved["optimizer"])
            self._updates_since_average = int(saved["updates_since_average"])
