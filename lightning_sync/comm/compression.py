"""Compressed synchronization: what goes on the wire, and the per-rank math of a compressed all-reduce.

``compression=None | "bf16" | "fp16" | "int8" | "int4" | "int2" | "topk:<fraction>" | "topk:<fraction>+int2"``
(``+int8``, ``+int4`` alike; an argument of every strategy) sends floating-point data in a narrower wire format.
This module holds the formats, the records, the persistent buffers and the error-feedback state (the kernels:
:mod:`lightning_sync.comm.quantize`'s for the integer formats, :mod:`lightning_sync.comm.sparse`'s for the sparse
ones);
:meth:`~lightning_sync.comm.Communicator.all_reduce_compressed` moves the bytes (it is the only code that calls
``torch.distributed``) and the parameter server (:mod:`lightning_sync.comm.ps`) uses :func:`encode` /
:func:`decode` for its messages. Nothing here imports ``torch.distributed``.

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
* ``"int4"``, ``"int2"``: the same with fewer levels — codes in [-7, 7] (``s = max|x| / 7``) and in [-1, 1]
  (ternary, ``s = max|x|``: "2-bit with a scale" as Streaming DiLoCo, MuLoCo and SparseLoCo send it), packed two and
  four to a byte (:mod:`lightning_sync.comm.quantize`), the same 256-element blocks and error feedback on both
  stages: 0.5 + 4/256 = 0.515625 and 0.25 + 4/256 = 0.265625 bytes per element. The codes are symmetric, as int8's,
  so zero is exact and the error is at most half a step either way; the unused most negative code (-8, -2) would buy
  a level on one side only. The block stays int8's 256: the scales then cost 3 % (int4) and 6 % (int2) on top of the
  codes, a block of 64 would cost 12 % and 25 % for a finer scale; and every chunk is a whole number of blocks,
  which packs whole.
* ``"topk:<fraction>"`` (e.g. ``"topk:0.01"``, ``0 < fraction < 1``): sparse records. Of each chunk of ``c``
  elements a rank sends its ``k = ⌈fraction · c⌉`` entries of largest magnitude, as ``k`` fp32 values and ``k``
  int32 indices in the chunk (8 bytes an entry: ``8 · fraction`` bytes per element, 1/16 of bf16's at 1 %), with
  error feedback on both stages as the integer formats: what a record leaves out stays in the rank's residual and
  is sent when it has grown among the largest (Stich et al., "Sparsified SGD with memory", 2018; the top-k of
  SparseLoCo's pseudo-gradients, arXiv 2508.15706, without its 2-bit values). The owner of a chunk sums the ``N``
  sparse records densely in fp32 and sends the top ``k`` of the sum (sparse sums do not reduce in a ring: the
  all-to-all and all-gather below carry them unchanged). It applies to *changes* (the parameter averages'
  pseudo-gradients), never to values that replace state: a sparse gradient average departs from DDP's, and a
  sparse pull of the parameter server's parameters would zero the rest of them — those refuse it
  (:class:`~lightning_sync.strategies.codec.CompressedCodec`, the parameter-server strategies).
* ``"topk:<fraction>+int8"``, ``"+int4"``, ``"+int2"`` (e.g. ``"topk:0.01+int2"``): the same selection with narrow
  values — the ``k`` chosen values, in index order, quantised with the integer formats' kernels (one fp32 scale per
  256 consecutive entries, symmetric codes packed 1, 2 or 4 to a byte; int2's scale the entries' mean ``|v|``, not
  their maximum: :mod:`lightning_sync.comm.sparse` says why) beside the ``k`` int32 indices:
  ``4 + 1, 0.5 or 0.25 + 4/256`` bytes an entry instead of 8 (int2: 4.265625, 0.0427 bytes per element at 1 %,
  1/47 of bf16's). The residual keeps what neither the selection nor the quantisation sent (residual = input −
  decoded: the entries left out whole, the chosen ones' quantisation error), on both stages; it applies where
  ``topk`` applies and is refused where it is. The indices stay int32 (4 of the 4.27 bytes an entry): a narrower
  index (delta or per-block offsets) would be data-dependent in size or change the selection; not done here.

**The all-reduce** (every backend, every format): a low-precision SUM is never requested from the backend, because
gloo (torch 2.14: ``bf16`` and ``fp16`` all-reduce are supported) adds in the wire type at every ring step — with 4
ranks its mean error was 1.64x that of the exact sum rounded once (``python benchmarks/compression.py --part sum``)
— and NCCL's ring also reduces in the buffer's type at each hop (its design; not measured here, no GPU); int8 cannot
be summed on the wire at all. Instead, as torchft's quantized all-reduce does:

1. each rank encodes its tensor (plus its residual, the integer formats) as ``N`` equal chunks and an
   **all-to-all** sends chunk ``j`` to rank ``j`` (a reduce-scatter in the wire format);
2. rank ``j`` decodes the ``N`` copies of its chunk and sums them in fp32 (fp64 for float64 tensors) in rank
   order, divides (the average), adds its own second-stage residual (integer formats: the "server error" of 1-bit
   Adam, the
   part of its reduced chunk that its last encoding dropped) and encodes the result;
3. an **all-gather** of the encoded chunks; every rank decodes all of them — its own included — so the result is
   **bit-identical on every rank**.

Bytes per rank (:func:`~lightning_sync.comm.cost.compressed_allreduce_bytes`): ``2 (N − 1)`` chunk records of
``c`` elements in the wire size (+ the scales of the integer formats), ``c = ⌈numel / N⌉`` (integer formats:
rounded up to a multiple of 256, so a chunk packs whole), padding included because it is sent. On one rank nothing
is sent and nothing is compressed.

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

from lightning_sync.comm.cost import (
    allgather_bytes,
    alltoall_bytes,
    compressed_allreduce_bytes,
    compressed_chunk_numel,
    compressed_record_bytes,
    sparse_record_bytes,
)
from lightning_sync.comm.quantize import dequantize, pack, packed_bytes, quantize, unpack
from lightning_sync.comm.sparse import ValueCode, decode_sparse, encode_sparse

#: the accepted values of ``compression`` besides ``None`` and the sparse ``"topk:<fraction>"``
COMPRESSIONS = ("bf16", "fp16", "int8", "int4", "int2")
#: the prefix of the sparse formats, ``"topk:<fraction>"`` with ``0 < fraction < 1``
TOPK = "topk:"
#: the integer formats: elements that share one scale (int8, int4 and int2 alike)
INT8_BLOCK = 256
#: the integer formats: bytes of one scale (float32)
SCALE_BYTES = 4
#: the largest int8 code (symmetric: -127..127, so 0 is exact and the range is symmetric)
INT8_MAX = 127
#: the largest int4 code (-7..7) and int2 code (-1..1, ternary)
INT4_MAX, INT2_MAX = 7, 1
#: largest finite float16
FP16_MAX = 65504.0

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


#: the narrow value formats a sparse format may take, ``"topk:<fraction>+<values>"``
SPARSE_VALUES = ("int8", "int4", "int2")


def check_compression(value: Any) -> str | None:
    """``None``, one of :data:`COMPRESSIONS` (exactly, case-sensitive), or ``"topk:<fraction>"`` with
    ``0 < fraction < 1``, optionally with narrow values ``"+int8"``, ``"+int4"`` or ``"+int2"`` (returned with the
    fraction written as Python writes the float, e.g. ``"topk:0.01"``, ``"topk:0.01+int2"``)."""
    if value is None or (isinstance(value, str) and value in COMPRESSIONS):
        return value
    if isinstance(value, str) and value.startswith(TOPK):
        text, plus, values = value[len(TOPK) :].partition("+")
        try:
            fraction = float(text)
        except ValueError:
            fraction = math.nan
        if 0.0 < fraction < 1.0 and (not plus or values in SPARSE_VALUES):
            return f"{TOPK}{fraction!r}" + (f"+{values}" if plus else "")
    raise ValueError(
        "compression must be None, 'bf16', 'fp16', 'int8', 'int4' or 'int2', or 'topk:<fraction>' with "
        "0 < fraction < 1 (e.g. 'topk:0.01'), optionally with narrow values '+int8', '+int4' or '+int2' (e.g. "
        f"'topk:0.01+int2'), got {value!r}"
    )


@dataclass(frozen=True)
class WireFormat:
    """How one element travels: ``dtype`` on the wire, and for the integer formats one fp32 scale per ``block``
    elements, codes in [-``qmax``, ``qmax``], ``per_byte`` of them packed in one byte (int4: 2, int2: 4)."""

    name: str
    dtype: torch.dtype
    block: int  #: elements per scale (1 and no scales for the casts)
    scale_bytes: int
    qmax: int = 0  #: the largest code (the integer formats)
    per_byte: int = 1  #: codes packed in one wire element
    fraction: float = 0.0  #: the sparse formats: the fraction of each chunk's elements sent (0: dense)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def quantized(self) -> bool:
        return self.scale_bytes > 0

    @property
    def sparse(self) -> bool:
        """A ``topk:<fraction>`` format: records of the largest entries with their indices."""
        return self.fraction > 0.0

    @property
    def feedback(self) -> bool:
        """Whether the format drops part of what it encodes for a residual to keep (the integer and sparse
        formats: error feedback); the casts round and keep nothing."""
        return self.quantized or self.sparse

    @property
    def bits(self) -> int:
        """Bits of one element's code on the wire (16, 8, 4 or 2; a sparse format: of one value, 32 for fp32)."""
        return 8 * self.element_size // self.per_byte

    @property
    def value_code(self) -> ValueCode | None:
        """A sparse format with narrow values (``topk:<fraction>+int2``): how its values are quantised; else
        ``None``."""
        return ValueCode(self.qmax, self.bits, self.block) if self.sparse and self.quantized else None

    @property
    def bytes_per_element(self) -> float:
        """Average wire bytes per element, scales included (2.0 for the casts, 1 + 4/256 for int8, 0.5 + 4/256 for
        int4, 0.25 + 4/256 for int2; for the sparse formats the fraction x the bytes of an entry, before rounding k
        up: 8 with fp32 values, 4 + the code's bytes + 4/256 with narrow ones)."""
        if self.sparse:
            entry = (4.0 + self.bits / 8 + self.scale_bytes / self.block) if self.quantized else 8.0
            return entry * self.fraction
        return self.element_size / self.per_byte + (self.scale_bytes / self.block if self.quantized else 0.0)

    def chunk_numel(self, numel: int, world_size: int) -> int:
        """Elements of one rank's chunk in the all-reduce (padded; see :func:`~lightning_sync.comm.cost`; a sparse
        format's chunk is not rounded to a block: its blocks are of entries)."""
        return compressed_chunk_numel(numel, world_size, 1 if self.sparse else self.block)

    def record_bytes(self, numel: int) -> int:
        """Bytes of ``numel`` elements encoded: data (packed: a last partial byte whole) plus scales (one per
        started block); a sparse record: its entries (:func:`~lightning_sync.comm.cost.sparse_record_bytes`)."""
        if self.sparse:
            if self.quantized:
                return sparse_record_bytes(numel, self.fraction, self.bits, self.block, self.scale_bytes)
            return sparse_record_bytes(numel, self.fraction)
        return compressed_record_bytes(numel, self.element_size, self.block, self.scale_bytes, self.per_byte)

    def allreduce_bytes(self, numel: int, world_size: int) -> tuple[int, int]:
        """Bytes a rank sends in a compressed all-reduce of ``numel`` elements, ``(all-to-all, all-gather)``."""
        if self.sparse:
            if world_size <= 1 or numel <= 0:
                return 0, 0
            record = self.record_bytes(self.chunk_numel(numel, world_size))
            return alltoall_bytes(record, world_size), allgather_bytes(record, world_size)
        return compressed_allreduce_bytes(
            numel, self.element_size, world_size, self.block, self.scale_bytes, self.per_byte
        )

    def scales(self, numel: int) -> int:
        return math.ceil(numel / self.block) if self.quantized else 0


