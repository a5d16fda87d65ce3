"""The packed integer formats (``compression="int4" | "int2"``) in-process: the bit layout of
:mod:`lightning_sync.comm.quantize`'s packing, and records of any size (int8's too) encoded within half a step per
element. Their all-reduce, byte formulas, error feedback and state are tested beside int8's in
``test_compression.py``."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_sync.comm.compression import FORMATS, INT8_BLOCK, decode, encode
from lightning_sync.comm.quantize import pack, packed_bytes, unpack

QMAX = {"int8": 127, "int4": 7, "int2": 1}
#: wire bytes per code (int4 and int2 packed two and four to a byte)
CODE_BYTES = {"int8": 1.0, "int4": 0.5, "int2": 0.25}
INTS = list(QMAX)


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("numel", [0, 1, 2, 3, 4, 5, 7, 1001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_pack_unpack_round_trip_two_or_four_codes_a_byte(bits, numel, dtype):
    half = 1 << (bits - 1)
    g = torch.Generator().manual_seed(numel)
    codes = torch.randint(-half, half, (numel,), generator=g).to(dtype)  # every code the bits hold, -8 and -2 too
    packed = torch.full((packed_bytes(numel, bits),), 0xFF, dtype=torch.uint8)
    kept = codes.clone()
    pack(codes, packed, bits)
    assert torch.equal(codes, kept)  # the codes are read, not clobbered
    assert packed.numel() == math.ceil(numel * bits / 8)
    out = torch.full((numel,), 99.0, dtype=dtype)
    unpack(packed, out, bits)
    assert torch.equal(out, codes)
    # the layout: code k of a byte in bits [k*bits, (k+1)*bits), two's complement; past the end, zero codes
    u = [int(c) % (1 << bits) for c in codes.tolist()] + [0] * (-numel % (8 // bits))
    per = 8 // bits
    expected = [sum(u[i + k] << (bits * k) for k in range(per)) for i in range(0, len(u), per)]
    assert packed.tolist() == expected
    # zero bytes are zero codes: a record's zero padding decodes to zeros
    unpack(torch.zeros_like(packed), out, bits)
    assert torch.equal(out, torch.zeros(numel, dtype=dtype))


@pytest.mark.parametrize("name", ["int4", "int2"])
def test_packed_encoding_error_is_at_most_half_a_step_per_block_and_residual_is_what_was_dropped(name):
    fmt, qmax = FORMATS[name], QMAX[name]
    g = torch.Generator().manual_seed(0)
    numel = 1001  # a partial block, and a size not a multiple of 2 or 4
    x = torch.randn(numel, generator=g) * torch.linspace(1e-3, 10, numel)  # blocks of very different magnitudes
    x[256:512] = 0.0  # a block of zeros stays exactly zero
    record = torch.empty(fmt.record_bytes(numel), dtype=torch.uint8)
    residual = torch.zeros(numel)
    scratch = torch.empty(numel)
    encode(fmt, x, record, residual=residual, scratch=scratch)
    out = torch.empty(numel)
    decode(fmt, record, out)
    for start in range(0, numel, INT8_BLOCK):
        block = slice(start, min(start + INT8_BLOCK, numel))
        step = float(x[block].abs().max()) / qmax
        err = (out[block] - x[block]).abs()
        assert float(err.max()) <= step / 2 * (1 + 1e-5) + 1e-12
        codes = out[block] / step if step else out[block]
        assert torch.allclose(codes, codes.round(), atol=1e-4) and float(codes.abs().max()) <= qmax + 1e-4
    assert torch.equal(out[256:512], torch.zeros(256))
    assert torch.allclose(residual, x - out, rtol=0, atol=1e-6 * float(x.abs().max()))
    # codes packed two or four a byte (the last byte partly used), then 4 scales (the last block is partial)
    assert record.numel() == math.ceil(numel * CODE_BYTES[name]) + 4 * 4
    # decoding into a sum (the reduction's) adds the same values, through its scratch
    acc = torch.ones(numel)
    decode(fmt, record, acc, accumulate=True, scratch=torch.empty(numel))
    assert torch.equal(acc, 1 + out)
    # fewer levels, larger errors: ternary keeps only the sign of values above half the block's maximum
    if name == "int2":
        big = x[:256].abs() > x[:256].abs().max() / 2
        assert torch.equal(out[:256][big].sign(), x[:256][big].sign()) and torch.equal(
            out[:256][~big], torch.zeros(int((~big).sum()))
        )


@pytest.mark.parametrize("name", INTS)
@pytest.mark.parametrize("numel", [1, 2, 3, 4, 5, 255, 256, 257, 1001])
def test_record_of_any_size_is_its_packed_codes_plus_a_scale_per_started_block(name, numel):
    # a parameter-server payload or a direct encode is any size: a last partial byte and block count whole
    fmt = FORMATS[name]
    codes = math.ceil(numel * CODE_BYTES[name])
    assert (
        fmt.record_bytes(numel)
        == codes + 4 * math.ceil(numel / 256)
        == packed_bytes(numel, fmt.bits) + 4 * math.ceil(numel / 256)
    )
    x = torch.linspace(-1, 1, numel)
    record = torch.full((fmt.record_bytes(numel),), 0xAB, dtype=torch.uint8)  # every byte is written
    encode(fmt, x, record)
    out = torch.empty(numel)
    decode(fmt, record, out)
    assert float((out - x).abs().max()) <= float(x.abs().max()) / QMAX[name] / 2 * (1 + 1e-6)
