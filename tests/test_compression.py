"""Compressed synchronization (``compression="bf16" | "fp16" | "int8" | "int4" | "int2"``): formats, bytes, error
bounds, strategies.

* In-process: the wire formats and their checks, the byte formulas of :mod:`lightning_sync.comm.cost`, encode/decode
  bounds, and the compressed all-reduce's per-rank stages run for N simulated ranks (the collectives done by copying
  records): identical results everywhere, bf16 within its rounding bound, int8, int4 and int2 with error feedback
  converging to the exact mean with a bounded accumulated error, workspaces reused; int4/int2's packing.
* Four gloo processes (no Lightning): :meth:`Communicator.all_reduce_compressed` bit-identical to the simulation,
  bytes recorded per collective exactly as the formulas say, asynchronous handles in flight during compute, link
  emulation charging the compressed bytes, subgroups and FedAvg-style partial participation.
* Two Lightning processes: BSP + bf16 trains the embedded default to within 2 points of fp32; the strategies' bytes
  per tag equal the analytic count; the parameter-server strategies with int8.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from launch import run_suite

from lightning_sync.comm import CommStats, Communicator, LinkModel
from lightning_sync.comm.compression import (
    FORMATS,
    INT8_BLOCK,
    Compressor,
    FeedbackView,
    check_compressible,
    check_compression,
    decode,
    encode,
    wire_format,
)
from lightning_sync.comm.cost import (
    allgather_bytes,
    alltoall_bytes,
    compressed_allreduce_bytes,
    compressed_chunk_numel,
    compressed_record_bytes,
)
from lightning_sync.launch import free_port

#: unit roundoff of the casts (round to nearest: relative error at most 2^-p for p significant bits)
U = {"bf16": 2.0**-8, "fp16": 2.0**-11}
#: the integer formats, their largest code and their wire bytes per code (packed: two or four codes a byte)
QMAX = {"int8": 127, "int4": 7, "int2": 1}
CODE_BYTES = {"int8": 1.0, "int4": 0.5, "int2": 0.25}
INTS = list(QMAX)
#: a sparse format (tests/test_topk.py has its own): in the gloo runs beside the dense ones, with fp32 values and
#: with ternary ones
TOPK = "topk:0.01"
TOPK_INT2 = "topk:0.01+int2"


# =============================================================================================== in-process
def simulate(comps: list[Compressor], xs: list[torch.Tensor], feedbacks=None, divisor=None, contribute=None):
    """The compressed all-reduce of ``xs`` (one per simulated rank, modified in place) by its three per-rank stages,
    with the all-to-all and the all-gather done by copying records between the ranks' workspaces."""
    n_ranks, numel = len(xs), xs[0].numel()
    wss = [c.acquire(numel, xs[0].dtype, xs[0].device, n_ranks) for c in comps]
    fb = feedbacks or [None] * n_ranks
    for r in range(n_ranks):
        comps[r].stage_encode(wss[r], xs[r], fb[r], True if contribute is None else contribute[r])
    rec = wss[0].record
    for r in range(n_ranks):  # all-to-all: rank r receives record r of every rank
        for k in range(n_ranks):
            wss[r].recv[k * rec : (k + 1) * rec].copy_(wss[k].send[r * rec : (r + 1) * rec])
    for r in range(n_ranks):
        comps[r].stage_reduce(wss[r], r, float(n_ranks) if divisor is None else divisor, fb[r])
    for r in range(n_ranks):  # all-gather of every rank's reduced chunk
        for k in range(n_ranks):
            wss[r].recv[k * rec : (k + 1) * rec].copy_(wss[k].mine)
    for r in range(n_ranks):
        comps[r].stage_decode(wss[r], xs[r])
        comps[r].release(wss[r])
    return xs


def _inputs(n_ranks: int, numel: int, seed: int = 0, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(numel, generator=g) for _ in range(n_ranks)]


def test_check_compression_accepts_exactly_the_formats():
    for value in (None, "bf16", "fp16", "int8", "int4", "int2"):
        assert check_compression(value) == value
    for bad in ("BF16", "INT4", "int3", "int1", "", 16, True, "fp32"):
        with pytest.raises(ValueError, match=r"compression must be None, 'bf16', 'fp16', 'int8', 'int4' or 'int2'"):
            check_compression(bad)


def test_check_compressible_refuses_what_cannot_shrink_or_is_not_floating():
    check_compressible("bf16", torch.float32, "x")
    check_compressible("fp16", torch.float64, "x")
    check_compressible("int8", torch.bfloat16, "x")
    check_compressible("int4", torch.bfloat16, "x")
    check_compressible("int2", torch.float16, "x")
    with pytest.raises(ValueError, match=r"does not shrink .*bfloat16.*Use compression='int8'"):
        check_compressible("bf16", torch.bfloat16, "the model")
    with pytest.raises(ValueError, match=r"does not shrink .*float16"):
        check_compressible("fp16", torch.float16, "the model")
    for name in INTS:
        with pytest.raises(ValueError, match=r"needs floating-point tensors.*torch.int64"):
            check_compressible(name, torch.int64, "the model")