FORMATS = {
    "bf16": WireFormat("bf16", torch.bfloat16, 1, 0),
    "fp16": WireFormat("fp16", torch.float16, 1, 0),
    "int8": WireFormat("int8", torch.int8, INT8_BLOCK, SCALE_BYTES, INT8_MAX),
    "int4": WireFormat("int4", torch.uint8, INT8_BLOCK, SCALE_BYTES, INT4_MAX, per_byte=2),
    "int2": WireFormat("int2", torch.uint8, INT8_BLOCK, SCALE_BYTES, INT2_MAX, per_byte=4),
}


def wire_format(compression: str) -> WireFormat:
    """The format of a checked ``compression`` (:func:`check_compression`)."""
    name = check_compression(compression) or ""
    if name.startswith(TOPK):
        text, _, values = name[len(TOPK) :].partition("+")
        if values:  # narrow values: the integer format's codes, scales and packing, applied to the chosen entries
            base = FORMATS[values]
            return WireFormat(
                name, base.dtype, base.block, base.scale_bytes, base.qmax, base.per_byte, fraction=float(text)
            )
        return WireFormat(name, torch.float32, 1, 0, fraction=float(text))
    return FORMATS[name]


def check_compressible(compression: str, dtype: torch.dtype, what: str) -> None:
    """Raise ``ValueError`` (at setup) if ``compression`` cannot apply to tensors of ``dtype``: not floating point,
    or a cast that would not shrink them (bf16/fp16 of 2-byte floats sends exactly as many bytes)."""
    fmt = wire_format(compression)
    if dtype not in _FLOATS:
        raise ValueError(
            f"compression={compression!r} needs floating-point tensors (float16, bfloat16, float32, float64); {what} "
            f"has dtype {dtype}. Use compression=None for this model."
        )
    if not fmt.feedback and torch.empty((), dtype=dtype).element_size() <= fmt.element_size:
        raise ValueError(
            f"compression={compression!r} does not shrink {what} of dtype {dtype}: the wire format is as wide as the "
            "data. Use compression='int8' (1 byte per element), 'int4' or 'int2' (1/2 or 1/4 byte) or None."
        )


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Sums are taken in fp32, or in the tensor's own dtype when it is wider (float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ------------------------------------------------------------------------------------------------ records
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
    """A byte record's (data, scales) views for ``numel`` elements: ``[scales (fp32) | data]`` for the integer
    formats (scales first, so they are 4-byte aligned in any record that starts aligned; data: int8 codes, or
    ``uint8`` bytes of packed codes), ``[data]`` for the casts."""
    if not fmt.quantized:
        return record[: numel * fmt.element_size].view(fmt.dtype), None
    ns = fmt.scales(numel)
    scales = record[: ns * fmt.scale_bytes].view(torch.float32)
    data = record[ns * fmt.scale_bytes : ns * fmt.scale_bytes + packed_bytes(numel, fmt.bits)].view(fmt.dtype)
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

    The integer formats work in ``scratch`` (a float tensor at least ``src``'s size, clobbered; allocated when not
    given), and with ``residual`` (``src``'s size) add the residual before encoding and replace it by what this
    encoding dropped (error feedback). A packed format writes the whole last byte (zero codes past ``src``).

    A sparse format writes all of its entries, those past ``src``'s size as (index 0, value 0)."""
    if fmt.sparse:
        encode_sparse(
            fmt.fraction, src, record, residual, scratch, src.numel() if numel is None else numel, fmt.value_code
        )
        return
    data, scales = _views(fmt, record, src.numel() if numel is None else numel)
    data = data[: packed_bytes(src.numel(), fmt.bits)] if fmt.quantized else data[: src.numel()]
    if scales is None:
        if fmt.dtype == torch.float16:
            _check_fp16_range(src, what)
        data.copy_(src)
        return
    work = scratch if scratch is not None else torch.empty_like(src)
    if residual is not None:
        residual.add_(src)  # the compensated value v = x + r, encoded in place of x; then r = v - decode
        codes = quantize(residual, scales, work, fmt.qmax, fmt.block, feedback=True)
    else:
        codes = quantize(src, scales, work, fmt.qmax, fmt.block)
    if fmt.per_byte == 1:
        data.copy_(codes)
    else:
        pack(codes, data, fmt.bits)


def decode(
    fmt: WireFormat,
    record: Tensor,
    out: Tensor,
    accumulate: bool = False,
    numel: int | None = None,
    scratch: Tensor | None = None,
) -> None:
    """Decode the byte tensor ``record`` — an encoding of ``numel`` elements (default ``out``'s size) — into
    ``out``, its first ``out.numel()`` elements (``accumulate``: add them to ``out``). A packed format unpacks its
    codes into ``out`` itself, or with ``accumulate`` into ``scratch`` (a tensor of ``out``'s dtype and at least its
    size, clobbered; allocated when not given)."""
    n = out.numel()
    if fmt.sparse:
        decode_sparse(fmt.fraction, record, out, accumulate, n if numel is None else numel, fmt.value_code)
        return
    data, scales = _views(fmt, record, n if numel is None else numel)
    if scales is None:
        if accumulate:
            out.add_(data[:n])
        else:
            out.copy_(data[:n])
        return
    if fmt.per_byte == 1:
        codes = data[:n]
    else:
        codes = out if not accumulate else (scratch[:n] if scratch is not None else torch.empty_like(out))
        unpack(data[: packed_bytes(n, fmt.bits)], codes, fmt.bits)
    dequantize(codes, scales[: fmt.scales(n)], out, fmt.block, accumulate)


# ------------------------------------------------------------------------------------------------ state
class ErrorFeedback:
    """One rank's residuals (the integer formats) for one stream of all-reduces (e.g. the gradient buffer):
    ``worker`` (what its encoding of its own tensor dropped, the tensor's size) and ``server`` (what its encoding of
    its reduced chunk dropped, the chunk's size). Both are per rank and go into the checkpoint. The server residual
    belongs to a chunk layout (world size, rank); a different layout (a subgroup) starts from zero."""

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
    tmp: Tensor  #: accumulation dtype, chunk: scratch of the reduced chunk's encoding (and of packed codes' decoding)
    mine: Tensor  #: uint8, one record: this rank's encoded reduced chunk (the all-gather's input)
    busy: bool = False


class Compressor:
    """The compression of one strategy: its wire format, its workspaces and its error-feedback state.

    One per strategy (its communicators share it); thread-safe for the asynchronous all-reduces that a
    communicator's driver thread runs. ``feedback(key, ...)`` returns the :class:`ErrorFeedback` of a stream of
    all-reduces (the integer formats; ``None`` for the casts), created at first use or restored from
    :meth:`load_state_dict`.
    """

    #: shapes whose idle workspaces are kept (least recently used ones are dropped beyond it)
    MAX_SHAPES = 8

    def __init__(self, compression: str) -> None:
        self.name = check_compression(compression)
        if self.name is None:
            raise ValueError(f"Compressor needs a compression: one of {', '.join(map(repr, COMPRESSIONS))}")
        self.fmt = wire_format(self.name)
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
            tmp=torch.zeros(chunk if self.fmt.feedback else 0, dtype=acc_dtype, device=device),
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
        """The residuals of stream ``key`` (the integer and sparse formats), or ``None`` (the casts keep no
        state)."""
        if not self.fmt.feedback:
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
        """Stage 1 (before the all-to-all): ``x`` (+ the worker residual, integer formats) into ``ws.send``, chunk
        ``j`` in record ``j``. ``contribute=False`` (a rank that sends zeros, e.g. outside FedAvg's participants)
        leaves its residual alone."""
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
        for k in range(ws.world_size):  # ws.tmp: scratch of a packed format's codes (free until the encoding)
            decode(self.fmt, ws.recv[k * rec : (k + 1) * rec], acc, accumulate=k > 0, scratch=ws.tmp)
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
