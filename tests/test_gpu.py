"""The GPU path (``pytest -m gpu``): skipped, with the reason, on machines without CUDA.

* **one GPU, NCCL**: every strategy trains a few steps with ``accelerator="gpu"``; during training (checked from a
  callback: Lightning's ``Strategy.teardown`` moves the module back to the CPU when ``fit`` ends) the module and the
  flat state are on the GPU and the communicator is on NCCL (the parameter-server strategies keep their servers on
  gloo with CPU buffers). SelSync reads nothing on the host between backward and the update
  (``torch.cuda.set_sync_debug_mode("error")`` in that window), and BSP launches its buckets during backward.
* **two ranks sharing one GPU, gloo** (what a one-GPU machine can run; the torchrun-style two-node environment:
  ``WORLD_SIZE=2``, ``NODE_RANK=r``, ``LOCAL_RANK=0``, ``Trainer(accelerator="gpu", devices=1, num_nodes=2)``,
  ``process_group_backend="gloo"``, so gloo carries CUDA tensors): every strategy with ``verify_sync=True`` (each
  sync checks that the ranks agree); for the synchronous strategies the replicas are compared after every step by an
  independent probe and are bit-identical after every sync; every strategy but SelSync (no averaging at the end)
  hands back identical models.
* **two GPUs, NCCL**: two ranks, one GPU each, BSP, SelSync, OSP and ALADDIN; BSP's replicas end bit-identical;
  so do BSP's with bf16 compression and OSP's with int8 (compressed all-reduce over NCCL);
* the compressed all-reduce's per-rank stages on CUDA tensors give the CPU's result (up to float32 rounding: CUDA
  may fuse a multiply-add that the CPU rounds twice).

What differs on CUDA (read from torch 2.11 / Lightning 2.6): ``Communicator`` synchronises the current stream after
a blocking NCCL collective only (``_cuda``), to charge its real duration as blocked time. With gloo and CUDA tensors
``ProcessGroupGloo``'s CUDA work makes its copy stream wait for the current stream before copying the input to
pinned host memory, and ``wait()`` makes the current stream wait for the copy back, while the host blocks until
the CPU all-reduce is done: ordering needs nothing more, and the blocked time is the real wait. The bucket hooks
run on the autograd engine's device thread, on the stream that accumulated the gradient, so a bucket's collective
is ordered after its gradients (as DDP's C++ hook). SelSync copies the squared norm to pinned host memory behind a
CUDA event and decides on the communicator's driver thread (gloo group of its own), so the training thread reads
nothing before the update; the vote is read after it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import run_external

from lightning_sync.strategies import STRATEGIES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="no CUDA GPU on this machine: the GPU/NCCL path is exercised where one is available (pytest -m gpu)",
    ),
]

NAMES = [cls.strategy_name for cls in STRATEGIES]
#: strategies whose replicas are identical after each step that synced (the others: OSP's unimportant layers are
#: corrected when the next step's ICS lands; the parameter-server strategies never wait for each other)
IDENTICAL_AFTER_SYNC = ("bsp", "selsync", "localsgd", "fedavg", "adpsgd")
#: strategies whose ranks run the same steps, so a probe may all-gather at every step
LOCKSTEP = (*IDENTICAL_AFTER_SYNC, "osp")


def _trainer(strategy: Any, devices: int, num_nodes: int = 1, callbacks: tuple = (), **kw: Any):
    import lightning.pytorch as pl

    from lightning_sync.launch import quiet_trainer_kwargs

    return pl.Trainer(
        accelerator="gpu",
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        max_epochs=1,
        limit_train_batches=6,
        callbacks=list(callbacks),
        **quiet_trainer_kwargs(limit_val_batches=0, **kw),
    )


def _where_it_trains():
    """A callback recording, at every step, where the module and the strategy's flat state live."""
    from lightning.pytorch.callbacks import Callback

    class WhereItTrains(Callback):
        def __init__(self) -> None:
            self.devices: set[str] = set()
            self.launched_during_backward: list[int] = []

        def on_train_batch_end(self, trainer, pl_module, *args):
            self.devices.add(next(pl_module.parameters()).device.type)
            flat = trainer.strategy._flat
            if flat is not None:
                self.devices.update(g.state.device.type for g in flat.groups)

        def on_after_backward(self, trainer, pl_module):
            overlap = getattr(trainer.strategy, "overlap", None)  # a SyncStrategy's gradient buckets
            buckets = overlap.buckets if overlap is not None else None
            if buckets is not None and buckets.armed:
                self.launched_during_backward.append(buckets.launched_during_backward)

    return WhereItTrains()


