"""The compressed paths of :meth:`~lightning_sync.strategies.SyncStrategy.average_state` and
:meth:`~lightning_sync.strategies.SyncStrategy.average_grads` (``compression="bf16" | "fp16" | "int8"``).

Parameter averaging sends each rank's change since the last average (the *reference*, identical on every rank), so
a cast or int8 rounds the update, not the parameters; gradient averaging sends the gradients, and the floating
buffers (BatchNorm statistics) stay exact beside them. int8 keeps one error-feedback stream per flat buffer
(``state/<i>``, ``grads/<i>``) in the :class:`~lightning_sync.comm.compression.Compressor`. The wire format and the
fp32 sums are :mod:`lightning_sync.comm.compression`'s; this module is the strategy's side: the reference, and the
residuals and reference in every rank's checkpoint part.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_sync.comm import Communicator
from lightning_sync.comm.compression import Compressor
from lightning_sync.strategies.checks import check_compressible_state


class CompressedAveraging:
    """Mixin of :class:`~lightning_sync.strategies.SyncStrategy`. The strategy's ``__init__`` sets ``compression``,
    ``compressor`` and ``_reference``; ``average_state`` / ``average_grads`` call the ``_compressed`` paths when
    ``compressor`` is set, ``strategy_state`` / ``load_strategy_state`` call :meth:`_compression_state` /
    :meth:`_load_compression_state`."""

    compression: str | None
    compressor: Compressor | None
    #: compressed parameter averaging: the last average (identical on every rank), what the next one is taken
    #: relative to (average = reference + the compressed average of each rank's change since)
    _reference: list[Tensor] | None

    def _averages_state(self) -> bool:
        """Whether this method averages parameters (:meth:`average_state`): with compression it then keeps the
        reference copy of the last average. Methods whose replicas never diverge (gradient averaging) do not."""
        return self.replicas_diverge

    def _setup_compression(self) -> None:
        """At setup, with the replicas identical: refuse tensors the compression cannot apply to, and take the
        reference of compressed parameter averaging (a resume overwrites it with the checkpoint's)."""
        if self.compression is None:
            return
        check_compressible_state(self.compression, self.flat, type(self).__name__)
        if self._averages_state() and self.world_size > 1:
            self._reference = [t.detach().clone() for t in self.flat.state_tensors()]

    def _average_state_compressed(
        self,
        tensors: list[Tensor],
        tag: str,
        participants: list[int] | None,
        comm: Communicator | None = None,
        member: int | None = None,
    ) -> None:
        """Compressed :meth:`average_state`: every rank sends its change since the last average,
        ``x_i − ref`` (so a cast or int8 rounds the update, not the parameters), the compressed all-reduce averages
        the changes in fp32 and every rank takes ``ref + mean``, which becomes the new reference. The mean of the
        replicas is ``ref + mean(x_i − ref)`` exactly for any reference the ranks share; the result is bit-identical
        on every rank. int8 keeps one error-feedback stream per flat buffer (``state/<i>``). ``comm`` (default: all
        ranks) and ``member`` (this rank's index in ``participants``' numbering, default its global rank): the
        replica groups' leaders."""
        assert self.compressor is not None
        if participants is not None and not participants:
            raise ValueError("participants must name at least one rank")
        if self._reference is None:
            raise RuntimeError(
                f"{type(self).__name__} averaged parameters with compression but took no reference at setup: "
                "override _averages_state() to return True"
            )
        comm = comm if comm is not None else self.comm
        member = member if member is not None else self.global_rank
        subset = participants is not None and len(participants) != comm.world_size
        contribute = not subset or member in (participants or [])
        for i, (t, ref) in enumerate(zip(tensors, self._reference)):
            t.sub_(ref)
            feedback = self.compressor.feedback(f"state/{i}", t.numel(), t.dtype, t.device)
            comm.all_reduce_compressed(
                t,
                self.compressor,
                op="sum" if subset else "avg",
                tag=tag,
                feedback=feedback,
                divisor=float(len(participants)) if subset and participants else None,
                contribute=contribute,
            )
            t.add_(ref)
            ref.copy_(t)

    def _take_reference(self, tensors: list[Tensor]) -> None:
        """With compressed parameter averaging, make ``tensors`` (what every rank holds after a sync, e.g. the new
        global model of an outer step) the reference the next sync's changes are taken from."""
        if self._reference is not None:
            for ref, t in zip(self._reference, tensors):
                ref.copy_(t)

    def _average_grads_compressed(self, comm: Communicator, tag: str) -> list[Tensor]:
        """Compressed :meth:`average_grads`: each flat gradient buffer through a compressed all-reduce (int8 with the
        error-feedback stream ``grads/<i>``); the floating buffers (BatchNorm statistics: state, not increments, and
        small) in one exact all-reduce of their own. Returns what the sync made identical."""
        assert self.compressor is not None
        flat = self.flat
        grads = flat.grad_tensors(with_buffers=False)
        for i, t in enumerate(grads):
            feedback = self.compressor.feedback(f"grads/{i}", t.numel(), t.dtype, t.device)
            comm.all_reduce_compressed(t, self.compressor, op="avg", tag=tag, feedback=feedback)
        buffers = [g.buffers for g in flat.groups if g.buffer_numel]
        if buffers:
            comm.all_reduce_many(buffers, op="avg", tag=tag)
        return grads + buffers

    def _compression_state(self) -> dict[str, Any] | None:
        """This rank's part of :meth:`strategy_state` under ``"compression"`` (``None`` without compression): the
        error-feedback residuals and the reference."""
        if self.compressor is None:
            return None
        return {
            "residuals": self.compressor.state_dict(),
            "reference": None if self._reference is None else [r.detach().cpu().clone() for r in self._reference],
        }

    def _load_compression_state(self, saved: dict[str, Any] | None) -> None:
        if (saved is None) != (self.compressor is None):
            raise ValueError(
                f"the checkpoint was written with compression {'off' if saved is None else 'on'}; this run has "
                f"compression={self.compression!r}. Resume with the compression the checkpoint was written with."
            )
        if saved is None or self.compressor is None:
            return
        self.compressor.load_state_dict(saved["residuals"])
        if saved.get("reference") is not None and self._reference is not None:
            for ref, value in zip(self._reference, saved["reference"]):
                ref.copy_(value)