@pytest.mark.parametrize("name", ["bf16", "fp16", *INTS])
@pytest.mark.parametrize("world,numel", [(2, 1001), (4, 1000), (3, 7), (4, 70_000), (5, 256 * 5 + 1), (3, 1)])
def test_byte_formula_is_elements_times_wire_size_plus_scales(name, world, numel):
    fmt = FORMATS[name]
    block = INT8_BLOCK if name in INTS else 1
    chunk = compressed_chunk_numel(numel, world, block)
    assert chunk == (math.ceil(math.ceil(numel / world) / block) * block)
    assert chunk * world >= numel > (chunk - block) * world - world  # padding is less than a block per rank
    # a chunk is whole blocks, so whole bytes of packed codes (256 codes: 128 bytes of int4, 64 of int2)
    record = compressed_record_bytes(chunk, fmt.element_size, block, fmt.scale_bytes, fmt.per_byte)
    expected = chunk * CODE_BYTES[name] + chunk // INT8_BLOCK * 4 if name in INTS else chunk * 2
    assert record == expected and isinstance(record, int)
    a2a, ag = compressed_allreduce_bytes(numel, fmt.element_size, world, block, fmt.scale_bytes, fmt.per_byte)
    assert a2a == ag == alltoall_bytes(record, world) == allgather_bytes(record, world) == (world - 1) * record
    assert fmt.allreduce_bytes(numel, world) == (a2a, ag)
    assert fmt.record_bytes(chunk) == record and fmt.chunk_numel(numel, world) == chunk
    assert fmt.allreduce_bytes(numel, 1) == (0, 0)
    # per element, scales included: the format's stated rate, exactly when the chunk is whole blocks
    assert record / chunk == fmt.bytes_per_element == (CODE_BYTES[name] + 4 / 256 if name in INTS else 2.0)


def test_byte_formula_worked_examples():
    # 4 ranks, 1M float32 elements: bf16 sends 2 * 3 chunks of 250k * 2 bytes; int8 2 * 3 chunks of 250,112 codes
    # (250k rounded up to 256) + 977 scales
    assert sum(compressed_allreduce_bytes(1_000_000, 2, 4)) == 3_000_000
    assert sum(compressed_allreduce_bytes(1_000_000, 1, 4, 256, 4)) == 6 * (250_112 + 977 * 4) == 1_524_120
    # int4: 125,056 bytes of codes (two a byte) + the same scales; int2: 62,528 bytes (four a byte)
    assert sum(FORMATS["int4"].allreduce_bytes(1_000_000, 4)) == 6 * (125_056 + 977 * 4) == 773_784
    assert sum(FORMATS["int2"].allreduce_bytes(1_000_000, 4)) == 6 * (62_528 + 977 * 4) == 398_616
    # fp32 ring for comparison: 2 * 3/4 * 4 MB
    from lightning_sync.comm.cost import ring_allreduce_bytes

    assert ring_allreduce_bytes(1_000_000, 4, 4) == 6_000_000


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_cast_encoding_is_round_to_nearest(name):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, dtype=torch.float64, generator=g) * 100
    # normal numbers only: below 2^-14 (6.1e-5) float16 is subnormal, with less than U relative precision
    x = x.sign() * x.abs().clamp_min(1e-3)
    fmt = FORMATS[name]
    record = torch.empty(fmt.record_bytes(1000), dtype=torch.uint8)
    encode(fmt, x, record)
    out = torch.empty(1000, dtype=torch.float64)
    decode(fmt, record, out)
    assert torch.equal(out, x.to(fmt.dtype).double())
    assert ((out - x).abs() <= U[name] * x.abs()).all()


def test_fp16_refuses_values_beyond_its_range():
    fmt = FORMATS["fp16"]
    x = torch.tensor([1.0, -70_000.0, 3.0])
    with pytest.raises(ValueError, match=r"beyond float16's range.*Use compression='bf16'"):
        encode(fmt, x, torch.empty(fmt.record_bytes(3), dtype=torch.uint8))


def test_int8_encoding_error_is_at_most_half_a_step_per_block_and_residual_is_what_was_dropped():
    fmt = FORMATS["int8"]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g) * torch.linspace(1e-3, 10, 1000)  # blocks of very different magnitudes
    x[256:512] = 0.0  # a block of zeros stays exactly zero
    record = torch.empty(fmt.record_bytes(1000), dtype=torch.uint8)
    residual = torch.zeros(1000)
    scratch = torch.empty(1000)
    encode(fmt, x, record, residual=residual, scratch=scratch)
    out = torch.empty(1000)
    decode(fmt, record, out)
    for start in range(0, 1000, INT8_BLOCK):
        block = slice(start, min(start + INT8_BLOCK, 1000))
        step = float(x[block].abs().max()) / 127
        assert float((out[block] - x[block]).abs().max()) <= step / 2 * (1 + 1e-5) + 1e-12
    assert torch.equal(out[256:512], torch.zeros(256))
    # the residual is what the encoding dropped (up to float32 rounding of values up to ~30)
    assert torch.allclose(residual, x - out, rtol=0, atol=1e-6 * float(x.abs().max()))
    assert record.numel() == 1000 + 4 * 4  # 1000 codes + 4 scales (the last block is partial)