@pytest.mark.parametrize("name", NAMES)
def test_every_strategy_trains_on_one_gpu_over_nccl(name, single_process):
    import lightning_sync  # noqa: F401  (registers the names)
    from lightning_sync.data import DigitsDataModule
    from lightning_sync.models import DigitsCNN

    where = _where_it_trains()
    trainer = _trainer(name, 1, callbacks=(where,))
    model = DigitsCNN()
    trainer.fit(model, DigitsDataModule(batch_size=32))
    assert trainer.global_step > 0
    assert where.devices == {"cuda"}  # during training; fit's teardown has moved the module back to the CPU since
    assert trainer.strategy.process_group_backend == "nccl"
    assert all(torch.isfinite(p).all() for p in model.parameters())
    if name == "bsp":
        assert where.launched_during_backward and all(n >= 1 for n in where.launched_during_backward)


@pytest.mark.parametrize("workload", ["digits", "text", "vgg", "words"])
def test_every_packaged_workload_trains_and_validates_on_a_gpu(workload, single_process):
    """``compare --accelerator gpu`` runs these models: their evaluation must keep every tensor on the GPU (the
    language models stacked a CPU token count with the CUDA loss at the first validation, issue 51)."""
    from workloads import fit_and_validate

    metrics = fit_and_validate(workload, "gpu")
    name = "val/ppl" if workload in ("text", "words") else "val/acc"
    assert name in metrics and torch.isfinite(torch.tensor(metrics[name]))


@pytest.mark.parametrize("agg", ["parameters", "gradients"])
def test_selsync_does_not_synchronise_with_the_gpu_before_the_update(single_process, agg):
    from probes import ProbedCNN, ReadProbe

    from lightning_sync import SelSyncStrategy
    from lightning_sync.data import DigitsDataModule

    probe = ReadProbe(cuda_sync_errors=agg == "parameters")  # any synchronising CUDA call in the window raises
    trainer = _trainer(SelSyncStrategy(delta=0.05, aggregation=agg), 1, callbacks=(probe,))
    trainer.fit(ProbedCNN(), DigitsDataModule(batch_size=32))
    assert len(probe.per_step) == 6
    if agg == "parameters":
        assert probe.per_step == [[]] * 6
    else:  # the vote must be on the host before the update: the documented cost of gradient aggregation
        assert all(calls == ["tolist"] for calls in probe.per_step)


# --------------------------------------------------------------------------- two ranks sharing one GPU, over gloo
def _shared_gpu(rank: int, out_dir: str) -> None:
    os.environ.update(NODE_RANK=str(rank), LOCAL_RANK="0")  # torchrun on two one-GPU "nodes" of this machine
    from datetime import timedelta

    import lightning.pytorch as pl
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback

    from lightning_sync.data import DigitsDataModule
    from lightning_sync.models import DigitsCNN

    class ReplicaProbe(Callback):
        """After every step: do the ranks hold bit-identical parameters and buffers (plain torch.distributed,
        not the strategy's code), and did the step sync?"""

        def __init__(self) -> None:
            self.rows: list[list[bool]] = []
            self._synced = 0

        def on_train_batch_end(self, trainer, pl_module, *args):
            tensors = [t.detach().reshape(-1) for t in pl_module.state_dict().values() if t.is_floating_point()]
            bits = torch.cat(tensors).view(torch.int32).to(torch.int64).cpu()
            local = torch.stack([bits.sum(), (bits * torch.arange(1, bits.numel() + 1)).sum()])
            gathered = [torch.zeros_like(local) for _ in range(2)]
            dist.all_gather(gathered, local)
            synced = trainer.strategy.step_counter.sync_steps > self._synced
            self._synced = trainer.strategy.step_counter.sync_steps
            self.rows.append([bool(synced), torch.equal(gathered[0], gathered[1])])

    res: dict[str, Any] = {}
    for cls in STRATEGIES:
        name = cls.strategy_name
        pl.seed_everything(0)
        strategy = cls(process_group_backend="gloo", verify_sync=True, timeout=timedelta(seconds=120))
        probe, where = ReplicaProbe(), _where_it_trains()
        callbacks = (probe, where) if name in LOCKSTEP else (where,)
        trainer = _trainer(strategy, 1, num_nodes=2, callbacks=callbacks)
        model = DigitsCNN()
        trainer.fit(model, DigitsDataModule(batch_size=32))
        flat = torch.cat([t.detach().double().reshape(-1).cpu() for t in model.state_dict().values()])
        res[name] = {
            "backend": trainer.strategy.process_group_backend,
            "world": trainer.world_size,
            "devices": sorted(where.devices),
            "steps": trainer.strategy.step_counter.steps,
            "rows": probe.rows,
            "launched_during_backward": where.launched_during_backward,
            "checksum": [float(flat.sum()), float((flat * torch.arange(flat.numel())).sum())],
        }
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(res))


