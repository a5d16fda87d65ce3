"""Compressed synchronization: what goes on the wire, and the per-rank math of a compressed all-reduce.

``compression=None | "bf16" | "fp16" | "int8"`` (an argument of every strategy) sends floating-point data in a
narrower wire format. This module holds the formats, the quantisation kernels, the persistent buffers and the
error-feedback state; :meth:`~lightning_sync.comm.Communicator.all_reduce_compressed` moves the bytes (it is the
only code that calls ``torch.distributed``) and the parameter server (:mod:`lightning_sync.comm.ps`) uses
:func:`encode` / :func:`decode` for its messages. Nothing here imports ``torch.distributed``.

**Wire formats.**

* ``"bf16"``, ``"fp16"``: a cast to ``torch.bfloat16`` / ``torch.float16`` (round to nearest even), 2 bytes per
  element. fp16 has 11 significant bits but a range of ±65504: a value beyond it raises (``ValueError``, use bf16),
  it is never silently sent as infinity.
* ``"int8"``: symmetric per-chunk quantisation: every :data:`INT8_BLOCK` (256) consecutive elements share one fp32
  scale ``s = max|x| / 127`` and travel as ``round(x / s)`` in [-127, 127]; 1 byte per element plus 4 bytes per
  256 elements. With **error feedback** (DeepSpeed's 1-bit Adam, "worker error"): a rank adds to each value it
  sends the residual the quantisation dropped from its previous value, ``v = x + r``, ``r ← v − Q(v)``, so nothing
  is lost for good: summed over steps, what was sent differs from what should have been by the last residual only
  (at most half a quantisation step per element).

**The all-reduce** (every backend, every format): a low-precision SUM is never requested from the backend, because
gloo (torch 2.14: ``bf16`` and ``fp16`` all-reduce are supported) adds in the wire type at every ring step — with 4
ranks its mean error was 1.64x that of the exact sum rounded once (``python benchmarks/compression.py --part sum``)
— and NCCL's ring also reduces in the buffer's type at each hop (its design; not measured here, no GPU); int8 cannot
be summed on the wire at all. Instead, as torchft's quantized all-reduce does:

1. each rank encodes its tensor (plus its residual, int8) as ``N`` equal chunks and an **all-to-all** sends chunk
   ``j`` to rank ``j`` (a reduce-scatter in the wire format);
2. rank ``j`` decodes the ``N`` copies of its chunk and sums them in fp32 (fp64 for float64 tensors) in rank
   order, divides (the average), adds its own second-stage residual (int8: the "server error" of 1-bit Adam, the
   part of its reduced chunk that its last encoding dropped) and encodes the result;
3. an **all-gather** of the encoded chunks; every rank decodes all of them — its own included — so the result is
   **bit-identical on every rank**.

Bytes per rank (:func:`~lightning_sync.comm.cost.compressed_allreduce_bytes`): ``2 (N − 1)`` chunk records of
``c`` elements in the wire size (+ the int8 scales), ``c = ⌈numel / N⌉`` (int8: rounded up to a multiple of 256),
padding included because it is sent. On one rank nothing is sent and nothing is compressed.

**Persistent buffers.** A :class:`Compressor` keeps one workspace per (size, dtype, device, world size) — the
send and receive records, the fp32 accumulator and scratch of one chunk — allocated at first use and reused by every
later all-reduce of that size; an asynchronous all-reduce in flight holds its workspace, so concurrent ones get
their own (the pool grows to the number in flight, then stays). Idle workspaces of the least recently used sizes
beyond :attr:`Compressor.MAX_SHAPES` are dropped (OSP's stages change size when its layer selection does). Only a
size not seen recently allocates.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_sync.comm.cost import compressed_chunk_numel, compressed_record_bytes

#: the accepted values of ``compression`` besides ``None``
COMPRESSIONS = ("bf16", "fp16", "int8")
#: int8: elements that share one scale
INT8_BLOCK = 256
#: int8: bytes of one scale (float32)
SCALE_BYTES = 4
#: the largest int8 code (symmetric: -127..127, so 0 is exact and the range is symmetric)
INT8_MAX = 127
#: largest finite float16
FP16_MAX = 65504.0

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_compression(value: Any) -> str | None:
    """``None`` or one of :data:`COMPRESSIONS` (exactly, case-sensitive)."""
    if value is None or (isinstance(value, str) and value in COMPRESSIONS):
        return value
    raise ValueError(f"compression must be None, 'bf16', 'fp16' or 'int8', got {value!r}")


@dataclass(frozen=True)
class WireFormat:
    """How one element travels: ``dtype`` on the wire, and for int8 one fp32 scale per ``block`` elements."""

    name: str
    dtype: torch.dtype
    block: int  #: elements per scale (1 and no scales for the casts)
    scale_bytes: int

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def quantized(self) -> bool:
        return self.scale_bytes > 0

    @property
    def bytes_per_element(self) -> float:
        """Average wire bytes per element, scales included (2.0 for the casts, 1 + 4/256 for int8)."""
        return self.element_size + (self.scale_bytes / self.block if self.quantized else 0.0)

    def chunk_numel(self, numel: int, world_size: int) -> int:
        """Elements of one rank's chunk in the all-reduce (padded; see :func:`~lightning_sync.comm.cost`)."""
        return compressed_chunk_numel(numel, world_size, self.block)

    def record_bytes(self, numel: int) -> int:
        """Bytes of ``numel`` elements encoded: data plus scales (one per started block)."""
        return compressed_record_bytes(numel, self.element_size, self.block, self.scale_bytes)

    def scales(self, numel: int) -> int:
        return math.ceil(numel / self.block) if self.quantized else 0


