"""How an average's values travel: exact, or compressed (``compression="bf16" | "fp16" | "int8" | "int4" | "int2" |
"topk:<fraction>"``);
a component any :class:`~lightning_sync.strategies.topology.Topology` applies over the communicator it chooses.

* :class:`ExactCodec` — the values in their own dtype: one all-reduce per tensor (FedAvg's participants: the others
  contribute zeros, the sum is divided by the participants).
* :class:`CompressedCodec` — parameter averaging sends each rank's change since the last average (the *reference*,
  identical on every rank), so a cast or an integer format rounds the update, not the parameters; gradient averaging
  sends the gradients. Either way the floating buffers (BatchNorm's running statistics: state, not increments, and
  small) stay exact beside them — a ternary code of a running variance's change could take it below zero. The
  integer formats (int8, int4, int2) keep one error-feedback stream per flat buffer (``state/<i>``, ``grads/<i>``)
  in the :class:`~lightning_sync.comm.compression.Compressor`. The wire format and the fp32 sums are
  :mod:`lightning_sync.comm.compression`'s; the codec holds the strategy's side: the reference, and the residuals and
  reference in every rank's checkpoint part.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_sync.comm import Communicator, FlatState
from lightning_sync.comm.compression import Compressor
from lightning_sync.strategies.checks import check_compressible_state

__all__ = ["CompressedCodec", "ExactCodec", "codec_for"]


class ExactCodec:
    """The values in their own dtype."""

    compressor: Compressor | None = None

    def average_state(
        self,
        comm: Communicator,
        tensors: list[Tensor],
        tag: str,
        participants: list[int] | None = None,
        member: int = 0,
        what: str = "rank",
    ) -> None:
        """The mean over ``comm``'s members of ``participants``' values (``member``: this one's index in their
        numbering): the others contribute zeros to the same all-reduce, and the sum is divided by the participants."""
        if participants is None or len(participants) == comm.world_size:
            comm.all_reduce_many(tensors, op="avg", tag=tag)
            return
        if not participants:
            raise ValueError(f"participants must name at least one {what}")
        if member not in participants:
            for t in tensors:
                t.zero_()
        comm.all_reduce_many(tensors, op="sum", tag=tag)
        for t in tensors:
            t.div_(len(participants))

    def average_grads(self, comm: Communicator, flat: FlatState, tag: str) -> list[Tensor]:
        """The flat gradients and floating buffers (staged beside them), one all-reduce per buffer."""
        flat.stage_buffers()
        tensors = flat.grad_tensors()
        comm.all_reduce_many(tensors, op="avg", tag=tag)
        flat.unstage_buffers()
        return tensors

    def setup(self, flat: FlatState, averages_state: bool, world_size: int, owner: str) -> None:
        """At setup, with the replicas identical."""

    def take_reference(self, tensors: list[Tensor]) -> None:
        """What every rank holds after a sync (nothing to keep without compression)."""

    def state_dict(self) -> dict[str, Any] | None:
        return None

    def load_state_dict(self, saved: dict[str, Any] | None, compression: str | None) -> None:
        if saved is not None:
            raise ValueError(
                "the checkpoint was written with compression on; this run has compression=None. Resume with the "
                "compression the checkpoint was written with."
            )


class CompressedCodec(ExactCodec):
    """Compressed averages with the reference of parameter averaging (see the module docstring)."""

    def __init__(self, compressor: Compressor) -> None:
        self.compressor = compressor
        #: parameter averaging: the last average (identical on every rank), what the next one is taken relative to
        #: (average = reference + the compressed average of each rank's change since)
        self.reference: list[Tensor] | None = None
        #: per state tensor (``FlatState.state_tensors()``'s order): how many leading elements are parameters; the
        #: rest are floating buffers, averaged exactly
        self._param_numel: list[int] = []
        self._owner = "the strategy"

    def setup(self, flat: FlatState, averages_state: bool, world_size: int, owner: str) -> None:
        """Refuse tensors the compression cannot apply to, and take the reference of compressed parameter averaging
        (a resume overwrites it with the checkpoint's)."""
        self._owner = owner
        if self.compressor.fmt.sparse and not averages_state:
            raise ValueError(
                f"compression={self.compressor.name!r} (sparse) applies to the changes a parameter average sends "
                f"(local SGD, DiLoCo, FedAvg, ADPSGD, SelSync with aggregation='parameters'); {owner} sends "
                "gradients — a sparse gradient moves a few coordinates a step while momentum and weight decay move "
                "all of them, which needs Deep Gradient Compression's momentum correction, not implemented here — or "
                "the parameter server's parameters, which a sparse pull would zero outside its top entries. Use "
                "'int8', 'int4', 'int2' or a cast with it."
            )
        check_compressible_state(self.compressor.name, flat, owner)
        if averages_state and world_size > 1:
            self.reference = [t.detach().clone() for t in flat.state_tensors()]
            self._param_numel = [g.param_numel for g in flat.groups if g.state.numel()]

    def average_state(
        self,
        comm: Communicator,
        tensors: list[Tensor],
        tag: str,
        participants: list[int] | None = None,
        member: int = 0,
        what: str = "rank",
    ) -> None:
        """Every rank sends its change since the last average, ``x_i − ref``, the compressed all-reduce averages the
        changes in fp32 and every rank takes ``ref + mean``, which becomes the new reference. The mean of the
        replicas is ``ref + mean(x_i − ref)`` exactly for any reference the ranks share; the result is bit-identical
        on every rank. The integer formats keep one error-feedback stream per flat buffer's parameters
        (``state/<i>``). The floating buffers (each state tensor's tail) are averaged exactly, after the parameters:
        they are running statistics, which a rounded change could take out of their range."""
        if participants is not None and not participants:
            raise ValueError(f"participants must name at least one {what}")
        if self.reference is None:
            raise RuntimeError(
                f"{self._owner} averaged parameters with compression but took no reference at setup: override "
                "_averages_state() to return True"
            )
        if len(tensors) != len(self._param_numel) or any(
            t.numel() != ref.numel() for t, ref in zip(tensors, self.reference)
        ):
            raise RuntimeError(
                f"{self._owner}: a compressed parameter average takes the flat state tensors it was set up with "
                f"({[r.numel() for r in self.reference]} elements), got {[t.numel() for t in tensors]}"
            )
        subset = participants is not None and len(participants) != comm.world_size
        contribute = not subset or member in (participants or [])
        buffers: list[Tensor] = []
        for i, (t, ref, n) in enumerate(zip(tensors, self.reference, self._param_numel)):
            if n < t.numel():
                buffers.append(t[n:])
            if not n:
                continue
            x, x_ref = t[:n], ref[:n]
            x.sub_(x_ref)
            feedback = self.compressor.feedback(f"state/{i}", n, t.dtype, t.device)
            comm.all_reduce_compressed(
                x,
                self.compressor,
                op="sum" if subset else "avg",
                tag=tag,
                feedback=feedback,
                divisor=float(len(participants)) if subset and participants else None,
                contribute=contribute,
            )
            x.add_(x_ref)
        if buffers:
            super().average_state(comm, buffers, tag, participants, member, what)
        for t, ref in zip(tensors, self.reference):
            ref.copy_(t)

    def take_reference(self, tensors: list[Tensor]) -> None:
        """Make ``tensors`` (what every rank holds after a sync, e.g. the new global model of an outer step) the
        reference the next sync's changes are taken from."""
        if self.reference is not None:
            for ref, t in zip(self.reference, tensors):
                ref.copy_(t)

    def average_grads(self, comm: Communicator, flat: FlatState, tag: str) -> list[Tensor]:
        """Each flat gradient buffer through a compressed all-reduce (the integer formats with the error-feedback stream
        ``grads/<i>``); the floating buffers (BatchNorm statistics: state, not increments, and small) in one exact
        all-reduce of their own. Returns what the sync made identical."""
        grads = flat.grad_tensors(with_buffers=False)
        for i, t in enumerate(grads):
            feedback = self.compressor.feedback(f"grads/{i}", t.numel(), t.dtype, t.device)
            comm.all_reduce_compressed(t, self.compressor, op="avg", tag=tag, feedback=feedback)
        buffers = [g.buffers for g in flat.groups if g.buffer_numel]
        if buffers:
            comm.all_reduce_many(buffers, op="avg", tag=tag)
        return grads + buffers

    def state_dict(self) -> dict[str, Any] | None:
        """This rank's error-feedback residuals and reference (its checkpoint part's ``"compression"``)."""
        return {
            "residuals": self.compressor.state_dict(),
            "reference": None if self.reference is None else [r.detach().cpu().clone() for r in self.reference],
        }

    def load_state_dict(self, saved: dict[str, Any] | None, compression: str | None) -> None:
        if saved is None:
            raise ValueError(
                f"the checkpoint was written with compression off; this run has compression={compression!r}. Resume "
                "with the compression the checkpoint was written with."
            )
        self.compressor.load_state_dict(saved["residuals"])
        if saved.get("reference") is not None and self.reference is not None:
            for ref, value in zip(self.reference, saved["reference"]):
                ref.copy_(value)


def codec_for(compressor: Compressor | None) -> ExactCodec:
    """The codec of a strategy's ``compression`` (its :class:`Compressor`, or ``None``)."""
    return ExactCodec() if compressor is None else CompressedCodec(compressor)