def test_two_ranks_share_one_gpu_over_gloo(tmp_path):
    run_external(_shared_gpu, 2, str(tmp_path))
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for name in NAMES:
        for r in res:
            m = r[name]
            assert m["backend"] == "gloo" and m["world"] == 2 and m["devices"] == ["cuda"], (name, m)
            assert m["steps"] > 0
        if name in IDENTICAL_AFTER_SYNC:
            rows = res[0][name]["rows"]
            assert any(synced for synced, _ in rows) or name == "selsync", name
            assert all(equal for synced, equal in rows if synced), (name, rows)
        if name != "selsync":  # the others hand back the global model (averaged at the end / the servers')
            assert res[0][name]["checksum"] == res[1][name]["checksum"], name
    assert res[0]["bsp"]["launched_during_backward"] and all(n >= 1 for n in res[0]["bsp"]["launched_during_backward"])


# ------------------------------------------------------------------------------------------ two GPUs, over NCCL
@pytest.mark.parametrize("name", ["bf16", "fp16", "int8"])
def test_compressed_all_reduce_stages_on_cuda_equal_the_cpu(name):
    from test_compression import _inputs, simulate

    from lightning_sync.comm.compression import Compressor

    cpu = [Compressor(name) for _ in range(3)]
    gpu = [Compressor(name) for _ in range(3)]
    fb_cpu = [c.feedback("x", 5000, torch.float32, torch.device("cpu")) for c in cpu]
    fb_gpu = [c.feedback("x", 5000, torch.float32, torch.device("cuda")) for c in gpu]
    for step in range(3):
        xs = _inputs(3, 5000, seed=step)
        expected = simulate(cpu, [x.clone() for x in xs], fb_cpu)[0]
        got = simulate(gpu, [x.cuda() for x in xs], fb_gpu)[0]
        assert torch.allclose(got.cpu(), expected, rtol=1e-5, atol=1e-6)


COMPRESSED = {"bsp+bf16": ("bsp", "bf16"), "osp+int8": ("osp", "int8")}


def _two_gpus(rank: int, out_dir: str) -> None:
    import lightning.pytorch as pl

    import lightning_sync  # noqa: F401
    from lightning_sync.data import DigitsDataModule
    from lightning_sync.models import DigitsCNN
    from lightning_sync.strategies import BSPStrategy, OSPStrategy

    res = {}
    for name in ("bsp", "selsync", "osp", "aladdin", *COMPRESSED):
        pl.seed_everything(0)
        where = _where_it_trains()
        if name in COMPRESSED:
            kind, compression = COMPRESSED[name]
            make = BSPStrategy if kind == "bsp" else OSPStrategy
            trainer = _trainer(make(compression=compression, verify_sync=True), 2, callbacks=(where,))
        else:
            trainer = _trainer(name, 2, callbacks=(where,))
        model = DigitsCNN()
        trainer.fit(model, DigitsDataModule(batch_size=32))
        flat = torch.cat(
            [t.detach().double().reshape(-1).cpu() for t in model.state_dict().values() if t.is_floating_point()]
        )
        res[name] = {
            "backend": trainer.strategy.process_group_backend,
            "devices": sorted(where.devices),
            "checksum": [float(flat.sum()), float((flat * torch.arange(flat.numel())).sum())],
            "bytes": trainer.strategy.sync_metrics()["bytes_sent"],
        }
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(res))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs for two NCCL ranks")
def test_two_ranks_over_nccl(tmp_path):
    run_external(_two_gpus, 2, str(tmp_path))
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for name in ("bsp", "selsync", "osp", "aladdin", *COMPRESSED):
        assert res[0][name]["backend"] == "nccl" and res[0][name]["bytes"] > 0
        assert res[0][name]["devices"] == res[1][name]["devices"] == ["cuda"]
    for name in ("bsp", *COMPRESSED):
        assert res[0][name]["checksum"] == res[1][name]["checksum"]
    assert res[0]["bsp+bf16"]["bytes"] < 0.6 * res[0]["bsp"]["bytes"]


def test_compare_runs_its_rows_on_the_gpu(tmp_path):
    """``lightning-sync compare --accelerator gpu``: on a one-GPU machine the two ranks share GPU 0 over gloo as
    one-GPU nodes, with a GPU per rank over NCCL; every row trains and is reported."""
    from lightning_sync.compare import main as compare_main

    result = compare_main(
        [
            "--workload",
            "digits",
            "--devices",
            "2",
            "--accelerator",
            "gpu",
            "--strategies",
            "ddp,bsp,localsgd+bf16,selsync",
            "--seeds",
            "1",
            "--link",
            "1gbit,1ms",
            "--target",
            "0.3",
            "--out",
            str(tmp_path),
            "--trainer.max_epochs=2",
            "--trainer.limit_train_batches=4",
        ]
    )
    table = {r["method"]: r for r in result["tables"]["1gbit,1ms"]}
    assert list(table) == ["ddp", "bsp", "localsgd+bf16", "selsync"]
    assert all(r["runs"] == 1 and not r.get("error") for r in table.values()), table
    overlay = (tmp_path / "1gbit-1ms" / "bsp" / "seed0" / "overlay.yaml").read_text()
    assert "accelerator: gpu" in overlay
