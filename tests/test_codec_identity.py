"""The codec kernels write bit-identical numbers to their frozen reference (``tests/codec_reference.py``, the kernels
as they were before they were made faster): every record's bytes (the selected indices, in their order, the values,
scales and packed codes), every residual and every decoded value, for every wire format, on inputs chosen to reach
every path — ties at a sparse record's threshold (the selection then falls back to one ``torch.topk`` of the whole
chunk, whose choice among equal magnitudes is the contract), zeros, heavy tails, non-finite values, short chunks,
padded records, float64 and bfloat16 tensors — and through the three per-rank stages of a compressed all-reduce with
error feedback over several syncs. Both run on this machine, so nothing machine-dependent is pinned.

Non-finite input is checked for the casts and the fp32-valued sparse format only: the integer codes of a NaN are a
float-to-integer cast of NaN, undefined in C++ (the integer formats send garbage for non-finite input, as before).
"""

from __future__ import annotations

import codec_reference as ref
import pytest
import torch

from lightning_sync.comm.compression import Compressor, ErrorFeedback, accumulation_dtype, decode, encode, wire_format
from lightning_sync.comm.sparse import _by_threshold, select_largest

DENSE = ("bf16", "fp16", "int8", "int4", "int2")
SPARSE = ("topk:0.01", "topk:0.1", "topk:0.5", "topk:0.01+int2", "topk:0.05+int4", "topk:0.05+int8", "topk:0.3+int2")
KINDS = ("normal", "heavy", "ties", "sparse", "zeros", "special")
#: sizes from one element to chunks past the sparse selection's fast path, odd and block-aligned
SIZES = (1, 5, 256, 1000, 5003, 40_001)


