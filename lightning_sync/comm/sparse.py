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

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_sync.comm.cost import SPARSE_INDEX_BYTES, topk_count
from lightning_sync.comm.quantize import dequantize, pack, packed_bytes, quantize, unpack

__all__ = ["ValueCode", "decode_sparse", "encode_sparse", "sparse_views"]


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
