"""One process of the 2 hosts x 2 processes job in test_multinode.py (run as a script inside a host's namespace).

It reads nothing but the environment a multi-node launcher sets (``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK``,
``LOCAL_RANK``, ``RANK``, ``WORLD_SIZE``): the Trainers say ``num_nodes=2, devices=2`` and Lightning does the rest.
It trains BSP, SelSync, ALADDIN and grouped local SGD (``replica_size="node"``) one after the other in this process
and writes what it saw to ``<out>/rank<RANK>.json`` (``<out>/error_rank<RANK>.txt`` with the traceback if anything
raised); its stdout and stderr go to ``<out>/log_rank<RANK>.txt``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

NUM_NODES = 2
DEVICES = 2
BSP_STEPS = 6
SELSYNC_STEPS = 20
SELSYNC_DELTA = 0.05  # with 4 ranks on the digits CNN: some steps sync, some stay local
ALADDIN_BATCHES = 5  # per rank, one epoch
GROUPED_STEPS = 6  # local SGD with replica_size="node" (each host a replica), period 3: syncs after steps 0 and 3
GROUPED_PERIOD = 3
TIMEOUT = timedelta(seconds=60)  # a mismatched collective fails instead of hanging for 30 minutes


def _sh(*cmd: str) -> str:
    return subprocess.run(list(cmd), capture_output=True, text=True).stdout.strip()


def _tx_bytes(interface: str) -> int:
    """Bytes this host's veth link has sent so far (the kernel's counter: every byte that left the host)."""
    (link,) = json.loads(_sh("ip", "-j", "-s", "link", "show", "dev", interface))
    return int(link["stats64"]["tx"]["bytes"])


def _checksum(model) -> tuple[str, bool]:
    """sha256 over the exact bits of every tensor of the state dict, and whether all floating values are finite."""
    digest = hashlib.sha256()
    finite = True
    for key, tensor in model.state_dict().items():
        t = tensor.detach().cpu().contiguous()
        digest.update(key.encode())
        digest.update(t.numpy().tobytes())
        if t.is_floating_point():
            finite = finite and bool(t.isfinite().all())
    return digest.hexdigest(), finite


def main(out: Path) -> None:
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback

    from lightning_sync import ALADDINStrategy, BSPStrategy, LocalSGDStrategy, SelSyncStrategy
    from lightning_sync.comm import destroy_default_group
    from lightning_sync.data import DigitsDataModule
    from lightning_sync.launch import quiet_trainer_kwargs
    from lightning_sync.models import DigitsCNN

    torch.set_num_threads(1)  # 4 processes on a small machine
    interface = os.environ["GLOO_SOCKET_IFNAME"]
    res: dict = {
        "env": {k: os.environ[k] for k in ("MASTER_ADDR", "NODE_RANK", "LOCAL_RANK", "RANK", "WORLD_SIZE")},
        "pid": os.getpid(),
        "namespace": _sh("ip", "netns", "identify", str(os.getpid())),
        "netns_inode": os.stat("/proc/self/ns/net").st_ino,
        "addresses": _sh("ip", "-o", "-4", "addr", "show").splitlines(),
        "interface": interface,
    }

    class Probe(Callback):
        """After every step: all-gather (plain torch.distributed, not the strategy's code) a checksum of the exact
        bits of parameters and buffers; record whether the step synced and whether all ranks agree (and, in
        ``replicas``, whether the ranks of each host agree)."""

        def __init__(self) -> None:
            self.rows: list[list[bool]] = []
            self.replicas: list[list[bool]] = []
            self._syncs = 0

        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            bits = torch.cat([t.detach().reshape(-1) for t in pl_module.state_dict().values() if t.is_floating_point()])
            bits = bits.view(torch.int32).to(torch.int64)
            local = torch.stack([bits.sum(), (bits * torch.arange(1, bits.numel() + 1)).sum()])
            gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, local)
            synced = trainer.strategy.step_counter.sync_steps > self._syncs
            self._syncs = trainer.strategy.step_counter.sync_steps
            self.rows.append([bool(synced), all(torch.equal(g, gathered[0]) for g in gathered)])
            hosts = [gathered[h * DEVICES : (h + 1) * DEVICES] for h in range(NUM_NODES)]
            self.replicas.append([all(torch.equal(g, host[0]) for g in host) for host in hosts])

    def fit(name: str, strategy: Any, callbacks: Any = (), **kw: Any) -> Any:
        pl.seed_everything(0)
        kw.setdefault("limit_val_batches", 0)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=DEVICES,
            num_nodes=NUM_NODES,
            strategy=strategy,
            callbacks=list(callbacks),
            **quiet_trainer_kwargs(**kw),
        )
        model = DigitsCNN(lr=0.05, momentum=0.9)
        tx_before = _tx_bytes(interface)
        trainer.fit(model, DigitsDataModule(batch_size=32))
        tx_after = _tx_bytes(interface)
        checksum, finite = _checksum(model)
        res[name] = {
            "global_rank": trainer.global_rank,
            "node_rank": trainer.node_rank,
            "local_rank": trainer.local_rank,
            "world_size": trainer.world_size,
            "num_nodes": trainer.num_nodes,
            "strategy": type(trainer.strategy).__name__,
            "metrics": trainer.strategy.sync_metrics(),
            "checksum": checksum,
            "finite": finite,
            "veth_tx_bytes": tx_after - tx_before,
        }
        return trainer

    fit("bsp", BSPStrategy(verify_sync=True, timeout=TIMEOUT), max_steps=BSP_STEPS)

    probe = Probe()
    fit(
        "selsync",
        # no average at the end: the test compares the replicas as the last step left them
        SelSyncStrategy(delta=SELSYNC_DELTA, verify_sync=True, timeout=TIMEOUT, average_at_end=False),
        [probe],
        max_steps=SELSYNC_STEPS,
    )
    res["selsync"]["probe"] = probe.rows

    trainer = fit(
        "aladdin", ALADDINStrategy(period=2, timeout=TIMEOUT), max_epochs=1, limit_train_batches=ALADDIN_BATCHES
    )
    summary = trainer.strategy.server_summary
    res["aladdin"]["server"] = {"pushes": summary["pushes"], "global_updates": summary["global_updates"]}
    res["aladdin"]["steps"] = trainer.strategy.step_counter.steps

    probe = Probe()
    grouped = LocalSGDStrategy(period=GROUPED_PERIOD, replica_size="node", verify_sync=True, timeout=TIMEOUT)
    trainer = fit("grouped", grouped, [probe], max_steps=GROUPED_STEPS)
    res["grouped"]["probe"] = probe.rows
    res["grouped"]["replicas"] = probe.replicas
    res["grouped"]["topology"] = [grouped.ranks_per_replica, grouped.num_replicas, grouped.replica_index]

    destroy_default_group()
    rank = os.environ["RANK"]
    (out / f"rank{rank}.json").write_text(json.dumps(res, allow_nan=True))


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    rank = os.environ.get("RANK", "?")
    log = os.open(out_dir / f"log_rank{rank}.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        main(out_dir)
    except BaseException:
        (out_dir / f"error_rank{rank}.txt").write_text(traceback.format_exc())
        raise
