"""What the wire formats cost on the CPU: encode + decode of one compressed all-reduce, per rank, on one thread.

    python benchmarks/codec_cost.py                              # words' 9,381,632 parameters, 4 ranks, 1 Gbit/s
    python benchmarks/codec_cost.py --numel 9816458 --world 4    # vgg's
    python benchmarks/codec_cost.py --formats int2,topk:0.05+int2 --bandwidth 100mbit

For each format, the real kernels of a sync (:class:`~lightning_sync.comm.compression.Compressor`'s three per-rank
stages, as :meth:`~lightning_sync.comm.Communicator.all_reduce_compressed` runs them) on one rank's tensor of
``--numel`` fp32 elements (normal values; error feedback on, its residuals carried from repeat to repeat, as in a
run), ``torch.set_num_threads(1)``; the two collectives are replaced by copies of the rank's own records into its
receive buffer (the same sizes, the same kind of values), and are not timed:

* **encode**: stage 1 (the rank's tensor plus its residual, encoded as ``N`` chunk records) and stage 2's encoding of
  the reduced chunk;
* **decode**: stage 2's decoding and fp32 sum of the ``N`` received records, and stage 3 (the ``N`` gathered
  records decoded into the tensor).

Each stage's time is the median over ``--repeats`` after one untimed warm-up (buffers allocated, kernels warm). The
table gives milliseconds per sync and per MB of the fp32 tensor, the bytes a rank sends
(:meth:`~lightning_sync.comm.compression.WireFormat.allreduce_bytes`) beside fp32's ring all-reduce
(:func:`~lightning_sync.comm.cost.ring_allreduce_bytes`), the seconds those saved bytes would take at
``--bandwidth``, and issue 60's goal: **encode + decode of a sync <= 10 % of the time the bytes saved would have taken
at 1 Gbit/s**.

Timings depend on the machine and its load: run it on a quiet machine (nothing else on the cores).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lightning_sync.comm.compression import Compressor, encode, wire_format
from lightning_sync.comm.cost import ring_allreduce_bytes
from lightning_sync.comm.link import parse_bandwidth

#: words' parameters (the workload issue 60's tables measure)
WORDS_NUMEL = 9_381_632
FORMATS = ("bf16", "int8", "int4", "int2", "topk:0.01", "topk:0.01+int2")
#: issue 60's goal: the codec's seconds at most this share of the time the bytes it saves would take
GOAL = 0.10


def measure(name: str, numel: int, world: int, repeats: int, seed: int = 0) -> dict[str, float]:
    """Median seconds of each stage of one rank's compressed all-reduce of ``numel`` fp32 elements (see the module
    docstring), and the bytes it sends."""
    g = torch.Generator().manual_seed(seed)
    source = torch.randn(numel, generator=g)
    comp = Compressor(name)
    feedback = comp.feedback("bench", numel, torch.float32, torch.device("cpu"))
    x = torch.empty(numel)
    times: dict[str, list[float]] = {"stage1": [], "reduce": [], "stage3": []}
    ws = comp.acquire(numel, torch.float32, torch.device("cpu"), world)
    try:
        for i in range(repeats + 1):
            x.copy_(source)
            t0 = time.perf_counter()
            comp.stage_encode(ws, x, feedback)
            t1 = time.perf_counter()
            ws.recv.copy_(ws.send)  # the all-to-all, not timed: the rank's own records stand for the others'
            t2 = time.perf_counter()
            comp.stage_reduce(ws, rank=0, divisor=float(world), feedback=feedback)
            t3 = time.perf_counter()
            ws.recv.copy_(ws.mine.repeat(world))  # the all-gather, not timed
            t4 = time.perf_counter()
            comp.stage_decode(ws, x)
            t5 = time.perf_counter()
            if i:  # the first is the warm-up
                times["stage1"].append(t1 - t0)
                times["reduce"].append(t3 - t2)
                times["stage3"].append(t5 - t4)
        # stage 2's encoding alone (its decoding and sum are the rest of the reduce stage)
        enc2: list[float] = []
        residual = feedback.server_residual(ws.chunk, world, 0) if feedback is not None else None
        for _ in range(repeats):
            ws.acc.copy_(source[: ws.chunk])  # a chunk is at most the tensor
            t0 = time.perf_counter()
            encode(comp.fmt, ws.acc, ws.mine, residual=residual, scratch=ws.tmp)
            enc2.append(time.perf_counter() - t0)
    finally:
        comp.release(ws)
    a2a, ag = comp.fmt.allreduce_bytes(numel, world)
    stage1, reduce_, stage3, encode2 = (statistics.median(v) for v in (*times.values(), enc2))
    return {
        "encode_s": stage1 + encode2,
        "decode_s": max(0.0, reduce_ - encode2) + stage3,
        "bytes": float(a2a + ag),
    }


def table(numel: int, world: int, formats: list[str], bandwidth: str, repeats: int) -> str:
    """The Markdown table of every format (see the module docstring)."""
    bps = parse_bandwidth(bandwidth)
    fp32 = ring_allreduce_bytes(numel, 4, world)
    mb = numel * 4 / 1e6
    lines = [
        f"{numel:,} fp32 elements ({mb:.1f} MB), {world} ranks, one thread; fp32's ring all-reduce sends "
        f"{fp32:,} bytes a rank; the goal: encode + decode <= {GOAL:.0%} of the saved bytes' time at {bandwidth}",
        "",
        "| format | bytes a rank sends | vs fp32 | encode ms | decode ms | encode + decode ms per MB | "
        f"saved bytes at {bandwidth}, ms | codec / saved | goal |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name in formats:
        wire_format(name)  # a bad name fails before any timing
        m = measure(name, numel, world, repeats)
        codec = m["encode_s"] + m["decode_s"]
        saved_s = 8 * (fp32 - m["bytes"]) / bps
        share = codec / saved_s if saved_s > 0 else float("inf")
        lines.append(
            f"| `{name}` | {m['bytes']:,.0f} | {m['bytes'] / fp32:.4f} | {1e3 * m['encode_s']:.1f} | "
            f"{1e3 * m['decode_s']:.1f} | {1e3 * codec / mb:.2f} | {1e3 * saved_s:.1f} | {share:.1%} | "
            f"{'met' if share <= GOAL else 'not met'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=WORDS_NUMEL, help="fp32 elements of the tensor (default: words')")
    parser.add_argument("--world", type=int, default=4, help="ranks of the all-reduce (>= 2)")
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated compressions")
    parser.add_argument("--bandwidth", default="1gbit", help="the link the saved bytes are timed at")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats of each stage (the median is kept)")
    args = parser.parse_args(argv)
    if args.numel < 1 or args.world < 2 or args.repeats < 1:
        parser.error("--numel >= 1, --world >= 2 and --repeats >= 1")
    torch.set_num_threads(1)
    text = table(args.numel, args.world, [f.strip() for f in args.formats.split(",") if f.strip()], args.bandwidth,
                 args.repeats)  # fmt: skip
    print(text)
    return text


if __name__ == "__main__":
    main()
