"""A frozen copy of the codec kernels as they were before they were made faster (2026-12-02, at commit 7229534:
``lightning_sync/comm/quantize.py``, ``sparse.py``, and ``compression.py``'s ``encode`` / ``decode`` and the three
per-rank stages of :class:`~lightning_sync.comm.compression.Compressor`), kept so that
``tests/test_codec_identity.py`` can check that the kernels in use write bit-identical records, residuals and decoded
values on this machine (both run here: nothing machine-dependent is pinned). Do not edit it to follow the kernels: it
is the contract they keep. A deliberate change of the numbers must change this reference in its own commit, saying
why.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_sync.comm.compression import FP16_MAX, WireFormat
from lightning_sync.comm.cost import SPARSE_INDEX_BYTES, topk_count
from lightning_sync.comm.sparse import ValueCode


def _split(numel: int, block: int) -> tuple[int, int]:
    """``numel`` as full blocks and a tail: (elements in full blocks, tail elements)."""
    full = numel // block * block
    return full, numel - full


def per_block(values: Tensor, scales: Tensor, block: int) -> list[tuple[Tensor, Tensor]]:
    """``values`` as a (blocks, block) view and its tail (one partial block), each with its scales column."""
    full, tail = _split(values.numel(), block)
    parts = []
    if full:
        parts.append((values[:full].view(-1, block), scales[: full // block].view(-1, 1)))
    if tail:
        parts.append((values[full:].view(1, -1), scales[full // block : full // block + 1].view(1, 1)))
    return parts


def quantize(
    values: Tensor, scales: Tensor, work: Tensor, qmax: int, block: int, feedback: bool = False, mean: bool = False
) -> Tensor:
    """Quantise ``values`` (1-D floating) with one scale per ``block`` elements into ``scales`` (fp32, at least
    ``⌈n / block⌉``) and the codes, as floats, into ``work`` (at least ``values``' size, clobbered); returns
    ``work[:n]``. With ``feedback``, ``values`` is replaced by what the encoding dropped, ``values − q·s`` (its
    error-feedback residual); otherwise it is not touched. ``mean``: the scale is the block's mean ``|x|`` (not
    its maximum over ``qmax``) and the codes are clamped to [-``qmax``, ``qmax``]."""
    n = values.numel()
    work = work[:n]
    torch.abs(values, out=work)
    full, tail = _split(n, block)
    if mean:  # the block means of |x|: codes clamped to [-Q, Q]
        if full:
            scales[: full // block].copy_(work[:full].view(-1, block).t().mean(dim=0))
        if tail:
            scales[full // block].copy_(work[full:].mean())
        scales[: math.ceil(n / block)].clamp_(min=torch.finfo(torch.float32).tiny)
    else:
        if full:  # the block maxima, reduced over the transposed view (several times faster than along rows on CPU)
            scales[: full // block].copy_(work[:full].view(-1, block).t().amax(dim=0))
        if tail:
            scales[full // block].copy_(work[full:].amax())
        scales[: math.ceil(n / block)].div_(qmax).clamp_(min=torch.finfo(torch.float32).tiny)
    for (v, sc), (w, _) in zip(per_block(values, scales, block), per_block(work, scales, block)):
        torch.div(v, sc, out=w)
    work.round_()
    if mean:
        work.clamp_(-qmax, qmax)
    if feedback:
        for (v, sc), (w, _) in zip(per_block(values, scales, block), per_block(work, scales, block)):
            v.addcmul_(w, sc, value=-1.0)
    return work


def dequantize(codes: Tensor, scales: Tensor, out: Tensor, block: int, accumulate: bool = False) -> None:
    """``out = q · s`` per block (``accumulate``: ``out += q · s``), in ``out``'s dtype, no temporary. ``codes`` may
    be ``out`` itself (unpacked in place), then it is scaled in place."""
    in_place = codes.data_ptr() == out.data_ptr() and codes.dtype == out.dtype
    for (q, sc), (target, _) in zip(per_block(codes, scales, block), per_block(out, scales, block)):
        if in_place:
            target.mul_(sc)
        elif accumulate:
            target.addcmul_(q, sc)
        else:
            target.copy_(q).mul_(sc)


def packed_bytes(numel: int, bits: int) -> int:
    """Bytes of ``numel`` codes of ``bits`` bits packed (a last partial byte counts whole)."""
    return math.ceil(numel * bits / 8)


def _pack_fields(groups: Tensor, out: Tensor, bits: int) -> None:
    """The integer-valued float columns of ``groups`` (bytes x codes a byte) into the bytes ``out``: each code cast
    to a signed byte, masked to its low ``bits`` (two's complement), shifted to its field and or-ed in."""
    dst = out.view(torch.int8)
    tmp = torch.empty_like(dst)  # one byte per packed byte: a fraction of the codes' size
    mask = (1 << bits) - 1
    for k in range(8 // bits):
        target = dst if k == 0 else tmp
        target.copy_(groups[:, k])
        target.bitwise_and_(mask)
        if k:
            tmp.bitwise_left_shift_(bits * k)
            dst.bitwise_or_(tmp)


def pack(codes: Tensor, out: Tensor, bits: int) -> None:
    """Pack the integer-valued float ``codes`` (in [-2^(bits-1), 2^(bits-1)), not modified) into the ``uint8``
    tensor ``out`` (at least :func:`packed_bytes`), ``8 // bits`` codes a byte, two's complement, code ``k`` of a
    group in bits ``[k·bits, (k+1)·bits)``."""
    per = 8 // bits
    full, tail = _split(codes.numel(), per)
    if full:
        _pack_fields(codes[:full].view(-1, per), out[: full // per], bits)
    if tail:  # a partial group: the codes past the end are zero
        last = torch.zeros(1, per, dtype=codes.dtype, device=codes.device)
        last[0, :tail] = codes[full:]
        _pack_fields(last, out[full // per : full // per + 1], bits)


def _unpack_fields(data: Tensor, groups: Tensor, bits: int) -> None:
    """Every field of the bytes ``data`` into the columns of ``groups`` (bytes x codes a byte), sign-extended by
    integer shifts: field ``k`` shifted to the top of a signed byte, then arithmetically back down."""
    signed = data.view(torch.int8)
    per = 8 // bits
    tmp = torch.empty_like(signed) if per > 1 else signed  # one byte per byte: a fraction of the codes' size
    for k in range(per):
        top = 8 - bits * (k + 1)
        if top:
            torch.bitwise_left_shift(signed, top, out=tmp)  # wraps in 8 bits (measured: every byte, both widths)
        torch.bitwise_right_shift(tmp if top else signed, 8 - bits, out=groups[:, k])


def unpack(data: Tensor, out: Tensor, bits: int) -> None:
    """The inverse of :func:`pack`: the first ``out.numel()`` codes of the ``uint8`` tensor ``data`` into the
    floating tensor ``out``, as signed integers."""
    per = 8 // bits
    n = out.numel()
    full, tail = _split(n, per)
    if full:
        _unpack_fields(data[: full // per], out[:full].view(-1, per), bits)
    if tail:  # the last, partial byte: its first ``tail`` codes
        last = torch.empty(1, per, dtype=out.dtype, device=out.device)
        _unpack_fields(data[full // per : full // per + 1], last, bits)
        out[full:].copy_(last[0, :tail])


def sparse_views(
    fraction: float, record: Tensor, numel: int, code: ValueCode | None = None
) -> tuple[Tensor | None, Tensor, Tensor | None, Tensor | None]:
    """A sparse record's ``(values, indices, scales, codes)`` views for a chunk of ``numel`` elements: fp32 values
    ``[k fp32 values | k int32 indices]`` (scales and codes ``None``); narrow values ``[scales fp32 | k int32
    indices | packed codes (uint8)]`` (values ``None``). Every part is 4-byte aligned in a record that starts so."""
    k = topk_count(numel, fraction)
    if code is None:
        return record[: 4 * k].view(torch.float32), record[4 * k : 8 * k].view(torch.int32), None, None
    ns = -(-k // code.block)
    scales = record[: 4 * ns].view(torch.float32)
    at = 4 * ns + SPARSE_INDEX_BYTES * k
    index = record[4 * ns : at].view(torch.int32)
    codes = record[at:]  # the packed codes and their zero padding to a multiple of 4 bytes
    return None, index, scales, codes


def encode_sparse(
    fraction: float,
    src: Tensor,
    record: Tensor,
    residual: Tensor | None,
    scratch: Tensor | None,
    numel: int,
    code: ValueCode | None = None,
) -> None:
    """The ``k`` entries of largest magnitude of ``src`` (+ ``residual``), indices ascending; with ``residual``, what
    was not sent stays in it: the entries left out, and what the value's encoding dropped of a chosen one (the fp32
    value of a wider one; with ``code``, the quantisation's error). Entries past ``src``'s size (a chunk shorter
    than the record's) are written as index 0 with a zero value (zero code, zero scale)."""
    values, index, scales, codes = sparse_views(fraction, record, numel, code)
    v = src
    if residual is not None:
        residual.add_(src)  # v = x + r; then r = v - decode(encode(v))
        v = residual
    m = v.numel()
    kk = min(index.numel(), m)
    chosen = None
    if kk:
        if scratch is not None and scratch.dtype == v.dtype and scratch.numel() >= m:
            magnitude = torch.abs(v, out=scratch[:m])
        else:
            magnitude = v.abs()
        chosen = torch.topk(magnitude, kk, sorted=False).indices.sort().values
        index[:kk].copy_(chosen)
    index[kk:].zero_()
    if code is None:
        assert values is not None
        if chosen is not None:
            picked = v[chosen]
            values[:kk].copy_(picked)
            if residual is not None:
                residual.index_put_((chosen,), picked - values[:kk].to(picked.dtype))
        values[kk:].zero_()
        return
    assert scales is not None and codes is not None
    used = packed_bytes(kk, code.bits)
    if chosen is not None:
        picked = v[chosen]  # a copy (k elements): quantised, then (with feedback) what its codes dropped
        work = torch.empty_like(picked)
        ternary = code.qmax == 1  # int2: the block's mean |v| as scale (the module docstring)
        q = quantize(picked, scales, work, code.qmax, code.block, feedback=residual is not None, mean=ternary)
        if code.bits == 8:
            codes[:kk].view(torch.int8).copy_(q)
        else:
            pack(q, codes[:used], code.bits)
        if residual is not None:
            residual.index_put_((chosen,), picked)
    scales[-(-kk // code.block) :].zero_()
    codes[used:].zero_()


def decode_sparse(
    fraction: float, record: Tensor, out: Tensor, accumulate: bool, numel: int, code: ValueCode | None = None
) -> None:
    """Scatter-add a sparse record's entries into ``out`` (zeroed first unless ``accumulate``). Entries at or past
    ``out``'s size (a last chunk shorter than the record's) hold zeros and are skipped. Narrow values are decoded
    as the dense integer formats decode (``q · s`` in ``out``'s dtype) before the scatter-add."""
    n = out.numel()
    if not accumulate:
        out.zero_()
    values, index, scales, codes = sparse_views(fraction, record, numel, code)
    k = index.numel()
    if n == 0 or k == 0:
        return
    if code is not None:
        assert scales is not None and codes is not None
        decoded = torch.empty(k, dtype=out.dtype, device=out.device)
        if code.bits == 8:
            decoded.copy_(codes[:k].view(torch.int8))
        else:
            unpack(codes[: packed_bytes(k, code.bits)], decoded, code.bits)
        dequantize(decoded, scales, decoded, code.block)
        values = decoded
    assert values is not None
    positions = index.long()
    if n < numel:
        keep = positions < n
        positions, values = positions[keep], values[keep]
    out.index_add_(0, positions, values.to(out.dtype))


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


# ------------------------------------------------------------------------------------------------ the stages
def stage_encode(fmt: WireFormat, ws, x: Tensor, feedback, contribute: bool = True) -> None:
    n, c, rec = ws.numel, ws.chunk, ws.record
    if not contribute:
        ws.send.zero_()
        return
    residual = feedback.worker if feedback is not None else None
    for j in range(ws.world_size):
        lo, hi = min(j * c, n), min((j + 1) * c, n)
        encode(
            fmt,
            x[lo:hi],
            ws.send[j * rec : (j + 1) * rec],
            residual=None if residual is None else residual[lo:hi],
            scratch=ws.acc,
            numel=c,
            what="the tensor to all-reduce",
        )


def stage_reduce(fmt: WireFormat, ws, rank: int, divisor: float | None, feedback) -> None:
    rec = ws.record
    acc = ws.acc
    for k in range(ws.world_size):
        decode(fmt, ws.recv[k * rec : (k + 1) * rec], acc, accumulate=k > 0, scratch=ws.tmp)
    if divisor is not None and divisor != 1:
        acc.div_(divisor)
    residual = None if feedback is None else feedback.server_residual(ws.chunk, ws.world_size, rank)
    encode(fmt, acc, ws.mine, residual=residual, scratch=ws.tmp, what="the reduced chunk")


def stage_decode(fmt: WireFormat, ws, x: Tensor) -> None:
    n, c, rec = ws.numel, ws.chunk, ws.record
    for j in range(ws.world_size):
        lo, hi = j * c, min((j + 1) * c, n)
        if hi > lo:
            decode(fmt, ws.recv[j * rec : (j + 1) * rec], x[lo:hi], numel=c)
