"""``SyncStrategy``: the Lightning glue every method in the pack builds on, and the method author's surface.

A :class:`~lightning.pytorch.strategies.DDPStrategy` that owns its communication. The module is **not** wrapped in
``DistributedDataParallel``: its parameters and floating-point buffers become views of persistent flat buffers
(:class:`~lightning_sync.comm.FlatState`), and rank 0's values are broadcast at setup so every replica starts
identical. The optimizer closure is wrapped so a method acts **after backward and before the update**
(:meth:`_after_backward`) and **after the update** (:meth:`_after_update`). Every collective, the method's own and
Lightning's, goes through one :class:`~lightning_sync.comm.Communicator`: one :class:`~lightning_sync.comm.CommStats`
per rank counts bytes sent, collectives and seconds blocked, and an optional :class:`~lightning_sync.comm.LinkModel`
delays each operation as a slower network would. :class:`~lightning_sync.callbacks.SyncStats` is added unless the user
did (``sync_stats=False`` opts out).

This file holds what a method author reads — the constructor, the step and its hooks, :meth:`average_state` /
:meth:`average_grads`, metrics and state; :class:`SyncStrategy`'s docstring is the guide. The rest is in mixins, one
concern each: :mod:`~lightning_sync.strategies.launcher` (registered names, launcher, what a spawn launch ships back),
:mod:`~lightning_sync.strategies.evaluation` (validation and the main checkpoint file see the global model),
:mod:`~lightning_sync.strategies.checkpoint` (every rank's part beside the checkpoint),
:mod:`~lightning_sync.strategies.topology` (who averages with whom: flat, grouped, fault-tolerant) and
:mod:`~lightning_sync.strategies.codec` (exact or compressed values) are components the strategy owns;
:mod:`~lightning_sync.strategies.outer` (the outer optimizer of parameter averaging),
:mod:`~lightning_sync.strategies.overlap` (the gradient all-reduce overlapped with backward),
:mod:`~lightning_sync.strategies.replicas` (replica groups: exact data parallelism inside a replica of several ranks),
:mod:`~lightning_sync.strategies.training_data` (data injection, loader transforms),
:mod:`~lightning_sync.strategies.collectives` (Lightning's collectives, counted) and
:mod:`~lightning_sync.strategies.sigterm` (the SIGTERM check, listening to every rank); argument and setup checks
are in :mod:`~lightning_sync.strategies.checks`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any, ClassVar, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from torch import Tensor
from torch.optim import Optimizer

from lightning_sync.comm import (
    CommStats,
    Communicator,
    FlatState,
    LinkModel,
    destroy_default_group,
    destroy_groups_at_exit,
    report_failure,
)
from lightning_sync.comm.buckets import GradBuckets
from lightning_sync.comm.compression import Compressor, check_compression
from lightning_sync.core import StepCounter
from lightning_sync.core.outer import OuterOptimizer
from lightning_sync.core.validation import check_bool, check_int
from lightning_sync.strategies.checkpoint import PerRankCheckpointing
from lightning_sync.strategies.checks import START_METHODS, check_ddp_arguments, check_link, check_supported
from lightning_sync.strategies.clipping import LocalClipping, LocalClippingMode, check_local_clipping
from lightning_sync.strategies.codec import ExactCodec, codec_for
from lightning_sync.strategies.collectives import CountedCollectives
from lightning_sync.strategies.defaults import add_default_callback
from lightning_sync.strategies.evaluation import GlobalModelEvaluation
from lightning_sync.strategies.fault_tolerance import FaultTolerance, FaultTolerantSync, check_fault_tolerance
from lightning_sync.strategies.injection import DataInjector
from lightning_sync.strategies.launcher import SyncLaunching, refuse_after_spawn
from lightning_sync.strategies.outer import OuterAveraging
from lightning_sync.strategies.overlap import OverlappedGrads
from lightning_sync.strategies.replicas import ReplicaGroups, ReplicaSize, check_replica_size
from lightning_sync.strategies.sigterm import SigtermCheck
from lightning_sync.strategies.topology import Topology, topology_for
from lightning_sync.strategies.training_data import DataLoaderTransform, TrainingData

__all__ = ["START_METHODS", "VERIFY_ENV", "SyncStrategy"]

#: environment variable that turns ``verify_sync`` on for every strategy (test mode)
VERIFY_ENV = "LIGHTNING_SYNC_VERIFY"


class SyncStrategy(
    SyncLaunching,
    LocalClipping,
    GlobalModelEvaluation,
    OuterAveraging,
    OverlappedGrads,
    ReplicaGroups,
    TrainingData,
    PerRankCheckpointing,
    CountedCollectives,
    SigtermCheck,
    FaultTolerantSync,
    DDPStrategy,
):
    r"""Base of every lightning_sync strategy; the guide for method authors follows the arguments.

    Args:
        link: emulate a slower network: a :class:`~lightning_sync.comm.LinkModel` or ``"1gbit,1ms"``. Off by
            default. Every operation then costs ``latency + bytes / bandwidth`` more (documented as emulation).
        verify_sync: after every sync, all-gather a checksum of what the sync made identical (parameters and
            buffers, or gradients) and raise if any rank differs. A test/debug mode; its traffic is tagged
            ``"verify"`` and kept out of the training totals. ``LIGHTNING_SYNC_VERIFY=1`` in the environment turns
            it on for every strategy.
        injection: SelSync's data injection for non-IID data, ``(alpha, beta)`` in (0, 1]: the training loader's
            batch size b is reduced to b' = b / (1 + alpha*beta*N) (Eq. 3) and every step ceil(alpha*N) ranks drawn
            from ``injection_seed`` share beta*b' samples with all ranks (see
            :class:`~lightning_sync.strategies.injection.DataInjector`). Available on every strategy but the
            parameter-server ones.
        injection_seed: seed of the sharing ranks' draw, an integer >= 0.
        compression: what the method's syncs send: ``None`` (the data's own dtype), ``"bf16"`` or ``"fp16"`` (2
            bytes per element) or ``"int8"`` (1 byte per element plus a 4-byte scale per 256, with error feedback):
            parameter averaging (as the change since the last average), gradient averaging, OSP's two stages and the
            parameter server's pushes and pulls (:mod:`lightning_sync.comm.compression`). Sums are taken in fp32.
            Small control collectives (votes, statistics, SIGTERM flags), floating buffers averaged with gradients,
            the setup broadcast, checkpoints and the parameter server's meeting-point gathers stay exact.
        replica_size: what one replica is: ``None`` (default: every rank, the flat behaviour), ``"node"`` (the ranks
            of one node, Lightning's ``devices``) or an integer >= 1 (that many consecutive global ranks; it must
            divide the world size, checked at setup). With replicas of several ranks, the ranks of a replica average
            their gradients every step (BSP's bucketed all-reduce overlapped with backward, exact: they stay
            bit-identical) and the method synchronises the replicas, on each replica's first rank over a group of
            those, then a broadcast inside the replica (:mod:`~lightning_sync.strategies.replicas`). ``link`` then
            emulates the link between replicas only. Refused by the methods that cannot run so (the parameter-server
            family, Sync-Switch, OSP), saying why.
        intra_link: emulate the link inside a replica group (a :class:`~lightning_sync.comm.LinkModel`,
            ``"100gbit"``...; default none); needs replica groups (checked at setup).
        sync_stats: add a :class:`~lightning_sync.callbacks.SyncStats` callback (LSSR and bytes in the progress bar
            and the loggers) when the Trainer has none; ``False`` adds nothing.
        fault_tolerance: ``None`` (default: every rank is needed, a failure stops the run) or a
            :class:`~lightning_sync.strategies.fault_tolerance.FaultTolerance`: this process is one replica group of a
            run on torchft that survives losing groups (:mod:`~lightning_sync.strategies.fault_tolerance`). Methods
            that cannot (:attr:`fault_tolerance_refusal`) raise at construction, saying why.
        local_clipping: what ``Trainer(gradient_clip_val=c)`` clips a *local* gradient (one replica's own, not
            every rank's mean, which is what DDP clips) at: ``"scaled"`` (default) :math:`c\sqrt N` for :math:`N`
            replicas, the bound of a replica gradient's norm over the mean's, so a local step is clipped about as
            often as DDP's; ``"as_given"`` at :math:`c`. A gradient that is every rank's mean (BSP, Sync-Switch's
            BSP phase, a SelSync gradient sync) is clipped at :math:`c` either way
            (:mod:`~lightning_sync.strategies.clipping`).
        start_method: how Lightning launches processes when it launches them, as for its ``ddp``: ``"popen"``
            (default: the script is run again for every other rank, the launching process is rank 0), ``"spawn"``
            (registered as ``"<name>_spawn"``: for notebooks and pytest; rank 0's results are shipped back, see
            :mod:`~lightning_sync.strategies.launcher`), ``"fork"`` or ``"forkserver"``; ignored under torchrun/SLURM,
            which start the processes themselves.
        timeout: collective timeout, a ``timedelta`` > 0, or ``None`` for torch's default.
        process_group_backend: ``None`` (Lightning's choice: gloo on CPU, nccl on GPU) or a backend name.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: ``DDPStrategy``'s,
            passed on as they are after a type check (a Lightning object of the documented class, or ``None``;
            ``accelerator`` may also be a name such as ``"cpu"``, resolved by the Trainer).

    **For method authors.** Put the math in ``lightning_sync.core`` and keep the subclass to glue; every collective
    must be issued in the same order on all ranks. The hooks that are yours, in the order they run:

    * ``__init__``: check your arguments (``ValueError`` naming the argument and its range), set yours, then
      ``super().__init__(**kwargs)``. A parameter-averaging method that takes ``outer_optimizer``,
      ``average_at_end`` and ``evaluate`` sets all three with :meth:`_averaging_options`.
    * :meth:`_check_supported` (``setup``): reject Trainer settings the method cannot honour (call ``super()`` first).
    * :meth:`_on_flat_ready` (``setup``): the flat state exists and replicas are identical (or restored on resume).
    * Every optimizer step, in :meth:`optimizer_step`: :meth:`_overlap_grads` (with :attr:`bucket_cap_mb` and no
      compression: announce a gradient average to overlap with backward), then Lightning's closure (training_step,
      backward), then :meth:`_after_backward` (gradients ready in the flat buffer, no update yet: call
      :meth:`average_grads` here), the optimizer's update, then :meth:`_after_update` (call :meth:`average_state`
      here), then the SIGTERM check unless :attr:`carries_sigterm`. Record each step with
      ``self.step_counter.record(synced)``; use ``self.comm`` for any other collective.
    * :meth:`strategy_state` / :meth:`load_strategy_state`: every piece of per-rank state (each rank's checkpoint part
      holds it; extend with ``super()``).
    * :meth:`sync_metrics` (logged every few steps) and :meth:`sync_event_metrics` (logged at each sync).
    * Lightning's hooks (``on_train_start``, ``on_train_end``, ``on_validation_start``, ``teardown``...) may be
      extended with ``super()``; ``on_train_end`` runs :meth:`_average_at_end` when ``average_at_end`` is set.

    Set :attr:`replicas_diverge`, :attr:`carries_sigterm`, :attr:`supports_accumulation` and :attr:`averages_for_eval`
    to match the method; with compression, :meth:`_averages_state` says whether it averages parameters.

    **Replica groups** (``replica_size``, :mod:`~lightning_sync.strategies.replicas`): the base averages the gradients
    inside each replica before :meth:`_after_backward`, and :meth:`average_state` / :meth:`average_grads` then average
    the replicas. A method that runs grouped counts replicas, not ranks (:attr:`num_replicas`,
    :attr:`replica_index`; ``participants`` are replica indices) and sends any other value with one value per
    replica through its :attr:`topology` (``self.topology.all_reduce`` / ``mean``); one that cannot sets
    :attr:`replica_groups_refusal` to the reason (``replica_size`` is then refused at construction).
    :class:`~lightning_sync.strategies.localsgd.LocalSGDStrategy` is the smallest complete example (walked through in
    ``docs/architecture.md``, with the life of one step).
    """

    strategy_name: ClassVar[str | None] = None
    strategy_description: ClassVar[str] = ""
    #: Whether replicas (parameters, optimizer state) can differ between ranks, so a checkpoint must hold
    #: every rank's own model and optimizer state rather than rank 0's.
    replicas_diverge: ClassVar[bool] = True
    #: Whether ``accumulate_grad_batches > 1`` is supported: the hooks run once per optimizer step, on the gradient
    #: accumulated (in the flat buffer) over the micro-batches.
    supports_accumulation: ClassVar[bool] = True
    #: ``False``: the base checks for SIGTERM with a 4-byte all-reduce after every update (as Lightning does every
    #: step). ``True``: the method handles it — folded into its own per-step collective (SelSync), or
    #: :meth:`_check_sigterm` called at its sync points only (periodic methods, so local steps stay collective-free).
    carries_sigterm: ClassVar[bool] = False
    #: Bucket size in MiB of the gradient all-reduce overlapped with backward (:mod:`lightning_sync.comm.buckets`),
    #: set by the ``bucket_cap_mb`` argument of methods that average gradients every step (they also override
    #: :meth:`_overlap_grads`); ``None``: no gradient hooks, :meth:`average_grads` is one all-reduce after backward.
    bucket_cap_mb: float | None = None
    #: DDP's ``find_unused_parameters`` for the overlapped all-reduce (see :mod:`lightning_sync.comm.buckets`)
    find_unused_parameters: bool = False
    #: Whether validation during fit averages diverged replicas into the module (tag ``"eval"``) and puts each rank's
    #: own back afterwards, and the main checkpoint file holds that average. Only meaningful with
    #: :attr:`replicas_diverge`; the parameter-server strategies set ``False``: they swap in the servers' model.
    averages_for_eval: ClassVar[bool] = True
    #: Why the method cannot run with ``fault_tolerance`` (``None``: it can, and implements
    #: :meth:`_ft_next_step_syncs`). Fault tolerance needs collectives among the replica groups at syncs only, each
    #: after a quorum taken at a step boundary, and a schedule every group can follow from shared state.
    fault_tolerance_refusal: ClassVar[str | None] = (
        "only local SGD and DiLoCo support fault tolerance (collectives among replica groups at their periodic syncs "
        "only, each preceded by a torchft quorum at a step boundary)"
    )

    def __init__(
        self,
        link: LinkModel | str | None = None,
        verify_sync: bool = False,
        injection: tuple[float, float] | None = None,
        injection_seed: int = 0,
        compression: str | None = None,
        sync_stats: bool = True,
        replica_size: ReplicaSize = None,
        intra_link: LinkModel | str | None = None,
        fault_tolerance: FaultTolerance | None = None,
        local_clipping: LocalClippingMode = "scaled",
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        link = check_link(link)
        replica_size = check_replica_size(replica_size)
        intra_link = check_link(intra_link, "intra_link")
        if self.replica_groups_refusal is not None:
            for name, value in (("replica_size", replica_size), ("intra_link", intra_link)):
                if value is not None:
                    raise ValueError(
                        f"{name} must be None for {type(self).__name__}: {self.replica_groups_refusal} Use "
                        f"{name}=None (every rank a replica), or a method that runs with replica groups (bsp, "
                        "localsgd, fedavg, adpsgd, diloco, selsync)."
                    )
        check_bool("verify_sync", verify_sync)
        check_bool("sync_stats", sync_stats)
        local_clipping = check_local_clipping(local_clipping)
        if injection is not None and (not isinstance(injection, (tuple, list)) or len(injection) != 2):
            raise ValueError(f"injection must be (alpha, beta) with both in (0, 1], or None; got {injection!r}")
        injection_seed = check_int("injection_seed", injection_seed, 0)
        compression = check_compression(compression)
        ft_conflicts = {"compression": compression, "injection": injection}
        fault_tolerance = check_fault_tolerance(self, fault_tolerance, ft_conflicts)
        injector = DataInjector(*injection, seed=injection_seed) if injection else None
        ddp_arguments: dict[str, Any] = dict(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        check_ddp_arguments(**ddp_arguments)
        super().__init__(**ddp_arguments)
        self.link: LinkModel | None = link
        self.replica_size = replica_size
        self.intra_link: LinkModel | None = intra_link
        #: ``LIGHTNING_SYNC_VERIFY=1`` in the environment turns the check on for every strategy (a test mode: run
        #: a whole suite or job with the invariants checked at every sync without editing its configuration)
        self.verify_sync = verify_sync or os.environ.get(VERIFY_ENV, "0") not in ("", "0")
        self.sync_stats = sync_stats
        #: ``fault_tolerance``: this process is one replica group of a fault-tolerant run (``None``: not)
        self.fault_tolerance: FaultTolerance | None = fault_tolerance
        self.local_clipping: LocalClippingMode = local_clipping
        self.comm_stats = CommStats()
        self.step_counter = StepCounter()
        self._comm: Communicator | None = None
        #: how the replicas average (flat, grouped, fault-tolerant), chosen at setup_environment
        self._topology: Topology | None = None
        self._flat: FlatState | None = None
        self._restored_state: dict[str, Any] | None = None
        self._restored_per_rank = False
        self._part_names: dict[str, str] = {}  # this rank's checkpoint path -> rank 0's, for its part's name
        self._dataloader_transforms: list[DataLoaderTransform] = []
        self.injector: DataInjector | None = injector
        self.compression: str | None = compression
        #: the compression's wire format, buffers and error-feedback residuals (``None`` without compression)
        self.compressor: Compressor | None = Compressor(compression) if compression is not None else None
        #: how an average's values travel: exact, or compressed with its reference and error feedback
        self.codec: ExactCodec = codec_for(self.compressor)
        self._last_loss: Any = None  # what the closure returned this step (the loss tensor)
        self._sigterm_buf: Tensor | None = None
        self._restored_comm: dict[str, Any] | None = None
        self._verify_after_update: Communicator | None = None  # verify_sync: check replicas after this update
        self._grad_buckets: GradBuckets | None = None
        #: with :attr:`outer_config`: the global parameters and outer momentum (built when the flat state exists)
        self.outer: OuterOptimizer | None = None
        self._updates_since_average = 0  # optimizer updates since the last parameter averaging (outer step)
        self._eval_replica: list[Tensor] | None = None  # this rank's replica while the global model is swapped in
        self._main_state_dict: dict[str, Any] | None = None  # what the main checkpoint file holds during a save
        self._adopted: dict[str, Any] | None = None  # rank 0's launch summary, in the launching process after spawn

    # ------------------------------------------------------------------ accessors
    @property
    def comm(self) -> Communicator:
        if self._comm is None:
            if self._adopted is not None:
                refuse_after_spawn(type(self).__name__, "comm")
            raise RuntimeError(f"{type(self).__name__} has no communicator before setup_environment()")
        return self._comm

    @property
    def topology(self) -> Topology:
        """How the replicas average (:mod:`~lightning_sync.strategies.topology`): the one object the averages call."""
        if self._topology is None:
            raise RuntimeError(f"{type(self).__name__} has no replica topology before setup_environment()")
        return self._topology

    @property
    def flat(self) -> FlatState:
        if self._flat is None:
            if self._adopted is not None:
                refuse_after_spawn(type(self).__name__, "flat")
            raise RuntimeError(f"{type(self).__name__} has no flat state before setup() while fitting")
        return self._flat

    # ------------------------------------------------------------------ setup
    def setup_environment(self) -> None:
        self._forget_launch_summary()
        super().setup_environment()
        destroy_groups_at_exit()  # torchrun, SLURM, a cluster host: the group outlives fit, not the process
        self.ranks_per_replica = self._resolve_replica_size()  # raises before any collective (a peer stops alike)
        self._comm = Communicator(self.comm_stats, self.link)
        self._setup_replica_groups()
        self._add_sync_stats()
        if self.fault_tolerance is not None:
            self._ft_setup_environment()  # joins nothing yet: reaches the lighthouse (a clear error if it cannot)
        self._topology = topology_for(self)

    def _add_sync_stats(self) -> None:
        """LSSR and bytes in the progress bar and loggers without extra wiring (``sync_stats=False`` opts out). Added
        before Lightning calls the callbacks' ``setup``, so the callback is set up like one the user passed."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self.sync_stats and trainer is not None:
            add_default_callback(trainer, "sync_stats")  # SyncStats, registered by lightning_sync.callbacks.stats

    def setup(self, trainer: pl.Trainer) -> None:
        self._check_supported(trainer)
        super().setup(trainer)
        self._install_local_clipping()  # the precision plugin is final now
        if self._ft is not None and self._ft_trainer_fitting(trainer):
            self._ft_start(trainer)  # the first quorum; a restarted replica group takes its peers' state here

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        kwargs = super().distributed_sampler_kwargs
        return kwargs if self.fault_tolerance is None else self._ft_sampler_kwargs(kwargs)

    def _check_supported(self, trainer: pl.Trainer) -> None:
        """Reject Trainer settings this strategy cannot honour, saying why and what to use instead (subclasses
        extend it, calling ``super()`` first)."""
        check_supported(self, trainer)
        if self.fault_tolerance is not None:
            self._ft_check_trainer(trainer)

    def configure_ddp(self) -> None:
        """Instead of wrapping in ``DistributedDataParallel``: flatten, broadcast rank 0's state, restore."""
        assert self.model is not None
        self._flat = FlatState(self.model)
        self._setup_grad_buckets()
        if not (self._restored_state is not None and self._restored_per_rank):
            # start identical; a resume of per-rank replicas keeps each rank's own (loaded before setup)
            for tensor in self._flat.state_tensors():
                self.comm.broadcast(tensor, src=0, tag="setup")
        self._setup_outer()
        self.codec.setup(self.flat, self._averages_state(), self.world_size, type(self).__name__)
        self._init_synced()  # evaluate="last_sync": the global model of the last sync starts as the replicas
        if self._restored_state is not None:
            self.load_strategy_state(self._restored_state)
            self._restored_state = None
        self._on_flat_ready()

    def _on_flat_ready(self) -> None:
        """Subclass hook: the flat state exists and replicas are identical (or restored)."""

    def _averages_state(self) -> bool:
        """Whether this method averages parameters (:meth:`average_state`): with compression it then keeps the
        reference copy of the last average. Methods whose replicas never diverge (gradient averaging) do not."""
        return self.replicas_diverge

    # ------------------------------------------------------------------ the step
    def pre_backward(self, closure_loss: Tensor) -> None:
        super().pre_backward(closure_loss)
        if self._flat is not None:
            self._flat.bind_grads()

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        def closure_then_sync() -> Any:
            self._arm_grad_buckets()
            try:
                result = closure()
                self._last_loss = result
                self._average_in_replica()  # replica groups: the replica's ranks average their gradients, exactly
                self._after_backward(optimizer)
            except BaseException:
                self._abandon_grad_buckets()
                raise
            self._check_grad_buckets_finished()
            return result

        output = super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)
        self._updates_since_average += 1
        if self._verify_after_update is not None:
            comm, self._verify_after_update = self._verify_after_update, None
            self._verify(self.flat.state_tensors(), "parameters and buffers after the update", comm)
        self._after_update(optimizer)
        if not self.carries_sigterm and self.world_size > 1:
            self._check_sigterm()
        return output

    def _after_backward(self, optimizer: Optimizer) -> None:
        """Gradients of this step are ready (flat, bound); the optimizer has not updated yet."""

    def _after_update(self, optimizer: Optimizer) -> None:
        """The optimizer has applied this step's update."""

    def _overlap_grads(self) -> tuple[Communicator, str] | None:
        """Before the backward of a step that will update the model: ``(communicator, tag)`` if this step's
        :meth:`_after_backward` will call ``average_grads(tag=tag, comm=communicator)`` — known before backward —
        so the gradient buckets are all-reduced during backward, each as soon as its gradients are ready
        (:mod:`lightning_sync.comm.buckets`); ``None`` (default) when it will not, or cannot be known yet (then
        :meth:`average_grads` is one all-reduce after backward). Only used when :attr:`bucket_cap_mb` is set."""
        return None

    # ------------------------------------------------------------------ train start and end
    def on_train_start(self) -> None:
        super().on_train_start()
        if self._restored_comm is not None:
            # A resumed run's own start-up traffic (the initial broadcast, Lightning's restore barriers, setting up
            # the servers) is not added: the totals continue from the checkpoint, which already holds the
            # uninterrupted run's start-up, so a resumed run logs the same totals as an uninterrupted one.
            self.comm_stats.load_state_dict(self._restored_comm)
            self._restored_comm = None
        self._route_sigterm_check()

    def on_train_end(self) -> None:
        self._restore_sigterm_check()
        if getattr(self, "average_at_end", False) and self._flat is not None:
            self._average_at_end()
        super().on_train_end()

    # ------------------------------------------------------------------ sync helpers
    def average_state(
        self, tag: str = "params", participants: list[int] | None = None, on_mean: Callable[[], None] | None = None
    ) -> bool:
        r"""Average parameters and floating buffers over the replicas, through :attr:`topology` (flat: one all-reduce
        per flat buffer over all ranks; the strategy never branches on which topology it runs).

        With ``participants`` (a rank list, identical on every rank), only those ranks' values are averaged and
        every rank takes the result: the others contribute zeros to the same all-reduce (so the bytes are those of
        a full all-reduce) and the sum is divided by ``len(participants)``.

        With an outer optimizer (:attr:`outer_config`, DiLoCo's Algorithm 1 outer step) the parameters' mean then
        goes through :class:`~lightning_sync.core.outer.OuterOptimizer`: :math:`\Delta = \theta_{global} -
        \text{mean}`, an outer SGD step on :math:`\theta_{global}`, and every rank takes the new
        :math:`\theta_{global}`. Floating buffers (BatchNorm statistics) keep the plain mean. ``on_mean`` is called
        while the flat buffers hold the mean, before that step (ADPSGD measures the replicas' spread there).

        With replica groups the replicas are averaged, not the ranks: ``participants`` are replica indices, the
        all-reduce runs over the replicas' first ranks and its result is broadcast inside each replica.

        Fault-tolerant (:attr:`fault_tolerance`): over the replica groups of the current quorum (``participants``:
        ranks in the quorum), ``on_mean`` before the commit (its collectives commit with the average); returns whether
        the sync committed (otherwise this replica keeps its own values and the next sync tries again). Always
        ``True`` otherwise.
        """
        tensors = self.flat.state_tensors()
        committed = self.topology.average(tensors, tag, participants, before_commit=on_mean)
        if self.verify_sync:
            self.topology.verify(tensors, "parameters and buffers", committed)
        if not committed:
            return False  # fault-tolerant: this replica group keeps its own values, the next sync tries again
        self._outer_step(tensors)
        self._record_synced()  # evaluate="last_sync": every rank holds the global model now
        self._mark_in_sync()  # and validation before the next step needs no average
        return True

    def average_grads(self, tag: str = "grads", comm: Communicator | None = None, verify_update: bool = False) -> None:
        """Average gradients (and floating buffers, carried in the same buffer) over ``comm`` (default: all
        ranks; a subgroup's communicator averages over its members only): the buckets launched during backward when
        :meth:`_overlap_grads` announced this call (the rest launched now, all waited on), else one all-reduce per
        (device, dtype) group now.

        With :attr:`verify_sync`, the averaged gradients are checked at once; with ``verify_update=True`` as well
        (methods whose replicas are identical before the step, e.g. BSP) the parameters and buffers are checked
        again after the optimizer applied them, on the same ranks.

        With replica groups the gradients were averaged inside the replica after backward already; this averages the
        replicas' gradients: over the leaders (compressed with :attr:`compressor`), then broadcast in each replica.
        """
        tensors = self.topology.average_grads(tag, comm)
        if self.verify_sync:
            comm = comm if comm is not None else self.comm  # with replica groups: every rank of every replica
            self._verify(tensors, "gradients and buffers", comm)
            if verify_update:
                self._verify_after_update = comm

    def _verify(self, tensors: list[Tensor], what: str, comm: Communicator | None = None) -> None:
        comm = comm if comm is not None else self.comm
        local = self.flat.checksum(tensors)
        gathered = comm.all_gather(local.to(self._comm_device()), tag="verify").cpu()
        if not bool((gathered == gathered[0]).all()):
            raise RuntimeError(
                f"verify_sync: {what} differ across ranks after a sync at step {self.step_counter.steps} "
                f"(per-rank checksums {gathered.tolist()})"
            )

    def _comm_device(self) -> torch.device:
        return self.root_device if self.comm.backend == "nccl" else torch.device("cpu")

    # ------------------------------------------------------------------ metrics
    def sync_metrics(self) -> dict[str, float]:
        """What :class:`~lightning_sync.callbacks.SyncStats` logs: LSSR, step counts and communication totals."""
        metrics = {
            "lssr": self.step_counter.lssr,
            "local_steps": float(self.step_counter.local_steps),
            "sync_steps": float(self.step_counter.sync_steps),
        }
        metrics.update(self.comm_stats.summary())
        if self.fault_tolerance is not None and hasattr(self, "ft_quorums"):
            metrics.update(self._ft_metrics())
        if self.injector is not None:
            metrics["injected_samples"] = float(self.injector.injected_samples)
            metrics["injected_payload_bytes"] = float(self.injector.payload_bytes)
        return metrics

    def sync_event_metrics(self) -> dict[str, float]:
        """Method-specific values :class:`~lightning_sync.callbacks.SyncStats` logs at every step that synced."""
        return {}

    # ------------------------------------------------------------------ state
    def strategy_state(self) -> dict[str, Any]:
        """This rank's state; subclasses extend the dict (``state = super().strategy_state(); state[...] = ...``)."""
        state: dict[str, Any] = {"comm": self.comm_stats.state_dict(), "steps": self.step_counter.state_dict()}
        if self.injector is not None:
            state["injector"] = self.injector.state_dict()
        if self.outer is not None:
            state["outer"] = self._outer_state()
        if (compression := self.codec.state_dict()) is not None:
            state["compression"] = compression  # the error-feedback residuals and the reference
        if self._synced is not None:
            state["synced"] = self._synced_state()
        if self._ft is not None:
            state["ft"] = self._ft.state_dict()  # torchft's step: a resumed replica group must not look behind
        return state

    def load_strategy_state(self, state: dict[str, Any]) -> None:
        self.comm_stats.load_state_dict(state["comm"])
        self._restored_comm = state["comm"]  # applied again when training starts (see on_train_start)
        self.step_counter.load_state_dict(state["steps"])
        if self.injector is not None and state.get("injector") is not None:
            self.injector.load_state_dict(state["injector"])
        self._load_outer_state(state.get("outer"))
        self.codec.load_state_dict(state.get("compression"), self.compression)
        self._load_synced(state.get("synced"))
        if self._ft is not None and state.get("ft") is not None:
            self._ft.load_state_dict(state["ft"])

    # ------------------------------------------------------------------ failures
    def on_exception(self, exception: BaseException) -> None:
        """Tell the other ranks why this one stops, before Lightning tears down and the process exits: their next
        operation with this rank raises :class:`~lightning_sync.comm.PeerFailure` naming it and its error."""
        self._abandon_grad_buckets()  # never wait for buckets in flight on the way out: a peer may be gone
        if self._comm is not None and self.world_size > 1:
            report_failure(exception)
        super().on_exception(exception)

    # ------------------------------------------------------------------ teardown
    def teardown(self) -> None:
        if self._grad_buckets is not None:
            self._grad_buckets.remove()
            self._grad_buckets = None
        self._remove_local_clipping()
        if self._topology is not None:
            self._topology.close()
            self._topology = None
        self._teardown_replica_groups()
        self._ft_teardown()
        if self._comm is not None:
            self._comm.close()  # the driver thread of asynchronous compressed all-reduces, if one was started
        self._flat = None
        self.codec = codec_for(self.compressor)  # a later fit takes its reference anew
        self._synced = None
        self._comm = None
        super().teardown()
        if isinstance(self._launcher, _MultiProcessingLauncher):
            # A spawned worker whose gloo group is alive at exit aborts about half the time (shared note).
            destroy_default_group()
