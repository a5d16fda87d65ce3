"""One replica group of a fault-tolerant run (driven by tests/test_fault_tolerance.py; not collected by pytest).

Started as its own process (``python tests/ft_worker.py '<json>'``) with its own ``MASTER_PORT``: a replica group is a
Lightning job of one process, or with ``"procs": n`` of n processes (Lightning starts the others; ``replica_size=
"node"``: one replica, exact data parallelism inside; with ``"sharded": true`` the model sharded with FSDP2 over
them, each rank a member of its shard index's quorum), that meets the other groups only through torchft (its first
process speaks for the group: it writes the files below). Trains
:class:`~lightning_sync.models.DigitsCNN` on :class:`~lightning_sync.data.DigitsDataModule` with local SGD, DiLoCo
(plain or streaming), FedAvg or ADPSGD and ``fault_tolerance=FaultTolerance(...)``, and writes, in ``out``:

* ``progress_g<group>.jsonl``: one line per optimizer step (pid, global step, epoch, batch, torchft step, whether the
  step synced and, when it did, the checksum of the parameters and buffers (streaming DiLoCo: of the fragment the
  step applied) and whether the sync committed);
* ``result_g<group>_<pid>.json`` when fit returns: the final model's validation accuracy (the whole validation
  split), steps, strategy state, communication totals and fault-tolerance counters;
* sharded, from each other rank: ``shard_g<group>_r<rank>_<pid>.json`` (its local shards' checksum, its bytes);
* with ``"save"``: a checkpoint of the run's end (``trainer.save_checkpoint`` while the strategy is still set up).

While the file ``<out>/slow`` exists every step sleeps ``slow`` seconds (four times as long in the last third of the
run): the test keeps the survivors slow until the restarted group has rejoined, so the rejoin is tested on a slow
machine too.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path


def main() -> None:
    cfg = json.loads(sys.argv[1])
    import lightning.pytorch as pl
    import torch

    from lightning_sync import (
        ADPSGDStrategy,
        BSPStrategy,
        DiLoCoStrategy,
        FaultTolerance,
        FedAvgStrategy,
        LocalSGDStrategy,
    )
    from lightning_sync.data import DigitsDataModule
    from lightning_sync.launch import quiet_trainer_kwargs
    from lightning_sync.models import DigitsCNN

    torch.set_num_threads(1)
    out = Path(cfg["out"])
    group = cfg["group"]
    progress = out / f"progress_g{group}.jsonl"
    ft = FaultTolerance(
        lighthouse=cfg["lighthouse"],
        replica_group=group,
        replica_groups=cfg["groups"],
        min_replicas=1,
        timeout=timedelta(seconds=cfg.get("timeout", 30)),
        quorum_timeout=timedelta(seconds=cfg.get("quorum_timeout", 300)),
        connect_timeout=timedelta(seconds=cfg.get("connect_timeout", 10)),
        join_timeout=timedelta(seconds=cfg.get("join_timeout", 120)),
    )
    kwargs = dict(cfg.get("args", {}))
    classes = {
        "localsgd": LocalSGDStrategy,
        "diloco": DiLoCoStrategy,
        "diloco_streaming": DiLoCoStrategy,
        "fedavg": FedAvgStrategy,
        "adpsgd": ADPSGDStrategy,
        "bsp": BSPStrategy,
    }
    procs = cfg.get("procs", 1)  # processes in this replica group: one replica, exact data parallelism inside
    if procs > 1:
        kwargs["replica_size"] = cfg.get("replica_size", "node")
    sharded = bool(cfg.get("sharded"))  # the group's model sharded with FSDP2 over its processes
    if sharded:
        kwargs.update(sharded=True, replica_size="node")
    strategy = classes[cfg["strategy"]](fault_tolerance=ft, sync_stats=False, **kwargs)
    streaming = isinstance(strategy, DiLoCoStrategy) and strategy.delay > 0

    class Progress(pl.Callback):
        def __init__(self) -> None:
            self.synced = 0
            self.failed = 0
            self.ft_step_at_start = None

        def on_train_start(self, trainer, pl_module) -> None:  # after a resume or a heal: counting goes on from here
            s = trainer.strategy
            self.flat_bytes = sum(t.numel() * t.element_size() for t in s.flat.state_tensors())  # what a sync sends
            self.synced, self.failed, self.ft_step_at_start = (
                s.step_counter.sync_steps,
                s.topology.failed_syncs,
                s.topology.step,
            )

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if trainer.global_rank:  # the group's leader speaks for it (its processes hold one replica)
                return
            s = trainer.strategy
            # a sync ends where its average is taken: at the launch, or (streaming DiLoCo) `delay` steps later
            synced = s.last_applied is not None if streaming else s.step_counter.sync_steps > self.synced
            record = {
                "pid": os.getpid(),
                "step": trainer.global_step,
                "epoch": trainer.current_epoch,
                "batch": batch_idx,
                "ft_step": s.topology.step,
                "synced": synced,
                "time": time.time(),
            }
            if synced:
                record["committed"] = s.topology.failed_syncs == self.failed
                # streaming: the fragment just applied (the others are local until their own syncs)
                tensors = [s._region(p) for p in s._parts[s.last_applied]] if streaming else s.flat.state_tensors()
                record["checksum"] = s.flat.checksum(tensors).tolist()
                record["replicas"] = s.topology.replicas
            self.synced, self.failed = s.step_counter.sync_steps, s.topology.failed_syncs
            with progress.open("a") as f:
                f.write(json.dumps(record) + "\n")
            if (out / "slow").exists():  # slower still late in the run: the survivors must not finish before the rejoin
                time.sleep(cfg["slow"] if trainer.global_step < cfg["max_steps"] * 2 // 3 else 4 * cfg["slow"])

    class SaveAtEnd(pl.Callback):
        def on_train_end(self, trainer, pl_module) -> None:
            if cfg.get("save"):
                trainer.save_checkpoint(cfg["save"])

    class ShardedDigitsCNN(DigitsCNN):
        def configure_model(self) -> None:
            from torch.distributed.fsdp import FSDPModule, fully_shard

            if isinstance(self.head, FSDPModule):
                return
            for part in (self.features, self.head):
                fully_shard(part, mesh=self.device_mesh["shard"])

    pl.seed_everything(cfg.get("seed", 0), verbose=False)
    model = ShardedDigitsCNN() if sharded else DigitsCNN()
    data = DigitsDataModule(batch_size=32)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=procs,
        strategy=strategy,
        max_steps=cfg["max_steps"],
        max_epochs=-1,
        limit_val_batches=0,
        callbacks=[progress_cb := Progress(), SaveAtEnd()],
        **quiet_trainer_kwargs(),
    )
    start = time.time()
    trainer.fit(model, data, ckpt_path=cfg.get("resume"))
    model.eval()
    correct = total = 0
    with torch.no_grad():  # sharded: every rank (FSDP2 all-gathers the shards inside the group)
        for x, y in data.val_dataloader():
            correct += int((model(x).argmax(1) == y).sum())
            total += len(y)
    from torch.distributed.tensor import DTensor

    # this rank's model (sharded: its local shards), to compare with the same rank of the other groups
    local = [t.to_local() if isinstance(t, DTensor) else t for t in model.state_dict().values()]
    checksum = hashlib.sha1(b"".join(t.detach().numpy().tobytes() for t in local)).hexdigest()
    if trainer.global_rank:
        if sharded:
            shard = {
                "pid": os.getpid(),
                "leader": os.getppid(),  # Lightning started this rank from the group's first process
                "rank": trainer.global_rank,
                "checksum": checksum,
                "bytes": dict(strategy.comm_stats.bytes_sent),
                "flat_bytes": progress_cb.flat_bytes,
            }
            (out / f"shard_g{group}_r{trainer.global_rank}_{os.getpid()}.json").write_text(json.dumps(shard))
        return
    result = {
        "pid": os.getpid(),
        "group": group,
        "val_acc": correct / total,
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "fit_s": time.time() - start,
        "strategy_step": strategy.step_counter.steps,
        "world_size": trainer.world_size,
        "ft_step_at_start": progress_cb.ft_step_at_start,
        "sync_steps": strategy.step_counter.sync_steps,
        "metrics": strategy.sync_metrics(),
        "bytes": dict(strategy.comm_stats.bytes_sent),
        "ops": dict(strategy.comm_stats.ops),
        "checksum": checksum,
        "flat_bytes": progress_cb.flat_bytes,
    }
    (out / f"result_g{group}_{os.getpid()}.json").write_text(json.dumps(result, indent=1))
    print(f"replica group {group}: fit returned", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
