"""The sparse wire format ``compression="topk:<fraction>"`` (issue 60): records of each chunk's largest entries with
their indices, error feedback on both stages.

In-process: the argument's check, the record's size, what an encoding sends and keeps, the simulated all-reduce
(every rank's result bit-identical; the sum of what was received equals the sum of the exact means less the
residuals, so the mean converges), the refusal where the format does not apply. The 4-rank gloo all-reduce
(bit-identical to the simulation, bytes as the formula) is in ``tests/test_compression.py``; the bit-identical resume
of local SGD with it in ``tests/test_resume.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_compression import _fit_one_process, _inputs, simulate

from lightning_sync.comm.compression import Compressor, check_compression, decode, encode, wire_format
from lightning_sync.comm.cost import sparse_record_bytes, topk_count


def test_the_fraction_is_checked_and_written_one_way():
    assert check_compression("topk:0.01") == check_compression("topk:1e-2") == check_compression("topk:0.010")
    assert check_compression("topk:0.5") == "topk:0.5"
    for bad in ("topk:0", "topk:1", "topk:1.5", "topk:-0.1", "topk:", "topk:x", "topk:nan", "topk:inf", "TOPK:0.1"):
        with pytest.raises(ValueError, match=r"or 'topk:<fraction>' with 0 < fraction < 1 \(e.g. 'topk:0.01'\)"):
            check_compression(bad)


def test_a_record_is_k_entries_of_an_index_and_a_value():
    assert [topk_count(n, 0.01) for n in (0, 1, 99, 100, 101, 250_000)] == [0, 1, 1, 1, 2, 2500]
    assert sparse_record_bytes(250_000, 0.01) == 2500 * 8
    fmt = wire_format("topk:0.01")
    assert fmt.sparse and fmt.feedback and not fmt.quantized and fmt.bytes_per_element == 0.08
    # 1M fp32 elements on 4 ranks: chunks of 250,000, 2,500 entries each; 3 records out in each collective
    assert fmt.allreduce_bytes(1_000_000, 4) == (3 * 20_000, 3 * 20_000)
    # against bf16's 3,000,000 bytes: 1/25 (8 bytes for 1 % of the elements, 2 bytes for all of them)
    assert sum(wire_format("bf16").allreduce_bytes(1_000_000, 4)) == 25 * sum(fmt.allreduce_bytes(1_000_000, 4))
    assert fmt.allreduce_bytes(1_000_000, 1) == (0, 0)


def _roundtrip(fmt, x, residual=None, capacity=None, out_numel=None):
    record = torch.zeros(fmt.record_bytes(capacity or x.numel()), dtype=torch.uint8)
    encode(fmt, x, record, residual=residual, numel=capacity)
    out = torch.full((out_numel or x.numel(),), float("nan"), dtype=x.dtype)  # decode overwrites all of it
    decode(fmt, record, out, numel=capacity)
    return out


def test_an_encoding_sends_the_largest_entries_and_keeps_the_rest():
    fmt = wire_format("topk:0.1")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g)
    residual = torch.zeros(1000)
    out = _roundtrip(fmt, x, residual)
    sent = out.nonzero().flatten()
    assert torch.equal(sent, x.abs().topk(100).indices.sort().values)  # the 100 largest magnitudes, exactly
    assert torch.equal(out[sent], x[sent])  # fp32 values: sent exactly
    assert torch.equal(out + residual, x)  # what was not sent is the residual, nothing is lost
    # the next encoding sends x + residual: entries left out grow until they are among the largest
    out2 = _roundtrip(fmt, x, residual)
    assert torch.equal(out2 + residual, x + (x - out))
    # float64 (a wider tensor's accumulation): the residual also keeps what the fp32 value dropped
    x64 = torch.randn(1000, generator=g, dtype=torch.float64) / 3
    r64 = torch.zeros(1000, dtype=torch.float64)
    out64 = _roundtrip(fmt, x64, r64)
    assert torch.equal(out64 + r64, x64) and r64[out64 != 0].abs().max() > 0


def test_a_chunk_shorter_than_its_record_pads_with_zero_entries():
    fmt = wire_format("topk:0.5")
    x = torch.tensor([0.0, 3.0, -1.0])  # a record for 10 elements holds 5 entries: 3 real, 2 of padding
    out = _roundtrip(fmt, x, capacity=10)
    assert torch.equal(out, x)
    # a record of 10 elements decoded into its first 4 (a last chunk): entries past the end are skipped
    y = torch.tensor([1.0, -5.0, 2.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    assert torch.equal(_roundtrip(fmt, y, capacity=10, out_numel=4), torch.tensor([1.0, -5.0, 2.0, 0.5]))


@pytest.mark.parametrize("world,numel", [(2, 1001), (4, 1000), (3, 7), (4, 70_000)])
def test_simulated_all_reduce_is_identical_everywhere_and_no_more_than_its_entries(world, numel):
    name = "topk:0.05"
    comps = [Compressor(name) for _ in range(world)]
    fbs = [c.feedback("s", numel, torch.float32, torch.device("cpu")) for c in comps]
    out = simulate(comps, _inputs(world, numel), fbs)
    assert all(torch.equal(out[0], o) for o in out[1:])  # bit-identical replicas
    chunk = math.ceil(numel / world)
    assert int((out[0] != 0).sum()) <= world * topk_count(chunk, 0.05)  # k entries of each chunk's sum


def _check_error_feedback_identity(name: str) -> None:
    """60 syncs of 4 ranks under ``name``: what every rank received, summed, is the sum of the exact means less the
    mean worker residual and the server residual; the residuals' share of the running mean shrinks as 1/t."""
    world, numel, steps = 4, 4000, 60
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(numel, generator=g) * (1 + 10 * torch.rand(numel, generator=g)) for _ in range(world)]
    exact = torch.stack(xs).double().mean(0)
    comps = [Compressor(name) for _ in range(world)]
    fbs = [c.feedback("s", numel, torch.float32, torch.device("cpu")) for c in comps]
    total = torch.zeros(numel, dtype=torch.float64)
    errors = []
    for t in range(1, steps + 1):
        total += simulate(comps, [x.clone() for x in xs], fbs)[0].double()
        workers = torch.stack([fb.worker.double() for fb in fbs]).mean(0)
        chunk = comps[0].fmt.chunk_numel(numel, world)
        servers = torch.cat([fbs[r].server_residual(chunk, world, r).double() for r in range(world)])[:numel]
        assert torch.allclose(total, t * exact - workers - servers, rtol=0, atol=1e-4 * t)
        errors.append(float((total / t - exact).abs().max()))
    assert errors[-1] < errors[0] / 5


