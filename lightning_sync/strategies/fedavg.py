"""Federated averaging with partial participation (McMahan et al.; as parameterised in SelSync §II-B: C and E)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

from torch.optim import Optimizer

from lightning_sync.core.periodic import fedavg_participants, fedavg_sync_positions
from lightning_sync.core.validation import check_int, check_real
from lightning_sync.strategies.periodic import PeriodicAveraging


class FedAvgStrategy(PeriodicAveraging):
    r"""Local steps; ``syncs_per_epoch`` times per epoch (:math:`E = 1/x`), uniformly spaced, the parameters of a
    random fraction ``fraction`` (:math:`C`) of the ranks are averaged and every rank takes that average.

    The participants of round :math:`r` are :math:`\lceil C N \rceil` ranks drawn from ``(seed, r)`` — the same on
    every rank, with no communication. The average is one all-reduce over the flat parameter buffer in which the
    other ranks contribute zeros (so the bytes are those of a full all-reduce), divided by the number of
    participants; floating buffers travel with it. ``fraction=1`` with ``syncs_per_epoch`` dividing the epoch's
    steps is local SGD with period ``steps_per_epoch / syncs_per_epoch``. Sync positions are
    ``round(j * steps_per_epoch / x)`` for ``j = 1..x`` (the last one ends the epoch). With replica groups
    (``replica_size``) the participants are :math:`\lceil C R \rceil` of the :math:`R` replicas (whole replicas);
    with sharded replicas (``sharded=True``) too, each rank averaging its shard over the ranks of its shard index with
    the other replicas contributing zeros (tested equal to grouped FedAvg).

    Fault-tolerant (``fault_tolerance=FaultTolerance(...)``): each round draws :math:`\lceil C M \rceil` of the
    :math:`M` replica groups in the current quorum (by their rank in it; ``(seed, r)`` as above, so every group draws
    the same set without communication), and every group of the quorum takes their mean. The round counter travels
    with the state a restarted group receives.

    With an outer optimizer the mean of the round's participants gives the pseudo-gradient: outer SGD with momentum
    is FedAvgM / FedOpt's server optimizer (Reddi et al. 2021), the family DiLoCo belongs to.

    Args:
        fraction: :math:`C \in (0, 1]`.
        syncs_per_epoch: :math:`x \ge 1`, at most the number of training batches per epoch.
        seed: seed of the participant draw (>= 0).
        average_at_end, evaluate, outer_optimizer: the periodic family's, see
            :class:`~lightning_sync.strategies.periodic.PeriodicAveraging` (``average_at_end`` averages all ranks).
    """

    strategy_name = "fedavg"
    supports_accumulation = False
    strategy_description = "FedAvg: average a random fraction C of the replicas x times per epoch"
    sharded_refusal = None  # the round's participants are replicas, their shards averaged over each shard index
    ft_config_fields = ("fraction", "syncs_per_epoch", "seed")
    state_fields = ("round",)

    def __init__(
        self,
        fraction: float = 1.0,
        syncs_per_epoch: int = 4,
        seed: int = 0,
        average_at_end: bool = True,
        evaluate: Literal["average", "last_sync"] = "average",
        outer_optimizer: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.fraction = check_real("fraction", fraction, 0.0, 1.0, low_open=True)
        self.syncs_per_epoch = check_int("syncs_per_epoch", syncs_per_epoch, 1)
        self.seed = check_int("seed", seed, 0)
        super().__init__(average_at_end=average_at_end, evaluate=evaluate, outer_optimizer=outer_optimizer, **kwargs)
        self.round = 0
        self.last_participants: list[int] = []
        self._positions: frozenset[int] = frozenset()
        self._batch_position = 0

    def on_train_start(self) -> None:
        super().on_train_start()
        steps = self.lightning_module.trainer.num_training_batches
        if not math.isfinite(steps):
            raise ValueError(
                "FedAvgStrategy syncs a number of times per epoch, but the training loader has no length. Use a "
                "sized dataset, or LocalSGDStrategy(period=...) for a fixed period in steps."
            )
        if self.syncs_per_epoch > steps:
            raise ValueError(
                f"syncs_per_epoch must be <= the {int(steps)} training batches per epoch, got {self.syncs_per_epoch}"
            )
        self._positions = frozenset(fedavg_sync_positions(int(steps), self.syncs_per_epoch))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._batch_position = batch_idx + 1

    def _sync_if_due(self, optimizer: Optimizer) -> bool:
        synced = self._batch_position in self._positions
        if synced:
            self.round += 1
            # replica indices (ranks when every rank is a replica): with replica groups whole replicas take part;
            # fault-tolerant: ranks in the current quorum
            members = self.topology.members()
            self.last_participants = fedavg_participants(members, self.fraction, self.seed, self.round)
            self.average_state(tag="params", participants=self.last_participants)
        return synced

    def _ft_next_step_syncs(self) -> bool:
        steps = self.lightning_module.trainer.num_training_batches
        following = self._batch_position + 1 if self._batch_position < steps else 1
        return following in self._positions

    def sync_metrics(self) -> dict[str, float]:
        metrics = super().sync_metrics()
        metrics["round"] = float(self.round)
        return metrics

    def sync_event_metrics(self) -> dict[str, float]:
        return {"participants": float(len(self.last_participants))}
