"""A model that needs sharding: FSDP2 inside each replica, DiLoCo (or local SGD) between the replicas.

Copy this file when your model is sharded with FSDP inside a node and the link between nodes is slow. The only
change to a LightningModule is ``configure_model``, which shards over the device mesh the strategy gives it, as for
Lightning's own ``ModelParallelStrategy``. The example model is a small MLP on scikit-learn's handwritten digits (no
download); on one machine, 4 CPU processes play 2 replicas ("nodes") of 2 shards each:

    python examples/train_sharded.py                                   # DiLoCo, 2 replicas x 2 shards, 4 processes
    python examples/train_sharded.py --strategy localsgd --strategy-arg period=8
    python examples/train_sharded.py --link 100mbit,10ms                # emulate a slow link between the replicas
    python examples/train_sharded.py --strategy fsdp                    # Lightning's FSDP2 over all 4 ranks

``--strategy`` is ``diloco`` (default), ``localsgd``, ``bsp``, ``selsync``, ``adpsgd`` or ``fedavg`` with
``sharded=True`` and ``replica_size=--replica-size`` (on a real cluster: ``replica_size="node"``), or ``fsdp``:
Lightning's ``ModelParallelStrategy(data_parallel_size=<all ranks>, tensor_parallel_size=1)``, what a user who shards
runs today, every step's gradients reduce-scattered over every rank. ``--strategy-arg KEY=VALUE`` (repeatable) goes to
the strategy's constructor (a Python literal, else a string).

Lightning starts the other processes by running this script again (everything is under ``if __name__ ==
"__main__":``); this process is rank 0 and prints the validation accuracy, the bytes each rank sent between the
replicas, the model's share a rank holds, and last a ``result: {...}`` line (JSON). Each rank's checkpoint part holds
its shards; the main checkpoint file holds the whole model, which the unsharded module loads for inference (see
docs/guide.md, "Sharded replicas").
"""

from __future__ import annotations

import argparse
import ast
import json
import os
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset, random_split

import lightning_sync

SHARDED = {
    "diloco": lightning_sync.DiLoCoStrategy,
    "localsgd": lightning_sync.LocalSGDStrategy,
    "bsp": lightning_sync.BSPStrategy,
    "selsync": lightning_sync.SelSyncStrategy,
    "adpsgd": lightning_sync.ADPSGDStrategy,
    "fedavg": lightning_sync.FedAvgStrategy,
}


# ----------------------------------------------------------------------------------------------- your code
class DigitsMLP(pl.LightningModule):
    """An MLP for 8x8 digit images; ``configure_model`` shards it with FSDP2."""

    def __init__(self, lr: float = 0.05, momentum: float = 0.9, width: int = 512) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
        )  # fmt: skip

    def configure_model(self) -> None:
        """Shard every Linear layer, then the whole model, over the ranks of this replica: the strategy's
        ``device_mesh["shard"]`` (lightning-sync's sharded replicas), or ``["data_parallel"]`` (Lightning's
        ``ModelParallelStrategy``). Lightning calls this at every setup (fit, then validate): a module sharded at an
        earlier one is left as it is."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(self.net, FSDPModule):
            return
        mesh = self.device_mesh
        mesh = mesh["shard"] if "shard" in (mesh.mesh_dim_names or ()) else mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # after configure_model: the optimizer holds the shards (its momentum is sharded too)
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

    def train_dataloader(self) -> DataLoader:  # every rank reads its own share, in a sharded replica too
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=128)


# ----------------------------------------------------------------------------------------------- the strategy
def make_strategy(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Any:
    """Lightning's FSDP2 over all ranks (``fsdp``), or a lightning-sync strategy on sharded replicas."""
    kwargs: dict[str, Any] = {}
    for item in args.strategy_arg:
        key, eq, value = item.partition("=")
        if not eq or not key:
            parser.error(f"--strategy-arg {item!r}: expected KEY=VALUE")
        try:
            kwargs[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            kwargs[key] = value
    if args.strategy == "fsdp":
        if args.link is not None:
            parser.error("--link emulates the link between lightning-sync's replicas; fsdp has none")
        return ModelParallelStrategy(data_parallel_size=args.devices * args.num_nodes, tensor_parallel_size=1, **kwargs)
    if args.strategy not in SHARDED:
        parser.error(f"--strategy must be fsdp or one of {', '.join(SHARDED)}, got {args.strategy!r}")
    kwargs.setdefault("replica_size", args.replica_size)
    kwargs.setdefault("sharded", True)
    if args.link is not None:
        kwargs["link"] = args.link
    try:
        return SHARDED[args.strategy](**kwargs)
    except (TypeError, ValueError) as err:  # the strategy's own check of its arguments, naming the bad one
        parser.error(f"--strategy {args.strategy} with {kwargs}: {type(err).__name__}: {err}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="diloco", help="diloco (default), localsgd, bsp, selsync, adpsgd, "
                        "fedavg (sharded replicas), or fsdp (Lightning's ModelParallelStrategy)")  # fmt: skip
    parser.add_argument("--strategy-arg", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--replica-size", default=2, type=lambda v: v if v == "node" else int(v),
                        help="ranks per sharded replica: an integer, or node (default: 2)")  # fmt: skip
    parser.add_argument("--link", default=None, help='emulated link between the replicas, e.g. "100mbit,10ms"')
    parser.add_argument("--devices", type=int, default=4, help="processes per node (default: 4)")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--max-epochs", type=int, default=4)
    parser.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps (-1: no limit)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/train_sharded", help="logs and checkpoints go here")
    args = parser.parse_args(argv)

    strategy = make_strategy(args, parser)
    if "OMP_NUM_THREADS" not in os.environ:  # a share of the cores per process
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.devices))
    pl.seed_everything(args.seed, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        max_epochs=args.max_epochs,
        max_steps=args.max_steps,
        default_root_dir=args.out,
        logger=False,
        enable_progress_bar=False,
    )
    model, data = DigitsMLP(lr=args.lr), DigitsData(batch_size=args.batch_size)
    trainer.fit(model, data)
    sync = trainer.strategy.sync_metrics() if hasattr(trainer.strategy, "sync_metrics") else None
    (val,) = trainer.validate(model, data, verbose=False)
    # the share of the model this rank holds: its local shards (FSDP2's DTensors) against the whole model
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    whole = sum(p.numel() for p in model.parameters())

    if trainer.is_global_zero:
        result: dict[str, Any] = {
            "strategy": args.strategy,
            "world_size": trainer.world_size,
            "global_step": trainer.global_step,
            "val_acc": round(float(val["val_acc"]), 4),
            "local_parameters": local,
            "parameters": whole,
        }
        print(f"\n{args.strategy}: {trainer.world_size} processes, {trainer.global_step} steps")
        print(f"  validation accuracy        {result['val_acc']:.4f}")
        print(f"  parameters on rank 0       {local:,} of {whole:,}")
        if sync is not None:
            result.update(bytes_between_replicas=sync.get("bytes_inter", sync["bytes_sent"]), lssr=sync["lssr"])
            print(f"  bytes sent between replicas (rank 0)  {result['bytes_between_replicas'] / 1e6:.2f} MB")
            print(f"  LSSR                       {sync['lssr']:.3f}  (local steps / all steps)")
        print("result: " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