def _data(kind: str, m: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, generator=g, dtype=torch.float64)
    if kind == "heavy":  # magnitudes over many orders
        x = x * torch.exp(3 * torch.randn(m, generator=g, dtype=torch.float64))
    elif kind == "ties":  # a handful of values: ties at every threshold
        x = torch.randint(-3, 4, (m,), generator=g).double()
    elif kind == "sparse":
        x = x * (torch.rand(m, generator=g, dtype=torch.float64) < 0.05)
    elif kind == "zeros":
        x = torch.zeros(m, dtype=torch.float64)
    elif kind == "special":
        at = torch.randint(0, m, (max(1, m // 50),), generator=g)
        x[at] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0], dtype=torch.float64).repeat(
            len(at) // 4 + 1
        )[: len(at)]
    return x.to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(_bits(a), _bits(b)), what


def _fits(name: str, kind: str) -> bool:
    fmt = wire_format(name)
    return kind != "special" or not fmt.quantized


def _one(name: str, kind: str, m: int, dtype: torch.dtype, feedback: bool, pad: int, scratch: bool, seed: int):
    """Encode and decode one input with the kernels and with the reference; compare every number."""
    fmt = wire_format(name)
    if name == "fp16" and kind in ("heavy",):
        return  # beyond fp16's range: both raise (checked once below)
    numel = m + pad
    src = _data(kind, m, dtype, seed)
    acc = accumulation_dtype(dtype)
    res0 = 0.1 * _data("normal", m, acc, seed + 1) if feedback else None
    outs = []
    for encode_, decode_ in ((encode, decode), (ref.encode, ref.decode)):
        record = torch.zeros(fmt.record_bytes(numel), dtype=torch.uint8)
        residual = None if res0 is None else res0.clone()
        # the integer formats' scratch is in the dtype of what they quantise (the residual's, else the source's)
        # (without a scratch they allocate one like the source, so a bfloat16 source with a fp32 residual needs one)
        work_dtype = acc if feedback or fmt.sparse else dtype
        scratch = scratch or (fmt.quantized and not fmt.sparse and feedback and dtype != acc)
        work = torch.full((numel,), 7.0, dtype=work_dtype) if scratch else None
        x = src.clone()
        encode_(fmt, x, record, residual=residual, scratch=work, numel=numel)
        _same(x, src, "the source is not modified")
        plain = torch.full((m,), float("nan"), dtype=dtype)
        decode_(fmt, record, plain, numel=numel)
        summed = _data("normal", m, dtype, seed + 2)
        decode_(fmt, record, summed, accumulate=True, numel=numel, scratch=torch.empty(m, dtype=dtype))
        outs.append((record, residual, plain, summed))
    (r1, e1, p1, s1), (r2, e2, p2, s2) = outs
    case = f"{name} {kind} m={m} {dtype} feedback={feedback} pad={pad} scratch={scratch}"
    _same(r1, r2, f"record: {case}")
    if feedback:
        _same(e1, e2, f"residual: {case}")
    _same(p1, p2, f"decoded: {case}")
    _same(s1, s2, f"decoded and added: {case}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", DENSE + SPARSE)
def test_records_residuals_and_decoded_values_are_the_reference_bits(name, kind):
    if not _fits(name, kind):
        pytest.skip("integer codes of non-finite values are undefined (the module docstring)")
    fmt = wire_format(name)
    seed = 0
    for m in SIZES:
        for dtype in (torch.float32, torch.float64, torch.bfloat16) if m < 10_000 else (torch.float32,):
            for feedback in (False, True) if fmt.feedback else (False,):
                pads = (0, 7) if fmt.sparse else (0, (-m) % 256 if fmt.quantized else 0)
                for pad in sorted(set(pads)):
                    seed += 1
                    _one(name, kind, m, dtype, feedback, pad, scratch=bool(seed % 2), seed=seed)


def test_the_selection_takes_the_whole_chunk_topk_when_magnitudes_tie_at_its_threshold():
    """Ties straddling the k-th magnitude: the records are the reference's (one ``torch.topk`` of the chunk) —
    values drawn from a few levels so that the k-th largest is shared by many entries, at sizes past the fast
    path."""
    for name in ("topk:0.01", "topk:0.01+int2"):
        fmt = wire_format(name)
        for m, levels in ((100_000, 5), (150_001, 50), (123_457, 2000)):
            g = torch.Generator().manual_seed(m)
            src = torch.randint(-levels, levels + 1, (m,), generator=g).float() / levels
            records = []
            for encode_ in (encode, ref.encode):
                record = torch.zeros(fmt.record_bytes(m), dtype=torch.uint8)
                residual = torch.zeros(m)
                encode_(fmt, src, record, residual=residual, scratch=torch.empty(m))
                records.append((record, residual))
            _same(records[0][0], records[1][0], f"{name} m={m}")
            _same(records[0][1], records[1][1], f"{name} m={m} residual")


def test_the_threshold_selection_is_taken_on_distinct_magnitudes_and_refused_where_unsure():
    """The fast path (:func:`~lightning_sync.comm.sparse.select_largest`'s threshold) is what the tests above check
    on large chunks of distinct values — it gives ``torch.topk``'s set — and it declines (``None``: the whole
    chunk's ``torch.topk``) on ties straddling the k-th place, on a NaN, and on a chunk too sparse for its sample."""
    g = torch.Generator().manual_seed(3)
    m, k = 40_001, 401
    x = torch.randn(m, generator=g).abs()
    chosen = _by_threshold(x, k)
    assert chosen is not None and torch.equal(chosen, torch.topk(x, k).indices.sort().values)
    assert torch.equal(select_largest(x, k), chosen)
    sparse = torch.zeros(m)
    sparse[torch.randperm(m, generator=g)[: 2 * k]] = torch.rand(2 * k, generator=g) + 0.5  # a reduced chunk
    chosen = _by_threshold(sparse, k)  # the sample's threshold is 0: taken strictly above it
    assert chosen is not None and torch.equal(chosen, torch.topk(sparse, k).indices.sort().values)
    assert _by_threshold(torch.randint(0, 5, (m,), generator=g).float(), k) is None  # ties at the k-th
    x[123] = float("nan")
    assert _by_threshold(x, k) is None
    assert torch.equal(select_largest(x, k), torch.topk(x, k).indices.sort().values)  # NaN first, as topk ranks it
    few = torch.zeros(m)
    few[:10] = 1.0
    assert _by_threshold(few, k) is None  # fewer than k above zero, k - 10 zeros to choose among


def test_fp16_beyond_its_range_raises_in_both():
    fmt = wire_format("fp16")
    x = torch.tensor([1.0, 1e6])
    for encode_ in (encode, ref.encode):
        with pytest.raises(ValueError, match="beyond float16's range"):
            encode_(fmt, x, torch.zeros(fmt.record_bytes(2), dtype=torch.uint8))


def _reference_sync(fmt, wss, xs, fbs):
    n = len(xs)
    for r in range(n):
        ref.stage_encode(fmt, wss[r], xs[r], fbs[r])
    _exchange(wss, "send")
    for r in range(n):
        ref.stage_reduce(fmt, wss[r], r, float(n), fbs[r])
    _exchange(wss, "mine")
    for r in range(n):
        ref.stage_decode(fmt, wss[r], xs[r])


def _sync(comps, wss, xs, fbs):
    n = len(xs)
    for r in range(n):
        comps[r].stage_encode(wss[r], xs[r], fbs[r])
    _exchange(wss, "send")
    for r in range(n):
        comps[r].stage_reduce(wss[r], r, float(n), fbs[r])
    _exchange(wss, "mine")
    for r in range(n):
        comps[r].stage_decode(wss[r], xs[r])


def _exchange(wss, part):
    """The all-to-all (``send``: rank r receives record r of every rank) or the all-gather (``mine``)."""
    rec = wss[0].record
    for r, ws in enumerate(wss):
        for k, other in enumerate(wss):
            piece = other.send[r * rec : (r + 1) * rec] if part == "send" else other.mine
            ws.recv[k * rec : (k + 1) * rec].copy_(piece)


@pytest.mark.parametrize("name", DENSE[2:] + SPARSE)
@pytest.mark.parametrize(
    ("numel", "dtype"), [(9_999, torch.float32), (120_003, torch.float32), (20_001, torch.bfloat16)]
)
def test_the_stages_of_a_compressed_all_reduce_are_the_reference_bits_sync_after_sync(name, numel, dtype):
    """Four simulated ranks, three syncs with error feedback (both residuals carried): after each, every buffer of
    every rank — records sent and received, the reduced chunk's record, the tensor, both residuals — is the
    reference's, bit for bit."""
    world = 4
    fmt = wire_format(name)
    runs = []
    for reference in (False, True):
        comps = [Compressor(name) for _ in range(world)]
        wss = [c.acquire(numel, dtype, torch.device("cpu"), world) for c in comps]
        fbs = [ErrorFeedback(numel, accumulation_dtype(dtype), torch.device("cpu")) for _ in range(world)]
        states = []
        for step in range(3):
            xs = [_data("heavy" if step == 1 else "normal", numel, dtype, 10 * step + r) for r in range(world)]
            if reference:
                _reference_sync(fmt, wss, xs, fbs)
            else:
                _sync(comps, wss, xs, fbs)
            states.append(
                [
                    (ws.send.clone(), ws.recv.clone(), ws.mine.clone(), x, fb.worker.clone(), fb.server.clone())
                    for ws, x, fb in zip(wss, xs, fbs)
                ]
            )
        runs.append(states)
    for step, (mine, theirs) in enumerate(zip(*runs)):
        for rank, (a, b) in enumerate(zip(mine, theirs)):
            for what, u, v in zip(("send", "recv", "mine", "tensor", "worker residual", "server residual"), a, b):
                _same(u, v, f"{name} numel={numel} {dtype} sync {step} rank {rank}: {what}")
