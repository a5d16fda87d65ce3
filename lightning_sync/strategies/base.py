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

This file holds what a method author reads: the constructor, the step and its hooks, :meth:`average_state` /
:meth:`average_grads`, metrics and state. Each other concern is an object the strategy owns, in the module of its
name (``topology``, ``codec``, ``outer``, ``replicas``, ``overlap``, ``clipping``, ``training_data``, ``sigterm``),
or, for Lightning's own hooks, one of four mixins (``launcher``, ``evaluation``, ``checkpoint``, ``collectives``):
``docs/architecture.md`` is the map.
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
from lightning_sync.comm.compression import Compressor, check_compression
from lightning_sync.core import StepCounter
from lightning_sync.core.outer import OuterOptimizer, OuterSGD
from lightning_sync.core.validation import check_bool
from lightning_sync.strategies.checkpoint import PerRankCheckpointing
from lightning_sync.strategies.checkpoint_dir import check_distributed_checkpoint
from lightning_sync.strategies.checks import START_METHODS, check_link, check_supported, ddp_arguments
from lightning_sync.strategies.clipping import LocalClipping, LocalClippingMode, check_local_clipping
from lightning_sync.strategies.codec import ExactCodec, codec_for
from lightning_sync.strategies.collectives import CountedCollectives
from lightning_sync.strategies.evaluation import GlobalModelEvaluation
from lightning_sync.strategies.fault_tolerance import FaultTolerance, check_fault_tolerance
from lightning_sync.strategies.ft_topology import topology_for
from lightning_sync.strategies.injection import DataInjector
from lightning_sync.strategies.launcher import SyncLaunching, refuse_after_spawn
from lightning_sync.strategies.outer import OuterAveraging
from lightning_sync.strategies.overlap import OverlappedGrads
from lightning_sync.strategies.replicas import FromLayout, ReplicaGroups, ReplicaSize, check_refusal, check_replica_size
from lightning_sync.strategies.sharded_topology import check_sharded
from lightning_sync.strategies.sigterm import SigtermCheck
from lightning_sync.strategies.state import load_declared_state, save_declared_state
from lightning_sync.strategies.sync_stats import add_sync_stats
from lightning_sync.strategies.topology import Topology
from lightning_sync.strategies.training_data import DataLoaderTransform, TrainingData, check_injection

__all__ = ["START_METHODS", "VERIFY_ENV", "SyncStrategy"]

#: environment variable that turns ``verify_sync`` on for every strategy (test mode)
VERIFY_ENV = "LIGHTNING_SYNC_VERIFY"


