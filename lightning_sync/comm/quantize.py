"""Block quantisation and bit packing: the kernels of the integer wire formats (``int8``, ``int4``, ``int2``).

:mod:`lightning_sync.comm.compression` lays the records out and keeps the state; this module is the arithmetic.
Every kernel works in buffers it is given (no temporary of the data's size: packing and unpacking take one byte per
packed byte) and is pure torch.

**Quantisation** (symmetric, one fp32 scale per ``block`` consecutive elements): ``s = max|x| / Q`` over the block
(``Q`` the largest code: 127, 7 or 1; a block of zeros gets the smallest normal float as scale and codes 0), codes
``q = round(x / s)`` (round half to even). ``|x / s| <= Q (1 + 2^-24) < Q + 1/2``, so the codes are in [-Q, Q]
without a clamp and every element's error ``|x − q s|`` is at most ``s / 2``. With error feedback the value is
replaced by that error (its residual). With ``mean`` (the sparse formats' ternary values,
:mod:`lightning_sync.comm.sparse`) the scale is the block's mean ``|x|`` instead and the codes are clamped to
[-Q, Q]: for ``Q = 1`` every value from half the mean up is sent as ``±s``.

**Packing** (``bits`` 4 or 2: two or four codes a byte): code ``k`` of a group takes bits ``[k·bits, (k+1)·bits)``
of its byte, in two's complement (``q mod 2^bits``), so a zero byte holds zero codes: the zero padding of a record
decodes to zeros, like int8's. A last, partial group (a size not a multiple of 2 or 4) has zero codes past the end.
Packing and unpacking are integer masks and shifts on signed bytes (unpacking sign-extends by an arithmetic shift);
the codes on either side are small integers in a floating buffer, exact in any float type.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


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
