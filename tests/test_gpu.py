"""The GPU / NCCL path (``pytest -m gpu``): skipped, with the reason, on machines without CUDA.

* one GPU: every strategy trains a few steps with ``accelerator="gpu"``, its communicator on NCCL and its flat
  state on the GPU (the parameter-server strategies keep their servers on gloo with CPU buffers);
* two or more GPUs: two ranks, one GPU each, train with BSP, SelSync, OSP and ALADDIN over NCCL, and BSP's replicas
  end bit-identical; so do BSP's with bf16 compression and OSP's with int8 (compressed all-reduce over NCCL);
* the compressed all-reduce's per-rank stages on CUDA tensors give the CPU's result (up to float32 rounding: CUDA
  may fuse a multiply-add that the CPU rounds twice).
"""

from __future__ import annotations

import json
from pathlib import Path

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


def _trainer(strategy: object, devices: int, **kw):
    import lightning.pytorch as pl

    from lightning_sync.launch import quiet_trainer_kwargs

    return pl.Trainer(
        accelerator="gpu",
        devices=devices,
        strategy=strategy,
        max_epochs=1,
        limit_train_batches=6,
        limit_val_batches=0,
        **quiet_trainer_kwargs(**kw),
    )


@pytest.mark.parametrize("name", NAMES)
def test_every_strategy_trains_on_one_gpu_over_nccl(name, single_process):
    import lightning_sync  # noqa: F401  (registers the names)
    from lightning_sync.data import DigitsDataModule
    from lightning_sync.models import DigitsCNN

    trainer = _trainer(name, 1)
    model = DigitsCNN()
    trainer.fit(model, DigitsDataModule(batch_size=32))
    assert trainer.global_step > 0
    assert next(model.parameters()).device.type == "cuda"
    assert trainer.strategy.process_group_backend == "nccl"
    assert all(torch.isfinite(p).all() for p in model.parameters())


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


def _two_ranks(rank: int, out_dir: str) -> None:
    import lightning.pytorch as pl

    import lightning_sync  # noqa: F401
    from lightning_sync.data import DigitsDataModule
    from lightning_sync.models import DigitsCNN
    from lightning_sync.strategies import BSPStrategy, OSPStrategy

    res = {}
    for name in ("bsp", "selsync", "osp", "aladdin", *COMPRESSED):
        pl.seed_everything(0)
        if name in COMPRESSED:
            kind, compression = COMPRESSED[name]
            make = BSPStrategy if kind == "bsp" else OSPStrategy
            trainer = _trainer(make(compression=compression, verify_sync=True), 2)
        else:
            trainer = _trainer(name, 2)
        model = DigitsCNN()
        trainer.fit(model, DigitsDataModule(batch_size=32))
        flat = torch.cat(
            [t.detach().double().reshape(-1).cpu() for t in model.state_dict().values() if t.is_floating_point()]
        )
        res[name] = {
            "backend": trainer.strategy.process_group_backend,
            "checksum": [float(flat.sum()), float((flat * torch.arange(flat.numel())).sum())],
            "bytes": trainer.strategy.sync_metrics()["bytes_sent"],
        }
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(res))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs for two NCCL ranks")
def test_two_ranks_over_nccl(tmp_path):
    run_external(_two_ranks, 2, str(tmp_path))
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for name in ("bsp", "selsync", "osp", "aladdin", *COMPRESSED):
        assert res[0][name]["backend"] == "nccl" and res[0][name]["bytes"] > 0
    for name in ("bsp", *COMPRESSED):
        assert res[0][name]["checksum"] == res[1][name]["checksum"]
    assert res[0]["bsp+bf16"]["bytes"] < 0.6 * res[0]["bsp"]["bytes"]
