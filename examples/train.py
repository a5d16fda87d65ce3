"""Train your own LightningModule with any lightning-sync strategy, chosen on the command line.

Copy this file and replace ``DigitsNet`` and ``DigitsData`` with your model and data; the rest stays. The example
model is a small CNN on scikit-learn's handwritten digits (shipped inside scikit-learn: no download).

    python examples/train.py --strategy ddp --devices 2 --max-epochs 3                  # Lightning's DDP, the baseline
    python examples/train.py --strategy selsync --strategy-arg delta=0.3 --devices 2 --max-epochs 3
    python examples/train.py --strategy localsgd --strategy-arg period=4 --link 1gbit,1ms --devices 2 --max-steps 40

    lightning-sync lighthouse --bind [::]:29510 &                  # fault tolerant: one job per replica group
    python examples/train.py --strategy localsgd --devices 1 --ft-lighthouse http://localhost:29510 \
        --ft-replica-group 0 --ft-replica-groups 2 &
    python examples/train.py --strategy localsgd --devices 1 --ft-lighthouse http://localhost:29510 \
        --ft-replica-group 1 --ft-replica-groups 2

``--strategy`` is any name in Lightning's strategy registry (``import lightning_sync`` adds ``bsp``, ``selsync``,
``localsgd``, ``fedavg``, ``adpsgd``, ``osp``, ``asp``, ``ssp``, ``aladdin``, ``sync_switch``, ``diloco`` and their
``_spawn`` / ``_notebook`` variants). ``--strategy-arg KEY=VALUE`` (repeatable) is passed to the strategy's
constructor; VALUE is a Python literal (``0.3``, ``None``, ``"auto"``, ``(0.1, 0.5)``), else ``inf``/``nan`` as a
float, else a string; ``timeout=SECONDS`` becomes a ``timedelta``. ``--link BANDWIDTH,LATENCY`` emulates a slower
network (the strategy's ``link=``).

With a plain name (``selsync``, ``ddp``) Lightning starts the other ranks by running this script again, so
everything runs under ``if __name__ == "__main__":`` and this process is rank 0 (``<name>_spawn`` spawns them
instead). Under torchrun or SLURM the launcher starts every process and Lightning starts none
(``examples/torchrun.sh``, ``examples/slurm.sbatch``). Logs and checkpoints go under ``--out``. Rank 0 prints the
validation accuracy and, for a lightning-sync strategy, ``trainer.strategy.sync_metrics()``; the last line it prints
is ``result: {...}`` (JSON).
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import os
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset, random_split
from torchmetrics.classification import MulticlassAccuracy

from lightning_sync import FaultTolerance  # (the import registers "selsync", "localsgd", ... with Lightning)


# ----------------------------------------------------------------------------------------------- your code
class DigitsNet(pl.LightningModule):
    """A small CNN for 8x8 digit images."""

    def __init__(self, lr: float = 0.05, momentum: float = 0.9) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.BatchNorm2d(32), nn.ReLU(),
        )  # fmt: skip
        self.head = nn.Linear(32 * 4 * 4, 10)
        self.val_acc = MulticlassAccuracy(num_classes=10, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)  # a torchmetrics metric: accumulated over every rank's share of the data
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)


class DigitsData(pl.LightningDataModule):
    """scikit-learn's 1797 handwritten digits as 1x8x8 images, split 80/20 into train/val with a fixed seed."""

    def __init__(self, batch_size: int = 32) -> None:
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        images = torch.tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
        data = TensorDataset(images, torch.tensor(y))
        self.train, self.val = random_split(data, [0.8, 0.2], generator=torch.Generator().manual_seed(0))

    def train_dataloader(self) -> DataLoader:  # Lightning adds a DistributedSampler: each rank gets its share
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=128)


