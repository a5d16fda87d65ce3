"""Bytes a rank puts on the wire for one collective, per backend algorithm.

These are the numbers the accounting records and the link emulation charges for. They count payload bytes
(no TCP/IP or transport headers) that *this rank sends*:

* **all-reduce**, gloo: gloo's ring algorithm (``gloo/allreduce.cc``: reduce-scatter then all-gather over
  ``2N`` segments of ``ceil(B / 2N)`` bytes rounded up to the element size; segments past the end of the buffer
  are clipped). When the element count divides by ``2N`` this is exactly :math:`2(N-1)B/N`; for ``N=2`` it is
  exactly ``B`` for every size. gloo may take a shared-memory shortcut when all ranks share a host; the count
  is then what the same collective sends between hosts.
* **all-reduce**, NCCL and others: the ring model :math:`\\lceil 2(N-1)B/N \\rceil`.
* **broadcast**: gloo's binomial tree (``gloo/broadcast.cc``): a rank sends ``B`` once per child in the tree
  rooted at ``src``; over all ranks that is :math:`(N-1)B`.
* **all-gather**: ring, :math:`(N-1)B_{local}` per rank.
* **reduce-scatter** of ``B`` bytes into ``N`` chunks, gloo: ``ProcessGroupGloo::reduce_scatter_single`` (torch 2.14)
  all-reduces a copy of the whole input with gloo's ring and keeps this rank's chunk, so it sends the all-reduce's
  bytes of the whole input; NCCL and others: the ring model :math:`\\lceil (N-1)B/N \\rceil`.
* **barrier**: no payload.
* **all-to-all** (equal splits): a rank sends its ``N − 1`` blocks for the others directly (its own stays local),
  :math:`(N-1)B_{block}` per rank, gloo and NCCL alike.
* **compressed all-reduce** (:mod:`lightning_sync.comm.compression`): an all-to-all of ``N`` encoded chunks then
  an all-gather of one, so :math:`2(N-1)` records of ``c`` elements per rank, ``c = ⌈numel/N⌉`` rounded up to the
  block of the scales (256) when quantised; a record is ``c`` times the wire element size — ``c / 2`` bytes for
  int4 and ``c / 4`` for int2, whose codes are packed two and four to a byte (the block is a multiple of both, so a
  chunk packs whole) — plus one 4-byte scale per block. Padding is counted: it is sent. A sparse record
  (``topk:<fraction>``) is ``k = ⌈fraction · c⌉`` entries of a 4-byte index and a 4-byte fp32 value, whatever the
  values; with narrow values (``topk:<fraction>+int8|int4|int2``) the ``k`` 4-byte indices, one 4-byte scale per
  256 entries and the ``k`` codes packed (8, 4 or 2 bits each), their bytes rounded up to a multiple of 4 so that
  every record keeps the next one 4-byte aligned (:func:`sparse_record_bytes`).

Nothing here imports ``torch.distributed``; the functions are pure and tested in-process.
"""

from __future__ import annotations

import math


