"""SelSync data injection (§III-E, Eq. 3): the math in-process, the transport on 4 CPU processes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from launch import run_external
from torch.utils.data import Dataset

from lightning_sync.comm.cost import allgather_bytes
from lightning_sync.core.injection import local_batch_size, shared_count, sharing_ranks

WORLD = 4
B = 32
ALPHA, BETA = 0.5, 0.5
FEATURES = 8


class IdDataset(Dataset):
    """Sample i is x = [i, features...] (float32), y = i % 10 (int64): every sample carries its origin."""

    def __init__(self, n: int = 640):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, FEATURES, generator=g)
        self.x[:, 0] = torch.arange(n, dtype=torch.float32)
        self.y = torch.arange(n) % 10

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class IdModel(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(FEATURES - 1, 10)
        self.records: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        assert torch.equal(y, x[:, 0].long() % 10)  # features and labels stayed aligned through the transport
        self.records.append(x[:, 0].long().tolist())
        return torch.nn.functional.cross_entropy(self.net(x[:, 1:]), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


# ------------------------------------------------------------------------------------------- in-process math
def test_eq3_local_batch_and_shared_count():
    assert local_batch_size(32, 0.5, 0.5, 8) == 11  # the paper's b'=11 for b=32, (0.5, 0.5)
    assert local_batch_size(32, 0.75, 0.75, 8) == 6  # and b'=6 for (0.75, 0.75)
    b_local = local_batch_size(B, ALPHA, BETA, WORLD)
    assert b_local == 16 and shared_count(b_local, BETA) == 8
    assert b_local + math.ceil(ALPHA * WORLD) * shared_count(b_local, BETA) == B


def test_sharing_ranks_are_seeded_and_sized():
    for step in range(20):
        ranks = sharing_ranks(WORLD, ALPHA, seed=0, step=step)
        assert ranks == sharing_ranks(WORLD, ALPHA, seed=0, step=step) and len(ranks) == 2
    assert len({tuple(sharing_ranks(WORLD, ALPHA, 0, s)) for s in range(20)}) > 1


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"injection": (0.0, 0.5)}, "alpha"),
        ({"injection": (1.5, 0.5)}, "alpha"),
        ({"injection": (0.5, 0.0)}, "beta"),
        ({"injection": (0.5, 2.0)}, "beta"),
        ({"injection": (0.5,)}, "injection"),
        ({"injection": (0.5, 0.5), "injection_seed": -1}, "injection_seed"),
    ],
)
def test_bad_injection_arguments(kwargs, match):
    from lightning_sync import SelSyncStrategy

    with pytest.raises(ValueError, match=match):
        SelSyncStrategy(**kwargs)


def test_batch_too_small_after_eq3_names_the_needed_batch_size():
    with pytest.raises(ValueError, match="batch_size >= 5"):
        local_batch_size(4, 1.0, 1.0, 4)


# ------------------------------------------------------------------------------------------- 4 processes
def _suite(rank: int, out_dir: str) -> None:
    from torch.utils.data import DataLoader

    from lightning_sync import SelSyncStrategy

    pl.seed_everything(0)
    model = IdModel()
    strategy = SelSyncStrategy(delta=0.05, injection=(ALPHA, BETA), injection_seed=7)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, DataLoader(IdDataset(), batch_size=B, shuffle=True))
    res = {
        "records": model.records,
        "local_batch": strategy.injector.local_batch,
        "loader_batch": trainer.train_dataloader.batch_size,
        "bytes_inject": strategy.comm_stats.bytes_sent["inject"],
        "ops_inject": strategy.comm_stats.ops["inject"],
        "payload": strategy.injector.payload_bytes,
        "metrics": strategy.sync_metrics(),
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("inject")
    run_external(_suite, WORLD, str(out))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_every_rank_trains_on_b_samples(suite):
    b_local = local_batch_size(B, ALPHA, BETA, WORLD)
    m = shared_count(b_local, BETA)
    for r in suite:
        assert r["local_batch"] == r["loader_batch"] == b_local  # the loader was rebuilt with b' (Eq. 3)
        steps = r["records"]
        assert len(steps) == len(suite[0]["records"])  # same number of steps everywhere
        full = [len(ids) for ids in steps if len(ids) == B]
        assert len(full) >= len(steps) - 1  # only a last partial batch may be shorter
        for ids in steps:
            own = len(ids) - 2 * min(m, len(ids) // 3)
            assert len(ids) == own + 2 * min(m, own)


def test_injected_samples_come_from_the_sharing_ranks(suite):
    b_local = local_batch_size(B, ALPHA, BETA, WORLD)
    m = shared_count(b_local, BETA)
    for step in range(len(suite[0]["records"])):
        sharers = sharing_ranks(WORLD, ALPHA, seed=7, step=step)
        own = [r["records"][step][: len(r["records"][step]) - 2 * m] for r in suite]
        expected = [i for s in sharers for i in own[s][:m]]
        for r, rec in enumerate(suite):
            injected = rec["records"][step][len(own[r]) :]
            assert injected == expected  # exactly the sharers' first beta*b' samples, in rank order
            assert set(own[r]).isdisjoint(set(own[(r + 1) % WORLD]))  # DistributedSampler: disjoint shards


def test_injection_bytes_are_counted(suite):
    b_local = local_batch_size(B, ALPHA, BETA, WORLD)
    m = shared_count(b_local, BETA)
    sample_bytes = FEATURES * 4 + 8  # float32 features + int64 label
    for r in suite:
        steps = len(r["records"])
        assert r["ops_inject"] == steps
        # the fixed-size ring all-gather: (N-1) slots of m samples per rank per step
        assert r["bytes_inject"] == steps * allgather_bytes(m * sample_bytes, WORLD)
        # the injected payload is the paper's alpha*N * beta*b' * sample size per step
        assert r["payload"] == steps * math.ceil(ALPHA * WORLD) * m * sample_bytes
        assert r["metrics"]["injected_payload_bytes"] == r["payload"]
        assert r["metrics"]["bytes_inject"] == r["bytes_inject"]


def test_alpha_beta_delta_and_partition_from_yaml():
    from lightning_sync import SelSyncStrategy
    from lightning_sync.cli import cli_main

    config = Path(__file__).resolve().parent.parent / "examples" / "configs" / "selsync_noniid.yaml"
    cli = cli_main(["--config", str(config), "--trainer.strategy.init_args.injection=[0.75, 0.75]"], run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, SelSyncStrategy) and strategy.delta == 0.3
    assert (strategy.injector.alpha, strategy.injector.beta) == (0.75, 0.75)
    assert cli.datamodule.partition == "labelskew" and cli.datamodule.labels_per_rank == 5


def test_digits_datamodule_partitions():
    from lightning_sync.data import DigitsDataModule, Dirichlet, LabelSkew

    dm = DigitsDataModule(partition="labelskew", labels_per_rank=10)
    assert isinstance(dm.train_dataloader().sampler, LabelSkew)  # one process: it must hold all 10 labels
    dm = DigitsDataModule(partition="dirichlet", dirichlet_alpha=0.3)
    assert isinstance(dm.train_dataloader().sampler, Dirichlet)
    for kwargs, name in (({"partition": "skewed"}, "partition"), ({"labels_per_rank": 0}, "labels_per_rank")):
        with pytest.raises(ValueError, match=name):
            DigitsDataModule(**kwargs)