# ----------------------------------------------------------------------------------------------- the strategy
def parse_value(text: str) -> Any:
    """A Python literal, else ``inf``/``nan`` as a float, else the string itself."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        pass
    try:
        return float(text)
    except ValueError:
        return text


def make_strategy(
    name: str, args: list[str], link: str | None, parser: argparse.ArgumentParser, fault_tolerance: Any = None
) -> Any:
    """The registered strategy ``name`` built with its registered arguments (``start_method`` for ``selsync`` /
    ``selsync_spawn``...) plus ``KEY=VALUE`` ``args``, ``link`` and ``fault_tolerance``. Errors go to
    ``parser.error``."""
    if name not in StrategyRegistry:
        parser.error(f"--strategy {name!r} is not registered; available: {', '.join(sorted(StrategyRegistry))}")
    entry = StrategyRegistry[name]
    cls, kwargs = entry["strategy"], dict(entry["init_params"])
    accepts = {p for c in cls.__mro__ if "__init__" in vars(c) for p in inspect.signature(c.__init__).parameters}
    if "start_method" in accepts and "start_method" not in kwargs:
        kwargs["start_method"] = "popen"  # a name registered without one (ddp_counted): re-run this script per rank
    for item in args:
        key, eq, value = item.partition("=")
        if not eq or not key:
            parser.error(f"--strategy-arg {item!r}: expected KEY=VALUE")
        kwargs[key] = parse_value(value)
        if key == "timeout" and isinstance(kwargs[key], (int, float)):
            kwargs[key] = timedelta(seconds=kwargs[key])
    if link is not None:
        if "link" not in accepts:
            parser.error(
                f"--link: strategy {name!r} ({cls.__name__}) has no link emulation. Use a "
                "lightning-sync strategy (bsp is DDP's algorithm), or ddp_counted (Lightning's DDP with the pack's "
                "byte accounting and link emulation)."
            )
        kwargs["link"] = link
    if fault_tolerance is not None:
        if "fault_tolerance" not in accepts:
            parser.error(f"--fault-tolerant: strategy {name!r} ({cls.__name__}) has no fault-tolerant mode")
        kwargs["fault_tolerance"] = fault_tolerance
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:  # the strategy's own check of its arguments, naming the bad one
        parser.error(f"--strategy {name} with {kwargs}: {type(err).__name__}: {err}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="selsync", help="a registered strategy name (default: selsync)")
    parser.add_argument(
        "--strategy-arg", action="append", default=[], metavar="KEY=VALUE", help="strategy argument (repeatable)"
    )
    parser.add_argument("--link", default=None, help='emulated network, e.g. "1gbit,1ms" (lightning-sync strategies)')
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2, help="processes per node")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--max-epochs", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps (-1: no limit)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/train", help="logs and checkpoints go here (default: runs/train)")
    ft = parser.add_argument_group(
        "fault tolerance (localsgd, diloco, fedavg, adpsgd)",
        "Run this process as one replica group of a fault-tolerant run on torchft (pip install -e '.[ft]'): start a "
        "lighthouse (lightning-sync lighthouse), then one job per replica group: --devices 1, or a node of N "
        "processes as one replica with --devices N --strategy-arg replica_size=node. A flag not given is read from "
        "TORCHFT_LIGHTHOUSE, REPLICA_GROUP_ID, NUM_REPLICA_GROUPS.",
    )
    ft.add_argument("--fault-tolerant", action="store_true", help="join a fault-tolerant run (implied by --ft-*)")
    ft.add_argument("--ft-lighthouse", default=None, metavar="URL", help="the lighthouse, e.g. http://host:29510")
    ft.add_argument("--ft-replica-group", type=int, default=None, metavar="I", help="this group's index, 0..N-1")
    ft.add_argument("--ft-replica-groups", type=int, default=None, metavar="N", help="how many replica groups")
    ft.add_argument("--ft-min-replicas", type=int, default=1, metavar="M", help="fewest groups a sync commits with")
    args = parser.parse_args(argv)

    ft_given = (args.ft_lighthouse, args.ft_replica_group, args.ft_replica_groups)
    if args.fault_tolerant or any(v is not None for v in ft_given):
        try:
            fault_tolerance = FaultTolerance(
                lighthouse=args.ft_lighthouse,
                replica_group=args.ft_replica_group,
                replica_groups=args.ft_replica_groups,
                min_replicas=args.ft_min_replicas,
            )
        except ValueError as err:
            parser.error(str(err))
    else:
        fault_tolerance = None
    strategy = make_strategy(args.strategy, args.strategy_arg, args.link, parser, fault_tolerance)
    if args.accelerator == "cpu" and "OMP_NUM_THREADS" not in os.environ:  # a share of the cores per process
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.devices))
    pl.seed_everything(args.seed, verbose=False)
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        max_epochs=args.max_epochs,
        max_steps=args.max_steps,
        default_root_dir=args.out,
        logger=CSVLogger(args.out, name=args.strategy),
        log_every_n_steps=5,
    )
    model, data = DigitsNet(lr=args.lr), DigitsData(batch_size=args.batch_size)
    trainer.fit(model, data)  # with "<name>" (popen), this process is rank 0 and the other ranks run this script
    sync = trainer.strategy.sync_metrics() if hasattr(trainer.strategy, "sync_metrics") else None
    (val,) = trainer.validate(model, data, verbose=False)  # the final model, also when max_steps ended mid-epoch

    if trainer.is_global_zero:
        result: dict[str, Any] = {
            "strategy": args.strategy,
            "world_size": trainer.world_size,
            "global_step": trainer.global_step,
            "val_acc": round(float(val["val_acc"]), 4),
            "cluster": type(trainer.strategy.cluster_environment).__name__,  # who started the processes
        }
        print(f"\n{args.strategy}: {trainer.world_size} processes ({result['cluster']}), {trainer.global_step} steps")
        print(f"  validation accuracy  {result['val_acc']:.4f}")
        if sync is not None:
            result.update(lssr=sync["lssr"], bytes_sent=sync["bytes_sent"], blocked_s=sync["blocked_s"])
            print(f"  LSSR                 {sync['lssr']:.3f}  (local steps / all steps)")
            print(f"  sync / local steps   {sync['sync_steps']:.0f} / {sync['local_steps']:.0f}")
            print(f"  bytes sent (rank 0)  {sync['bytes_sent'] / 1e6:.2f} MB")
            print(f"  blocked in comm      {sync['blocked_s']:.3f} s")
        print("result: " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
