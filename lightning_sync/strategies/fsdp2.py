"""``CountedFSDP2Strategy``: Lightning's own ``ModelParallelStrategy`` (FSDP2 over all ranks), measured — the reference
row a user who shards a model runs today."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, ClassVar, Literal

import lightning.pytorch as pl
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_sync.comm import CommStats, LinkModel, destroy_groups_at_exit
from lightning_sync.comm.fsdp_comm import FSDPCounting, count_fsdp_collectives
from lightning_sync.core.validation import check_int
from lightning_sync.strategies.checks import check_link

__all__ = ["CountedFSDP2Strategy"]


class CountedFSDP2Strategy(ModelParallelStrategy):
    """Lightning's own ``ModelParallelStrategy`` as FSDP2 over all ranks, measured: ``compare``'s ``fsdp2`` row.

    Training is Lightning's ``ModelParallelStrategy`` unchanged: the LightningModule's ``configure_model`` shards the
    model with ``fully_shard`` over ``self.device_mesh["data_parallel"]``, FSDP2 all-gathers each module's parameters
    for its forward and backward and reduce-scatters its gradients, Lightning's optimizer step updates each rank's
    shard. What this subclass adds, and all it adds:

    * ``data_parallel_size`` defaults to **every rank** (``"all"``: the world size over ``tensor_parallel_size=1``).
      Lightning's default ``"auto"`` is the number of nodes, so on one machine the model would not be sharded and
      every rank would read the whole data set;
    * right after Lightning's setup (``configure_model`` has sharded the model, no forward has run) FSDP2's
      collectives are routed through the pack's communicators
      (:func:`~lightning_sync.comm.fsdp_comm.count_fsdp_collectives`): the same collectives on the same tensors, so
      the trajectory is Lightning's bit for bit, with every byte recorded in :attr:`comm_stats` (tags
      ``"fsdp_all_gather"`` and ``"fsdp_reduce_scatter"``) and, with ``link``, each collective delayed as the emulated
      link would (blocking: FSDP2 on CPU runs them on the training thread);
    * :meth:`sync_metrics` with the keys of the pack's strategies (every step synchronises: LSSR 0).

    Not counted, as in the ``ddp`` row: Lightning's own per-step SIGTERM broadcast and the validation's reductions
    (Lightning issues them outside the strategy's collectives). The launcher is ``ModelParallelStrategy``'s (the
    script run again per process, or nothing launched when the processes were started externally: torchrun, SLURM,
    ``compare``'s workers).

    Args:
        link: emulate a slower network: a :class:`~lightning_sync.comm.LinkModel` or ``"1gbit,1ms"``; ``None``
            (default) for none.
        data_parallel_size: ranks FSDP2 shards over; ``"all"`` (default): the world size divided by
            ``tensor_parallel_size``.
        tensor_parallel_size: ``ModelParallelStrategy``'s (default 1: FSDP2 alone).
        save_distributed_checkpoint, process_group_backend, timeout: ``ModelParallelStrategy``'s.
    """

    strategy_name: ClassVar[str] = "fsdp2_counted"

    def __init__(
        self,
        link: LinkModel | str | None = None,
        data_parallel_size: int | Literal["all"] = "all",
        tensor_parallel_size: int = 1,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        self.link: LinkModel | None = check_link(link)
        if data_parallel_size != "all":
            check_int("data_parallel_size", data_parallel_size, 1)
        check_int("tensor_parallel_size", tensor_parallel_size, 1)
        super().__init__(
            data_parallel_size=data_parallel_size,  # type: ignore[arg-type]  # "all" is resolved at setup
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.comm_stats = CommStats()
        #: the counted FSDP2 collectives (their communicators); set at setup
        self.fsdp_counting: FSDPCounting | None = None

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name,
                cls,
                description="Lightning's ModelParallelStrategy (FSDP2 over all ranks) with the pack's accounting "
                "and optional link emulation",
            )

    def setup_environment(self) -> None:
        if self._data_parallel_size == "all":
            world = self.num_nodes * self.num_processes
            if world % self._tensor_parallel_size:
                raise ValueError(
                    f"tensor_parallel_size={self._tensor_parallel_size} does not divide the {world} ranks; give "
                    "data_parallel_size and tensor_parallel_size whose product is the number of ranks"
                )
            self._data_parallel_size = world // self._tensor_parallel_size
        super().setup_environment()
        destroy_groups_at_exit()  # torchrun, SLURM, a cluster host: the group outlives fit, not the process

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)  # configure_model has sharded the model; Lightning's setup moves it and the optimizers
        assert self.lightning_module is not None
        self.fsdp_counting = count_fsdp_collectives(self.lightning_module, self.comm_stats, self.link)

    def sync_metrics(self) -> dict[str, float]:
        """The keys of :meth:`SyncStrategy.sync_metrics`: every optimizer step reduce-scatters the gradients (LSSR
        0), and the bytes FSDP2 sent (``bytes_fsdp_all_gather``, ``bytes_fsdp_reduce_scatter``)."""
        module = self.lightning_module
        steps = float(module.trainer.global_step) if module is not None and module._trainer is not None else 0.0
        metrics: dict[str, Any] = {"lssr": 0.0, "local_steps": 0.0, "sync_steps": steps}
        metrics.update(self.comm_stats.summary())
        return metrics