@pytest.mark.parametrize("name", ["bf16", "fp16", *INTS])
@pytest.mark.parametrize("world,numel", [(2, 1001), (4, 1000), (3, 7), (4, 70_000)])
def test_simulated_all_reduce_is_identical_on_every_rank_and_close_to_the_mean(name, world, numel):
    xs = _inputs(world, numel)
    exact = torch.stack(xs).double().mean(0)
    comps = [Compressor(name) for _ in range(world)]
    out = simulate(comps, [x.clone() for x in xs])
    assert all(torch.equal(out[0], o) for o in out[1:])  # bit-identical replicas
    if name in U:
        # two roundings (each input, then the fp32 mean) and the fp32 sum: |err| <= u (mean|x_i| + |mean|) + eps
        bound = U[name] * (torch.stack(xs).abs().double().mean(0) + exact.abs()) * (1 + U[name]) + 1e-6
        assert ((out[0].double() - exact).abs() <= bound).all()
    else:  # without feedback: half a step of each input's block plus half a step of the reduced block
        assert float((out[0].double() - exact).abs().max()) <= 2 * float(torch.stack(xs).abs().max()) / QMAX[name]


def test_bf16_averaging_error_on_known_tensors():
    # 1 + 2^-8 is halfway between two bf16 neighbours (1 and 1 + 2^-7): rounds to even (1). Four ranks averaging
    # [1 + 2^-8, 1, 1, 1] therefore get exactly 1, an error of 2^-10 = u / 4 * mean, within the bound.
    xs = [torch.full((8,), 1.0 + 2.0**-8), torch.ones(8), torch.ones(8), torch.ones(8)]
    out = simulate([Compressor("bf16") for _ in range(4)], [x.clone() for x in xs])
    assert torch.equal(out[0], torch.ones(8))
    # values that bf16 holds exactly average exactly (the sum is taken in fp32, the mean is representable)
    xs = [torch.full((8,), v) for v in (1.0, 2.0, 3.0, 6.0)]
    assert torch.equal(simulate([Compressor("bf16") for _ in range(4)], xs)[0], torch.full((8,), 3.0))
    # a gloo-style bf16 SUM would round after every addition: 256 + 1 + 1 + 1 in bf16 from the left is 256; the
    # fp32 sum, rounded once, is bf16(259) = 260, and the mean 65
    xs = [torch.full((4,), 256.0), torch.ones(4), torch.ones(4), torch.ones(4)]
    assert torch.equal(simulate([Compressor("bf16") for _ in range(4)], xs)[0], torch.full((4,), 65.0))


@pytest.mark.parametrize("name", INTS)
def test_error_feedback_keeps_the_accumulated_error_bounded_and_the_mean_converges(name):
    world, numel, steps = 4, 5000, 200
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(numel, generator=g) * (1 + 10 * torch.rand(numel, generator=g)) for _ in range(world)]
    exact = torch.stack(xs).double().mean(0)
    amax = float(torch.stack(xs).abs().max())
    # a residual is at most half a step, s/2 = max|x + r| / 2Q, so at most amax / (2Q - 1) (the worker's); the
    # reduced values are at most amax + that, so the server's is at most (amax + worker's) / (2Q - 1)
    q = QMAX[name]
    worker_bound = amax / (2 * q - 1)
    bound = worker_bound + (amax + worker_bound) / (2 * q - 1)
    comps = [Compressor(name) for _ in range(world)]
    fbs = [c.feedback("s", numel, torch.float32, torch.device("cpu")) for c in comps]
    total = torch.zeros(numel, dtype=torch.float64)
    first_error = None
    for t in range(1, steps + 1):
        out = simulate(comps, [x.clone() for x in xs], fbs)
        total += out[0].double()
        accumulated = float((total - t * exact).abs().max())
        # sum of what was received = t * mean - mean(worker residuals) - server residual: each at most half a step
        assert accumulated <= bound * 1.01 + 1e-5 * t
        if t == 1:
            first_error = float((total - exact).abs().max())
    mean_error = float((total / steps - exact).abs().max())
    assert mean_error <= bound / steps * 1.01 + 1e-5  # ~1/t: the mean of the compressed averages converges
    assert mean_error <= first_error / 50
    # without feedback every step makes the same rounding error, so its mean never improves: it is the first step's
    comps = [Compressor(name) for _ in range(world)]
    for _ in range(3):
        plain = simulate(comps, [x.clone() for x in xs])[0].double()
        assert float((plain - exact).abs().max()) == first_error


def test_error_feedback_of_a_rank_that_does_not_contribute_is_kept():
    comps = [Compressor("int8") for _ in range(2)]
    fbs = [c.feedback("s", 600, torch.float32, torch.device("cpu")) for c in comps]
    fbs[1].worker.fill_(0.25)
    xs = _inputs(2, 600)
    out = simulate(comps, [x.clone() for x in xs], fbs, divisor=1.0, contribute=[True, False])
    assert torch.equal(fbs[1].worker, torch.full((600,), 0.25))  # untouched: nothing of it was sent
    assert float((out[0] - xs[0]).abs().max()) <= 2 * float(xs[0].abs().max()) / 127  # rank 0's value alone


def test_feedback_view_keeps_residuals_with_their_elements():
    fb = FeedbackView(torch.zeros(10), torch.zeros(4 * 256))
    assert fb.server_residual(256, 4, 2).data_ptr() == fb.server[512:].data_ptr()
    with pytest.raises(ValueError, match="packed server residual"):
        fb.server_residual(128, 4, 0)