def _round_up(value: int, multiple: int) -> int:
    return ((value + multiple - 1) // multiple) * multiple


def gloo_ring_allreduce_bytes(numel: int, element_size: int, world_size: int, rank: int) -> int:
    """Bytes ``rank`` sends in gloo's ring all-reduce of ``numel`` elements (``gloo/allreduce.cc::ring``)."""
    total = numel * element_size
    n = world_size
    if n <= 1 or total == 0:
        return 0
    num_segments = _round_up(max(1, 2 * n), n)  # gloo's maxSegmentSize is unbounded in ProcessGroupGloo
    per_rank = num_segments // n
    segment = _round_up((total + num_segments - 1) // num_segments, element_size)
    span = num_segments * segment
    sent = 0
    for i in range(num_segments - per_rank):
        for first in ((rank + 1) * per_rank, rank * per_rank):  # reduce-scatter, then all-gather
            offset = ((first + i) * segment) % span
            sent += max(0, min(segment, total - offset))
    return sent


def ring_allreduce_bytes(numel: int, element_size: int, world_size: int) -> int:
    """Ring all-reduce model, :math:`\\lceil 2(N-1)B/N \\rceil` bytes per rank."""
    if world_size <= 1:
        return 0
    return math.ceil(2 * (world_size - 1) * numel * element_size / world_size)


def allreduce_bytes(numel: int, element_size: int, world_size: int, rank: int, backend: str) -> int:
    if backend == "gloo":
        return gloo_ring_allreduce_bytes(numel, element_size, world_size, rank)
    return ring_allreduce_bytes(numel, element_size, world_size)


def reduce_scatter_bytes(numel: int, element_size: int, world_size: int, rank: int, backend: str) -> int:
    """Bytes ``rank`` sends in a reduce-scatter of an input of ``numel`` elements (FSDP2's gradient reduction): gloo
    all-reduces the whole input (see the module docstring), the others send :math:`(N-1)/N` of it (ring)."""
    if backend == "gloo":
        return gloo_ring_allreduce_bytes(numel, element_size, world_size, rank)
    if world_size <= 1:
        return 0
    return math.ceil((world_size - 1) * numel * element_size / world_size)


def broadcast_bytes(nbytes: int, world_size: int, rank: int, src: int) -> int:
    """Bytes ``rank`` sends in a binomial-tree broadcast from ``src`` (``gloo/broadcast.cc``)."""
    n = world_size
    if n <= 1 or nbytes == 0:
        return 0
    vrank = (rank - src) % n
    dim = max(1, math.ceil(math.log2(n)))
    mask = (1 << dim) - 1
    sends = 0
    for i in range(dim):
        mask ^= 1 << i
        if vrank & mask:
            continue
        vpeer = vrank ^ (1 << i)
        if vpeer >= n:
            continue
        if vrank & (1 << i) == 0:
            sends += 1
    return sends * nbytes


def allgather_bytes(local_nbytes: int, world_size: int) -> int:
    """Ring all-gather: each rank forwards ``N-1`` blocks of ``local_nbytes``."""
    return max(0, world_size - 1) * local_nbytes


def alltoall_bytes(block_nbytes: int, world_size: int) -> int:
    """All-to-all with equal splits: each rank sends ``N-1`` blocks of ``block_nbytes`` (its own block stays)."""
    return max(0, world_size - 1) * block_nbytes


def compressed_chunk_numel(numel: int, world_size: int, block: int = 1) -> int:
    """Elements of one rank's chunk in a compressed all-reduce: ``⌈numel / N⌉`` rounded up to ``block``."""
    if numel <= 0 or world_size <= 0:
        return 0
    return _round_up(math.ceil(numel / world_size), block)


def compressed_record_bytes(
    numel: int, element_size: int, block: int = 1, scale_bytes: int = 0, per_element: int = 1
) -> int:
    """Bytes of ``numel`` encoded elements: ``⌈numel / per_element⌉`` wire elements (``per_element`` codes packed
    in one: 2 for int4, 4 for int2) plus one scale per started block (when ``scale_bytes``)."""
    scales = math.ceil(numel / block) if scale_bytes else 0
    return math.ceil(numel / per_element) * element_size + scales * scale_bytes


def compressed_allreduce_bytes(
    numel: int, element_size: int, world_size: int, block: int = 1, scale_bytes: int = 0, per_element: int = 1
) -> tuple[int, int]:
    """Bytes a rank sends in a compressed all-reduce, as ``(all-to-all, all-gather)``: each is
    :math:`(N-1)` records of one chunk (:func:`compressed_chunk_numel`, :func:`compressed_record_bytes`)."""
    if world_size <= 1 or numel <= 0:
        return 0, 0
    chunk = compressed_chunk_numel(numel, world_size, block)
    record = compressed_record_bytes(chunk, element_size, block, scale_bytes, per_element)
    return alltoall_bytes(record, world_size), allgather_bytes(record, world_size)


#: bytes of one entry of a sparse record: an int32 index in the chunk and an fp32 value
SPARSE_ENTRY_BYTES = 8
#: bytes of one index of a sparse record (int32, its position in the chunk)
SPARSE_INDEX_BYTES = 4


def topk_count(numel: int, fraction: float) -> int:
    """Entries of a sparse record of ``numel`` elements: ``⌈fraction · numel⌉``, at least one (none for nothing)."""
    if numel <= 0:
        return 0
    return max(1, math.ceil(fraction * numel))


def sparse_record_bytes(
    numel: int, fraction: float, value_bits: int = 32, block: int = 256, scale_bytes: int = 4
) -> int:
    """Bytes of a sparse record of ``numel`` elements: its ``k`` = :func:`topk_count` entries. fp32 values
    (``value_bits=32``, ``topk:<fraction>``): ``k`` entries of :data:`SPARSE_ENTRY_BYTES`. Narrow values
    (``value_bits`` 8, 4 or 2: ``topk:<fraction>+int8|int4|int2``): ``k`` indices of :data:`SPARSE_INDEX_BYTES`,
    one ``scale_bytes`` scale per started ``block`` of entries, and the ``k`` codes packed ``8 // value_bits`` to a
    byte, those bytes rounded up to a multiple of 4 (the next record stays 4-byte aligned; the padding is sent)."""
    k = topk_count(numel, fraction)
    if value_bits == 32:
        return k * SPARSE_ENTRY_BYTES
    scales = math.ceil(k / block) * scale_bytes
    return k * SPARSE_INDEX_BYTES + scales + _round_up(math.ceil(k * value_bits / 8), 4)
