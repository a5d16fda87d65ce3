"""The wide drop-in check (issue 57): every strategy at its defaults against Lightning's DDP on more than one ordinary
script, over many seeds, in fp32 and with clipping + bf16.

Two user scripts (``benchmarks/dropin.py``'s ``SCRIPTS``): the ResNet-style CNN with BatchNorm on the embedded
digits, SGD with Nesterov momentum and a per-step OneCycleLR; and a small character Transformer on Python's help text
with AdamW and a linear warm-up (``benchmarks/dropin_text.py``). Both: 2 ranks, 3 epochs of 32 steps per rank
(per-rank batch 16), ``ModelCheckpoint`` + ``EarlyStopping`` on ``val_acc``, ``val_check_interval=0.5``; validation
accuracy after fit. Two configurations (``benchmarks/dropin.py`` ``CONFIGS``): ``fp32`` (``precision="32-true"``, no
clipping) and ``clip+bf16`` (``gradient_clip_val=1.0`` with ``precision="bf16-mixed"``: bf16 autocast of the
forward and backward; the averaging itself is in fp32, no compression). What a strategy refuses at setup is changed
up front as its message says (OSP: no clipping; the parameter-server strategies: validation at epoch ends).

The rule, per script, configuration and strategy, against ``ddp`` on the same seeds: FAIL when the mean validation
accuracy is more than ``--mean-margin`` (3) points below ``ddp``'s, or when any seed is more than ``--seed-margin``
(10) points below ``ddp``'s run on that seed.

    python benchmarks/dropin_grid.py --out DIR                   # the full grid: 2 scripts x 2 configs x 10 seeds
    python benchmarks/dropin_grid.py --out DIR --scripts cnn --configs fp32 --seeds 0 1 --strategies ddp,adpsgd
    python benchmarks/dropin_grid.py --check DIR/runs.jsonl      # the table and the verdicts of what ran

Every finished run is appended to ``DIR/runs.jsonl`` as it ends, and a rerun with the same ``--out`` skips the runs
already there (a long grid can be stopped and continued). The runs of one script and configuration share two
processes started once (``launch_local``), so Lightning's import is paid once per group, not per run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import dropin

#: what the strategies' refusals at setup ask for (benchmarks/dropin.py ADAPTATIONS), applied up front
UP_FRONT: dict[str, dict[str, Any]] = {
    "osp": {"gradient_clip_val": None},
    **{name: {"val_check_interval": 1.0} for name in ("asp", "ssp", "aladdin", "sync_switch")},
}
#: per-rank batch of both scripts: 3 epochs of 32 steps per rank on 2 ranks (the issue's script)
BATCH = 16
EPOCHS = 3
WORLD = 2
SEEDS = tuple(range(10))
MEAN_MARGIN = 3.0
SEED_MARGIN = 10.0


def _key(row: dict[str, Any]) -> tuple[str, str, str, int]:
    return row["script"], row["config"], row["strategy"], row["seed"]


def _grid_worker(rank: int, out: str, script: str, config: str, names: list[str], seeds: list[int]) -> None:
    import lightning_sync  # noqa: F401  (registers the names)

    warnings.filterwarnings("ignore")
    path = Path(out) / "runs.jsonl"
    done = {_key(r) for r in read_runs(path)} if path.exists() else set()
    for seed in seeds:
        for name in names:
            if (script, config, name, seed) in done:
                continue
            t0 = time.perf_counter()
            res = dropin.run_user_script(
                name,
                Path(out) / "runs" / f"{script}_{config}_{name}_s{seed}",
                WORLD,
                epochs=EPOCHS,
                seed=seed,
                trainer_overrides={**dropin.CONFIGS[config], **UP_FRONT.get(name, {})},
                batch_size=BATCH,
                evaluate=False,
                script=script,
            )
            if rank == 0:
                row = {
                    "script": script,
                    "config": config,
                    "strategy": name,
                    "seed": seed,
                    "val_acc": res["val_acc"],
                    "global_step": res["global_step"],
                    "lssr": res["metrics"].get("lssr"),
                    "period": res["metrics"].get("period"),
                    "wall_s": round(time.perf_counter() - t0, 2),
                }
                with path.open("a") as f:
                    f.write(json.dumps(row) + "\n")


def read_runs(path: Path) -> list[dict[str, Any]]:
    """The runs of ``runs.jsonl``; a run recorded twice keeps its last record."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return list({_key(r): r for r in rows}.values())