def test_workspaces_are_allocated_once_per_shape_and_reused():
    comps = [Compressor("int8") for _ in range(3)]
    fbs = [c.feedback("s", 999, torch.float32, torch.device("cpu")) for c in comps]
    for _ in range(5):
        simulate(comps, _inputs(3, 999), fbs)
    assert [c.workspaces() for c in comps] == [1, 1, 1]
    ws = comps[0].acquire(999, torch.float32, torch.device("cpu"), 3)
    other = comps[0].acquire(999, torch.float32, torch.device("cpu"), 3)  # one in flight: a second one
    assert other is not ws and comps[0].workspaces() == 2
    comps[0].release(ws)
    comps[0].release(other)
    assert comps[0].acquire(999, torch.float32, torch.device("cpu"), 3) in (ws, other)


@pytest.mark.parametrize("name", INTS)
def test_compressor_state_round_trips_and_refuses_another_compression(name):
    c = Compressor(name)
    fb = c.feedback("grads/0", 300, torch.float32, torch.device("cpu"))
    fb.worker.copy_(torch.arange(300.0))
    fb.server_residual(256, 2, 1).fill_(3.0)
    state = c.state_dict()
    assert state["compression"] == name
    d = Compressor(name)
    d.load_state_dict(state)
    assert d.state_dict()["feedback"]["grads/0"]["worker"].equal(torch.arange(300.0))  # restored, not used yet
    restored = d.feedback("grads/0", 300, torch.float32, torch.device("cpu"))
    assert torch.equal(restored.worker, torch.arange(300.0))
    assert torch.equal(restored.server_residual(256, 2, 1), torch.full((256,), 3.0))
    assert torch.equal(restored.server_residual(256, 3, 1), torch.zeros(256))  # another layout starts at zero
    for other in ("bf16", *(n for n in INTS if n != name)):
        with pytest.raises(ValueError, match="Resume with the same compression"):
            Compressor(other).load_state_dict(state)
    assert Compressor("bf16").feedback("x", 10, torch.float32, torch.device("cpu")) is None  # casts: no state


# =============================================================================================== 4 gloo ranks
WORLD = 4
NUMEL = 70_001  # not a multiple of N or of the int8 block: padding is exercised and counted
#: the asynchronous bf16 all-reduce takes 0.35 s on it (0.17 s for int8): long against a descheduling on a loaded
#: 2-core machine running 4 ranks and their driver threads (tens of ms)
SLOW = LinkModel(bandwidth="5mbit", latency="5ms")
ASYNC_COMPUTE_S = 0.05  # compute while the asynchronous all-reduce is in flight


def _comm_worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    res: dict = {}
    try:
        stats = CommStats()
        comm = Communicator(stats)
        for name in ("bf16", "fp16", *INTS, TOPK, TOPK_INT2):
            comp = Compressor(name)
            fb = comp.feedback("x", NUMEL, torch.float32, torch.device("cpu"))
            outs = []
            for step in range(3):  # three steps: error feedback carries over
                x = _inputs(WORLD, NUMEL, seed=step)[rank]
                comm.all_reduce_compressed(x, comp, op="avg", tag=name, feedback=fb)
                outs.append(x)
            res[name] = {
                "out": [o.tolist() for o in outs],
                "bytes": stats.bytes_sent[name],
                "ops": stats.ops[name],
                "blocking": stats.blocking[name],
                "workspaces": comp.workspaces(),
            }
            # the buffers the two collectives carried: N records out (one stays), one record gathered from each
            ws = comp.acquire(NUMEL, torch.float32, torch.device("cpu"), WORLD)
            res[name].update(record=ws.record, send=ws.send.numel(), recv=ws.recv.numel(), mine=ws.mine.numel())
            comp.release(ws)
        # asynchronous, under link emulation: in flight during compute, same result as the blocking one
        slow = Communicator(CommStats(), link=SLOW)
        comp = Compressor("bf16")
        x = _inputs(WORLD, NUMEL, seed=7)[rank]
        y = x.clone()
        slow.all_reduce_compressed(y, comp, op="avg", tag="blocking")
        # the first asynchronous call starts the driver (a process group of its own, created by every rank)
        slow.all_reduce_compressed(torch.zeros(10), comp, tag="warm-up", async_op=True).wait()
        slow.barrier()
        launch = time.perf_counter()
        handle = slow.all_reduce_compressed(x, comp, op="avg", tag="async", async_op=True)
        compute_start = time.perf_counter() - launch
        a = torch.randn(200, 200)
        while time.perf_counter() - launch < ASYNC_COMPUTE_S:
            a = torch.tanh(a @ a.T / 200)
        res["async_completed_during_compute"] = handle.is_completed()
        checked_s = time.perf_counter() - launch  # the check ran before this
        handle.wait()
        res["async"] = {
            "launch_return_s": compute_start,
            "checked_s": checked_s,
            "done_s": handle.completed_at - launch,
            "equal_to_blocking": bool(torch.equal(x, y)),
            "blocked_s": slow.stats.blocked_seconds["async"],
            "blocking": slow.stats.blocking["async"],
            "bytes": slow.stats.bytes_sent["async"],
        }
        # link emulation charges the compressed bytes: two operations, latency + bytes / bandwidth each
        slow.barrier()
        t0 = time.perf_counter()
        slow.all_reduce_compressed(_inputs(WORLD, NUMEL)[rank], Compressor("int8"), tag="timed")
        res["emulated_s"] = time.perf_counter() - t0
        # a subgroup (blocking) and partial participation (FedAvg: ranks 1 and 3 send zeros, divide by 2)
        sub = comm.subgroup([0, 1, 2])
        if sub is not None:
            z = _inputs(3, 1000)[rank]
            sub.all_reduce_compressed(z, Compressor("int8"), op="avg", tag="sub")
            res["sub"] = z.tolist()
        part = _inputs(WORLD, 1000, seed=3)[rank]
        comm.all_reduce_compressed(part, Compressor("bf16"), op="sum", divisor=2.0, contribute=rank in (0, 2))
        res["part"] = part.tolist()
        res["bn"] = _bn_average(rank, comm)
        slow.close()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(res, f)
        dist.destroy_process_group()