class SyncStrategy(
    SyncLaunching,
    GlobalModelEvaluation,
    PerRankCheckpointing,
    CountedCollectives,
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
        compression: what the method's syncs send: ``None`` (the data's own dtype), ``"bf16"``, ``"fp16"``,
            ``"int8"``, ``"int4"``, ``"int2"`` (with error feedback) or ``"topk:<fraction>"`` (``+int2``/``+int4``/
            ``+int8``; parameter averaging only): the format table, bytes per element and who takes which are in
            :mod:`lightning_sync.comm.compression`. Sums are taken in fp32; control collectives, buffers, the setup
            broadcast and checkpoints stay exact.
        replica_size: what one replica is: ``None`` (default: every rank, the flat behaviour), ``"node"`` (the ranks
            of one node, Lightning's ``devices``) or an integer >= 1 (that many consecutive global ranks; it must
            divide the world size, checked at setup). With replicas of several ranks, the ranks of a replica average
            their gradients every step (BSP's bucketed all-reduce overlapped with backward, exact: they stay
            bit-identical) and the method synchronises the replicas, on each replica's first rank over a group of
            those, then a broadcast inside the replica (:mod:`~lightning_sync.strategies.replicas`). ``link`` then
            emulates the link between replicas only. Refused by the methods that cannot run so (the parameter-server
            family, Sync-Switch, OSP), saying why.
        sharded: ``True``: each replica's model is sharded with FSDP2 over its ranks and the method runs between
            replicas on each rank's shard (:mod:`~lightning_sync.strategies.sharded_topology`: the methods that do).
        save_distributed_checkpoint: with ``sharded=True``, ``True`` makes a checkpoint a directory in
            ``torch.distributed.checkpoint``'s format, every rank writing its own shards (no rank holds the whole
            model), as Lightning's ``ModelParallelStrategy(save_distributed_checkpoint=True)``;
            ``False`` (default): each rank's part a file beside the main file, which holds the whole model
            (:mod:`~lightning_sync.strategies.checkpoint_dir`).
        intra_link: emulate the link inside a replica (a :class:`~lightning_sync.comm.LinkModel`, ``"100gbit"``...;
            default none; FSDP2's collectives too when sharded); needs replica groups (checked at setup).
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
      ``super().__init__(**kwargs)``. A method that averages parameters on a schedule derives from
      :class:`~lightning_sync.strategies.periodic.PeriodicAveraging` (its three shared arguments, the step's frame).
    * :meth:`_check_supported` (``setup``): reject Trainer settings the method cannot honour (call ``super()`` first).
    * :meth:`_on_flat_ready` (``setup``): the flat state exists and replicas are identical (or restored on resume).
    * Every optimizer step, in :meth:`optimizer_step`: :meth:`_overlap_grads` (with :attr:`bucket_cap_mb` and no
      compression: announce a gradient average to overlap with backward), then Lightning's closure (training_step,
      backward), then :meth:`_after_backward` (gradients ready in the flat buffer, no update yet: call
      :meth:`average_grads` here), the optimizer's update, then :meth:`_after_update` (call :meth:`average_state`
      here), then the SIGTERM check unless :attr:`carries_sigterm`. Record each step with
      ``self.step_counter.record(synced)``; use ``self.comm`` for any other collective.
    * Every piece of per-rank state (each rank's checkpoint part holds it): name it in :attr:`state_fields`; extend
      :meth:`strategy_state` / :meth:`load_strategy_state` with ``super()`` only where restoring does real work.
    * :meth:`sync_metrics` (logged every few steps) and :meth:`sync_event_metrics` (logged at each sync).
    * Lightning's hooks (``on_train_start``, ``on_train_end``, ``on_validation_start``, ``teardown``...) may be
      extended with ``super()``; ``on_train_end`` runs :meth:`_average_at_end` when ``average_at_end`` is set.

    Set :attr:`replicas_diverge`, :attr:`carries_sigterm`, :attr:`supports_accumulation` and :attr:`averages_for_eval`
    to match the method; with compression, :meth:`_averages_state` says whether it averages parameters.

    **Replica groups** (``replica_size``): the gradients are averaged inside each replica before
    :meth:`_after_backward`, the averages then run between replicas; a method counts replicas (:attr:`num_replicas`,
    :attr:`replica_index`; ``participants`` are replica indices) and sends any other per-replica value through
    :attr:`topology`, or sets :attr:`replica_groups_refusal`. ``docs/architecture.md`` walks through
    :class:`~lightning_sync.strategies.localsgd.LocalSGDStrategy`, the smallest complete example.
    """

    strategy_name: ClassVar[str | None] = None
    strategy_description: ClassVar[str] = ""
    #: The ``outer_optimizer`` argument parsed (the outer step, :mod:`~lightning_sync.strategies.outer`); None: none.
    outer_config: OuterSGD | None = None
    #: This class's per-rank state, saved and restored (:mod:`~lightning_sync.strategies.state`): attribute names, or
    #: ``{key: names}`` to save them as one dict under ``key``.
    state_fields: ClassVar[tuple[str, ...] | dict[str, tuple[str, ...]]] = ()
    #: Whether replicas (parameters, optimizer state) can differ between ranks, so a checkpoint must hold
    #: every rank's own model and optimizer state rather than rank 0's.
    replicas_diverge: ClassVar[bool] = True
    #: Whether ``accumulate_grad_batches > 1`` is supported: the hooks run once per optimizer step, on the gradient
    #: accumulated (in the flat buffer) over the micro-batches.
    supports_accumulation: ClassVar[bool] = True
    #: ``False``: the base checks for SIGTERM with a 4-byte all-reduce after every update (Lightning: every step).
    #: ``True``: the method does, in its own per-step collective (SelSync) or ``self.sigterm.check()`` at its syncs.
    carries_sigterm: ClassVar[bool] = False
    #: Bucket size in MiB of the gradient all-reduce overlapped with backward (:mod:`lightning_sync.comm.buckets`),
    #: set by the ``bucket_cap_mb`` argument of methods that average gradients every step (they also override
    #: :meth:`_overlap_grads`); ``None``: no gradient hooks, :meth:`average_grads` is one all-reduce after backward.
    bucket_cap_mb: float | None = None
    #: DDP's ``find_unused_parameters`` for the overlapped all-reduce (see :mod:`lightning_sync.comm.buckets`)
    find_unused_parameters: bool = False
    #: Why the method cannot run with replica groups (``None``: it can): ``replica_size`` is refused with it.
    replica_groups_refusal: ClassVar[str | None] = None
    #: Why the method cannot run with sharded replicas (``None``: it can): ``sharded=True`` is refused with it.
    sharded_refusal: ClassVar[str | None] = (
        "the method does not declare that it runs on sharded replicas (one whose averages all go through its "
        "topology sets sharded_refusal = None)."
    )
    #: With replica groups: the MiB buckets of the in-replica gradient all-reduce (BSP: its ``bucket_cap_mb``)
    intra_bucket_cap_mb: float | None = 25.0
    num_replicas: FromLayout[int] = FromLayout()
    replica_index: FromLayout[int] = FromLayout()
    is_replica_leader: FromLayout[bool] = FromLayout()
    ranks_per_replica: FromLayout[int] = FromLayout()
    #: Whether validation during fit averages diverged replicas into the module (tag ``"eval"``) and puts each rank's
    #: own back afterwards, and the main checkpoint file holds that average. Only meaningful with
    #: :attr:`replicas_diverge`; the parameter-server strategies set ``False``: they swap in the servers' model.
    averages_for_eval: ClassVar[bool] = True
    #: Why the method cannot run with ``fault_tolerance`` (``None``: it can, and implements
    #: :meth:`_ft_next_step_syncs`). Fault tolerance needs collectives among the replica groups at syncs only, each
    #: after a quorum taken at a step boundary, and a schedule every group can follow from shared state.
    fault_tolerance_refusal: ClassVar[str | None] = (
        "only BSP and the periodic methods support fault tolerance (collectives among replica groups at their syncs "
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
        sharded: bool = False,
        save_distributed_checkpoint: bool = False,
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
        self.sharded = check_sharded(self, sharded, replica_size, fault_tolerance)
        self.save_distributed_checkpoint = check_distributed_checkpoint(
            save_distributed_checkpoint, sharded, fault_tolerance
        )
        check_refusal(self, replica_size=replica_size, intra_link=intra_link)
        check_bool("verify_sync", verify_sync)
        check_bool("sync_stats", sync_stats)
        local_clipping = check_local_clipping(local_clipping)
        injection_seed = check_injection(injection, injection_seed)
        compression = check_compression(compression)
        ft_conflicts = {"compression": compression, "injection": injection}
        fault_tolerance = check_fault_tolerance(self, fault_tolerance, ft_conflicts)
        injector = DataInjector(*injection, seed=injection_seed) if injection else None
        super().__init__(**ddp_arguments(locals()))
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
        self.replicas = ReplicaGroups(self)  # the replica layout
        self.overlap = OverlappedGrads(self)  # the gradient all-reduce overlapped with backward
        self.clipping = LocalClipping(self)  # gradient_clip_val on a local step
        self.training_data = TrainingData(self)  # loader transforms and data injection
        self.sigterm = SigtermCheck(self)  # the SIGTERM check, listening to every rank
        self.comm_stats = CommStats()
        self.step_counter = StepCounter()
        self._comm: Communicator | None = None
        #: how the replicas average (flat, grouped, fault-tolerant), chosen at setup_environment
        self._topology: Topology | None = None
        self._flat: FlatState | None = None
        self._restored_state: dict[str, Any] | None = None
        self._restored_per_rank = False
        self._part_names: dict[str, str] = {}  # this rank's checkpoint path -> rank 0's, for its part's name
        self.injector: DataInjector | None = injector
        self.compression: str | None = compression
        #: the compression's wire format, buffers and error-feedback residuals (``None`` without compression)
        self.compressor: Compressor | None = Compressor(compression) if compression is not None else None
        #: how an average's values travel: exact, or compressed with its reference and error feedback
        self.codec: ExactCodec = codec_for(self.compressor)
        self._last_loss: Any = None  # what the closure returned this step (the loss tensor)
        self._restored_comm: dict[str, Any] | None = None
        self._verify_after_update: Communicator | None = None  # verify_sync: check replicas after this update
        #: the outer step after every parameter average (with :attr:`outer_config`; :attr:`outer` is its optimizer)
        self.outer_averaging = OuterAveraging()
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
    def outer(self) -> OuterOptimizer | None:
        """With :attr:`outer_config`: the global parameters and outer momentum (built when the flat state exists)."""
        return self.outer_averaging.optimizer

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
        self.replicas.resolve()  # raises before any collective (a peer stops alike)
        self._comm = Communicator(self.comm_stats, self.link)
        self.replicas.setup()
        add_sync_stats(self.lightning_module, self.sync_stats)
        self._topology = topology_for(self)
        self._topology.setup_environment()  # fault-tolerant: reaches the lighthouse (a clear error if it cannot)

    def setup(self, trainer: pl.Trainer) -> None:
        self._check_supported(trainer)
        super().setup(trainer)
        self.clipping.install()  # the precision plugin is final now
        self.topology.start(trainer)  # fault-tolerant: the first quorum; a restarted group takes its peers' state

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        kwargs = super().distributed_sampler_kwargs
        return kwargs if self._topology is None else self._topology.sampler_kwargs(kwargs)

    def _check_supported(self, trainer: pl.Trainer) -> None:
        """Reject Trainer settings this strategy cannot honour, saying why and what to use instead (subclasses
        extend it, calling ``super()`` first)."""
        check_supported(self, trainer)
        self.topology.check_trainer(trainer)

    def configure_ddp(self) -> None:
        """Instead of wrapping in ``DistributedDataParallel``: flatten, broadcast rank 0's state, restore."""
        assert self.model is not None
        self._flat = FlatState(self.model)
        self.overlap.setup(self._flat, self.model)
        if not (self._restored_state is not None and self._restored_per_rank):
            # start identical; a resume of per-rank replicas keeps each rank's own (loaded before setup)
            self.topology.start_identical(self._flat.state_tensors())
        self.outer_averaging.setup(self.outer_config, self.flat)
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

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return super().training_step(*self.training_data.batch_args(args), **kwargs)  # injection: shared samples

    def process_dataloader(self, dataloader: object) -> object:
        return self.training_data.loader(super().process_dataloader(dataloader))

    def add_dataloader_transform(self, transform: DataLoaderTransform) -> None:
        """Register a transform of the *training* dataloader Lightning prepared (SelDP swaps in its sampler)."""
        self.training_data.add_transform(transform)

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        def closure_then_sync() -> Any:
            self.overlap.arm()
            try:
                result = closure()
                self._last_loss = result
                self.replicas.average_in_replica(self.overlap.buckets)  # replica groups: exact, inside the replica
                self._after_backward(optimizer)
            except BaseException:
                self.overlap.abandon()
                raise
            self.overlap.check_finished()
            return result

        output = super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)
        self.outer_averaging.count_update()
        if self._verify_after_update is not None:
            comm, self._verify_after_update = self._verify_after_update, None
            self._verify(self.flat.state_tensors(), "parameters and buffers after the update", comm)
        self._after_update(optimizer)
        if not self.carries_sigterm and self.world_size > 1:
            self.sigterm.check()
        return output

    def _after_backward(self, optimizer: Optimizer) -> None:
        """Gradients of this step are ready (flat, bound); the optimizer has not updated yet."""

    def _after_update(self, optimizer: Optimizer) -> None:
        """The optimizer has applied this step's update."""

    def _gradient_is_local(self) -> bool:
        """Whether this step's gradient, about to be clipped, is this rank's own, not the ranks' mean (clipping.py)."""
        return True

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
        self.sigterm.route()

    def on_train_end(self) -> None:
        self.sigterm.restore()
        if getattr(self, "average_at_end", False) and self._flat is not None:
            self._average_at_end()
        super().on_train_end()

    def _average_at_end(self) -> None:
        """``average_at_end``: the final average when :attr:`outer_averaging` says one is due (DiLoCo overrides it)."""
        if self.outer_averaging.final_sync_due(self.topology.has_peers, self._in_sync):
            self.average_state(tag="final")

    # ------------------------------------------------------------------ sync helpers
    def average_state(
        self, tag: str = "params", participants: list[int] | None = None, on_mean: Callable[[], None] | None = None
    ) -> bool:
        r"""Average parameters and floating buffers over the replicas, through :attr:`topology` (flat: one all-reduce
        per flat buffer over all ranks; the strategy never branches on which topology it runs).

        With ``participants`` (a rank list, identical on every rank), only those ranks' values are averaged and
        every rank takes the result: the others contribute zeros to the same all-reduce (so the bytes are those of
        a full all-reduce) and the sum is divided by ``len(participants)``.

        With an outer optimizer (:attr:`outer_config`) the parameters' mean then goes through :attr:`outer_averaging`
        (:mod:`~lightning_sync.strategies.outer`: DiLoCo's outer step; buffers keep the plain mean). ``on_mean`` is
        called while the flat buffers hold the mean, before that step (ADPSGD measures the replicas' spread there).

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
        if self.outer_averaging.apply(self.flat, self.optimizers):
            self.codec.take_reference(tensors)  # compressed: the next changes are taken from what every rank now holds
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
            # with replica groups every rank of every replica; sharded replicas: the ranks of this shard index
            comm = comm if comm is not None else self.topology.identical_over()
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
        if self._topology is not None:
            metrics.update(self._topology.metrics())  # fault-tolerant: quorums, heals, failed syncs
        metrics.update(self.training_data.metrics())
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
        if (outer := self.outer_averaging.state_dict()) is not None:
            state["outer"] = outer
        if (compression := self.codec.state_dict()) is not None:
            state["compression"] = compression  # the error-feedback residuals and the reference
        if self._synced is not None:
            state["synced"] = self._synced_state()
        if self._topology is not None:
            state.update(self._topology.state_dict())  # fault-tolerant: torchft's step
        state.update(save_declared_state(self))  # the method's declared state_fields, last (as subclasses add theirs)
        return state

    def load_strategy_state(self, state: dict[str, Any]) -> None:
        self.comm_stats.load_state_dict(state["comm"])
        self._restored_comm = state["comm"]  # applied again when training starts (see on_train_start)
        self.step_counter.load_state_dict(state["steps"])
        load_declared_state(self, state)
        if self.injector is not None and state.get("injector") is not None:
            self.injector.load_state_dict(state["injector"])
        self.outer_averaging.load_state_dict(state.get("outer"), self.outer_config)
        self.codec.load_state_dict(state.get("compression"), self.compression)
        self._load_synced(state.get("synced"))
        if self._topology is not None:
            self._topology.load_state_dict(state)

    # ------------------------------------------------------------------ failures
    def on_exception(self, exception: BaseException) -> None:
        """Tell the other ranks why this one stops, before Lightning tears down and the process exits: their next
        operation with this rank raises :class:`~lightning_sync.comm.PeerFailure` naming it and its error."""
        self.overlap.abandon()  # never wait for buckets in flight on the way out: a peer may be gone
        if self._comm is not None and self.world_size > 1:
            report_failure(exception)
        super().on_exception(exception)

    # ------------------------------------------------------------------ teardown
    def teardown(self) -> None:
        self.overlap.remove()
        self.clipping.remove()
        if self._topology is not None:
            self._topology.close()  # kept: its metrics are read after fit
        self.replicas.teardown()
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
