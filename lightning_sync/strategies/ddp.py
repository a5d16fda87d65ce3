"""``CountedDDPStrategy``: Lightning's own ``DDPStrategy``, measured — the reference row of every speed claim."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, ClassVar, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from torch.nn.parallel import DistributedDataParallel

from lightning_sync.comm import CommStats, LinkModel, destroy_default_group, destroy_groups_at_exit
from lightning_sync.comm.ddp_hook import BufferBroadcastAccounting, DDPHookState, allreduce_hook, charge_broadcast
from lightning_sync.core.validation import check_bool
from lightning_sync.strategies.checks import check_link, ddp_arguments

__all__ = ["CountedDDPStrategy"]

_REJECTED = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")


class CountedDDPStrategy(DDPStrategy):
    """Lightning's own ``DDPStrategy``, measured: the reference row of every speed claim.

    Training is Lightning's ``DDPStrategy`` unchanged: ``DistributedDataParallel`` wraps the module (its buckets, its
    overlap of bucket all-reduces with backward, its buffer broadcasts), Lightning's optimizer step, Lightning's
    launchers and collectives. What this subclass adds, and all it adds:

    * it registers :func:`lightning_sync.comm.ddp_hook.allreduce_hook` on the ``DistributedDataParallel`` module right
      after Lightning wrapped it, before the first backward. Lightning's ``DDPStrategy._register_ddp_hooks`` registers
      ``ddp_comm_hook`` on CUDA only (on CPU it is silently ignored), so the hook is registered here, on every device.
      A subclass rather than a callback: the emulated link is then an argument of the strategy, like every strategy of
      the pack (``--trainer.strategy.init_args.link=1gbit,1ms`` means the same for every row of ``compare``), and the
      accounting lives with the strategy that communicates. The hook has PyTorch's default ``allreduce_hook`` semantics
      (divide by the world size, all-reduce), so without a link this is plain Lightning DDP, with its bytes counted;
    * a forward pre-hook counts DDP's buffer broadcasts and charges them on the same link
      (:class:`~lightning_sync.comm.ddp_hook.BufferBroadcastAccounting`), and DDP's initial broadcast of rank 0's state
      is charged too (tag ``"setup"``, outside the training totals, as the pack's strategies count theirs);
    * :meth:`sync_metrics` and :attr:`comm_stats` with the same keys as
      :meth:`~lightning_sync.strategies.SyncStrategy.sync_metrics` (LSSR 0: every step synchronises), so a comparison
      table has no holes;
    * the launcher policy and the teardown of the pack's strategies: ``start_method="spawn"`` by default (every row of a
      comparison is launched the same way), nothing launched when the processes were started externally (torchrun,
      SLURM, the namespace cluster: ``LOCAL_RANK`` set), and the default process group destroyed at teardown under
      spawn (a spawned gloo worker with a live group aborts at exit about half the time; see the integration notes).

    The accounting is not checkpointed (a resumed run counts from zero): this is the reference row of comparisons,
    which do not resume. The link emulation is tested on CPU/gloo; on NCCL it has not run (no GPU was available).

    Args:
        link: emulate a slower network: a :class:`~lightning_sync.comm.LinkModel` or ``"1gbit,1ms"``; ``None`` (default)
            for none. On a kernel-limited link (the namespace cluster) leave it ``None``: DDP runs as it is.
        record_buckets: keep every bucket all-reduce's size in ``ddp_hook_state.buckets`` (tests, diagnostics).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin, process_group_backend,
            timeout, start_method: ``DDPStrategy``'s (``start_method`` defaults to ``"spawn"`` here).
        **ddp_kwargs: passed to ``DistributedDataParallel`` as ``DDPStrategy`` does (``bucket_cap_mb``,
            ``find_unused_parameters``, ``gradient_as_bucket_view``, ``static_graph``, ...). ``ddp_comm_state``,
            ``ddp_comm_hook``, ``ddp_comm_wrapper`` and ``model_averaging_period`` are rejected: the strategy registers
            its own hook (DDP takes one), and model averaging replaces it.
    """

    strategy_name: ClassVar[str] = "ddp_counted"

    def __init__(
        self,
        link: LinkModel | str | None = None,
        record_buckets: bool = False,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "spawn",
        **ddp_kwargs: Any,
    ) -> None:
        for name in _REJECTED:
            if ddp_kwargs.get(name) is not None:
                raise ValueError(
                    f"{name} is not accepted by CountedDDPStrategy: it registers its own communication hook (the "
                    "default all-reduce with accounting and link emulation; DDP takes one hook). Use Lightning's "
                    "DDPStrategy for a custom hook or post-local SGD."
                )
        self.link: LinkModel | None = check_link(link)
        self.record_buckets = check_bool("record_buckets", record_buckets)
        super().__init__(**ddp_arguments(locals()), **ddp_kwargs)
        self.comm_stats = CommStats()
        #: the hook's state (accounting, emulated link, buckets carried); created in ``setup_environment``
        self.ddp_hook_state: DDPHookState | None = None

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name,
                cls,
                description="Lightning's DDPStrategy with the pack's accounting and optional link emulation",
            )

    def _configure_launcher(self) -> None:
        """Under torchrun, SLURM or any launcher that starts the processes itself (``LOCAL_RANK`` set), launch
        nothing whatever ``start_method`` says (as the pack's strategies do)."""
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            super()._configure_launcher()

    def setup_environment(self) -> None:
        super().setup_environment()
        destroy_groups_at_exit()  # torchrun, SLURM, a cluster host: the group outlives fit, not the process
        self.ddp_hook_state = DDPHookState(self.comm_stats, self.link, record_buckets=self.record_buckets)

    def configure_ddp(self) -> None:
        super().configure_ddp()  # Lightning wraps the module (and registers nothing on CPU)
        assert isinstance(self.model, DistributedDataParallel)
        state = self.ddp_hook_state
        assert state is not None
        module_states = [*self.model.module.parameters(), *self.model.module.buffers()]
        charge_broadcast(state, [t for t in module_states if t.numel() > 0], tag="setup")
        self.model.register_comm_hook(state, allreduce_hook)
        self.model.register_forward_pre_hook(BufferBroadcastAccounting(state))

    def sync_metrics(self) -> dict[str, float]:
        """The keys of :meth:`SyncStrategy.sync_metrics` (every optimizer step all-reduces gradients: LSSR 0), and
        ``comm_span_s``: the seconds DDP communicated (each iteration's first bucket launch to its last
        completion)."""
        state = self.ddp_hook_state
        metrics = {"lssr": 0.0, "local_steps": 0.0, "sync_steps": float(state.iterations) if state else 0.0}
        metrics.update(self.comm_stats.summary())
        #: seconds from each iteration's first bucket launch to its last completion (overlapped + blocked)
        metrics["comm_span_s"] = state.comm_seconds if state else 0.0
        return metrics

    def teardown(self) -> None:
        if self.ddp_hook_state is not None:
            self.ddp_hook_state.close()
        super().teardown()
        if isinstance(self._launcher, _MultiProcessingLauncher):
            destroy_default_group()  # a spawned worker whose gloo group is alive at exit aborts about half the time