def _bn_average(rank: int, comm: Communicator) -> dict:
    """A compressed parameter average (int2, the narrowest integer format) of a model with BatchNorm whose running
    variances moved from 1 to 0.4 on every rank, the parameters by about ±1.1 (a ternary code of the variance's change
    at that block's scale is −1.1: a variance of −0.1): once over every rank, once over ranks 0 and 2 (FedAvg)."""
    from lightning_sync.comm import FlatState
    from lightning_sync.strategies.codec import CompressedCodec

    out: dict = {}
    for case, participants in (("all", None), ("part", [0, 2])):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(10, 30), torch.nn.BatchNorm1d(30))
        flat = FlatState(model)
        codec = CompressedCodec(Compressor("int2"))
        codec.setup(flat, True, WORLD, "the test")
        (g,) = flat.groups
        gen = torch.Generator().manual_seed(rank + 1)
        with torch.no_grad():
            g.state[: g.param_numel].add_(torch.rand(g.param_numel, generator=gen).mul(2.2).sub(1.1))
            model[1].running_var.fill_(0.4).add_(torch.rand(30, generator=gen) * 0.01)
            model[1].running_mean.add_(torch.randn(30, generator=gen))
        buffers = g.buffers.clone()
        changes = g.state[: g.param_numel] - codec.reference[0][: g.param_numel]
        # the expectations, by the same collectives: the buffers exact, the parameters' changes alone compressed
        if participants is None:
            comm.all_reduce(buffers, op="avg", tag="bn/expected")
            comm.all_reduce_compressed(changes, Compressor("int2"), op="avg", tag="bn/expected")
        else:
            if rank not in participants:
                buffers.zero_()
            comm.all_reduce(buffers, op="sum", tag="bn/expected")
            buffers.div_(len(participants))
            comm.all_reduce_compressed(
                changes, Compressor("int2"), op="sum", divisor=2.0, contribute=rank in participants, tag="bn/expected"
            )
        params = codec.reference[0][: g.param_numel] + changes
        codec.average_state(comm, flat.state_tensors(), "bn", participants, rank)
        out[case] = {
            "buffers_exact": bool(torch.equal(g.buffers, buffers)),
            "params_compressed": bool(torch.equal(g.state[: g.param_numel], params)),
            "min_running_var": float(model[1].running_var.min()),
            "reference_taken": bool(torch.equal(codec.reference[0], g.state)),
            "checksum": float(g.state.double().sum()),
        }
    return out


@pytest.fixture(scope="module")
def comm_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("compression_comm")
    mp.start_processes(_comm_worker, args=(free_port(), str(out)), nprocs=WORLD, start_method="spawn")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("name", ["bf16", "fp16", *INTS, TOPK, TOPK_INT2])
def test_gloo_compressed_all_reduce_equals_the_simulation_bit_for_bit(comm_results, name):
    comps = [Compressor(name) for _ in range(WORLD)]
    fbs = [c.feedback("x", NUMEL, torch.float32, torch.device("cpu")) for c in comps]
    for step in range(3):
        expected = simulate(comps, _inputs(WORLD, NUMEL, seed=step), fbs)[0]
        for r in comm_results:
            assert torch.equal(torch.tensor(r[name]["out"][step]), expected)


@pytest.mark.parametrize("name", ["bf16", "fp16", *INTS, TOPK, TOPK_INT2])
def test_gloo_bytes_recorded_per_collective_equal_the_formula(comm_results, name):
    fmt = wire_format(name)
    a2a, ag = fmt.allreduce_bytes(NUMEL, WORLD)
    record = fmt.record_bytes(fmt.chunk_numel(NUMEL, WORLD))
    assert a2a == ag == (WORLD - 1) * record
    if name in INTS:  # 70,001 elements over 4 ranks: chunks of 17,664 (69 blocks), codes packed, 69 scales
        assert record == 17_664 * CODE_BYTES[name] + 69 * 4
    if name == TOPK:  # chunks of 17,501: the top 176 (1 %, rounded up), 8 bytes each
        assert record == 176 * 8
    elif name == TOPK_INT2:  # the same 176 entries: int32 indices, one scale, 44 bytes of ternary codes
        assert record == 176 * 4 + 4 + 44
    else:
        assert (a2a, ag) == compressed_allreduce_bytes(
            NUMEL, fmt.element_size, WORLD, fmt.block, fmt.scale_bytes, fmt.per_byte
        )
    for r in comm_results:
        # the records gloo carried: N in the all-to-all's input (its own stays), one into the all-gather
        assert r[name]["record"] == record and r[name]["mine"] == record
        assert r[name]["send"] == r[name]["recv"] == WORLD * record
        assert r[name]["bytes"] == 3 * (a2a + ag)  # three all-reduces, two collectives each
        assert r[name]["ops"] == r[name]["blocking"] == 6
        assert r[name]["workspaces"] == 1  # the buffers of the first all-reduce were reused


