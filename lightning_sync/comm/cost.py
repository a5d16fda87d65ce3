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
* **barrier**: no payload.
* **all-to-all** (equal splits): a rank sends its ``N − 1`` blocks for the others directly (its own stays local),
  :math:`(N-1)B_{block}` per rank, gloo and NCCL alike.
* **compressed all-reduce** (:mod:`lightning_sync.comm.compression`): an all-to-all of ``N`` encoded chunks then
  an all-gather of one, so :math:`2(N-1)` records of ``c`` elements per rank, ``c = ⌈numel/N⌉`` rounded up to the
  int8 block (256) when quantised; a record is ``c`` times the wire element size plus one 4-byte scale per block.
  Padding is counted: it is sent.

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


def compressed_record_bytes(numel: int, element_size: int, block: int = 1, scale_bytes: int = 0) -> int:
    """Bytes of ``numel`` encoded elements: ``numel`` wire elements plus one scale per started block (when
    ``scale_bytes``)."""
    scales = math.ceil(numel / block) if scale_bytes else 0
    return numel * element_size + scales * scale_bytes


def compressed_allreduce_bytes(
    numel: int, element_size: int, world_size: int, block: int = 1, scale_bytes: int = 0
) -> tuple[int, int]:
    """Bytes a rank sends in a compressed all-reduce, as ``(all-to-all, all-gather)``: each is
    :math:`(N-1)` records of one chunk (:func:`compressed_chunk_numel`, :func:`compressed_record_bytes`)."""
    if world_size <= 1 or numel <= 0:
        return 0, 0
    record = compressed_record_bytes(compressed_chunk_numel(numel, world_size, block), element_size, block, scale_bytes)
    return alltoall_bytes(record, world_size), allgather_bytes(record, world_size)
