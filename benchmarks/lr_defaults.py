"""The asynchronous family at the learning rate of the user's (DDP's) configuration: test perplexity vs BSP (issue 17).

    python benchmarks/lr_defaults.py                          # seeds 1-5, 3 epochs, 4 processes: ~10 min on 2 cores
    python benchmarks/lr_defaults.py --seeds 1 2 --warmup 0   # without the warm-up rows
    python benchmarks/lr_defaults.py --old                    # the papers' literal rates (before issue 17)
    python benchmarks/lr_defaults.py --warmup 0 --momentum    # the workers' momentum: derived ('auto') vs the user's
    python benchmarks/lr_defaults.py --seeds 1 2 3 --warmup 0 --sweep   # ASP at fixed worker momenta
    python benchmarks/lr_defaults.py --warmup 0 --milestones 2  # the rate x0.1 for the last epoch

The text workload's packaged configuration (``lightning-sync compare --workload text``: a character Transformer, SGD
lr 0.1, momentum 0.9, its data) trained ``--epochs`` epochs by BSP, ASP, SSP, ALADDIN and Sync-Switch at their
defaults — pushes scaled by 1/m, ASP's and SSP's workers at the momentum derived from the user's
(``worker_momentum="auto"``), Sync-Switch's BSP phase at the user's rate — and, for ASP and Sync-Switch, with the
optional linear warm-up of the pushes (``warmup_steps=--warmup``). ``--old`` adds the literal configurations
(``update_scale=1.0``; Sync-Switch ``bsp_lr_scale=None``), which is what the strategies did before. Every fit of one
seed runs in the same 4 torchrun-style processes (``torch.set_num_threads(1)`` each: 4 ranks on 2 cores), one seed
after another. Printed: test perplexity per seed and the ratio to BSP's of the same seed, then the mean and range of
the ratio. The asynchronous rows' push order follows the OS's scheduling of the processes, so a run's perplexity
moves between runs of the same seed; read the ratios over seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from pathlib import Path
from typing import Any


def _variants(warmup: int, old: bool, momentum: bool, sweep: bool) -> list[tuple[str, str, dict[str, Any]]]:
    rows: list[tuple[str, str, dict[str, Any]]] = [
        ("BSP", "bsp", {}),
        ("ASP", "asp", {}),
        ("SSP(s=4)", "ssp", {}),
        ("ALADDIN", "aladdin", {}),
        ("Sync-Switch", "sync_switch", {}),
    ]
    if warmup:
        rows += [
            (f"ASP(warmup {warmup})", "asp", {"warmup_steps": warmup}),
            (f"Sync-Switch(warmup {warmup})", "sync_switch", {"warmup_steps": warmup}),
        ]
    if momentum:
        rows += [
            ("ASP(worker_momentum=None)", "asp", {"worker_momentum": None}),
            ("SSP(worker_momentum=None)", "ssp", {"worker_momentum": None}),
            ("Sync-Switch(worker_momentum='auto')", "sync_switch", {"worker_momentum": "auto"}),
        ]
    if sweep:  # how worker_momentum="auto"'s slope was chosen: ASP's workers at fixed momenta (the user's is 0.9)
        rows += [(f"ASP(worker_momentum={mu})", "asp", {"worker_momentum": mu}) for mu in (0.9, 0.8, 0.6)]
        # the steady-state step of momentum 0.75, (1 - 0.9) / (1 - 0.75) = 0.4 of 0.9's, with the momentum kept
        rows.append(
            ("ASP(worker_momentum=None, update_scale=0.4/m)", "asp", {"worker_momentum": None, "update_scale": 0.1})
        )
    if old:
        rows += [
            ("ASP(update_scale=1)", "asp", {"update_scale": 1.0}),
            ("SSP(update_scale=1)", "ssp", {"update_scale": 1.0}),
            ("Sync-Switch(paper: m*lr, scale 1)", "sync_switch", {"bsp_lr_scale": None, "update_scale": 1.0}),
        ]
    return rows


def _worker(
    rank: int,
    out_dir: str,
    seeds: list[int],
    epochs: int,
    warmup: int,
    old: bool,
    momentum: bool,
    sweep: bool,
    milestones: list[int] | None,
) -> None:
    import lightning.pytorch as pl
    import yaml
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_sync  # noqa: F401  (registers the names)
    from lightning_sync.compare import packaged_config
    from lightning_sync.data.text import PythonTextDataModule
    from lightning_sync.launch import quiet_trainer_kwargs
    from lightning_sync.models import CharTransformerLM

    config = yaml.safe_load(packaged_config("text").read_text())
    results = []
    for seed in seeds:
        for label, name, kwargs in _variants(warmup, old, momentum, sweep):
            entry = StrategyRegistry[name]
            strategy = entry["strategy"](**{**entry["init_params"], **kwargs})
            pl.seed_everything(seed)
            trainer = pl.Trainer(
                accelerator="cpu",
                devices=4,
                strategy=strategy,
                max_epochs=epochs,
                limit_val_batches=config["trainer"]["limit_val_batches"],
                **quiet_trainer_kwargs(),
            )
            model = CharTransformerLM(**config["model"]["init_args"], lr_milestones=milestones)
            data = PythonTextDataModule(**config["data"]["init_args"])
            trainer.fit(model, data)
            ppl = float(trainer.test(model, data, verbose=False)[0]["test/ppl"])
            results.append({"seed": seed, "row": label, "test_ppl": ppl})
            if rank == 0:
                print(f"seed {seed} {label}: test perplexity {ppl:.2f}", flush=True)
    Path(out_dir, f"res_rank{rank}.json").write_text(json.dumps(results))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=30, help="warm-up rows' warmup_steps (0: no warm-up rows)")
    parser.add_argument("--old", action="store_true", help="add the papers' literal configurations")
    parser.add_argument(
        "--momentum",
        action="store_true",
        help="add ASP/SSP at the user's momentum (worker_momentum=None: before) and Sync-Switch with 'auto'",
    )
    parser.add_argument("--sweep", action="store_true", help="add ASP at fixed worker momenta (how 'auto' was chosen)")
    parser.add_argument(
        "--milestones",
        type=int,
        nargs="+",
        default=None,
        help="epochs at which the rate is multiplied by 0.1 (the model's lr_milestones; default: a constant rate)",
    )
    args = parser.parse_args(argv)

    from lightning_sync.launch import launch_local

    with tempfile.TemporaryDirectory() as out:
        launch_local(
            _worker,
            4,
            out,
            args.seeds,
            args.epochs,
            args.warmup,
            args.old,
            args.momentum,
            args.sweep,
            args.milestones,
            threads=1,
        )
        results = json.loads(Path(out, "res_rank0.json").read_text())
    bsp = {r["seed"]: r["test_ppl"] for r in results if r["row"] == "BSP"}
    labels = list(dict.fromkeys(r["row"] for r in results))
    decay = f", x0.1 at epochs {args.milestones}" if args.milestones else ""
    head = f"Test perplexity at lr 0.1{decay} (text workload, 4 ranks, {args.epochs} epochs)"
    print(f"\n## {head}; ratio to BSP's, same seed")
    print("| row | " + " | ".join(f"seed {s}" for s in args.seeds) + " | mean ratio | ratio range |")
    print("|---|" + "---:|" * (len(args.seeds) + 2))
    for label in labels:
        cells, ratios = [], []
        for seed in args.seeds:
            ppl = next(r["test_ppl"] for r in results if r["row"] == label and r["seed"] == seed)
            ratio = ppl / bsp[seed] if math.isfinite(ppl) else math.inf
            ratios.append(ratio)
            cells.append(f"{ppl:.2f} ({ratio:.2f}x)" if math.isfinite(ppl) else "inf")
        finite = [r for r in ratios if math.isfinite(r)]
        mean = f"{statistics.fmean(ratios):.2f}x" if len(finite) == len(ratios) else "diverged"
        spread = f"{min(finite):.2f}-{max(finite):.2f}x" if finite else "-"
        print(f"| {label} | " + " | ".join(cells) + f" | {mean} | {spread} |")


if __name__ == "__main__":
    main()