def test_gloo_async_compressed_all_reduce_is_in_flight_during_compute(comm_results):
    nbytes = sum(compressed_allreduce_bytes(NUMEL, 2, WORLD))
    emulated = 2 * SLOW.latency_seconds + 8 * nbytes / SLOW.bits_per_second  # two operations on the link
    for r in comm_results:
        a = r["async"]
        assert a["equal_to_blocking"]
        assert a["bytes"] == nbytes and a["blocking"] == 0
        assert a["launch_return_s"] < emulated / 2  # returned at once (a blocking launch takes >= emulated)
        assert a["done_s"] >= emulated
        # in flight during the compute: a handle is not complete before its emulated transfer is, so a check that
        # said "complete" returned at least `emulated` after the launch (exact). The check runs at about
        # ASYNC_COMPUTE_S = 0.05 s, 0.3 s before that: a handle that ignores the emulated link is caught
        assert not r["async_completed_during_compute"] or a["checked_s"] >= emulated, a
        assert a["blocked_s"] < a["done_s"]  # only what was left after the compute was waited for


def test_a_compressed_parameter_average_keeps_batchnorm_statistics_exact(comm_results):
    """The floating buffers are running statistics, not increments: they travel exactly beside the compressed
    parameters (with int2 a ternary code of a variance's change took running variances below zero: NaN at eval)."""
    for case in ("all", "part"):
        rows = [r["bn"][case] for r in comm_results]
        for row in rows:
            assert row["buffers_exact"] and row["params_compressed"] and row["reference_taken"], (case, row)
            assert row["min_running_var"] >= 0.4, (case, row)
        assert len({row["checksum"] for row in rows}) == 1, case  # every rank holds the same average


def test_gloo_link_emulation_charges_the_compressed_bytes(comm_results):
    nbytes = sum(compressed_allreduce_bytes(NUMEL, 1, WORLD, INT8_BLOCK, 4))
    emulated = 2 * SLOW.latency_seconds + 8 * nbytes / SLOW.bits_per_second
    for r in comm_results:
        assert emulated <= r["emulated_s"] < emulated + 0.25


def test_gloo_subgroup_and_partial_participation(comm_results):
    xs = _inputs(3, 1000)
    expected = simulate([Compressor("int8") for _ in range(3)], [x.clone() for x in xs])[0]
    for r in comm_results[:3]:
        assert torch.equal(torch.tensor(r["sub"]), expected)
    assert "sub" not in comm_results[3]
    xs = _inputs(WORLD, 1000, seed=3)
    exact = (xs[0].double() + xs[2].double()) / 2
    outs = [torch.tensor(r["part"]) for r in comm_results]
    assert all(torch.equal(outs[0], o) for o in outs)
    bound = U["bf16"] * ((xs[0].abs() + xs[2].abs()).double() / 2 + exact.abs()) * (1 + U["bf16"]) + 1e-6
    assert ((outs[0].double() - exact).abs() <= bound).all()


# =============================================================================================== Lightning
EPOCHS = 6  # lightning-sync compare's embedded default
SEEDS = 5


