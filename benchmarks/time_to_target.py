"""The commands behind the committed time-to-target results (issue 16, item 6): per workload, the tuning, one
`compare` per link (one command per table), the merged report with the bandwidth plot, the kernel-limited cluster
row, and the communication-share check.

    python benchmarks/time_to_target.py                      # print the commands (nothing runs)
    python benchmarks/time_to_target.py --run                # run them, one after another
    python benchmarks/time_to_target.py --run --tune         # re-tune the recipes first
    python benchmarks/time_to_target.py --workloads vgg --only 1gbit --run

Per workload W (defaults: the communication-bound `vgg` and `words`, and the compute-bound control `digits`), with
`--devices` ranks (4) and `--out` (docs/benchmarks/time_to_target):

1. (`--tune`) `python benchmarks/tune.py --workload W --link 1gbit,1ms --seeds 2 --write examples/recipes`;
2. `lightning-sync compare --workload W --recipes --seeds 5 --link 1gbit,1ms` -> OUT/W/1gbit (the headline table);
3. the same with `--seeds 3` at 100mbit,1ms and 10gbit,1ms -> OUT/W/100mbit, OUT/W/10gbit;
4. `lightning-sync compare --merge OUT/W/100mbit OUT/W/1gbit OUT/W/10gbit --out OUT/W`: a table per link and
   `time_to_target_vs_bandwidth.png` over the three;
5. `sudo lightning-sync compare --workload W --recipes --seeds 3 --cluster 4x1gbit` -> OUT/W/cluster_4x1gbit (the
   1 Gbit/s row on kernel-limited links, no emulation; needs root);
6. `python benchmarks/comm_share.py --workload W --devices 4` (DDP's communication share at 1gbit,1ms).

Every table's speedups are against `ddp` (Lightning's DDPStrategy under the same link). Each compare run takes
`--run-timeout` (seconds, default none) as a wall-time cap on top of the configs' epoch budgets.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess

LINKS = {"100mbit": ("100mbit,1ms", 3), "1gbit": ("1gbit,1ms", 5), "10gbit": ("10gbit,1ms", 3)}


def commands(
    workloads: list[str], devices: int, out: str, tune: bool, only: list[str], run_timeout: float | None
) -> list[list[str]]:
    cmds: list[list[str]] = []
    timeout = ["--run-timeout", f"{run_timeout:g}"] if run_timeout else []
    for w in workloads:
        base = ["lightning-sync", "compare", "--workload", w, "--devices", str(devices), "--recipes"]
        if tune:
            cmds.append(
                ["python", "benchmarks/tune.py", "--workload", w, "--devices", str(devices), "--link",
                 "1gbit,1ms", "--seeds", "2", "--write", "examples/recipes", "--out", f"runs/tune/{w}"]
            )  # fmt: skip
        for name, (link, seeds) in LINKS.items():
            if not only or name in only:
                cmds.append([*base, "--seeds", str(seeds), "--link", link, *timeout, "--out", f"{out}/{w}/{name}"])
        if not only or len(only) == len(LINKS):
            folders = [f"{out}/{w}/{name}" for name in LINKS]
            cmds.append(["lightning-sync", "compare", "--merge", *folders, "--out", f"{out}/{w}"])
        if not only or "cluster" in only:
            cmds.append(
                ["sudo", *base, "--seeds", "3", "--cluster", "4x1gbit", *timeout, "--out", f"{out}/{w}/cluster_4x1gbit"]
            )
        if not only or "share" in only:
            cmds.append(["python", "benchmarks/comm_share.py", "--workload", w, "--devices", str(devices)])
    return cmds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="vgg,words,digits")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--out", default="docs/benchmarks/time_to_target")
    parser.add_argument("--tune", action="store_true", help="re-tune the recipes first (benchmarks/tune.py)")
    parser.add_argument("--only", default="", help=f"comma-separated subset of {', '.join(LINKS)}, cluster, share")
    parser.add_argument("--run-timeout", type=float, default=None, help="wall-time cap of each compare run (s)")
    parser.add_argument("--run", action="store_true", help="run the commands (default: print them)")
    args = parser.parse_args(argv)
    only = [o for o in args.only.split(",") if o]
    cmds = commands(
        [w for w in args.workloads.split(",") if w], args.devices, args.out, args.tune, only, args.run_timeout
    )
    for cmd in cmds:
        print(shlex.join(cmd), flush=True)
        if args.run:
            subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