def verdicts(
    rows: list[dict[str, Any]], mean_margin: float = MEAN_MARGIN, seed_margin: float = SEED_MARGIN
) -> list[dict[str, Any]]:
    """Per script, configuration and strategy (``ddp`` excluded), on the seeds both it and ``ddp`` ran: the mean gap
    to ``ddp`` and the worst per-seed gap, in points, and whether the rule passes (mean gap >= -``mean_margin`` and
    every seed's gap >= -``seed_margin``)."""
    acc: dict[tuple[str, str, str], dict[int, float]] = {}
    for r in rows:
        acc.setdefault((r["script"], r["config"], r["strategy"]), {})[r["seed"]] = r["val_acc"]
    out = []
    for (script, config, name), runs in sorted(acc.items()):
        ddp = acc.get((script, config, "ddp"))
        if name == "ddp" or not ddp:
            continue
        seeds = sorted(set(runs) & set(ddp))
        if not seeds:
            continue
        gaps = {s: 100 * (runs[s] - ddp[s]) for s in seeds}
        mean_gap = statistics.mean(gaps.values())
        worst_seed = min(gaps, key=gaps.__getitem__)
        out.append(
            {
                "script": script,
                "config": config,
                "strategy": name,
                "seeds": len(seeds),
                "mean": statistics.mean(runs[s] for s in seeds),
                "ddp_mean": statistics.mean(ddp[s] for s in seeds),
                "mean_gap": mean_gap,
                "worst_seed": worst_seed,
                "worst_gap": gaps[worst_seed],
                "passes": mean_gap >= -mean_margin and gaps[worst_seed] >= -seed_margin,
            }
        )
    return out


def table(rows: list[dict[str, Any]], mean_margin: float = MEAN_MARGIN, seed_margin: float = SEED_MARGIN) -> str:
    lines = [
        f"rule: FAIL when the mean is > {mean_margin:g} points below ddp's, or a seed > {seed_margin:g} points below "
        "ddp's same seed",
        "",
        "| script | config | strategy | seeds | val acc mean | ddp mean | mean gap (points) | worst seed gap (seed) "
        "| verdict |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for v in verdicts(rows, mean_margin, seed_margin):
        verdict = "pass" if v["passes"] else "FAIL"
        lines.append(
            f"| {v['script']} | {v['config']} | {v['strategy']} | {v['seeds']} | {v['mean']:.4f} | {v['ddp_mean']:.4f} "
            f"| {v['mean_gap']:+.2f} | {v['worst_gap']:+.1f} ({v['worst_seed']}) | {verdict} |"
        )
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]], mean_margin: float = MEAN_MARGIN, seed_margin: float = SEED_MARGIN) -> str:
    """One row per strategy, one column per script and configuration: the mean gap to ``ddp`` / the worst seed's gap
    (points), the number of seeds, and FAIL where the rule fails; the first row is ``ddp``'s mean accuracy."""
    found = verdicts(rows, mean_margin, seed_margin)
    columns = sorted({(v["script"], v["config"]) for v in found}, key=lambda c: (c[0], c[1] != "fp32"))
    cell = {(v["script"], v["config"], v["strategy"]): v for v in found}
    names = [n for n in dropin.STRATEGIES if any(v["strategy"] == n for v in found)]
    head = " | ".join(f"{s}, {c}" for s, c in columns)
    lines = [f"| strategy | {head} |", "|---|" + "---:|" * len(columns)]
    ddp = []
    for column in columns:
        v = next(v for v in found if (v["script"], v["config"]) == column)
        ddp.append(f"{v['ddp_mean']:.4f}")
    lines.append("| ddp (mean val acc) | " + " | ".join(ddp) + " |")
    for name in names:
        cells = []
        for script, config in columns:
            v = cell.get((script, config, name))
            if v is None:
                cells.append("")
                continue
            mark = "" if v["passes"] else " **FAIL**"
            cells.append(f"{v['mean_gap']:+.2f} / {v['worst_gap']:+.1f} ({v['seeds']}){mark}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="the grid's folder: runs.jsonl and the runs' files (a rerun continues it)")
    parser.add_argument("--scripts", nargs="+", default=list(dropin.SCRIPTS), choices=dropin.SCRIPTS)
    parser.add_argument("--configs", nargs="+", default=["fp32", "clip+bf16"], choices=list(dropin.CONFIGS))
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--strategies", default=",".join(("ddp", *dropin.STRATEGIES)), help="comma-separated")
    parser.add_argument("--check", metavar="RUNS_JSONL", help="no runs: the table and verdicts of a runs.jsonl")
    parser.add_argument("--mean-margin", type=float, default=MEAN_MARGIN)
    parser.add_argument("--seed-margin", type=float, default=SEED_MARGIN)
    args = parser.parse_args(argv)
    if args.check:
        rows = read_runs(Path(args.check))
    else:
        if not args.out:
            parser.error("--out is required to run the grid")
        from lightning_sync.launch import launch_local

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        names = [n.strip() for n in args.strategies.split(",") if n.strip()]
        for script in args.scripts:
            for config in args.configs:
                t0 = time.perf_counter()
                launch_local(_grid_worker, WORLD, str(out), script, config, names, args.seeds)
                print(f"[dropin_grid] {script}, {config}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        rows = read_runs(out / "runs.jsonl")
    print(table(rows, args.mean_margin, args.seed_margin))
    print("\nmean gap / worst seed's gap to ddp, in points (seeds):\n")
    print(summary(rows, args.mean_margin, args.seed_margin))
    failed = [v for v in verdicts(rows, args.mean_margin, args.seed_margin) if not v["passes"]]
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    sys.exit(main())