def _strategy_suite(rank: int, out_dir: str) -> None:
    import lightning.pytorch as pl

    import lightning_sync.strategies as S
    from lightning_sync.data import DigitsDataModule
    from lightning_sync.launch import quiet_trainer_kwargs
    from lightning_sync.models import DigitsCNN

    res: dict = {}
    kw = quiet_trainer_kwargs(accelerator="cpu", devices=2, limit_val_batches=0)

    class Numel(pl.Callback):
        """The flat state's sizes (the strategy drops it at teardown)."""

        def on_train_start(self, trainer, pl_module):
            groups = trainer.strategy.flat.groups
            self.numel = {
                "state": trainer.strategy.flat.numel(),
                "params": sum(g.param_numel for g in groups),
                "buffers": sum(g.buffer_numel for g in groups),
            }

    # BSP fp32 vs bf16 (and int8) on the embedded default: test accuracy of the model fit hands back, over SEEDS
    # seeds (one seed's run is chaotic: on one machine seed 0's fp32 run ends 3 points below the other seeds');
    # seed 0's run also gives the bytes and collectives
    for compression in (None, "bf16", "int8"):
        res[f"bsp/{compression}"] = {"acc": []}
        for seed in range(SEEDS):
            pl.seed_everything(seed)
            model, dm = DigitsCNN(), DigitsDataModule(batch_size=32)
            strategy = S.BSPStrategy(compression=compression, verify_sync=True)
            pl.Trainer(strategy=strategy, max_epochs=EPOCHS, callbacks=[numel := Numel()], **kw).fit(model, dm)
            test = pl.Trainer(strategy=S.BSPStrategy(), **quiet_trainer_kwargs(accelerator="cpu", devices=2))
            res[f"bsp/{compression}"]["acc"].append(float(test.test(model, dm, verbose=False)[0]["test/acc"]))
            if seed == 0:
                res[f"bsp/{compression}"].update(
                    bytes=dict(strategy.comm_stats.bytes_sent),
                    ops=dict(strategy.comm_stats.ops),
                    steps=strategy.step_counter.steps,
                    numel=numel.numel,
                )
    # one short fit per strategy family with int8: bytes per tag against the formula, replicas checked by verify_sync
    runs = {
        "localsgd": lambda: S.LocalSGDStrategy(period=4, compression="int8", verify_sync=True),
        "fedavg": lambda: S.FedAvgStrategy(fraction=0.5, syncs_per_epoch=2, compression="bf16", verify_sync=True),
        "osp": lambda: S.OSPStrategy(fixed_share=0.5, compression="int8", verify_sync=True),
        "asp": lambda: S.ASPStrategy(compression="int8"),
        "aladdin": lambda: S.ALADDINStrategy(period=2, compression="bf16"),
    }
    for name, make in runs.items():
        pl.seed_everything(0)
        model, dm = DigitsCNN(), DigitsDataModule(batch_size=32)
        strategy = make()
        pl.Trainer(strategy=strategy, max_epochs=2, callbacks=[numel := Numel()], **kw).fit(model, dm)
        res[name] = {
            "bytes": dict(strategy.comm_stats.bytes_sent),
            "ops": dict(strategy.comm_stats.ops),
            "steps": strategy.step_counter.steps,
            "syncs": strategy.step_counter.sync_steps,
            "numel": numel.numel,
            "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
            "pushes": getattr(strategy, "server_summary", {}).get("pushes"),
        }
    (Path(out_dir) / f"res_rank{rank}.json").write_text(json.dumps(res))


@pytest.fixture(scope="module")
def strategy_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("compression_strategies")
    return run_suite(_strategy_suite, 2, out)


#: the floor of a median test accuracy on the embedded default (10 classes: chance is 0.10)
ACC_FLOOR = 0.96


def test_bsp_bf16_trains_the_embedded_default_within_two_points_of_fp32(strategy_results):
    """Median test accuracy over SEEDS seeds: bf16 at most 2 points below fp32, both above ACC_FLOOR.

    The accuracies are the same in every run on one machine (4 runs of this suite gave identical numbers) but
    depend on the CPU's float kernels: each machine type draws its own trajectories, so the bounds leave room for
    another draw. Measured on one machine type (seeds 0-4): medians 0.986 fp32 / 0.984 bf16 (an earlier version),
    0.986 / 0.983 (now: fp32 runs 0.955-0.989, bf16 0.980-0.992). The runs cluster within 1.2 points, except an
    outlier about 3 points low (fp32 seed 0: 0.958, 0.955), 1 run of 10; a median leaves the cluster only when 3 of
    its 5 runs do. A per-seed pair differs by up to 2.5 points, so a single seed cannot carry the claim. (1 point
    is 3.6 of the 359 test images.)

    What fails it: a codec or reduction that breaks training, e.g. bytes that decode to garbage (median 0.10,
    measured). A cast that keeps only the exponent (low byte or mantissa zeroed) still trains to 0.98-0.99
    (measured), as SGD tolerates such gradients: the round-to-nearest and error-bound tests above catch that."""
    r = strategy_results[0]
    fp32, bf16, int8 = (statistics.median(r[f"bsp/{c}"]["acc"]) for c in ("None", "bf16", "int8"))
    assert fp32 > ACC_FLOOR, r["bsp/None"]["acc"]
    assert bf16 > ACC_FLOOR, r["bsp/bf16"]["acc"]
    assert bf16 >= fp32 - 0.02, (r["bsp/None"]["acc"], r["bsp/bf16"]["acc"])
    assert int8 > fp32 - 0.02, r["bsp/int8"]["acc"]  # int8 with error feedback: reported, loosely bounded


@pytest.mark.parametrize("compression", ["bf16", "int8"])
def test_bsp_gradient_bytes_are_the_compressed_count_plus_the_exact_buffers(strategy_results, compression):
    from lightning_sync.comm.cost import gloo_ring_allreduce_bytes

    for rank, res in enumerate(strategy_results):
        r = res[f"bsp/{compression}"]
        params, buffers, fmt = r["numel"]["params"], r["numel"]["buffers"], FORMATS[compression]
        per_step = sum(compressed_allreduce_bytes(params, fmt.element_size, 2, fmt.block, fmt.scale_bytes))
        per_step += gloo_ring_allreduce_bytes(buffers, 4, 2, rank)  # BatchNorm statistics, exact
        assert r["bytes"]["grads"] == r["steps"] * per_step
        assert r["ops"]["grads"] == 3 * r["steps"]  # all-to-all, all-gather, buffers
        fp32 = res["bsp/None"]
        ratio = r["bytes"]["grads"] / fp32["bytes"]["grads"]
        assert ratio == pytest.approx(0.5 if compression == "bf16" else 0.25, abs=0.03)


