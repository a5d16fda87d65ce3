"""Sync-Switch (BSP for the first 25% of the workload, then ASP) vs BSP and ASP: time, accuracy, switch cost.

    python benchmarks/sync_switch.py                     # 4 processes, 20 epochs, 3 repeats: about 2.5 min on 2 cores
    python benchmarks/sync_switch.py --world 2 --epochs 2 --repeats 1     # a quick end-to-end check
    python benchmarks/sync_switch.py --straggler-slowdown 4               # rank n-1 x4 slower in every fit
    python benchmarks/sync_switch.py --strategies "BSP,Sync-Switch(12.5%),Sync-Switch(50%),BSP(lr_scale=4)"

Same model (demo CNN), data (digits, embedded), epochs, per-rank batch (32) and optimizer (SGD, lr 0.05, momentum
0.9, weight decay 1e-4) for every row; the issue's goal is accuracy within 1 point of BSP's and a switch under 1 s
(the paper: BSP-level accuracy in a fraction of BSP's time, a 36 s switch that restarts from a checkpoint). Rows:

* ``BSP`` (:class:`~lightning_sync.BSPStrategy`: gradients averaged every step, lr 0.05 as given) and ``ASP``
  (:class:`~lightning_sync.ASPStrategy`: parameter servers, dynamic work assignment);
* ``Sync-Switch(25%)``: :class:`~lightning_sync.SyncSwitchStrategy` with ``SyncSwitch(schedule=[("bsp", 0.25),
  ("asp", 1.0)])`` and the paper's configuration policy (§IV-C): the learning rate is multiplied by the number of
  ranks while BSP runs (linear scaling for the global batch n·32) and by 1 under ASP; the switch happens inside the
  running processes (``--switch`` sets the fraction of the default rows);
* ``Sync-Switch(25%, bsp_lr_scale=1)``: the same without the linear scaling (an ablation: lr 0.05 throughout,
  as the BSP row), to tell the effect of the switch from the effect of the larger BSP learning rate.
* not in the default list: ``BSP(lr_scale=X)`` (BSP with lr 0.05·X, e.g. the paper's n·eta for plain BSP),
  ``Sync-Switch(P%)`` / ``Sync-Switch(P%, bsp_lr_scale=X)`` for any switch point P.

Reported per row: fit wall time (``trainer.fit`` on every rank, started after a barrier, the slowest rank's; setup
of the parameter servers included) and the time from ``on_train_start`` to ``on_train_end`` (the slowest rank's),
each row's time over BSP's *in the same repeat* (median of those ratios), test accuracy of the model fit hands back
(BSP: the replicas; ASP and Sync-Switch after ASP: the servers' global model; ``trainer.test`` on it, rank 0's
result; mean over repeats) and its difference from BSP's in points, gradient all-reduces per rank (comm tag
``grads``), pushes per rank (to the parameter servers), bytes sent per rank (these three: mean over ranks), and for
Sync-Switch the step (and epoch) of the switch and its cost: the seconds ``switch_to_asp`` took on each rank as the
strategy measured them (the 4-byte meeting all-reduce, which includes waiting for the last rank to reach the switch
step, plus loading the servers), the slowest rank's. The test split has 360 images (one is 0.28 points) and ASP is
not deterministic (its order of pushes depends on timing): single ASP or Sync-Switch runs vary by a few points, so
judge the 1-point goal on several repeats.

How: ``--world`` processes started once by :func:`~lightning_sync.launch.launch_local` (gloo, CPU), each with
``torch.set_num_threads(1)``, run every fit one after another. Repeat ``r`` seeds model, split and shuffling with
``--seed + r`` for every row, and runs every row once before the next repeat begins (interleaved, so drift in the
machine's speed hits all rows alike); medians of times, means of accuracies. Before the timed fits one untimed
``--warmup-epochs`` fit of every row pays the one-time costs (gloo connections, first-call allocations) that would
otherwise fall on the first row. With more ranks than cores (4 on a 2-core machine) the ranks share cores: ASP's
parameter-server threads compete with training, so absolute times and ratios are this machine's; compare rows with
each other, not with another machine. ``--straggler-slowdown X`` slows rank n-1 by X times its own step time
(:class:`~lightning_sync.callbacks.StragglerInjection`) in every fit.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

_NUM = r"(\d+(?:\.\d+)?)"
_ROW_PATTERNS = (
    (re.compile(r"^BSP$"), "bsp"),
    (re.compile(rf"^BSP\(lr_scale={_NUM}\)$"), "bsp"),
    (re.compile(r"^ASP$"), "asp"),
    (re.compile(rf"^Sync-Switch\({_NUM}%\)$"), "switch"),
    (re.compile(rf"^Sync-Switch\({_NUM}%,\s*bsp_lr_scale={_NUM}\)$"), "switch"),
)


def _pct(fraction: float) -> str:
    return f"{fraction * 100:g}%"


def _parse_row(name: str) -> dict:
    """A row's name -> what it runs: ``{"kind", "lr_scale" (BSP's model lr factor), "switch", "bsp_lr_scale"}``."""
    for pattern, kind in _ROW_PATTERNS:
        match = pattern.match(name.strip())
        if match is None:
            continue
        groups = [float(g) for g in match.groups()]
        if kind == "bsp":
            return {"kind": kind, "lr_scale": groups[0] if groups else 1.0}
        if kind == "asp":
            return {"kind": kind}
        switch = groups[0] / 100
        if not 0 < switch < 1:
            raise ValueError(f"{name}: the switch point must be in (0%, 100%)")
        return {"kind": kind, "switch": switch, "bsp_lr_scale": groups[1] if len(groups) > 1 else None}
    raise ValueError(
        f"unknown row {name!r}: use BSP, BSP(lr_scale=X), ASP, Sync-Switch(P%) or Sync-Switch(P%, bsp_lr_scale=X)"
    )


def _split_names(text: str) -> list[str]:
    """Comma-separated row names; commas inside parentheses belong to the name."""
    return [n.strip() for n in re.split(r",(?![^()]*\))", text) if n.strip()]


def _worker(
    rank: int,
    world: int,
    out_dir: str,
    epochs: int,
    slowdown: float,
    seed: int,
    names: list[str],
    repeats: int,
    warmup_epochs: int,
) -> None:
    import lightning.pytorch as pl
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback

    from lightning_sync import ASPStrategy, BSPStrategy, SyncSwitchStrategy
    from lightning_sync.callbacks import StragglerInjection, SyncSwitch
    from lightning_sync.data import DigitsDataModule
    from lightning_sync.launch import quiet_trainer_kwargs
    from lightning_sync.models import DigitsCNN

    specs = {name: _parse_row(name) for name in names}

    def make_strategy(spec: dict):
        # The paper's configuration (the rows' meaning, and what the committed tables ran): every ASP push is the
        # worker's full step (update_scale=1.0), BSP's rate is m x eta unless bsp_lr_scale says otherwise. The
        # library's defaults anchor on DDP's rate instead (update_scale="auto", bsp_lr_scale=1.0).
        if spec["kind"] == "bsp":
            return BSPStrategy()
        if spec["kind"] == "asp":
            return ASPStrategy(update_scale=1.0)
        return SyncSwitchStrategy(bsp_lr_scale=spec["bsp_lr_scale"], update_scale=1.0)

    class Meter(Callback):
        def __init__(self) -> None:
            self.samples = 0
            self.start = self.end = 0.0

        def on_train_start(self, trainer, pl_module) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.samples += len(batch[1])

        def on_train_end(self, trainer, pl_module) -> None:
            self.end = time.perf_counter()

    def one_run(name: str, repeat: int, max_epochs: int) -> dict:
        spec = specs[name]
        run_seed = seed + max(repeat, 0)
        pl.seed_everything(run_seed, verbose=False)
        meter = Meter()
        callbacks: list = [meter]
        if spec["kind"] == "switch":
            callbacks.append(SyncSwitch(schedule=[("bsp", spec["switch"]), ("asp", 1.0)]))
        if slowdown > 1:
            callbacks.append(StragglerInjection(ranks=world - 1, slowdown=slowdown))
        kw = quiet_trainer_kwargs(accelerator="cpu", devices=world)
        strategy = make_strategy(spec)
        trainer = pl.Trainer(strategy=strategy, max_epochs=max_epochs, limit_val_batches=0, callbacks=callbacks, **kw)
        model = DigitsCNN(lr=0.05 * spec.get("lr_scale", 1.0), momentum=0.9)
        dm = DigitsDataModule(batch_size=32, seed=run_seed)
        if dist.is_initialized():  # the first fit creates the process group
            dist.barrier()  # every rank starts its clock together
        t0 = time.perf_counter()
        trainer.fit(model, dm)
        fit_s = time.perf_counter() - t0
        tester = pl.Trainer(strategy=make_strategy(spec), **kw)
        acc = float(tester.test(model, dm, verbose=False)[0]["test/acc"])
        dist.barrier()
        stats = strategy.comm_stats
        return {
            "strategy": name,
            "repeat": repeat,
            "rank": rank,
            "fit_s": fit_s,
            "train_s": meter.end - meter.start,
            "samples": meter.samples,
            "steps": trainer.global_step,
            "grad_allreduces": stats.ops.get("grads", 0),
            "pushes": int(getattr(strategy, "server_summary", {}).get("pushes", 0)),
            "bytes_sent": stats.total_bytes(),
            "switches": list(getattr(strategy, "switches", [])),
            "test_acc": acc,
        }

    if warmup_epochs > 0:  # untimed: one-time costs of the processes, not of the first row
        for name in names:
            one_run(name, -1, warmup_epochs)
    # interleaved: every repeat runs every row once, so drift in the machine's speed hits all rows alike
    rows = [one_run(name, r, epochs) for r in range(repeats) for name in names]
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(rows))


def _summarize(rows: list[dict], names: list[str], repeats: int) -> dict:
    per: dict = {}
    for name in names:
        runs = []
        for r in range(repeats):
            mine = [x for x in rows if x["strategy"] == name and x["repeat"] == r]
            to_asp = [s for x in mine for s in x["switches"] if s["from"] == "bsp" and s["to"] == "asp"]
            runs.append(
                {
                    "fit_s": max(x["fit_s"] for x in mine),
                    "train_s": max(x["train_s"] for x in mine),
                    "acc": next(x["test_acc"] for x in mine if x["rank"] == 0),
                    "grad_allreduces": statistics.mean(x["grad_allreduces"] for x in mine),
                    "pushes": statistics.mean(x["pushes"] for x in mine),
                    "bytes_sent": statistics.mean(x["bytes_sent"] for x in mine),
                    "steps": statistics.mean(x["steps"] for x in mine),
                    "switches": len(to_asp) // max(1, len(mine)),
                    "switch_step": min((s["step"] for s in to_asp), default=None),
                    "switch_epoch": min((s["epoch"] for s in to_asp), default=None),
                    "switch_s": max((s["seconds"] for s in to_asp), default=None),
                }
            )
        per[name] = runs
    bsp = per.get("BSP")
    out = {}
    for name, runs in per.items():
        switch_s = [x["switch_s"] for x in runs if x["switch_s"] is not None]
        res = {
            "fit_s": statistics.median(x["fit_s"] for x in runs),
            "train_s": statistics.median(x["train_s"] for x in runs),
            "acc": statistics.mean(x["acc"] for x in runs),
            "grad_allreduces": statistics.mean(x["grad_allreduces"] for x in runs),
            "pushes": statistics.mean(x["pushes"] for x in runs),
            "bytes_sent": statistics.mean(x["bytes_sent"] for x in runs),
            "steps": statistics.mean(x["steps"] for x in runs),
            "switch_step": runs[0]["switch_step"],
            "switch_epoch": runs[0]["switch_epoch"],
            "switch_s": max(switch_s) if switch_s else None,
            "switch_s_median": statistics.median(switch_s) if switch_s else None,
            "runs": runs,
        }
        if bsp is not None:
            res["fit_ratio"] = statistics.median(x["fit_s"] / b["fit_s"] for x, b in zip(runs, bsp))
            res["train_ratio"] = statistics.median(x["train_s"] / b["train_s"] for x, b in zip(runs, bsp))
            res["acc_diff_points"] = 100 * (res["acc"] - statistics.mean(b["acc"] for b in bsp))
        out[name] = res
    return out


def _table(results: dict) -> str:
    has_bsp = "BSP" in results
    lines = [
        "| strategy | fit s | fit / BSP | train s | train / BSP | test acc | vs BSP (points) | grad all-reduces / rank "
        "| pushes / rank | MB sent / rank | switch at step (epoch) | switch s (max over ranks) |",
        "|---|" + "---:|" * 11,
    ]
    for name, r in results.items():
        ratio = f"{r['fit_ratio']:.2f}" if has_bsp else "-"
        train_ratio = f"{r['train_ratio']:.2f}" if has_bsp else "-"
        diff = f"{r['acc_diff_points']:+.2f}" if has_bsp else "-"
        at = f"{r['switch_step']} ({r['switch_epoch']})" if r["switch_step"] is not None else "-"
        cost = f"{r['switch_s']:.4f}" if r["switch_s"] is not None else "-"
        lines.append(
            f"| {name} | {r['fit_s']:.1f} | {ratio} | {r['train_s']:.1f} | {train_ratio} | {r['acc']:.4f} | {diff} "
            f"| {r['grad_allreduces']:.0f} | {r['pushes']:.0f} | {r['bytes_sent'] / 1e6:.1f} | {at} | {cost} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4, help="processes (default 4)")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each row, interleaved; medians reported")
    parser.add_argument("--switch", type=float, default=0.25, help="Sync-Switch's BSP fraction in the default rows")
    parser.add_argument("--straggler-slowdown", type=float, default=0.0, help="0: off; X > 1: rank n-1 x X slower")
    parser.add_argument("--seed", type=int, default=0, help="repeat r uses seed + r")
    parser.add_argument("--warmup-epochs", type=int, default=1, help="untimed fit of every row first (0: none)")
    parser.add_argument("--strategies", default=None, help="comma-separated rows (default: see the docstring)")
    parser.add_argument("--out", default="runs/bench_sync_switch.md", help="Markdown report ('' = do not write)")
    args = parser.parse_args()
    pct = _pct(args.switch)
    default = f"BSP,ASP,Sync-Switch({pct}),Sync-Switch({pct}, bsp_lr_scale=1)"
    names = _split_names(args.strategies or default)
    for name in names:
        _parse_row(name)  # fail before starting processes
    if args.straggler_slowdown and args.straggler_slowdown <= 1:
        parser.error("--straggler-slowdown must be 0 (off) or > 1")

    from lightning_sync.launch import launch_local

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        launch_local(
            _worker,
            args.world,
            args.world,
            tmp,
            args.epochs,
            args.straggler_slowdown,
            args.seed,
            names,
            args.repeats,
            args.warmup_epochs,
            threads=1,
        )
        rows = [row for r in range(args.world) for row in json.loads((Path(tmp) / f"rank{r}.json").read_text())]
    wall = time.perf_counter() - start
    results = _summarize(rows, names, args.repeats)

    straggler = (
        f"rank {args.world - 1} slowed x{args.straggler_slowdown:g}" if args.straggler_slowdown else "no straggler"
    )
    heading = (
        f"{args.world} CPU processes (1 thread each), digits CNN, {args.epochs} epochs, batch 32 per rank, "
        f"{straggler}; "
        f"median of {args.repeats} interleaved runs (seeds {args.seed}..{args.seed + args.repeats - 1}; "
        "test acc: mean; ratios: median of per-repeat ratios to BSP)"
    )
    table = _table(results)
    command = "python " + shlex.join(sys.argv)
    lines = [f"## Sync-Switch benchmark\n\n{heading}\n", table, ""]
    bsp = results.get("BSP")
    if bsp is not None:
        for name, r in results.items():
            if r["switch_s"] is None:
                continue
            acc_ok = r["acc_diff_points"] >= -1.0
            switch_ok = r["switch_s"] < 1.0
            lines.append(
                f"- {name}: {r['fit_ratio']:.2f}x BSP's fit time, accuracy {r['acc_diff_points']:+.2f} points vs "
                f"BSP ({'within' if acc_ok else 'NOT within'} 1 point), switch {r['switch_s']:.3f} s "
                f"({'<' if switch_ok else 'NOT <'} 1 s; paper: 36 s)"
            )
    lines += ["", f"Command: `{command}`", f"Benchmark wall time: {wall:.0f} s"]
    report = "\n".join(lines)
    print("\n" + report)
    print("\n" + json.dumps(results, indent=1))
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(report + "\n")
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