FORMATS = {
    "bf16": WireFormat("bf16", torch.bfloat16, 1, 0),
    "fp16": WireFormat("fp16", torch.float16, 1, 0),
    "int8": WireFormat("int8", torch.int8, INT8_BLOCK, SCALE_BYTES),
}


def wire_format(compression: str) -> WireFormat:
    return FORMATS[check_compression(compression) or ""]


def check_compressible(compression: str, dtype: torch.dtype, what: str) -> None:
    """Raise ``ValueError`` (at setup) if ``compression`` cannot apply to tensors of ``dtype``: not floating point,
    or a cast that would not shrink them (bf16/fp16 of 2-byte floats sends exactly as many bytes)."""
    fmt = wire_format(compression)
    if dtype not in _FLOATS:
        raise ValueError(
            f"compression={compression!r} needs floating-point tensors (float16, bfloat16, float32, float64); {what} "
            f"has dtype {dtype}. Use compression=None for this model."
        )
    if not fmt.quantized and torch.empty((), dtype=dtype).element_size() <= fmt.element_size:
        raise ValueError(
            f"compression={compression!r} does not shrink {what} of dtype {dtype}: the wire format is as wide as the "
            "data. Use compression='int8' (1 byte per element) or None."
        )


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Sums are taken in fp32, or in the tensor's own dtype when it is wider (float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ------------------------------------------------------------------------------------------------ kernels
def _split(numel: int, block: int) -> tuple[int, int]:
    """``numel`` as full blocks and a tail: (elements in full blocks, tail elements)."""
    full = numel // block * block
    return full, numel - full


