"""OSP: two-stage synchronization — important layers now, the rest overlapped with the next step, with LGP
correction (Overlapped Synchronization Parallel, §3-4; decentralized form: all-reduce instead of a parameter server,
which the paper allows for co-located servers)."""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_sync.comm import CommHandle, Communicator
from lightning_sync.comm.buckets import DEFAULT_BUCKET_CAP_MB, check_bucket_cap_mb
from lightning_sync.comm.compression import FeedbackView
from lightning_sync.comm.link import parse_bandwidth
from lightning_sync.core.osp import ICSSchedule, layer_importance, select_unimportant, sgd_step, u_max
from lightning_sync.core.validation import check_real
from lightning_sync.strategies.base import SyncStrategy


class OSPStrategy(SyncStrategy):
    r"""Every step: a blocking all-reduce of the *important* layers' gradients (RS) before the update, and an
    asynchronous all-reduce of the *unimportant* ones (ICS) that stays in flight during the next step's forward and
    backward.

    * **Importance (PGP, Eq. 4)**: per parameter tensor, :math:`I^l = \sum |g \cdot w|`, from the previous step's
      *global* gradient (RS result, or ICS result once it arrived) and the parameters: all-reduced values on
      parameters that are identical on every rank, so every rank derives the same bitmap (GIB) without a message.
      With an optimizer other than ``torch.optim.SGD`` the parameters are not identical (the correction below is
      approximate there), so the importance vector (one value per layer) is averaged over ranks each step (tag
      ``"osp"``) before the bitmap is derived: without it the ranks could select different layers and their
      all-reduces would not match.
    * **ICS size**: :math:`U_{max} = b(1+lr)T_c/N` (Eq. 5) with :math:`T_c` the measured forward+backward time per
      step and :math:`b` the ``bandwidth`` given, or measured from the RS all-reduces of the last epoch (both averaged
      over ranks with one tiny all-reduce per epoch), capped at ``max_unimportant_fraction`` of the model; per epoch
      :math:`S(G^u)_1 = 0`, :math:`S(G^u)_i = (1 - loss_i/L)\,U_{max}` (Algorithm 1, with :math:`loss_i` the previous
      epoch's mean training loss). Layers are taken in ascending importance while they fit in :math:`S(G^u)`.
      ``fixed_share`` replaces the schedule by a constant fraction of the model (tests, ablations).
    * **LGP (Eq. 6-7)**: the update uses the global important gradients and the *local* unimportant ones; when the
      ICS completes — waited on at the latest before the next update — the unimportant parameters are corrected by
      replacing the local gradient's contribution with the global one. For ``torch.optim.SGD`` (momentum, dampening,
      Nesterov, weight decay) the correction is exact: the unimportant layers' parameters and momentum buffers are
      saved before the local update and the step is re-applied from them with the global gradient
      (:func:`~lightning_sync.core.osp.sgd_step`), which is BSP's update and bit-identical on every rank; for other
      optimizers it is the approximation
      :math:`w \mathrel{-}= \eta (g^g - g^l)` with the group's learning rate, and their state (e.g. Adam's moments)
      keeps the local gradient. The next step's forward and backward do run on the uncorrected unimportant
      parameters: that staleness is OSP's trade.
    * The ICS runs on its own process group, so blocking collectives issued meanwhile (Lightning's, the next RS) do
      not queue behind it. Floating buffers are averaged in the RS every step. Local shuffling per epoch (§4.2) is
      the sampler's ``set_epoch`` reshuffle (Lightning's default).
    * §4.3: ``S(G^u) = 0`` is BSP (tested); the 80% cap keeps OSP from degrading towards ASP.
    * When the RS covers the whole model (the first step, the first epoch's :math:`S_1 = 0`, or a share too small
      for any layer) it is BSP's bucketed all-reduce, overlapped with backward (``bucket_cap_mb``), provided
      ``bandwidth`` or ``fixed_share`` is given: with neither, the RS all-reduces are the bandwidth probe of Eq. 5
      and must be timed alone, after backward. A partial RS (important layers gathered from all over the flat
      buffer) is one all-reduce after backward: which layers are important is known only once the previous ICS
      has landed, which is waited for after this backward so that it overlaps it.

    Logged (``SyncStats``): ``bytes_rs``, ``bytes_ics``, ``ics_fraction`` (share of the model in the ICS this
    step), ``u_max`` (elements), ``ics_wait_s`` (time waiting on ICS) and ``overlap`` (1 − waited / ICS duration).

    * With ``compression`` both stages are compressed all-reduces (the ICS one in flight on the ICS group's driver
      thread), their gradients packed as without it; the integer formats' error-feedback residuals stay with each
      element in the positions of the whole gradient buffer whatever layers a step packs
      (:class:`~lightning_sync.comm.compression.FeedbackView`); the buffers travel exactly in an all-reduce of their
      own; Eq. 5's budget counts wire bytes.

    Unsupported (rejected at setup): gradient clipping (the correction assumes the unclipped local gradient was
    applied); parameters of several dtypes/devices.

    Args:
        bandwidth: link bandwidth for Eq. 5 (``"1gbit"``, bits/s); ``None`` measures it from the RS all-reduces.
        max_unimportant_fraction: cap of :math:`U_{max}` as a fraction of the model, in [0, 1) (paper: 0.8).
        loss_rate: the link's loss rate in Eq. 5, a fraction of packets lost in [0, 1].
        fixed_share: use this fraction of the model, in [0, 1), as :math:`S(G^u)` every step instead of
            Algorithm 1.
        bucket_cap_mb: bucket size in MiB of a whole-model RS overlapped with backward (see above), a number > 0;
            ``None``: never overlapped.

    When :math:`U_{max}` comes from measured times (``T_c``, and the bandwidth when not given) and is below the cap,
    the ICS share depends on wall-clock measurements, so runs are not bit-reproducible; with the cap binding (a fast
    link) or ``fixed_share`` they are.
    """

    strategy_name = "osp"
    strategy_name = "osp"
    fault_tolerance_refusal = (
        "it all-reduces gradients at every step (and keeps one in flight into the next), so a quorum would be needed "
        "at every step; this mode makes the periodic methods (local SGD, DiLoCo) fault-tolerant"
    )
    supports_accumulation = False
    strategy_description = "OSP: important layers all-reduced before the step, the rest overlapped with the next"
    state_fields = ("schedule", "_epoch", "_epoch_stats", "_rs_bytes_seconds")
    replicas_diverge = False  # parameters are corrected to the global update: identical on every rank
    replica_groups_refusal = (
        "its two stages split every step's gradient by layer importance over all ranks (the important layers "
        "before the update, the rest in flight during the next step, with the LGP correction on each rank's own "
        "local gradient); a two-level form of both stages is not implemented. For exact gradient averaging with "
        "replica groups use bsp."
    )
    sharded_refusal = (
        "its two stages split every step's gradient by layer importance over all ranks (the important layers' "
        "average before the update, the rest in flight during the next step, the LGP correction on each rank's own "
        "local gradient), while on sharded replicas FSDP2 reduce-scatters each layer's gradient over the replica's "
        "ranks inside backward; a sharded form of both stages is not implemented. For exact gradient averaging over "
        "sharded replicas use BSPStrategy(sharded=True)."
    )

    def __init__(
        self,
        bandwidth: str | float | None = None,
        max_unimportant_fraction: float = 0.8,
        loss_rate: float = 0.0,
        fixed_share: float | None = None,
        bucket_cap_mb: float | None = DEFAULT_BUCKET_CAP_MB,
        **kwargs: Any,
    ) -> None:
        self.bandwidth = None if bandwidth is None else parse_bandwidth(bandwidth)
        self.max_unimportant_fraction = check_real(
            "max_unimportant_fraction", max_unimportant_fraction, 0.0, 1.0, high_open=True
        )
        self.loss_rate = check_real("loss_rate", loss_rate, 0.0, 1.0)
        self.fixed_share = (
            None if fixed_share is None else check_real("fixed_share", fixed_share, 0.0, 1.0, high_open=True)
        )
        self.bucket_cap_mb = check_bucket_cap_mb(bucket_cap_mb)
        super().__init__(**kwargs)
        self.schedule: ICSSchedule | None = None
        self.importance: torch.Tensor | None = None
        self._ics_comm: Communicator | None = None
        self._pending: dict[str, Any] | None = None
        self._epoch = -1
        self._epoch_stats = [0.0, 0.0, 0.0]  # compute seconds, steps, loss sum
        self._rs_bytes_seconds = [0.0, 0.0]
        self._loss_sum: torch.Tensor | None = None
        self._step_start = 0.0
        self.ics_fraction = 0.0
        self.last_unimportant: list[int] = []
        self.ics_in_flight_at_next_step: bool | None = None
        self._ics_durations = [0.0, 0.0]  # total ICS duration, total waited

    # ------------------------------------------------------------------ setup
    def setup_environment(self) -> None:
        super().setup_environment()
        self._ics_comm = self.comm.split()

    def _check_supported(self, trainer: Any) -> None:
        super()._check_supported(trainer)
        if trainer.gradient_clip_val:
            raise ValueError(
                "OSPStrategy does not support gradient clipping: its LGP correction replaces the local gradient that "
                "was applied by the global one, which clipping would have changed. Remove gradient_clip_val."
            )

    def _on_flat_ready(self) -> None:
        if len(self.flat.groups) != 1:
            raise ValueError(
                "OSPStrategy needs all parameters and buffers in one dtype on one device (it ranks layers across "
                "one flat buffer); convert the model to a single dtype."
            )
        g = self.flat.groups[0]
        self._sizes = [v.numel() for v in g.param_views]
        self._offsets = [0]
        for n in self._sizes[:-1]:
            self._offsets.append(self._offsets[-1] + n)
        self._product = torch.empty_like(g.grad_region)  # scratch for the importance pass
        self._rs_buf = torch.empty_like(g.grads)
        cap = max(1, int(self.max_unimportant_fraction * g.param_numel))
        self._ics_buf = torch.empty(cap, dtype=g.grads.dtype, device=g.grads.device)
        self._ics_local = torch.empty_like(self._ics_buf)
        self._saved_params = torch.empty_like(self._ics_buf)  # unimportant parameters before the local update
        self._saved_momentum = torch.empty_like(self._ics_buf)  # and their momentum buffers (SGD)
        if self.compressor is not None and self.compressor.fmt.feedback:
            # packed residuals (the integer formats) of each stage: the packed size, and N padded chunks of it
            pad = self.world_size * self.compressor.fmt.block
            self._res_packed = {
                stage: (torch.empty(size, dtype=g.grads.dtype), torch.zeros(size + pad, dtype=g.grads.dtype))
                for stage, size in (("rs", g.param_numel), ("ics", cap))
            }
        if self.schedule is None:
            self.schedule = self._new_schedule()

    # ------------------------------------------------------------------ per step
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._step_start = time.perf_counter()
        if self._pending is not None:
            self.ics_in_flight_at_next_step = not self._pending["handle"].is_completed()
        return super().training_step(*args, **kwargs)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        epoch = self.lightning_module.trainer.current_epoch
        if epoch != self._epoch:
            self._start_epoch(epoch)

    def _start_epoch(self, epoch: int) -> None:
        """Algorithm 1 at an epoch boundary, from values averaged over ranks (one 3-float all-reduce)."""
        assert self.schedule is not None
        self._fold_loss()
        compute, steps, loss_sum = self._epoch_stats
        rs_bytes, rs_seconds = self._rs_bytes_seconds
        measured_bw = rs_bytes / rs_seconds if rs_seconds > 0 else 0.0
        local = torch.tensor(
            [compute / steps if steps else 0.0, loss_sum / steps if steps else math.nan, measured_bw],
            dtype=torch.float64,
            device=self._comm_device(),
        )
        self.comm.all_reduce(local, op="avg", tag="osp")
        t_c, loss, bw = (float(x) for x in local.tolist())
        bandwidth = self.bandwidth / 8.0 if self.bandwidth is not None else bw
        g = self.flat.groups[0]
        # Eq. 5 bounds bytes; an element of the ICS costs its wire size
        element = self.compressor.fmt.bytes_per_element if self.compressor is not None else g.grads.element_size()
        limit = u_max(bandwidth, t_c, self.world_size, self.loss_rate) / element
        self.schedule.start_epoch(epoch, loss if steps else None, limit)
        self._epoch = epoch
        self._epoch_stats = [0.0, 0.0, 0.0]
        self._rs_bytes_seconds = [0.0, 0.0]

    def _fold_loss(self) -> None:
        if self._loss_sum is not None:
            self._epoch_stats[2] += float(self._loss_sum)
            self._loss_sum = None

    def _budget(self) -> float:
        assert self.schedule is not None
        if self.fixed_share is not None:
            return self.fixed_share * self.flat.groups[0].param_numel
        return self.schedule.share

    def _overlap_grads(self) -> tuple[Communicator, str] | None:
        """A whole-model RS, known before backward: no importance yet, or a budget no layer fits in (then
        :func:`~lightning_sync.core.osp.select_unimportant` selects nothing whatever the importance). Not while the
        RS times are Eq. 5's bandwidth measurement (``bandwidth`` and ``fixed_share`` both ``None``)."""
        if self.bandwidth is None and self.fixed_share is None:
            return None
        if self.importance is None or not self._sizes or self._budget() < min(self._sizes):
            return self.comm, "rs"
        return None

    def _after_backward(self, optimizer: Optimizer) -> None:
        self._epoch_stats[0] += time.perf_counter() - self._step_start
        self._epoch_stats[1] += 1
        if isinstance(self._last_loss, torch.Tensor):  # summed on device; read once per epoch, not every step
            loss = self._last_loss.detach()
            self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
        self._drain()
        g = self.flat.groups[0]
        if self.importance is not None and not isinstance(optimizer, torch.optim.SGD):
            # other optimizers' LGP correction is approximate, so the parameters (and |g w|) differ between ranks:
            # agree on one importance vector, or the ranks pick different layers and the collectives mismatch
            self.comm.all_reduce(self.importance, op="avg", tag="osp")
        unimportant = (
            select_unimportant(self.importance, self._sizes, self._budget()) if self.importance is not None else []
        )
        important = sorted(set(range(len(self._sizes))) - set(unimportant))
        self.last_unimportant = unimportant
        # RS: important gradients and the buffers, one blocking all-reduce
        start, sent_before = time.perf_counter(), self.comm_stats.bytes_sent["rs"]
        if self.compressor is not None:
            self._rs_compressed(important)
        elif not unimportant:
            self.average_grads(tag="rs")
        else:
            n = 0
            for i in important:
                self._rs_buf[n : n + self._sizes[i]].copy_(g.grad_views[i].reshape(-1))
                n += self._sizes[i]
            self._rs_buf[n : n + g.buffer_numel].copy_(g.buffers)
            self.comm.all_reduce(self._rs_buf[: n + g.buffer_numel], op="avg", tag="rs")
            if self.verify_sync:
                self._verify([self._rs_buf[: n + g.buffer_numel]], "important gradients and buffers after the RS")
            n = 0
            for i in important:
                g.grad_views[i].reshape(-1).copy_(self._rs_buf[n : n + self._sizes[i]])
                n += self._sizes[i]
            g.buffers.copy_(self._rs_buf[n : n + g.buffer_numel])
        self._rs_bytes_seconds[0] += self.comm_stats.bytes_sent["rs"] - sent_before
        self._rs_bytes_seconds[1] += time.perf_counter() - start
        # importance of the important layers from the global gradient and the (identical) parameters
        full = layer_importance(g.grad_region, g.state[: g.param_numel], self._sizes, self._product)
        if self.importance is None or not unimportant:
            self.importance = full
        else:
            for i in important:
                self.importance[i] = full[i]
        # ICS: the unimportant gradients, asynchronous, on the second group
        self.ics_fraction = sum(self._sizes[i] for i in unimportant) / g.param_numel
        if unimportant:
            self._launch_ics(optimizer, unimportant)
        self.step_counter.record(True)

    # ------------------------------------------------------------------ compression
    def _pack(self, flat: torch.Tensor, layers: list[int], out: torch.Tensor) -> int:
        """Copy ``layers``' slices of a buffer in gradient positions into ``out``, in order; return the count."""
        n = 0
        for i in layers:
            out[n : n + self._sizes[i]].copy_(flat[self._offsets[i] : self._offsets[i] + self._sizes[i]])
            n += self._sizes[i]
        return n

    def _unpack(self, packed: torch.Tensor, layers: list[int], flat: torch.Tensor) -> None:
        n = 0
        for i in layers:
            flat[self._offsets[i] : self._offsets[i] + self._sizes[i]].copy_(packed[n : n + self._sizes[i]])
            n += self._sizes[i]

    def _residual_streams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The integer formats' residuals in the positions of the gradient buffer: this rank's own (worker) and
        those of the chunks it reduced (server); two streams of the compressor, so both are checkpointed."""
        assert self.compressor is not None
        g = self.flat.groups[0]
        streams = []
        for key in ("grads/0", "grads/0:server"):
            fb = self.compressor.feedback(key, g.param_numel, g.grads.dtype, g.grads.device)
            assert fb is not None
            streams.append(fb.worker)
        return streams[0], streams[1]

    def _packed_feedback(self, stage: str, layers: list[int], n: int) -> FeedbackView | None:
        """The residuals of ``layers``, packed as their gradients are (integer formats; ``None`` for the casts)."""
        assert self.compressor is not None
        if not self.compressor.fmt.feedback:
            return None
        worker, server = self._residual_streams()
        packed_worker, packed_server = self._res_packed[stage]
        self._pack(worker, layers, packed_worker)
        self._pack(server, layers, packed_server)
        total = self.world_size * self.compressor.fmt.chunk_numel(n, self.world_size)
        packed_server[n:total].zero_()
        return FeedbackView(packed_worker[:n], packed_server[:total])

    def _unpack_feedback(self, layers: list[int], feedback: FeedbackView | None, n: int) -> None:
        if feedback is None:
            return
        worker, server = self._residual_streams()
        self._unpack(feedback.worker, layers, worker)
        self._unpack(feedback.server[:n], layers, server)

    def _rs_compressed(self, important: list[int]) -> None:
        """The RS with compression: the important layers' gradients packed into one compressed all-reduce, the
        buffers in an exact one."""
        assert self.compressor is not None
        g = self.flat.groups[0]
        n = self._pack(g.grad_region, important, self._rs_buf)
        feedback = self._packed_feedback("rs", important, n)
        self.comm.all_reduce_compressed(self._rs_buf[:n], self.compressor, op="avg", tag="rs", feedback=feedback)
        self._unpack_feedback(important, feedback, n)
        if g.buffer_numel:
            self.comm.all_reduce(g.buffers, op="avg", tag="rs")
        if self.verify_sync:
            self._verify([self._rs_buf[:n], g.buffers], "important gradients and buffers after the RS")
        self._unpack(self._rs_buf, important, g.grad_region)

    def _launch_ics(self, optimizer: Optimizer, layers: list[int]) -> None:
        g = self.flat.groups[0]
        n = 0
        for i in layers:
            self._ics_local[n : n + self._sizes[i]].copy_(g.grad_views[i].reshape(-1))
            n += self._sizes[i]
        self._ics_buf[:n].copy_(self._ics_local[:n])
        assert self._ics_comm is not None
        launched = time.perf_counter()
        feedback = None
        if self.compressor is not None:
            feedback = self._packed_feedback("ics", layers, n)
            handle = self._ics_comm.all_reduce_compressed(
                self._ics_buf[:n], self.compressor, op="avg", tag="ics", async_op=True, feedback=feedback
            )
        else:
            handle = self._ics_comm.all_reduce(self._ics_buf[:n], op="avg", tag="ics", async_op=True)
        groups = {id(p): group for group in optimizer.param_groups for p in group["params"]}
        sgd = isinstance(optimizer, torch.optim.SGD)
        hyper, n = [], 0
        for i in layers:
            p, size = g.params[i], self._sizes[i]
            group = groups.get(id(p))
            self._saved_params[n : n + size].copy_(g.param_views[i].reshape(-1))
            buf = optimizer.state.get(p, {}).get("momentum_buffer") if group is not None else None
            if buf is not None:
                self._saved_momentum[n : n + size].copy_(buf.reshape(-1))
            hyper.append(
                None
                if group is None
                else {
                    "lr": float(group["lr"]),
                    "momentum": float(group.get("momentum", 0.0)) if sgd else 0.0,
                    "dampening": float(group.get("dampening", 0.0)) if sgd else 0.0,
                    "nesterov": bool(group.get("nesterov", False)) if sgd else False,
                    "weight_decay": float(group.get("weight_decay", 0.0)) if sgd else 0.0,
                    "had_buffer": buf is not None,
                }
            )
            n += size
        self._pending = {
            "handle": handle,
            "feedback": (feedback, n),
            "layers": layers,
            "hyper": hyper,
            "optimizer": optimizer,
            "launched": launched,
        }

    def _drain(self) -> None:
        """Wait for the ICS in flight (if any) and apply the LGP correction, Eq. 7."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        handle: CommHandle = pending["handle"]
        waited_from = time.perf_counter()
        handle.wait()
        self._unpack_feedback(pending["layers"], *pending["feedback"])
        done = handle.completed_at or time.perf_counter()
        self._ics_durations[0] += done - pending["launched"]
        self._ics_durations[1] += done - waited_from
        g = self.flat.groups[0]
        optimizer: Optimizer = pending["optimizer"]
        sgd = isinstance(optimizer, torch.optim.SGD)
        n = 0
        with torch.no_grad():
            for i, hyper in zip(pending["layers"], pending["hyper"]):
                size = self._sizes[i]
                view = g.param_views[i].reshape(-1)
                global_grad = self._ics_buf[n : n + size]
                if hyper is not None and sgd:
                    # redo the step from the saved state with the global gradient (exact, identical on all ranks)
                    state = optimizer.state.setdefault(g.params[i], {})
                    buf = state.get("momentum_buffer")
                    if buf is not None and hyper["had_buffer"]:
                        buf.reshape(-1).copy_(self._saved_momentum[n : n + size])
                    view.copy_(self._saved_params[n : n + size])
                    new_buf = sgd_step(
                        view,
                        global_grad,
                        buf.reshape(-1) if buf is not None and hyper["had_buffer"] else None,
                        hyper["lr"],
                        hyper["momentum"],
                        hyper["dampening"],
                        hyper["nesterov"],
                        hyper["weight_decay"],
                    )
                    if buf is not None and not hyper["had_buffer"] and new_buf is not None:
                        buf.reshape(-1).copy_(new_buf)  # the buffer's first step: it is the global gradient
                elif hyper is not None:
                    # other optimizers: the SGD-form approximation w -= lr * (g_global - g_local)
                    view.sub_(hyper["lr"] * (global_grad - self._ics_local[n : n + size]))
                # importance of this layer from its global gradient and the corrected parameters
                self.importance[i] = float((global_grad * view).abs().sum())  # type: ignore[index]
                n += size
        if self.verify_sync and sgd:
            # parameters only: the buffers were averaged by the RS, and this step's forward has since updated
            # them (BatchNorm running statistics) from each rank's own batch; the next RS averages them again
            self._verify([g.state[: g.param_numel]], "parameters after the LGP correction")

    # ------------------------------------------------------------------ drain points
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._drain()  # a checkpoint holds corrected parameters, with no gradient in flight
        return super().lightning_module_state_dict()

    def on_validation_start(self) -> None:
        self._drain()
        super().on_validation_start()

    def on_train_end(self) -> None:
        self._drain()
        super().on_train_end()

    def on_exception(self, exception: BaseException) -> None:
        self._pending = None  # never wait for the ICS in flight on the way out: a peer may be gone
        super().on_exception(exception)

    def teardown(self) -> None:
        if self._pending is not None and self._comm is not None:
            self._drain()
        if self._ics_comm is not None:
            self._ics_comm.destroy()
            self._ics_comm = None
        super().teardown()

    # ------------------------------------------------------------------ metrics and state
    def sync_metrics(self) -> dict[str, float]:
        metrics = super().sync_metrics()
        total, waited = self._ics_durations
        metrics["ics_fraction"] = self.ics_fraction
        metrics["u_max"] = float(self.schedule.u_max) if self.schedule is not None else 0.0
        metrics["ics_wait_s"] = waited
        metrics["overlap"] = 1.0 - waited / total if total > 0 else 0.0
        return metrics

    def _new_schedule(self) -> ICSSchedule:
        return ICSSchedule(self.flat.groups[0].param_numel, self.max_unimportant_fraction)

    def strategy_state(self) -> dict[str, Any]:
        # real work: the ICS in flight is drained and the epoch's loss folded in first; the importance tensor is
        # saved on the CPU and restored onto the gradients' device in float64 (the rest: state_fields)
        self._drain()
        self._fold_loss()
        state = super().strategy_state()
        state["importance"] = None if self.importance is None else self.importance.cpu()
        return state

    def load_strategy_state(self, state: dict[str, Any]) -> None:
        super().load_strategy_state(state)
        if state.get("importance") is not None:
            self.importance = state["importance"].to(device=self.flat.groups[0].grads.device, dtype=torch.float64)
