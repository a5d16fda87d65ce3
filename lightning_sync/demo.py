"""``lightning-sync demo``: the point of the pack in about four minutes on a 2-core CPU machine.

Lightning's own DDP against the methods that win on a slow link, on a communication-bound workload (``--workload
demo``: the ``words`` language model made small, 2 processes) under an emulated 100 Mbit/s, 1 ms link, 3 seeds,
time to a fixed validation perplexity. It is ``lightning-sync compare`` with these arguments (printed first), run in
worker processes started once; the table, the plots (time to target per method, perplexity against time) and every
run's records are written under ``--out``. The rows are the settings the decision guide starts a slow link from:
local SGD averaging every 32 steps in bf16 and DiLoCo averaging in bf16, both validating the last sync's model
(no averaging for validation).

    lightning-sync demo                      # ~4 min on 2 cores
    lightning-sync demo --seeds 1            # ~1.5 min
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from typing import Any

#: what ``demo`` runs: ``lightning-sync compare`` with these arguments (and ``--seeds``, ``--out``)
DEMO_ARGS = (
    "--workload",
    "demo",
    "--link",
    "100mbit,1ms",
    "--strategies",
    "ddp,localsgd+bf16,diloco+bf16",
    "--strategy-arg",
    "localsgd.period=32",
    "--strategy-arg",
    "localsgd.evaluate=last_sync",
    "--strategy-arg",
    "diloco.evaluate=last_sync",
    "--run-timeout",
    "300",
)
#: the command of the full grid (every method, three links), printed at the end
FULL_GRID = (
    "lightning-sync compare --workload words --devices 4 --seeds 3 "
    "--link 100mbit,1ms --link 1gbit,1ms --link 10gbit,1ms --out runs/grid"
)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from lightning_sync.compare import main as compare_main

    parser = argparse.ArgumentParser(prog="lightning-sync demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="runs per method (>= 1; default 3)")
    parser.add_argument("--out", default="runs/demo", help="output folder (default runs/demo)")
    args, extra = parser.parse_known_args(sys.argv[2:] if argv is None else argv)
    compare_args = [*DEMO_ARGS, "--seeds", str(args.seeds), "--out", args.out, *extra]
    print("lightning-sync demo = lightning-sync compare " + shlex.join(compare_args), flush=True)
    start = time.perf_counter()
    result = compare_main(compare_args)
    minutes, seconds = divmod(time.perf_counter() - start, 60)
    print(f"\nlightning-sync demo: {int(minutes)} min {seconds:.0f} s in all. Plots: {args.out}/100mbit-1ms/")
    print(f"The full grid (every method at three link speeds; hours on 2 cores):\n    {FULL_GRID}")
    return result
