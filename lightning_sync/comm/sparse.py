"""The sparse wire formats' kernels (``compression="topk:<fraction>"`` and ``"topk:<fraction>+int8|int4|int2"``,
:mod:`lightning_sync.comm.compression`): a record of a chunk's ``k = ⌈fraction · numel⌉`` entries of largest
magnitude (:func:`~lightning_sync.comm.cost.sparse_record_bytes`), encoded with error feedback and decoded by a
scatter-add. Nothing here imports ``torch.distributed``.

* fp32 values (``topk:<fraction>``): ``[k fp32 values | k int32 indices]``.
* Narrow values (``+int8``, ``+int4``, ``+int2``): ``[⌈k / 256⌉ fp32 scales | k int32 indices | k codes packed]``:
  the ``k`` chosen values, in the order of their indices (ascending), are quantised with the dense integer formats'
  kernels (:mod:`lightning_sync.comm.quantize`: one fp32 scale per 256 consecutive entries, codes ``round(v / s)``
  in [-Q, Q], packed 1, 2 or 4 to a byte), the code bytes padded with zeros to a multiple of 4. int8 and int4 keep
  the dense scale ``max|v| / Q``. **int2's scale is the block's mean** ``|v|`` (codes clamped to [-1, 1]), not the
  dense int2's ``max|v|``: the chosen entries are the chunk's largest, their magnitudes close together, and a
  ternary code at the largest one's scale sends every one below half of it as 0 — its index sent for nothing — and
  every one above half at up to twice its value. On heavy-tailed values most chosen entries became zeros and the
  error kept most of the values' energy (``tests/test_topk.py`` measures both on fixed data), and local SGD on
  ``words`` with ``topk:0.02+int2`` diverged (one seed, 2026-12-01; with the mean it reached the target). With
  error feedback the residual keeps both what the selection left out (the entries not chosen, whole) and what the
  quantisation dropped of the chosen ones (``v − q·s``): residual = input − decoded, element by element.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_sync.comm.cost import SPARSE_INDEX_BYTES, topk_count
from lightning_sync.comm.quantize import dequantize, pack, packed_bytes, quantize, unpack

__all__ = ["ValueCode", "decode_sparse", "encode_sparse", "select_largest", "sparse_views"]

#: chunks of at least this many elements select through a threshold (:func:`select_largest`); below, one
#: ``torch.topk`` of the chunk is as fast
SELECT_BY_THRESHOLD = 16_384
#: the threshold's sample: every ``stride``-th magnitude, with ``stride`` at most this ...
_SAMPLE_STRIDE = 64
#: ... and at least this many of the sample's largest expected above the threshold, so that it holds
_SAMPLE_ABOVE = 64
#: the threshold is set for this many times ``k`` candidates (one more pass never needed on random-like data)
_MARGIN = 1.25


@dataclass(frozen=True)
class ValueCode:
    """How a sparse record's values travel when narrower than fp32: codes in [-``qmax``, ``qmax``] of ``bits`` bits,
    one fp32 scale per ``block`` entries (the dense integer formats' quantisation applied to the chosen values)."""

    qmax: int
    bits: int
    block: int


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


def select_largest(magnitude: Tensor, k: int) -> Tensor:
    """The indices, ascending (int64), of the ``k`` largest of the 1-D ``magnitude`` (``0 < k <= numel``, not
    modified): exactly the set that ``torch.topk(magnitude, k)`` returns, sorted — the contract of every rank's
    records, ties at the ``k``-th magnitude included.

    A large chunk's selection goes by a threshold instead of a ``torch.topk`` of all of it (several times faster on
    one CPU thread: one comparison and one compaction of the chunk, then a ``torch.topk`` of the ~1.25 ``k``
    candidates): the ``k``-th largest of a strided sample, scaled, gives a threshold ``t`` with somewhat more than
    ``k`` entries at or above it; the candidates' ``k``-th largest ``T >= t`` is then the chunk's, and when exactly
    ``k`` entries are at or above ``T`` the top ``k`` is that one set, which is ``torch.topk``'s. Otherwise — ties at
    ``T`` straddling the ``k``-th place (``torch.topk`` then chooses among equals by its own order), fewer than ``k``
    candidates (a sample unlike the chunk), or a NaN (``torch.topk`` ranks NaN above everything) — the selection is
    the ``torch.topk`` of the whole chunk, as it always was. That costs the old time plus the failed try (~1/8 of
    it): on fresh normal data of 2.3M elements no selection of 100 at 1 % fell back, 2 of 100 at 5 %; in
    ``benchmarks/codec_cost.py``'s runs 6 of 70 did, its data full of equal magnitudes (the same tensor every repeat,
    and int2 values, ``q·s``, equal across a block)."""
    m = magnitude.numel()
    if m >= SELECT_BY_THRESHOLD and 4 * k <= m and k >= 4 * _SAMPLE_ABOVE:  # a sample of at most 1/4 of the chunk
        chosen = _by_threshold(magnitude, k)
        if chosen is not None:
            return chosen
    return torch.topk(magnitude, k, sorted=False).indices.sort().values


def _by_threshold(magnitude: Tensor, k: int) -> Tensor | None:
    """:func:`select_largest` through a sampled threshold, or ``None`` where it cannot be sure of ``torch.topk``'s
    set (its docstring)."""
    m = magnitude.numel()
    stride = max(1, min(_SAMPLE_STRIDE, k // _SAMPLE_ABOVE))
    sample = magnitude[::stride]
    ks = min(sample.numel(), math.ceil(_MARGIN * k / stride) + 8)
    t = torch.topk(sample, ks, sorted=False).values.min()
    candidate = torch.lt(magnitude, t)
    candidate.logical_not_()  # at or above t, and NaN (a NaN threshold takes all: refused below)
    index = candidate.nonzero().view(-1)  # ascending
    n = index.numel()
    if n > m // 2:  # many ties at t (e.g. a chunk mostly of zeros, as a reduced chunk of sparse records): above it
        torch.le(magnitude, t, out=candidate)
        candidate.logical_not_()
        index = candidate.nonzero().view(-1)
        n = index.numel()
    if n < k or n > m // 2:
        return None
    values = magnitude.index_select(0, index)
    if bool(values.isnan().any()):
        return None
    # T: the candidates' k-th largest, from whichever end is shorter
    if k <= n - k + 1:
        kth = torch.topk(values, k, sorted=False).values.min()
    else:
        kth = torch.topk(values, n - k + 1, largest=False, sorted=False).values.max()
    chosen = index.masked_select(torch.ge(values, kth))
    return chosen if chosen.numel() == k else None


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
        chosen = select_largest(magnitude, kk)
        index[:kk].copy_(chosen)
    index[kk:].zero_()
    if code is None:
        assert values is not None
        if chosen is not None:
            picked = v.index_select(0, chosen)
            values[:kk].copy_(picked)
            if residual is not None:  # the indices are distinct: a copy to them is the assignment
                residual.index_copy_(0, chosen, picked - values[:kk].to(picked.dtype))
        values[kk:].zero_()
        return
    assert scales is not None and codes is not None
    used = packed_bytes(kk, code.bits)
    if chosen is not None:
        picked = v.index_select(0, chosen)  # a copy (k elements): quantised, then (with feedback) what codes dropped
        work = torch.empty_like(picked)
        ternary = code.qmax == 1  # int2: the block's mean |v| as scale (the module docstring)
        q = quantize(picked, scales, work, code.qmax, code.block, feedback=residual is not None, mean=ternary)
        if code.bits == 8:
            codes[:kk].view(torch.int8).copy_(q)
        else:
            pack(q, codes[:used], code.bits)
        if residual is not None:
            residual.index_copy_(0, chosen, picked)
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