def test_error_feedback_delivers_the_exact_sum_less_the_residuals_and_the_mean_converges():
    """Stage 1 sends v_r - w_r (v_r = x_r + the previous w_r), stage 2 sends u - s (u = the mean of stage 1 + the
    previous s): summed over steps, what every rank received is sum_t mean_r(x_r) - mean_r(w_r) - s."""
    _check_error_feedback_identity("topk:0.05")


def test_sparse_formats_are_refused_where_they_would_not_average_changes(single_process):
    from lightning_sync import ASPStrategy, BSPStrategy, LocalSGDStrategy

    for strategy in (BSPStrategy(compression="topk:0.01"), ASPStrategy(compression="topk:0.01")):
        with pytest.raises(ValueError, match=r"compression='topk:0.01' \(sparse\) applies to the changes"):
            _fit_one_process(strategy)
    _fit_one_process(LocalSGDStrategy(period=2, compression="topk:0.01"))  # parameter averaging takes it


# ------------------------------------------------------------------------------------------ narrow values
#: the sparse formats with narrow values: codes of 8, 4 or 2 bits, one fp32 scale per 256 entries, beside the indices
NARROW = {"topk:0.1+int8": (127, 8), "topk:0.1+int4": (7, 4), "topk:0.1+int2": (1, 2)}


def test_narrow_values_are_checked_and_written_one_way():
    assert check_compression("topk:1e-2+int2") == check_compression("topk:0.010+int2") == "topk:0.01+int2"
    for name in ("topk:0.05+int8", "topk:0.05+int4", "topk:0.05+int2"):
        assert check_compression(name) == name
    for bad in ("topk:0.01+", "topk:0.01+int3", "topk:0.01+bf16", "topk:0.01+INT2", "topk:0+int2", "int2+topk:0.1",
                "topk:0.01+int2+int2", "topk:0.01+ int2"):  # fmt: skip
        with pytest.raises(ValueError, match=r"optionally with narrow values '\+int8', '\+int4' or '\+int2'"):
            check_compression(bad)