def test_parameter_averaging_bytes_are_the_compressed_count_plus_the_exact_buffers(strategy_results):
    """The parameters' changes in the wire format, the BatchNorm statistics exact beside them (running statistics: a
    rounded change could take a running variance below zero)."""
    from lightning_sync.comm.cost import gloo_ring_allreduce_bytes

    for rank, res in enumerate(strategy_results):
        for name, compression in (("localsgd", "int8"), ("fedavg", "bf16")):
            r, fmt = res[name], FORMATS[compression]
            params, buffers = r["numel"]["params"], r["numel"]["buffers"]
            assert buffers > 0 and params + buffers == r["numel"]["state"]  # the workload has BatchNorm
            per_sync = sum(compressed_allreduce_bytes(params, fmt.element_size, 2, fmt.block, fmt.scale_bytes))
            per_sync += gloo_ring_allreduce_bytes(buffers, 4, 2, rank)
            assert r["ops"]["params"] == 3 * r["syncs"]  # all-to-all, all-gather, buffers
            assert r["bytes"]["params"] == r["syncs"] * per_sync
            # the average at the end goes the same way; none where the last step synced (FedAvg's, the epoch's
            # last): the replicas are identical there. Local SGD (period 4) ends local steps past its last sync.
            last_synced = name == "fedavg" or (r["steps"] - 1) % 4 == 0
            assert r["bytes"].get("final", 0) == (0 if last_synced else per_sync)
            if name == "localsgd":
                assert not last_synced, r["steps"]  # the compressed final average is exercised
            assert r["finite"]


def test_osp_stages_and_parameter_server_messages_are_compressed(strategy_results):
    for res in strategy_results:
        osp = res["osp"]
        assert osp["bytes"]["ics"] > 0 and osp["finite"]
        # both stages together send at most what one int8 all-reduce of every gradient would, plus padding per stage
        full = sum(compressed_allreduce_bytes(osp["numel"]["params"], 1, 2, 256, 4))
        assert osp["bytes"]["ics"] + osp["bytes"]["rs"] <= osp["steps"] * (full + 2 * 2 * (256 + 4) + 8 * 64 * 4)
        asp = res["asp"]
        assert asp["finite"] and asp["pushes"] > 0
    # a push carries one server's shards: 32-byte header + int8 codes + a scale per 256 (rank 0 pushes to rank 1)
    asp = strategy_results[0]["asp"]
    numel = asp["numel"]["state"]
    shard1 = numel - math.ceil(numel / 2)  # ShardPlan: ceil(total / N) per shard, shard 1 is the rest
    assert asp["bytes"]["push"] == asp["pushes"] * (32 + shard1 + 4 * math.ceil(shard1 / 256))


# =============================================================================================== setup (one process)
def _fit_one_process(strategy, **trainer_kwargs) -> None:
    import lightning.pytorch as pl

    from lightning_sync.data import DigitsDataModule
    from lightning_sync.launch import quiet_trainer_kwargs
    from lightning_sync.models import DigitsCNN

    kw = quiet_trainer_kwargs(accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=3, limit_val_batches=0)
    kw.update(trainer_kwargs)
    pl.Trainer(strategy=strategy, **kw).fit(DigitsCNN(), DigitsDataModule(batch_size=32))


def test_a_cast_that_cannot_shrink_the_parameters_is_refused_at_setup(single_process):
    from lightning_sync import BSPStrategy

    with pytest.raises(ValueError, match=r"compression='bf16' does not shrink BSPStrategy's .* torch.bfloat16"):
        _fit_one_process(BSPStrategy(compression="bf16"), precision="bf16-true")
    _fit_one_process(BSPStrategy(compression="int8"), precision="bf16-true")  # int8 does shrink bf16


@pytest.mark.parametrize("name", ["localsgd", "aladdin"])
def test_compression_on_one_rank_trains_without_sending(name, single_process):
    import lightning_sync.strategies as S

    strategy = (
        S.LocalSGDStrategy(period=1, compression="int8")
        if name == "localsgd"
        else S.ALADDINStrategy(compression="int8")
    )
    _fit_one_process(strategy)
    sent = {tag: n for tag, n in strategy.comm_stats.bytes_sent.items() if n and tag != "work"}
    assert sent == {}  # (the parameter server's batch claims go to the store even on one rank)


def test_workspaces_of_sizes_not_used_recently_are_dropped():
    comp = Compressor("bf16")
    for numel in range(100, 100 + 3 * Compressor.MAX_SHAPES):  # e.g. OSP's stages as the layer selection changes
        comp.release(comp.acquire(numel, torch.float32, torch.device("cpu"), 2))
    assert comp.workspaces() == Compressor.MAX_SHAPES
    busy = comp.acquire(7, torch.float32, torch.device("cpu"), 2)
    for numel in range(1000, 1000 + 3 * Compressor.MAX_SHAPES):
        comp.release(comp.acquire(numel, torch.float32, torch.device("cpu"), 2))
    assert busy in comp._pool[(7, torch.float32, torch.device("cpu"), 2)]  # one in use is never dropped