def _per_block(values: Tensor, scales: Tensor, block: int) -> list[tuple[Tensor, Tensor]]:
    """``values`` as a (blocks, block) view and its tail (one partial block), each with its scales column."""
    full, tail = _split(values.numel(), block)
    parts = []
    if full:
        parts.append((values[:full].view(-1, block), scales[: full // block].view(-1, 1)))
    if tail:
        parts.append((values[full:].view(1, -1), scales[full // block : full // block + 1].view(1, 1)))
    return parts


def quantize_int8(values: Tensor, q: Tensor, scales: Tensor, scratch: Tensor, feedback: bool = False) -> None:
    """Encode ``values`` as int8 codes ``q`` with one fp32 scale per :data:`INT8_BLOCK` elements, working in
    ``scratch`` (a float tensor of at least ``values``' size, clobbered). With ``feedback``, ``values`` is replaced
    by what the encoding dropped, ``values − decode(q)`` (its error-feedback residual); otherwise it is not touched.

    ``s = max|x| / 127`` per block (a block of zeros gets the smallest normal float as scale and codes 0), codes
    ``round(x / s)``; ``|x / s| <= 127 (1 + 2^-24) < 127.5``, so the codes are in [-127, 127] without a clamp."""
    n = values.numel()
    work = scratch[:n]
    torch.abs(values, out=work)
    full, tail = _split(n, INT8_BLOCK)
    if full:  # the block maxima, reduced over the transposed view (several times faster than along rows on CPU)
        scales[: full // INT8_BLOCK].copy_(work[:full].view(-1, INT8_BLOCK).t().amax(dim=0))
    if tail:
        scales[full // INT8_BLOCK].copy_(work[full:].amax())
    scales[: math.ceil(n / INT8_BLOCK)].div_(INT8_MAX).clamp_(min=torch.finfo(torch.float32).tiny)
    for (v, sc), (w, _) in zip(_per_block(values, scales, INT8_BLOCK), _per_block(work, scales, INT8_BLOCK)):
        torch.div(v, sc, out=w)
    work.round_()
    q.copy_(work)
    if feedback:
        for (v, sc), (w, _) in zip(_per_block(values, scales, INT8_BLOCK), _per_block(work, scales, INT8_BLOCK)):
            v.addcmul_(w, sc, value=-1.0)


def dequantize_int8(q: Tensor, scales: Tensor, out: Tensor, accumulate: bool = False) -> None:
    """``out = q · s`` per block (``accumulate``: ``out += q · s``), in ``out``'s dtype, no temporary."""
    for (codes, sc), (target, _) in zip(_per_block(q, scales, INT8_BLOCK), _per_block(out, scales, INT8_BLOCK)):
        if accumulate:
            target.addcmul_(codes, sc)
        else:
            target.copy_(codes).mul_(sc)


def _check_fp16_range(src: Tensor, what: str) -> None:
    if not src.numel():
        return
    low, high = torch.aminmax(src)  # a reduction, no temporary of src's size
    amax = max(-float(low), float(high))
    if math.isfinite(amax) and amax > FP16_MAX:
        raise ValueError(
            f"compression='fp16': {what} holds a value of magnitude {amax:.6g}, beyond float16's range (±65504); "
            "it would be sent as infinity. Use compression='bf16' (float32's range) or 'int8' (scaled)."
        )


def _views(fmt: WireFormat, record: Tensor, numel: int) -> tuple[Tensor, Tensor | None]:
    """A byte record's (data, scales) views for ``numel`` elements: ``[scales (fp32) | data]`` for int8 (scales
    first, so they are 4-byte aligned in any record that starts aligned), ``[data]`` for the casts."""
    if not fmt.quantized:
        return record[: numel * fmt.element_size].view(fmt.dtype), None
    ns = fmt.scales(numel)
    scales = record[: ns * fmt.scale_bytes].view(torch.float32)
    data = record[ns * fmt.scale_bytes : ns * fmt.scale_bytes + numel].view(torch.int8)
    return data, scales


def encode(
    fmt: WireFormat,
    src: Tensor,
    record: Tensor,
    residual: Tensor | None = None,
    scratch: Tensor | None = None,
    numel: int | None = None,
    what: str = "the tensor",
) -> None:
    """Write ``src`` (1-D floating, not modified) into the byte tensor ``record``: the encoding of ``numel``
    elements (default ``src``'s size; more when the record is padded — the padding must be zeros already, as in a
    freshly zeroed buffer whose layout never changes).

    int8 works in ``scratch`` (a float tensor at least ``src``'s size, clobbered; allocated when not given), and
    with ``residual`` (``src``'s size) adds the residual before encoding and replaces it by what this encoding
    dropped (error feedback)."""
    data, scales = _views(fmt, record, src.numel() if numel is None else numel)
    data = data[: src.numel()]
    if scales is None:
        if fmt.dtype == torch.float16:
            _check_fp16_range(src, what)
        data.copy_(src)
        return
    work = scratch if scratch is not None else torch.empty_like(src)
    if residual is not None:
        residual.add_(src)  # the compensated value v = x + r, encoded in place of x; then r = v - decode
        quantize_int8(residual, data, scales, work, feedback=True)
    else:
        quantize_int8(src, data, scales, work)


def decode(fmt: WireFormat, record: Tensor, out: Tensor, accumulate: bool = False, numel: int | None = None) -> None:
    """Decode the byte tensor ``record`` — an encoding of ``numel`` elements (default ``out``'s size) — into
    ``out``, its first ``out.numel()`` elements (``accumulate``: add them to ``out``)."""
    data, scales = _views(fmt, record, out.numel() if numel is None else numel)
    data = data[: out.numel()]
    if scales is None:
        if accumulate:
            out.add_(data)
        else:
            out.copy_(data)
        return
    dequantize_int8(data, scales[: fmt.scales(out.numel())], out, accumulate)


# ------------------------------------------------------------------------------------------------ state
class ErrorFeedback:
    """One rank's int8 residuals for one stream of all-reduces (e.g. the gradient buffer): ``worker`` (what its
    encoding of its own tensor dropped, the tensor's size) and ``server`` (what its encoding of its reduced chunk
    dropped, the chunk's size). Both are per rank and go into the checkpoint. The server residual belongs to a
    chunk layout (world size, rank); a different layout (a subgroup) starts from zero."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.worker = torch.zeros(numel, dtype=dtype, device=device)
        self.server: Tensor | None = None
        self.layout: tuple[int, int] | None = None

    def server_residual(self, chunk: int, world_size: int, rank: int) -> Tensor:
        if self.server is None or self.layout != (world_size, rank) or self.server.numel() != chunk:
            self.server = torch.zeros(chunk, dtype=self.worker.dtype, device=self.worker.device)
            self.layout = (world_size, rank)
        return self.server

    def state_dict(self) -> dict[str, Any]:
        return {
            "worker": self.worker.detach().cpu().clone(),
            "server": None if self.server is None else self.server.detach().cpu().clone(),
            "layout": self.layout,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["worker"].numel() != self.worker.numel():
            raise ValueError(
                f"error-feedback state holds {state['worker'].numel()} elements, this tensor has {self.worker.numel()}"
            )
        self.worker.copy_(state["worker"])
        if state.get("server") is not None:
            # a copy: the state handed in (a checkpoint's, or a snapshot of it) must not change with training
            self.server = state["server"].to(device=self.worker.device, dtype=self.worker.dtype, copy=True)
            self.layout = tuple(state["layout"]) if state.get("layout") is not None else None


class FeedbackView:
    """Error feedback for an all-reduce of a *selection* of a stream's elements, packed (OSP sends a different set of
    layers each step): the caller packs the stream's residuals, kept in the positions of the full buffer, into
    ``worker`` (the packed tensor's size) and ``server`` (``N`` padded chunks of the packed tensor: rank ``r``'s
    server residual is chunk ``r``), runs the all-reduce, and scatters both back. So every residual stays with its
    element whatever the packing."""

    def __init__(self, worker: Tensor, server: Tensor) -> None:
        self.worker = worker
        self.server = server

    def server_residual(self, chunk: int, world_size: int, rank: int) -> Tensor:
        if self.server.numel() != chunk * world_size:
            raise ValueError(f"packed server residual holds {self.server.numel()} elements, not {world_size} x {chunk}")
        return self.server[rank * chunk : (rank + 1) * chunk]


@dataclass
class Workspace:
    """The persistent buffers of one compressed all-reduce shape (see the module docstring)."""

    numel: int
    world_size: int
    chunk: int  #: elements per rank's chunk (padded)
    record: int  #: bytes of one encoded chunk
    send: Tensor  #: uint8, N records: the all-to-all's input (padding stays zero: the layout never changes)
    recv: Tensor  #: uint8, N records: the all-to-all's output, then the all-gather's output
    acc: Tensor  #: accumulation dtype, chunk: this rank's reduced chunk (and the encoding's scratch before)
    tmp: Tensor  #: accumulation dtype, chunk: scratch of the reduced chunk's encoding (int8)
    mine: Tensor  #: uint8, one record: this rank's encoded reduced chunk (the all-gather's input)
    busy: bool = False


class Compressor:
    """The compression of one strategy: its wire format, its workspaces and its error-feedback state.

    One per strategy (its communicators share it); thread-safe for the asynchronous all-reduces that a
    communicator's driver thread runs. ``feedback(key, ...)`` returns the :class:`ErrorFeedback` of a stream of
    all-reduces (int8 only; ``None`` for the casts), created at first use or restored from :meth:`load_state_dict`.
    """

    #: shapes whose idle workspaces are kept (least recently used ones are dropped beyond it)
    MAX_SHAPES = 8

    def __init__(self, compression: str) -> None:
        self.name = check_compression(compression)
        if self.name is None:
            raise ValueError("Compressor needs a compression: 'bf16', 'fp16' or 'int8'")
        self.fmt = FORMATS[self.name]
        self._lock = threading.Lock()
        self._pool: dict[tuple[int, torch.dtype, torch.device, int], list[Workspace]] = {}
        self._feedback: dict[str, ErrorFeedback] = {}
        self._restored: dict[str, dict[str, Any]] = {}

    def __getstate__(self) -> dict[str, Any]:  # a spawned strategy pickles its compressor (no buffers yet)
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ buffers
    def acquire(self, numel: int, dtype: torch.dtype, device: torch.device, world_size: int) -> Workspace:
        """A free workspace for an all-reduce of ``numel`` elements of ``dtype`` over ``world_size`` ranks."""
        key = (numel, dtype, device, world_size)
        with self._lock:
            pool = self._pool.setdefault(key, [])
            self._pool[key] = self._pool.pop(key)  # most recently used last
            for ws in pool:
                if not ws.busy:
                    ws.busy = True
                    return ws
            self._evict()
        chunk = self.fmt.chunk_numel(numel, world_size)
        record = self.fmt.record_bytes(chunk)
        acc_dtype = accumulation_dtype(dtype)
        ws = Workspace(
            numel=numel,
            world_size=world_size,
            chunk=chunk,
            record=record,
            send=torch.zeros(world_size * record, dtype=torch.uint8, device=device),
            recv=torch.zeros(world_size * record, dtype=torch.uint8, device=device),
            acc=torch.zeros(chunk, dtype=acc_dtype, device=device),
            tmp=torch.zeros(chunk if self.fmt.quantized else 0, dtype=acc_dtype, device=device),
            mine=torch.zeros(record, dtype=torch.uint8, device=device),
            busy=True,
        )
        with self._lock:
            self._pool[key].append(ws)
        return ws

    def release(self, ws: Workspace) -> None:
        with self._lock:
            ws.busy = False

    def _evict(self) -> None:
        """With the lock held, before allocating a new shape: drop idle workspaces of the least recently used shapes
        beyond :attr:`MAX_SHAPES` (OSP's stages change size with the layers a step selects; a fixed layout such as a
        gradient buffer keeps its one workspace)."""
        for key in list(self._pool)[: max(0, len(self._pool) - self.MAX_SHAPES)]:
            self._pool[key] = [ws for ws in self._pool[key] if ws.busy]
            if not self._pool[key]:
                del self._pool[key]

    def workspaces(self) -> int:
        """How many workspaces exist (tests: buffers are reused, not reallocated per sync)."""
        with self._lock:
            return sum(len(p) for p in self._pool.values())

    # ------------------------------------------------------------------ error feedback
    def feedback(self, key: str, numel: int, dtype: torch.dtype, device: torch.device) -> ErrorFeedback | None:
        """The residuals of stream ``key`` (int8), or ``None`` (the casts keep no state)."""
        if not self.fmt.quantized:
            return None
        with self._lock:
            fb = self._feedback.get(key)
            if fb is None or fb.worker.numel() != numel:
                fb = ErrorFeedback(numel, accumulation_dtype(dtype), device)
                restored = self._restored.pop(key, None)
                if restored is not None:
                    fb.load_state_dict(restored)
                self._feedback[key] = fb
            return fb

    def state_dict(self) -> dict[str, Any]:
        """Every stream's residuals (CPU copies), and those restored but not used yet."""
        with self._lock:
            streams = {k: fb.state_dict() for k, fb in self._feedback.items()}
            for k, v in self._restored.items():
                streams.setdefault(k, v)
        return {"compression": self.name, "feedback": streams}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("compression") != self.name:
            raise ValueError(
                f"the checkpoint's compression state is for compression={state.get('compression')!r}; this run uses "
                f"compression={self.name!r}. Resume with the same compression."
            )
        with self._lock:
            self._restored = dict(state.get("feedback", {}))
            for key in list(self._feedback):
                if key in self._restored:
                    self._feedback[key].load_state_dict(self._restored.pop(key))

    # ------------------------------------------------------------------ the all-reduce's per-rank stages
    def stage_encode(
        self, ws: Workspace, x: Tensor, feedback: ErrorFeedback | FeedbackView | None, contribute: bool = True
    ) -> None:
        """Stage 1 (before the all-to-all): ``x`` (+ the worker residual, int8) into ``ws.send``, chunk ``j`` in
        record ``j``. ``contribute=False`` (a rank that sends zeros, e.g. outside FedAvg's participants) leaves its
        residual alone."""
        n, c, rec = ws.numel, ws.chunk, ws.record
        if not contribute:
            ws.send.zero_()
            return
        residual = feedback.worker if feedback is not None else None
        for j in range(ws.world_size):
            lo, hi = min(j * c, n), min((j + 1) * c, n)
            encode(
                self.fmt,
                x[lo:hi],
                ws.send[j * rec : (j + 1) * rec],
                residual=None if residual is None else residual[lo:hi],
                scratch=ws.acc,
                numel=c,
                what="the tensor to all-reduce",
            )

    def stage_reduce(
        self, ws: Workspace, rank: int, divisor: float | None, feedback: ErrorFeedback | FeedbackView | None
    ) -> None:
        """Stage 2 (after the all-to-all, at the chunk's owner): sum the ``N`` decoded copies of this rank's chunk in
        the accumulation dtype (rank order), divide, add the server residual and encode into ``ws.mine``."""
        rec = ws.record
        acc = ws.acc
        for k in range(ws.world_size):
            decode(self.fmt, ws.recv[k * rec : (k + 1) * rec], acc, accumulate=k > 0)
        if divisor is not None and divisor != 1:
            acc.div_(divisor)
        residual = None if feedback is None else feedback.server_residual(ws.chunk, ws.world_size, rank)
        encode(self.fmt, acc, ws.mine, residual=residual, scratch=ws.tmp, what="the reduced chunk")

    def stage_decode(self, ws: Workspace, x: Tensor) -> None:
        """Stage 3 (after the all-gather into ``ws.recv``): every rank's encoded chunk back into ``x``."""
        n, c, rec = ws.numel, ws.chunk, ws.record
        for j in range(ws.world_size):
            lo, hi = j * c, min((j + 1) * c, n)
            if hi > lo:
                decode(self.fmt, ws.recv[j * rec : (j + 1) * rec], x[lo:hi], numel=c)
