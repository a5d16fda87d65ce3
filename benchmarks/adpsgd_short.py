"""ADPSGD on a short run (issue 57): validation accuracy against DDP per seed, and the period at each averaging.

The drop-in CNN script (``benchmarks/dropin.py``: ResNet-style CNN with BatchNorm on the digits, OneCycleLR stepped
per batch, fp32, no clipping), 2 ranks, 3 epochs of 33 steps per rank (per-rank batch 16), with the two changes that
made ADPSGD's period grow while the model was still near chance: heavy-ball momentum instead of Nesterov, and
OneCycleLR's ``max_lr=1.5`` (a super-convergence setting). Rows are ``benchmarks/dropin.py --strategies`` rows.

    python benchmarks/adpsgd_short.py --seeds 0 1 2 3 4 5 6 7 8 9      # ddp, ADPSGD before and after issue 57
    python benchmarks/adpsgd_short.py --lr 0.1 --nesterov                # the drop-in script's own settings

Before issue 57 ADPSGD sampled C2 over the first quarter of all steps; on these 99 steps that window (25 steps) ended
inside the warm-up epoch (33 steps), so C2 was the one sample after it: the row
``adpsgd@sample_fraction=0.0@min_samples=1`` is exactly that setting on this run.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import dropin
import lightning.pytorch as pl

ROWS = ("ddp", "adpsgd@sample_fraction=0.0@min_samples=1", "adpsgd")
#: the last step of epoch 2 (0-based: 33 steps per epoch)
EPOCH_2_END = 65


class PeriodTrace(pl.Callback):
    """ADPSGD's controller after each averaging (step, period, S_k / (lr C2)) and validation accuracy by step."""

    def __init__(self) -> None:
        self.syncs: list[dict[str, Any]] = []
        self.val: list[tuple[int, float]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        c = getattr(trainer.strategy, "controller", None)
        if c is None or c.since_sync != 0 or c.phase == "warmup":
            return
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        ratio = c.last_s / (lr * c.c2) if c.last_s is not None and c.c2 > 0 else None
        self.syncs.append({"step": c.steps - 1, "period": c.period, "phase": c.phase, "ratio": ratio})

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if "val_acc" in trainer.callback_metrics and trainer.state.fn == "fit":
            self.val.append((trainer.global_step, float(trainer.callback_metrics["val_acc"])))


def _worker(rank: int, out: str, rows: list[str], seeds: list[int], model_kwargs: dict[str, Any]) -> None:
    import lightning_sync  # noqa: F401  (registers the names)

    warnings.filterwarnings("ignore")
    results = []
    for seed in seeds:
        for entry in rows:
            name, kwargs = dropin.parse_row(entry)
            trace = PeriodTrace()
            res = dropin.run_user_script(
                name,
                Path(out) / f"{rows.index(entry)}_s{seed}",
                2,
                epochs=3,
                seed=seed,
                strategy_kwargs=kwargs,
                trainer_overrides=dropin.CONFIGS["fp32"],
                model_kwargs=model_kwargs,
                batch_size=16,
                evaluate=False,
                callbacks=lambda trace=trace: [trace],
            )
            results.append({"row": entry, "seed": seed, "val_acc": res["val_acc"], "syncs": trace.syncs,
                            "val": trace.val, "lssr": res["metrics"].get("lssr")})  # fmt: skip
    if rank == 0:
        (Path(out) / "short.json").write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated benchmarks/dropin.py rows")
    parser.add_argument("--lr", type=float, default=1.5, help="OneCycleLR's max_lr (1.5)")
    parser.add_argument("--nesterov", action="store_true", help="Nesterov momentum (the drop-in script's)")
    parser.add_argument("--trace-seed", type=int, default=2, help="print the ADPSGD rows' periods on this seed")
    parser.add_argument("--json", help="also write every run here")
    parser.add_argument("--summarise", metavar="JSON", help="no runs: the tables of a --json file (.gz read too)")
    args = parser.parse_args()
    if args.summarise:
        raw = Path(args.summarise).read_bytes()
        results = json.loads(gzip.decompress(raw) if args.summarise.endswith(".gz") else raw)
        rows = list(dict.fromkeys(r["row"] for r in results))
        args.seeds = sorted({r["seed"] for r in results})
    else:
        from lightning_sync.launch import launch_local

        rows = dropin.split_rows(args.rows)
        model_kwargs = {"lr": args.lr, "nesterov": args.nesterov}
        with tempfile.TemporaryDirectory() as out:
            launch_local(_worker, 2, out, rows, args.seeds, model_kwargs)
            results = json.loads((Path(out) / "short.json").read_text())
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    ddp = {r["seed"]: r["val_acc"] for r in results if r["row"] == "ddp"}
    if args.summarise:
        print(f"{args.summarise}: seeds {args.seeds}")
    else:
        print(f"max_lr={args.lr}, {'Nesterov' if args.nesterov else 'heavy-ball'} momentum, seeds {args.seeds}")
    print("| row | val acc mean | vs ddp (points) | worst seed vs ddp | per seed | LSSR |")
    print("|---|---:|---:|---:|---|---:|")
    for row in rows:
        mine = [r for r in results if r["row"] == row]
        mean = statistics.mean(r["val_acc"] for r in mine)
        gaps = [100 * (r["val_acc"] - ddp[r["seed"]]) for r in mine if r["seed"] in ddp]
        lssr = [r["lssr"] for r in mine if r["lssr"] is not None]
        per_seed = " ".join(f"{r['val_acc']:.3f}" for r in mine)
        mean_lssr = f"{statistics.mean(lssr):.3f}" if lssr else ""
        print(f"| {row} | {mean:.4f} | {statistics.mean(gaps):+.2f} | {min(gaps):+.1f} | {per_seed} | {mean_lssr} |")
    print(f"\nthe period up to step {EPOCH_2_END} (the end of epoch 2), means over the seeds:")
    print("| row | period there | increments up to there | averagings after the warm-up | largest period |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        runs = [r["syncs"] for r in results if r["row"] == row and r["syncs"]]
        if not runs:
            continue
        there = [[s["period"] for s in syncs if s["step"] <= EPOCH_2_END][-1] for syncs in runs]
        ups = [sum(b["period"] > a["period"] and b["step"] <= EPOCH_2_END for a, b in zip(x, x[1:])) for x in runs]
        print(
            f"| {row} | {statistics.mean(there):.1f} | {statistics.mean(ups):.1f} | "
            f"{statistics.mean(len(x) for x in runs):.1f} | {max(s['period'] for x in runs for s in x)} |"
        )
    for r in results:
        if r["seed"] == args.trace_seed and r["syncs"]:
            print(f"\n{r['row']}, seed {r['seed']}: val acc by step {[(s, round(v, 3)) for s, v in r['val']]}")
            print("step:period (S_k / lr C2): " + " ".join(
                f"{s['step']}:{s['period']}" + (f"({s['ratio']:.2f})" if s["ratio"] is not None else "")
                for s in r["syncs"]))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
