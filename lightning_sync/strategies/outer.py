r"""The outer optimizer of parameter averaging (DiLoCo's Algorithm 1 outer step): a component the strategy owns.

Strategies that take an ``outer_optimizer`` argument (local SGD, FedAvg, ADPSGD and DiLoCo through
:class:`~lightning_sync.strategies.periodic.PeriodicAveraging`, SelSync with ``aggregation="parameters"``) set the
strategy's ``outer_config``; then every :meth:`~lightning_sync.strategies.SyncStrategy.average_state`, after whichever
topology averaged (flat, grouped, fault-tolerant), hands the mean to :class:`OuterAveraging`: it turns it into the
pseudo-gradient :math:`\Delta = \theta_{global} - \text{mean}`, steps :math:`\theta_{global}` with
:class:`~lightning_sync.core.outer.OuterOptimizer` (the math) and every rank takes it. The component holds that
optimizer, the count of optimizer updates since the last outer step (which decides the final sync of
``average_at_end``) and their state in every rank's checkpoint part (``"outer"``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.optim import Optimizer

from lightning_sync.comm import FlatState
from lightning_sync.core.outer import OuterOptimizer, OuterSGD

__all__ = ["OuterAveraging", "inner_lr"]


def inner_lr(optimizers: Sequence[Optimizer]) -> float | None:
    r""":math:`\gamma_t` for the outer momentum's ``inner_lr_scaling``: the learning rate of the first optimizer's first
    parameter group now (the rate of the round's last inner step; schedulers scale every group alike). None before
    the optimizers exist."""
    if not optimizers or not optimizers[0].param_groups:
        return None
    return float(optimizers[0].param_groups[0]["lr"])


class OuterAveraging:
    """The outer step after every parameter average, owned by :class:`~lightning_sync.strategies.SyncStrategy`
    (``strategy.outer_averaging``; ``strategy.outer`` is its :attr:`optimizer`).

    The strategy calls :meth:`setup` when the flat state exists (``configure_ddp``; :meth:`choose` when the outer
    optimizer is chosen later, DiLoCo's ``"auto"``), :meth:`count_update` after every optimizer update, :meth:`apply` in
    ``average_state`` while the flat buffers hold the mean, :meth:`final_sync_due` for ``average_at_end``, and
    :meth:`state_dict` / :meth:`load_state_dict` with its checkpoint part."""

    def __init__(self) -> None:
        #: the global parameters and outer momentum (``None``: plain averaging, no outer optimizer)
        self.optimizer: OuterOptimizer | None = None
        #: optimizer updates since the last outer step
        self.updates_since_average = 0
        #: whether the outer optimizer is known (``False``: chosen later, see :meth:`choose`)
        self.chosen = True
        self._held: tuple[dict[str, Any] | None] | None = None  # a checkpoint's state, until chosen

    def setup(self, config: OuterSGD | None, flat: FlatState) -> None:
        """The global parameters start as the (identical) replicas; a resume then loads the saved ones."""
        if config is not None:
            self.optimizer = OuterOptimizer(config, [g.state[: g.param_numel] for g in flat.groups])

    def choose(self, config: OuterSGD | None, flat: FlatState) -> None:
        """The outer optimizer chosen after setup (DiLoCo's ``"auto"``, once the inner optimizers exist): built over the
        flat state, then the checkpoint's state :meth:`load_state_dict` held until now is loaded."""
        self.chosen = True
        self.setup(config, flat)
        held, self._held = self._held, None
        if held is not None:
            self.load_state_dict(held[0], config)

    def count_update(self) -> None:
        """One optimizer update more since the last outer step."""
        self.updates_since_average += 1

    def apply(self, flat: FlatState, optimizers: Sequence[Optimizer]) -> bool:
        r"""With the flat buffers holding the mean: the outer step on every group's parameters (buffers keep the mean),
        so every rank holds the new :math:`\theta_{global}`. Returns whether it stepped (then the compressed codec takes
        the new global model as its reference)."""
        if self.optimizer is None:
            return False
        lr = inner_lr(optimizers)
        for index, g in enumerate(flat.groups):
            if g.param_numel:
                self.optimizer.step(g.state[: g.param_numel], index, inner_lr=lr)
        self.updates_since_average = 0
        return True

    def final_sync_due(self, has_peers: bool, in_sync: bool) -> bool:
        r"""Whether ``average_at_end`` takes one more average (tag ``"final"``) to hand back the global model, not rank
        0's replica. Without an outer optimizer, the average of the replicas (w = W 1/n), unless the last step synced
        the whole model (``in_sync``: the replicas are identical) or there is nobody to average with (fault-tolerant:
        the other replica groups are elsewhere). With one, the outer step on the inner steps since the last one — the
        global model DiLoCo would hold after one more sync; none when the last step synced (the replicas then hold
        :math:`\theta_{global}`, and a step on a zero pseudo-gradient would still move it by the momentum)."""
        if self.optimizer is None:
            return has_peers and not in_sync
        return self.updates_since_average > 0

    def state_dict(self) -> dict[str, Any] | None:
        """This rank's part of the strategy's state under ``"outer"`` (``None`` without an outer optimizer)."""
        if self.optimizer is None:
            return None
        return {"optimizer": self.optimizer.state_dict(), "updates_since_average": self.updates_since_average}

    def load_state_dict(self, saved: dict[str, Any] | None, config: OuterSGD | None) -> None:
        """Restore :meth:`state_dict`; ``config`` is this run's outer optimizer, which must be the checkpoint's (held
        until :meth:`choose` when it is not known yet)."""
        if not self.chosen:
            self._held = (saved,)
            return
        if (saved is None) != (config is None):
            raise ValueError(
                f"the checkpoint was written {'without' if saved is None else 'with'} an outer optimizer and "
                f"this run has outer_optimizer={None if config is None else config.spec()}: "
                "resume with the outer_optimizer the checkpoint was written with"
            )
        if self.optimizer is not None and saved is not None:
            self.optimizer.load_state_dict(saved["optimizer"])
            self.updates_since_average = int(saved["updates_since_average"])