def test_a_narrow_record_is_scales_indices_and_packed_codes():
    from lightning_sync.comm.cost import sparse_record_bytes

    fmt = wire_format("topk:0.01+int2")
    assert fmt.sparse and fmt.quantized and fmt.feedback and fmt.bits == 2
    assert fmt.bytes_per_element == pytest.approx(0.01 * (4 + 0.25 + 4 / 256))
    # 1M elements on 4 ranks: chunks of 250,000 (not rounded to a block: the blocks are of entries), k = 2,500
    # entries: 10,000 bytes of indices, 10 scales (40 bytes), 625 bytes of codes rounded up to 628
    assert fmt.chunk_numel(1_000_000, 4) == 250_000
    assert fmt.record_bytes(250_000) == sparse_record_bytes(250_000, 0.01, 2) == 10_000 + 40 + 628
    assert fmt.allreduce_bytes(1_000_000, 4) == (3 * 10_668, 3 * 10_668)
    # words' 9,381,632 parameters on 4 ranks: 1/47 of bf16's bytes, 1/1.9 of topk's with fp32 values
    bf16, fp32 = (sum(wire_format(n).allreduce_bytes(9_381_632, 4)) for n in ("bf16", "topk:0.01"))
    assert sum(fmt.allreduce_bytes(9_381_632, 4)) == 2 * 3 * (23_455 * 4 + 92 * 4 + 5_864) == 600_312
    assert 46 < bf16 / 600_312 < 47 and 1.8 < fp32 / 600_312 < 1.9
    for name, (_, bits) in NARROW.items():  # every record a multiple of 4 bytes: the next one stays aligned
        for numel in (1, 3, 10, 11, 255, 2561, 100_003):
            k = topk_count(numel, 0.1)
            size = wire_format(name).record_bytes(numel)
            assert size == 4 * k + 4 * math.ceil(k / 256) + 4 * math.ceil(math.ceil(k * bits / 8) / 4)
            assert size % 4 == 0


@pytest.mark.parametrize("name", list(NARROW))
def test_a_narrow_encoding_sends_the_largest_entries_quantised_and_keeps_the_rest(name):
    qmax, bits = NARROW[name]
    fmt = wire_format(name)
    g = torch.Generator().manual_seed(0)
    numel = 3001  # 301 entries: a partial block of 45, a code count not a multiple of 4
    x = torch.randn(numel, generator=g) * torch.linspace(0.1, 10, numel)  # blocks of very different magnitudes
    residual = torch.zeros(numel)
    record = torch.full((fmt.record_bytes(numel),), 0xAB, dtype=torch.uint8)  # every byte is written
    encode(fmt, x, record, residual=residual)
    out = torch.full((numel,), float("nan"))
    decode(fmt, record, out)
    chosen = x.abs().topk(301).indices.sort().values  # the 301 largest magnitudes, in index order
    left_out = torch.ones(numel, dtype=torch.bool)
    left_out[chosen] = False
    assert torch.equal(out[left_out], torch.zeros(int(left_out.sum())))  # nothing else is sent
    assert torch.equal(residual[left_out], x[left_out])  # what the selection left out stays, whole
    # the chosen values, in index order, quantised per 256 entries: s = max|v| / Q (int8, int4) or the mean |v|
    # (int2: ternary codes clamped to [-1, 1]), codes round(v / s)
    v = x[chosen]
    for start in range(0, 301, 256):
        block = slice(start, min(start + 256, 301))
        if bits == 2:
            s = float(v[block].abs().mean())
            assert torch.allclose(out[chosen][block], (v[block] / s).round().clamp(-1, 1) * s, rtol=1e-6, atol=0)
            assert torch.equal(out[chosen][block].abs() > 0, v[block].abs() >= s / 2)  # from half the mean: +-s
        else:
            s = float(v[block].abs().max()) / qmax
            assert torch.allclose(out[chosen][block], (v[block] / s).round() * s, rtol=1e-6, atol=0)
            assert float((out[chosen][block] - v[block]).abs().max()) <= s / 2 * (1 + 1e-6)
    # residual = input - decoded, to the rounding of the subtraction
    assert torch.allclose(out + residual, x, rtol=0, atol=1e-6 * float(x.abs().max()))
    # the next encoding sends x + residual: entries left out grow until they are among the largest
    before = residual.clone()
    out2 = torch.empty(numel)
    encode(fmt, x, record, residual=residual)
    decode(fmt, record, out2)
    assert torch.allclose(out2 + residual, x + before, rtol=0, atol=1e-6 * float(x.abs().max()))
    # decoding into a sum adds the same values
    acc = torch.ones(numel)
    decode(fmt, record, acc, accumulate=True)
    assert torch.equal(acc, 1 + out2)


