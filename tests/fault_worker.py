"""One rank of a fault-injection run (driven by tests/test_faults.py; not collected by pytest).

Started as its own process with torchrun-style variables (one "node" per rank: ``NODE_RANK=rank``,
``LOCAL_RANK=0``), so no launcher stops the other ranks when this one fails. Trains a tiny model with the strategy
named in the JSON argument; on the faulty rank, at the given step and point, it raises or leaves with
``os._exit(1)`` after writing the wall-clock time of the fault to ``mark``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta


def _fault(cfg: dict, rank: int, step: int) -> None:
    with open(cfg["mark"], "w") as f:
        f.write(repr(time.time()))
        f.flush()
        os.fsync(f.fileno())
    print(f"rank {rank}: injecting {cfg['fault']} at step {step} ({cfg['where']})", file=sys.stderr, flush=True)
    if cfg["fault"] == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step}")
    os._exit(1)


def ps_watch(cfg: dict, rank: int, world: int) -> None:
    """The parameter server without Lightning: a one-element vector is served by rank 0 alone, so rank 0's pushes
    and pulls never reach rank 1; only the watch threads can tell it that rank 1 is gone."""
    import torch
    import torch.distributed as dist

    from lightning_sync.comm import CommStats, Communicator
    from lightning_sync.comm.ps import ParameterServer
    from lightning_sync.core.ps import ShardPlan, ShardServer

    timeout = timedelta(seconds=cfg["timeout"])
    dist.init_process_group("gloo", timeout=timeout)
    comm = Communicator(CommStats())
    flat = torch.zeros(1)
    plan = ShardPlan(1, world, 1 << 22)
    assert plan.servers() == [0]
    ps = ParameterServer(plan, ShardServer(torch.zeros(plan.numel(rank)), world), comm.stats, timeout=timeout)
    comm.barrier()
    if rank == cfg["rank"]:
        time.sleep(0.5)
        _fault(cfg, rank, 0)
    deadline = time.time() + 4 * cfg["timeout"]
    steps = 0
    while time.time() < deadline:
        ps.push(torch.ones(1), 0, want_reply=rank == 0, wait=True)
        if rank == 0:
            ps.wait_params()
            ps.take_params(flat)
        steps += 1
        time.sleep(0.01)
    print(f"rank {rank}: no failure noticed in {steps} steps", file=sys.stderr, flush=True)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    if cfg["strategy"] == "ps_watch":
        ps_watch(cfg, rank, world)
        return

    import lightning.pytorch as pl
    import torch
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_sync import (
        ALADDINStrategy,
        ASPStrategy,
        BSPStrategy,
        LocalSGDStrategy,
        OSPStrategy,
        SelSyncStrategy,
        SyncSwitchStrategy,
    )
    from lightning_sync.launch import quiet_trainer_kwargs

    torch.set_num_threads(1)
    faulty = rank == cfg["rank"]

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.hidden = torch.nn.Linear(8, 8)
            self.out = torch.nn.Linear(8, 2)

        def training_step(self, batch, batch_idx):
            step = self.trainer.global_step
            if faulty and cfg["where"] == "training_step" and step == cfg["step"]:
                _fault(cfg, rank, step)
            time.sleep(cfg["sleep"])  # a steady step rate: the survivors alone would need minutes for the epoch
            x, y = batch
            return F.cross_entropy(self.out(torch.relu(self.hidden(x))), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    timeout = timedelta(seconds=cfg["timeout"])
    strategies = {
        "bsp": lambda: BSPStrategy(timeout=timeout),
        "selsync": lambda: SelSyncStrategy(delta=0.3, timeout=timeout),
        # half the model in the ICS: an asynchronous all-reduce is in flight during every next step
        "osp": lambda: OSPStrategy(fixed_share=0.5, timeout=timeout),
        # small shards: every rank serves some, so a worker waits on its peers' servers
        "asp": lambda: ASPStrategy(shard_size=16, timeout=timeout),
        # default shard size: one shard per rank; workers never wait for replies
        "aladdin": lambda: ALADDINStrategy(period=2, timeout=timeout),
        "sync_switch": lambda: SyncSwitchStrategy(shard_size=16, timeout=timeout),
        # replica groups of 2 ranks: the intra-replica all-reduce every step, the leaders' average every 2 steps
        "localsgd_grouped": lambda: LocalSGDStrategy(period=2, replica_size=2, timeout=timeout),
    }
    strategy = strategies[cfg["strategy"]]()
    if faulty and cfg["where"] == "ics_launch":
        # OSP: die after this step's blocking all-reduce, before launching the asynchronous one the peers have
        # already launched, so the survivors' next wait is on a handle in flight to a rank that is gone
        launch = strategy._launch_ics

        def launch_or_fail(optimizer, layers):
            step = strategy.lightning_module.trainer.global_step
            if step == cfg["step"]:
                _fault(cfg, rank, step)
            return launch(optimizer, layers)

        strategy._launch_ics = launch_or_fail

    pl.seed_everything(0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(cfg["samples"], 8, generator=gen)
    y = (x.sum(1) > 0).long()
    loader = DataLoader(TensorDataset(x, y), batch_size=1, shuffle=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=world,
        strategy=strategy,
        max_epochs=1,
        limit_val_batches=0,
        **quiet_trainer_kwargs(),
    )
    trainer.fit(Tiny(), loader)
    print(f"rank {rank}: fit returned", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