def test_a_short_narrow_chunk_pads_with_zero_entries():
    fmt = wire_format("topk:0.5+int2")
    x = torch.tensor([0.0, 3.0, -1.0])  # a record for 10 elements holds 5 entries: 3 real, 2 of padding
    record = torch.full((fmt.record_bytes(10),), 0xFF, dtype=torch.uint8)
    encode(fmt, x, record, numel=10)
    out = torch.empty(3)
    decode(fmt, record, out, numel=10)
    s = torch.tensor(4.0 / 3.0)  # ternary at the mean |v| of the 3 entries: 0 stays 0, 3 and -1 are sent as +-s
    assert torch.equal(out, torch.stack([torch.tensor(0.0), s, -s]))
    scales, index, codes = record[:4].view(torch.float32), record[4:24].view(torch.int32), record[24:]
    assert torch.equal(scales, s.view(1)) and index.tolist() == [0, 1, 2, 0, 0]
    assert codes.tolist() == [0b110100, 0, 0, 0]  # codes 0, +1, -1 (two's complement 0b11) in bits 0-1, 2-3, 4-5


def test_ternary_values_at_the_mean_keep_less_error_than_at_the_largest():
    """Why int2's scale is the chosen entries' mean |v| (``lightning_sync/comm/sparse.py``): on heavy-tailed values
    (normal times log-normal), the top 2 %'s ternary codes at the block's largest magnitude send almost every chosen
    entry as 0 and keep most of their squared norm as error; at the mean every chosen entry is sent, the error a
    fraction of it. int4's codes at the largest over 7 keep little error already (the dense kernel, kept)."""
    from lightning_sync.comm.quantize import quantize

    g = torch.Generator().manual_seed(0)
    x = torch.randn(200_000, generator=g) * torch.randn(200_000, generator=g).exp()
    v = x[x.abs().topk(4000).indices.sort().values]

    def encoded(qmax, mean):
        residual, codes = v.clone(), torch.empty(4000)
        quantize(residual, torch.empty(16), codes, qmax, 256, feedback=True, mean=mean)
        return float((codes == 0).float().mean()), float(residual.norm() ** 2 / v.norm() ** 2)

    zeros_max, error_max = encoded(1, False)
    zeros_mean, error_mean = encoded(1, True)
    assert zeros_max > 0.9 and error_max > 0.7
    assert zeros_mean == 0.0 and error_mean < 0.3
    assert encoded(7, False)[1] < 0.06
    # the format encodes with the mean: its record's 16 scales are the blocks' mean |v| (256 entries each, 160 last)
    fmt = wire_format("topk:0.02+int2")
    record = torch.zeros(fmt.record_bytes(200_000), dtype=torch.uint8)
    encode(fmt, x, record)
    means = torch.stack([v[i : i + 256].abs().mean() for i in range(0, 4000, 256)])
    assert torch.allclose(record[:64].view(torch.float32), means, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", ["topk:0.05+int2", "topk:0.05+int4", "topk:0.05+int8"])
@pytest.mark.parametrize("world,numel", [(2, 1001), (4, 70_000), (3, 7)])
def test_narrow_simulated_all_reduce_is_identical_everywhere(name, world, numel):
    comps = [Compressor(name) for _ in range(world)]
    fbs = [c.feedback("s", numel, torch.float32, torch.device("cpu")) for c in comps]
    out = simulate(comps, _inputs(world, numel), fbs)
    assert all(torch.equal(out[0], o) for o in out[1:])  # bit-identical replicas
    assert int((out[0] != 0).sum()) <= world * topk_count(math.ceil(numel / world), 0.05)


@pytest.mark.parametrize("name", ["topk:0.05+int2", "topk:0.05+int4"])
def test_narrow_error_feedback_delivers_the_exact_sum_less_the_residuals(name):
    """As with fp32 values: summed over steps, what every rank received is the sum of the exact means less the
    mean worker residual and the server residual — now holding the quantisation's error of the chosen entries too."""
    _check_error_feedback_identity(name)


def test_narrow_sparse_formats_are_refused_where_topk_is(single_process):
    from lightning_sync import ASPStrategy, BSPStrategy, LocalSGDStrategy

    for strategy in (BSPStrategy(compression="topk:0.01+int2"), ASPStrategy(compression="topk:0.01+int2")):
        with pytest.raises(ValueError, match=r"compression='topk:0.01\+int2' \(sparse\) applies to the changes"):
            _fit_one_process(strategy)
    _fit_one_process(LocalSGDStrategy(period=2, compression="topk:0.01+int2"))


def test_the_codec_cost_script_times_every_format_and_counts_their_bytes():
    """``benchmarks/codec_cost.py`` on a small tensor (its timings are the machine's; what is checked is that every
    format runs through the real stages and its bytes are the format's count)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import codec_cost

    text = codec_cost.main(["--numel", "3001", "--world", "4", "--repeats", "1"])
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == list(codec_cost.FORMATS)
    for row in rows:
        name, sent = row.split("`")[1], row.split("|")[2].strip()
        assert int(sent.replace(",", "")) == sum(wire_format(name).allreduce_bytes(3001, 4))
        assert row.rstrip(" |").endswith(("met", "not met"))
