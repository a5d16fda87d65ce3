"""Sharded replicas (``sharded=True``): each replica's model sharded with FSDP2 over its ranks, the method between
replicas on each rank's shard. 4 CPU processes (gloo) as 2 replicas x 2 shards, started once for the module.

What is held here:

* **Against Lightning's FSDP2**: sharded local SGD at period 1 (SGD with momentum and weight decay, plain averaging)
  equals Lightning's ``ModelParallelStrategy(data_parallel_size=4, tensor_parallel_size=1)`` with ``fully_shard``
  over all 4 ranks (BSP, exactly in exact arithmetic: the update is linear), in float64 to the rounding bound of
  ``tests/tolerance.py``.
* **Against grouped (DDP-inside) replicas**: sharded local SGD at period 4 equals grouped local SGD
  (``replica_size=2``, the whole model on every rank) with the same seeds, also with ``gradient_clip_val`` (the
  replica's whole gradient clipped, its norm taken from the shards), and sharded DiLoCo (outer Nesterov momentum)
  equals grouped DiLoCo, the same way: FSDP2's reduce-scatter inside a replica is DDP's all-reduce, the
  average between replicas per shard is the leaders' average of the whole model.
* **Invariants at every step**, from outside the strategy (a plain ``torch.distributed`` checksum gather of each
  rank's local shard): after every sync each shard is identical across the replicas, between syncs the replicas
  differ; ``verify_sync`` is on in those runs (it checks the same after every sync); validation during fit sees the
  replicas' average, and training resumes on each replica's own shards.
* **A language model's configuration** (AdamW, bf16-mixed, gradient accumulation, BatchNorm, DiLoCo's default
  outer optimizer) runs with ``verify_sync`` checking every sync.
* **Bytes between replicas per rank** are the shard's: one all-reduce of the local shard over the 2 replicas per
  sync, half the grouped leader's.
* **Checkpoints**: a fit resumed from the end of its first epoch (mid-period, with DiLoCo's outer momentum) ends
  bit-identical to the uninterrupted fit; each rank's part holds its local shards, the main file the whole model (a
  plain state dict the unsharded module loads); ``trainer.validate`` after fit and from that file (the module's own
  values zeroed first) gives the whole model's loss; after a fit that ends with the replicas apart, every replica
  evaluates replica 0's model. With ``save_distributed_checkpoint=True`` (a DCP directory) the same fits, and fits
  resumed from a directory, are bit-identical; validate from a directory gives the whole model's loss; Lightning's
  ``consolidate_checkpoint`` of a directory gives the main file's whole model.
* **FSDP2's own traffic counted**: ``compare``'s ``fsdp2`` row (``CountedFSDP2Strategy``) is Lightning's
  ``ModelParallelStrategy`` bit for bit, its all-gathers and reduce-scatters counted exactly; inside a sharded
  replica the same traffic is counted as ``intra/fsdp_*``.
* **Refusals at setup**: a LightningModule without ``configure_model``, ``fully_shard`` over the 2-D mesh (HSDP);
  at construction (in-process) ``sharded`` without ``replica_size``, or with ``fault_tolerance`` for a method other
  than local SGD and DiLoCo (fault-tolerant sharded groups: ``tests/test_fault_tolerance.py``). The
  other methods on sharded replicas, and the refusals of those that do not run sharded, are
  ``tests/test_sharded_methods.py``'s.
"""

from __future__ import annotations

import json
import math
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from launch import run_suite
from tolerance import assert_equal_in_exact_arithmetic

from lightning_sync.comm.cost import gloo_ring_allreduce_bytes

WORLD = 4
SHARDS = 2  # ranks per replica
REPLICAS = WORLD // SHARDS
K = 10  # optimizer steps of the equality runs
PERIOD = 4
TIMEOUT = timedelta(seconds=120)
CLIP = 0.05  # gradient_clip_val of the clipping runs: below the gradients' norms, so every step clips
SIZES = (16, 32, 32, 1)  # the MLP's widths: the last layer's weight [1, 32] is padded on the second shard


# ----------------------------------------------------------------------------------------------- worker side
def _suite(rank: int, out_dir: str) -> None:
    import lightning.pytorch as pl
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch import nn
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_sync import DiLoCoStrategy, LocalSGDStrategy
    from lightning_sync.launch import quiet_trainer_kwargs
    from lightning_sync.strategies import CountedFSDP2Strategy

    out = Path(out_dir)
    res: dict = {}

    class MLP(pl.LightningModule):
        """A float64 MLP; ``shard_over`` names the device-mesh dimension ``configure_model`` shards over (None: it
        does not override ``configure_model`` sharding anything; ``"2d"``: the whole 2-D mesh, HSDP)."""

        def __init__(self, shard_over: str | None) -> None:
            super().__init__()
            self.shard_over = shard_over
            layers: list[nn.Module] = []
            for a, b in zip(SIZES, SIZES[1:]):
                layers += [nn.Linear(a, b, dtype=torch.float64), nn.Tanh()]
            self.net = nn.Sequential(*layers[:-1])

        def configure_model(self) -> None:
            if self.shard_over is None or isinstance(self.net, FSDPModule):  # sharded at an earlier setup
                return
            mesh = self.device_mesh if self.shard_over == "2d" else self.device_mesh[self.shard_over]
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

        def predict_step(self, batch, batch_idx):
            return self.net(batch[0])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)

    class Plain(MLP):
        """The same MLP without ``configure_model`` (grouped replicas; the refusal of a module that does not shard)."""

        configure_model = pl.LightningModule.configure_model

    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, SIZES[0], generator=g, dtype=torch.float64)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    data = TensorDataset(x, y)

    def loader() -> DataLoader:
        return DataLoader(data, batch_size=8, shuffle=True)

    def full(model) -> dict[str, torch.Tensor]:
        """The whole parameters (all-gathered from the shards: every rank of the mesh calls it)."""
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in
                model.named_parameters()}  # fmt: skip

    def fit(name, strategy, make_model, callbacks=(), ckpt_path=None, **kw):
        pl.seed_everything(0)
        model = make_model()  # after the seed: every run starts from the same parameters
        kw.setdefault("limit_val_batches", 0)
        kw.setdefault("default_root_dir", out)  # a resumed fit's default ModelCheckpoint writes there, not into cwd
        trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, callbacks=list(callbacks),
                             **quiet_trainer_kwargs(**kw))  # fmt: skip
        trainer.fit(model, loader(), loader() if kw["limit_val_batches"] else None, ckpt_path=ckpt_path)
        torch.save(full(model), out / f"{name}_rank{rank}.pt")
        return trainer

    def local_checksum(model) -> torch.Tensor:
        parts = [(p.to_local() if hasattr(p, "to_local") else p).detach().reshape(-1) for p in model.parameters()]
        bits = torch.cat(parts).view(torch.int64)
        return torch.stack([bits.sum(), (bits * torch.arange(1, bits.numel() + 1)).sum()])

    def gather(value: torch.Tensor) -> list[torch.Tensor]:
        gathered = [torch.zeros_like(value) for _ in range(WORLD)]
        dist.all_gather(gathered, value)  # plain torch.distributed: outside the strategy's code and accounting
        return gathered

    class Probe(Callback):
        """After every step: whether it synced, whether each shard is identical across the replicas (ranks i and
        i + SHARDS), and whether the two shards of a replica differ (they are different halves of the model)."""

        def __init__(self) -> None:
            self.rows: list[list[bool]] = []
            self._syncs = 0

        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            sums = gather(local_checksum(pl_module))
            synced = trainer.strategy.step_counter.sync_steps > self._syncs
            self._syncs = trainer.strategy.step_counter.sync_steps
            same = all(torch.equal(sums[i], sums[i + SHARDS]) for i in range(SHARDS))
            self.rows.append([bool(synced), same, not torch.equal(sums[0], sums[1])])

    class AtValidation(Callback):
        """What the first validation batch sees against each replica's own shards (callbacks' on_validation_start
        runs before the strategy swaps the average in), and the shards training resumes from afterwards."""

        def __init__(self) -> None:
            self.rows: list[dict] = []

        def on_validation_start(self, trainer, pl_module) -> None:
            self._before = torch.cat([p.to_local().detach().reshape(-1).clone() for p in pl_module.parameters()])

        def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
            if batch_idx:
                return
            now = torch.cat([p.to_local().detach().reshape(-1).clone() for p in pl_module.parameters()])
            before: list = [None] * WORLD
            dist.all_gather_object(before, self._before)  # the two shards' lengths differ (the padded last layer)
            other = before[(rank + SHARDS) % WORLD]
            self.rows.append({"replicas_differed": not torch.equal(before[rank], other),
                              "is_average": torch.equal(now, (before[rank % SHARDS] + before[rank % SHARDS + SHARDS])
                                                        / 2)})  # fmt: skip

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if self.rows and "put_back" not in self.rows[-1]:
                now = torch.cat([p.to_local().detach().reshape(-1) for p in pl_module.parameters()])
                self.rows[-1]["put_back"] = torch.equal(now, self._before)

    class Memory(Callback):
        """Rank's training-state bytes as compare's end record counts them (lightning_sync.benchmark.memory)."""

        def __init__(self) -> None:
            from lightning_sync.benchmark.memory import MemoryCount

            self.count, self.result = MemoryCount(), {}

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            self.count.observe_grads(pl_module)

        def on_train_end(self, trainer, pl_module) -> None:
            self.result = self.count.record(pl_module, trainer.optimizers, trainer.strategy)

    def counts(strategy) -> dict:
        stats = strategy.comm_stats
        return {"bytes": dict(stats.bytes_sent), "sync_steps": strategy.step_counter.sync_steps}

    # 1. sharded local SGD at period 1 vs Lightning's FSDP2 over all ranks (float64)
    mp = ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1, timeout=TIMEOUT)
    fit("fsdp_all", mp, lambda: MLP("data_parallel"), max_steps=K)
    # compare's fsdp2 row: the same, its collectives counted (data_parallel_size defaults to every rank)
    memory = {name: Memory() for name in ("fsdp2_counted", "sharded_p1", "grouped_p4")}
    tr = fit("fsdp2_counted", CountedFSDP2Strategy(timeout=TIMEOUT), lambda: MLP("data_parallel"),
             [memory["fsdp2_counted"]], max_steps=K)  # fmt: skip
    res["fsdp2_counted"] = {"bytes": dict(tr.strategy.comm_stats.bytes_sent), "metrics": tr.strategy.sync_metrics()}
    tr = fit("sharded_p1", LocalSGDStrategy(period=1, replica_size=SHARDS, sharded=True, timeout=TIMEOUT),
             lambda: MLP("shard"), [memory["sharded_p1"]], max_steps=K)  # fmt: skip
    res["sharded_p1"] = counts(tr.strategy)

    # 2. sharded vs grouped (DDP inside the replica): local SGD at period 4, DiLoCo with an outer Nesterov momentum
    outer = {"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True}
    probe, at_val = Probe(), AtValidation()
    kw = dict(replica_size=SHARDS, timeout=TIMEOUT)
    tr = fit("sharded_p4", LocalSGDStrategy(period=PERIOD, sharded=True, verify_sync=True, **kw), lambda: MLP("shard"),
             [probe, at_val], max_steps=K, val_check_interval=3, limit_val_batches=2)  # fmt: skip
    res["sharded_p4"] = {**counts(tr.strategy), "probe": probe.rows, "validation": at_val.rows}
    tr = fit("grouped_p4", LocalSGDStrategy(period=PERIOD, **kw), lambda: Plain(None), [memory["grouped_p4"]],
             max_steps=K)  # fmt: skip
    res["grouped_p4"] = counts(tr.strategy)
    res["memory"] = {name: m.result for name, m in memory.items()}
    # gradient clipping of the replica's gradient (FSDP2's sharded one: its norm is the whole gradient's) at c*sqrt(R)
    clip = dict(max_steps=K, gradient_clip_val=CLIP)
    fit("sharded_clip", LocalSGDStrategy(period=PERIOD, sharded=True, **kw), lambda: MLP("shard"), **clip)
    fit("grouped_clip", LocalSGDStrategy(period=PERIOD, **kw), lambda: Plain(None), **clip)
    fit("grouped_unclipped", LocalSGDStrategy(period=PERIOD, **kw), lambda: Plain(None), max_steps=K)
    tr = fit("sharded_diloco", DiLoCoStrategy(sync_every=PERIOD, outer_optimizer=outer, sharded=True,
                                              verify_sync=True, **kw), lambda: MLP("shard"), max_steps=K)  # fmt: skip
    res["sharded_diloco"] = counts(tr.strategy)
    fit(
        "grouped_diloco",
        DiLoCoStrategy(sync_every=PERIOD, outer_optimizer=outer, **kw),
        lambda: Plain(None),
        max_steps=K,
    )

    # compression between replicas applies to the local shards: int8 with verify_sync, probed after every step
    probe = Probe()
    tr = fit("sharded_int8", LocalSGDStrategy(period=PERIOD, sharded=True, compression="int8", verify_sync=True, **kw),
             lambda: MLP("shard"), [probe], max_steps=K)  # fmt: skip
    res["sharded_int8"] = {**counts(tr.strategy), "probe": probe.rows}
    # the sparse format with ternary values, as topk: each rank's change of its local shard, its top 10 %
    probe = Probe()
    sparse = LocalSGDStrategy(period=PERIOD, sharded=True, compression="topk:0.1+int2", verify_sync=True, **kw)
    tr = fit("sharded_topk_int2", sparse, lambda: MLP("shard"), [probe], max_steps=K)
    res["sharded_topk_int2"] = {**counts(tr.strategy), "probe": probe.rows}

    # 3. checkpoints: each rank's part holds its local shards, the main file the whole model; a resume from the end
    # of the first epoch (mid-period: local SGD syncs after steps 0 and 5, DiLoCo after 2, 5, 8) continues exactly
    resumable = {
        "localsgd": lambda **extra: LocalSGDStrategy(period=5, sharded=True, **kw, **extra),
        "diloco": lambda **extra: DiLoCoStrategy(sync_every=3, outer_optimizer=outer, sharded=True, **kw, **extra),
    }
    for method, make in resumable.items():
        ckpt = ModelCheckpoint(dirpath=out / f"ckpt_{method}", every_n_epochs=1, save_top_k=-1, filename="{epoch}")
        epochs = dict(max_epochs=3, limit_train_batches=4, enable_checkpointing=True)
        tr = fit(f"{method}_whole", make(), lambda: MLP("shard"), [ckpt], **epochs)
        if method == "localsgd":  # evaluation after fit, and from the last checkpoint's whole model
            model = tr.lightning_module
            plain = Plain(None)
            plain.load_state_dict(full(model))
            with torch.no_grad():
                reference = float(nn.functional.mse_loss(plain.net(x), y))
            tr.limit_val_batches = 1.0  # the fit ran without validation
            after_fit = tr.validate(model, loader(), verbose=False)[0]["val_loss"]
            with torch.no_grad():  # the checkpoint, not what the module holds, is what is evaluated next
                for param in model.parameters():
                    param.to_local().zero_()
            from_ckpt = tr.validate(model, loader(), ckpt_path=str(ckpt.dirpath) + "/epoch=2.ckpt", verbose=False)
            res["validate"] = {"reference": reference, "after_fit": after_fit, "from_ckpt": from_ckpt[0]["val_loss"]}
            predictions = torch.cat(tr.predict(model, DataLoader(data, batch_size=8)))  # this rank's share of the data
            with torch.no_grad():  # the restored whole model on this rank's samples (DistributedSampler's order)
                mine = plain.net(x[rank::WORLD])
            res["predict_max_diff"] = float((predictions - mine).abs().max())
        fit(f"{method}_resumed", make(), lambda: MLP("shard"), ckpt_path=str(out / f"ckpt_{method}" / "epoch=0.ckpt"),
            **epochs)  # fmt: skip

    # the same fits with distributed checkpoints (a directory in DCP's format; save_last overwrites last.ckpt each
    # epoch), and each resumed from its first epoch's directory; for local SGD, validate from the last one
    for method, make in resumable.items():
        dirpath = out / f"dcp_{method}"
        ckpt = ModelCheckpoint(dirpath=dirpath, every_n_epochs=1, save_top_k=-1, filename="{epoch}", save_last=True)
        # and the best one only: each epoch's save removes the previous directory (ModelCheckpoint's top-k)
        best = ModelCheckpoint(dirpath=out / f"dcp_{method}_top1", monitor="step", mode="max", save_top_k=1,
                               every_n_epochs=1, filename="{epoch}")  # fmt: skip
        epochs = dict(max_epochs=3, limit_train_batches=4, enable_checkpointing=True)
        tr = fit(f"{method}_dcp_whole", make(save_distributed_checkpoint=True), lambda: MLP("shard"), [ckpt, best],
                 **epochs)  # fmt: skip
        if method == "localsgd":
            model = tr.lightning_module
            tr.limit_val_batches = 1.0
            with torch.no_grad():
                for param in model.parameters():
                    param.to_local().zero_()
            from_dir = tr.validate(model, loader(), ckpt_path=str(dirpath / "epoch=2.ckpt"), verbose=False)
            res["validate"]["from_dcp"] = from_dir[0]["val_loss"]
        fit(f"{method}_dcp_resumed", make(save_distributed_checkpoint=True), lambda: MLP("shard"),
            ckpt_path=str(dirpath / "epoch=0.ckpt"), **epochs)  # fmt: skip

    # evaluation after a fit whose replicas differ at the end (no average_at_end): every replica takes replica 0's
    # (K steps: the last sync after step 8, step 9 local)
    diverging = LocalSGDStrategy(period=PERIOD, average_at_end=False, sharded=True, **kw)
    tr = fit("diverged", diverging, lambda: MLP("shard"), max_steps=K)
    model = tr.lightning_module
    before = full(model)
    replica0: list = [None] * WORLD
    dist.all_gather_object(replica0, before)
    tr.limit_val_batches = 1.0
    tr.validate(model, loader(), verbose=False)
    after = full(model)
    res["diverged"] = {
        "differed": not all(torch.equal(before[k], replica0[SHARDS][k]) for k in before) if rank < SHARDS else None,
        "is_replica0": all(torch.equal(after[k], replica0[0][k]) for k in after),
    }

    # the configuration of a language model: AdamW, bf16-mixed, gradient accumulation, DiLoCo's default outer
    # optimizer (Nesterov over an adaptive inner one), BatchNorm buffers; verify_sync checks every sync
    class Adaptive(MLP):
        def __init__(self) -> None:
            super().__init__("shard")
            self.net = nn.Sequential(nn.Linear(SIZES[0], 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 1)).float()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x.float()), y.float())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    tr = fit("adaptive", DiLoCoStrategy(sync_every=3, sharded=True, verify_sync=True, **kw), Adaptive, max_steps=6,
             precision="bf16-mixed", accumulate_grad_batches=2)  # fmt: skip
    res["adaptive"] = {"sync_steps": tr.strategy.step_counter.sync_steps, "outer": tr.strategy.outer_config.spec()}

    # 4. refused at setup, saying why (every rank alike; the last runs of the suite)
    def refused(model, **kw) -> str:
        try:
            fit("refused", LocalSGDStrategy(period=2, sharded=True, replica_size=SHARDS, timeout=TIMEOUT), model,
                max_steps=1, **kw)  # fmt: skip
        except ValueError as err:
            return str(err)
        return ""

    res["refused_plain"] = refused(lambda: Plain(None))
    res["refused_hsdp"] = refused(lambda: MLP("2d"))
    (out / f"res_rank{rank}.json").write_text(json.dumps(res))


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded")
    return out, run_suite(_suite, WORLD, out)


def _load(out: Path, name: str, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(out / f"{name}_rank{rank}.pt")


def _fsdp_bytes(ranks: int, rank: int, steps: int) -> dict[str, int]:
    """FSDP2's bytes for ``steps`` training steps of the MLP sharded over ``ranks`` ranks (this rank ``rank`` among
    them), float64: per step every Linear layer's padded local shard all-gathered twice (before its forward, and
    before its backward: FSDP2 reshards a non-root module after its forward), and its padded gradient
    reduce-scattered once, which gloo runs as an all-reduce of the whole padded gradient."""
    from lightning_sync.comm.cost import allgather_bytes

    shards = [(b + ranks - 1) // ranks * (a + 1) for a, b in zip(SIZES, SIZES[1:])]  # padded shard of each layer
    return {
        "fsdp_all_gather": steps * sum(2 * allgather_bytes(8 * p, ranks) for p in shards),
        "fsdp_reduce_scatter": steps * sum(gloo_ring_allreduce_bytes(ranks * p, 8, ranks, rank) for p in shards),
    }


# ----------------------------------------------------------------------------------------------- the references
def test_the_counted_fsdp2_row_is_lightnings_fsdp2_bit_for_bit_with_its_bytes_counted(suite):
    """``compare``'s ``fsdp2`` row (``CountedFSDP2Strategy``) trains as Lightning's ``ModelParallelStrategy`` over
    all ranks, bit-identically (its collectives routed through the pack's communicators are FSDP2's own), and counts
    FSDP2's all-gathers and reduce-scatters exactly."""
    out, res = suite
    for rank in range(WORLD):
        ours, lightning = _load(out, "fsdp2_counted", rank), _load(out, "fsdp_all", rank)
        assert ours.keys() == lightning.keys()
        assert all(torch.equal(ours[k], lightning[k]) for k in ours), f"rank {rank}"
        assert res[rank]["fsdp2_counted"]["bytes"] == _fsdp_bytes(WORLD, rank, K)
        metrics = res[rank]["fsdp2_counted"]["metrics"]
        assert metrics["lssr"] == 0 and metrics["sync_steps"] == K
        assert metrics["bytes_sent"] == sum(_fsdp_bytes(WORLD, rank, K).values())


def test_fsdp2s_traffic_inside_a_sharded_replica_is_counted_at_the_intra_level(suite):
    """Sharded local SGD at period 1 (no validation): FSDP2's all-gathers and reduce-scatters over the replica's 2
    ranks are in the rank's accounting as ``intra/fsdp_*``, the analytic bytes of the shards."""
    _, res = suite
    for rank in range(WORLD):
        sent = res[rank]["sharded_p1"]["bytes"]
        expected = _fsdp_bytes(SHARDS, rank % SHARDS, K)
        assert {k: sent[f"intra/{k}"] for k in expected} == expected, f"rank {rank}"


def test_memory_per_rank_counts_the_local_shards_under_fsdp2(suite):
    """compare's memory count (``lightning_sync.benchmark.memory``): FSDP2 over 4 ranks holds each parameter's padded
    shard (its own storage), sharded replicas of 2 ranks the padded shards in one flat buffer, grouped replicas the
    whole model; the momentum buffers are the optimizer's view of the same parameters (FSDP2's: the unpadded local
    shards); the gradients are FSDP2's reduce-scatter outputs (one padded buffer per module) or, grouped, the flat
    gradient buffer."""
    _, res = suite
    whole = sum(a * b + b for a, b in zip(SIZES, SIZES[1:]))

    def padded(ranks: int) -> int:
        return sum((b + ranks - 1) // ranks * (a + 1) for a, b in zip(SIZES, SIZES[1:]))

    def unpadded(ranks: int, rank: int) -> int:  # the rows of each layer this rank's shard holds, times (a + 1)
        rows = [max(0, min(-(-b // ranks), b - rank * -(-b // ranks))) for b in SIZES[1:]]
        return sum(r * (a + 1) for r, a in zip(rows, SIZES))

    for rank in range(WORLD):
        fsdp, sharded, grouped = (res[rank]["memory"][n] for n in ("fsdp2_counted", "sharded_p1", "grouped_p4"))
        assert fsdp["params_bytes"] == 8 * padded(WORLD) and fsdp["grads_bytes"] == 8 * padded(WORLD)
        assert fsdp["optimizer_bytes"] == 8 * unpadded(WORLD, rank) and fsdp["outer_bytes"] == 0
        assert sharded["params_bytes"] == 8 * padded(SHARDS) and sharded["grads_bytes"] == 8 * padded(SHARDS)
        assert sharded["optimizer_bytes"] == 8 * unpadded(SHARDS, rank % SHARDS)
        assert grouped["params_bytes"] == grouped["grads_bytes"] == grouped["optimizer_bytes"] == 8 * whole
        assert fsdp["peak_rss_bytes"] > 0


def test_sharded_local_sgd_at_period_1_equals_lightnings_fsdp2_over_all_ranks(suite):
    out, res = suite
    for rank in range(WORLD):
        ours, lightning = _load(out, "sharded_p1", rank), _load(out, "fsdp_all", rank)
        assert_equal_in_exact_arithmetic(ours, lightning, K, f"rank {rank}: sharded local SGD vs FSDP2")
    assert res[0]["sharded_p1"]["sync_steps"] == K


@pytest.mark.parametrize("method", ["p4", "diloco", "clip"])
def test_sharded_replicas_equal_grouped_ddp_inside_replicas(suite, method):
    out, res = suite
    sharded, grouped = f"sharded_{method}", f"grouped_{method}"
    if method == "clip":  # clipping the whole replica gradient, from its shards; not vacuous: it changed the run
        for rank in range(WORLD):
            ours, reference = _load(out, sharded, rank), _load(out, grouped, rank)
            assert_equal_in_exact_arithmetic(ours, reference, K, f"rank {rank}: {sharded} vs {grouped}")
        unclipped = _load(out, "grouped_unclipped", 0)
        assert not torch.equal(unclipped["net.0.weight"], _load(out, grouped, 0)["net.0.weight"])
        return
    for rank in range(WORLD):
        ours, reference = _load(out, sharded, rank), _load(out, grouped, rank)
        assert_equal_in_exact_arithmetic(ours, reference, K, f"rank {rank}: {sharded} vs {grouped}")
    # not vacuous: the runs trained (moved away from the start) and the two methods differ from each other
    assert not torch.equal(_load(out, "sharded_p4", 0)["net.0.weight"], _load(out, "sharded_diloco", 0)["net.0.weight"])
    expected = math.ceil(K / PERIOD) if method == "p4" else K // PERIOD
    assert res[0][sharded]["sync_steps"] == expected


# ----------------------------------------------------------------------------------------------- invariants
def test_each_shard_is_identical_across_replicas_after_every_sync_and_differs_between(suite):
    _, res = suite
    rows = res[0]["sharded_p4"]["probe"]
    assert len(rows) == K and all(r["sharded_p4"]["probe"] == rows for r in res)
    syncs = [synced for synced, _, _ in rows]
    assert syncs == [step % PERIOD == 0 for step in range(K)]
    assert all(same for synced, same, _ in rows if synced)
    assert not any(same for synced, same, _ in rows if not synced)
    assert all(halves_differ for _, _, halves_differ in rows)


def test_validation_sees_the_replicas_average_and_training_resumes_on_its_own_shards(suite):
    _, res = suite
    for r in res:
        rows = r["sharded_p4"]["validation"]
        assert len(rows) == K // 3
        assert any(row["replicas_differed"] for row in rows)
        assert all(row["is_average"] for row in rows)
        assert all(row["put_back"] for row in rows)


def test_bytes_between_replicas_per_rank_are_the_shards(suite):
    """Each sync all-reduces the rank's local shard (with FSDP2's padding: the last layer's [1, 32] weight and [1]
    bias are one row on the first shard, padding on the second) over the 2 replicas: half the grouped leader's
    bytes per sync; the grouped run's other rank sends none."""
    _, res = suite
    whole = sum(a * b + b for a, b in zip(SIZES, SIZES[1:]))
    padded = sum((b + SHARDS - 1) // SHARDS * (a + 1) for a, b in zip(SIZES, SIZES[1:]))
    assert SHARDS * padded >= whole
    for rank, r in enumerate(res):
        syncs = r["sharded_p4"]["sync_steps"]
        shard = syncs * gloo_ring_allreduce_bytes(padded, 8, REPLICAS, rank // SHARDS)
        assert r["sharded_p4"]["bytes"]["params"] == shard
        leader = r["grouped_p4"]["bytes"].get("params", 0)
        assert leader == (syncs * gloo_ring_allreduce_bytes(whole, 8, REPLICAS, rank // SHARDS) if rank % SHARDS == 0
                          else 0)  # fmt: skip
        assert "intra/grads" not in r["sharded_p4"]["bytes"]  # FSDP2 averages the gradients inside the replica


def test_compression_between_sharded_replicas_sends_the_shard_in_int8(suite):
    """int8 compresses each rank's change of its local shard: every shard identical across the replicas after every
    sync (and ``verify_sync`` on), a quarter of the exact shard's bytes plus the per-256 scales."""
    from lightning_sync.comm.compression import wire_format
    from lightning_sync.comm.cost import compressed_allreduce_bytes

    _, res = suite
    fmt = wire_format("int8")
    for r in res:
        rows = r["sharded_int8"]["probe"]
        assert [synced for synced, _, _ in rows] == [step % PERIOD == 0 for step in range(K)]
        assert all(same for synced, same, _ in rows if synced)
    padded = sum((b + SHARDS - 1) // SHARDS * (a + 1) for a, b in zip(SIZES, SIZES[1:]))
    for r in res:
        syncs = r["sharded_int8"]["sync_steps"]
        expected = syncs * sum(
            compressed_allreduce_bytes(padded, fmt.element_size, REPLICAS, fmt.block, fmt.scale_bytes)
        )
        assert r["sharded_int8"]["bytes"]["params"] == expected < r["sharded_p4"]["bytes"]["params"] / 3


def test_sharded_replicas_take_the_sparse_format_with_ternary_values(suite):
    """``topk:0.1+int2`` between sharded replicas: every shard identical across the replicas after every sync, and
    each sync's bytes the format's count for the padded local shard."""
    from lightning_sync.comm.compression import wire_format

    _, res = suite
    fmt = wire_format("topk:0.1+int2")
    padded = sum((b + SHARDS - 1) // SHARDS * (a + 1) for a, b in zip(SIZES, SIZES[1:]))
    for r in res:
        rows = r["sharded_topk_int2"]["probe"]
        assert [synced for synced, _, _ in rows] == [step % PERIOD == 0 for step in range(K)]
        assert all(same for synced, same, _ in rows if synced)
        syncs = r["sharded_topk_int2"]["sync_steps"]
        assert r["sharded_topk_int2"]["bytes"]["params"] == syncs * sum(fmt.allreduce_bytes(padded, REPLICAS))


# ----------------------------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("method", ["localsgd", "diloco"])
def test_a_resumed_sharded_fit_is_bit_identical_to_the_uninterrupted_one(suite, method):
    out, _ = suite
    for rank in range(WORLD):
        whole, resumed = _load(out, f"{method}_whole", rank), _load(out, f"{method}_resumed", rank)
        assert whole.keys() == resumed.keys()
        assert all(torch.equal(whole[k], resumed[k]) for k in whole), f"rank {rank}"
    # not vacuous: training went on after the checkpoint
    first = torch.load(out / f"ckpt_{method}" / "epoch=0.ckpt", weights_only=False)["state_dict"]
    assert not torch.equal(first["net.0.weight"], _load(out, f"{method}_whole", 0)["net.0.weight"])


@pytest.mark.parametrize("method", ["localsgd", "diloco"])
def test_distributed_checkpoints_change_nothing_and_a_fit_resumed_from_one_is_bit_identical(suite, method):
    """``save_distributed_checkpoint=True``: the fit that saves directories is the fit that saves files, bit for bit,
    and a fit resumed from its first epoch's directory (mid-period; DiLoCo's outer momentum in the parts) ends where
    the uninterrupted one does."""
    out, _ = suite
    for rank in range(WORLD):
        whole = _load(out, f"{method}_whole", rank)
        for name in (f"{method}_dcp_whole", f"{method}_dcp_resumed"):
            other = _load(out, name, rank)
            assert whole.keys() == other.keys()
            assert all(torch.equal(whole[k], other[k]) for k in whole), f"{name}, rank {rank}"


def test_a_distributed_checkpoint_is_a_dcp_directory_that_lightning_consolidates_into_the_whole_model(suite):
    """Each rank's part names its shards by reference (no tensor of the model in it); ``last.ckpt``, overwritten at
    every epoch, is the last epoch's with nothing left over; Lightning's own consolidation of a directory gives, under
    ``state_dict``, the whole global model the file format's main file holds, bit for bit."""
    import subprocess
    import sys

    from lightning_sync.comm.dcp import SHARD_REF

    out, _ = suite
    directory = out / "dcp_localsgd" / "epoch=0.ckpt"
    names = sorted(p.name for p in directory.iterdir())
    assert {".metadata", "meta.pt"} <= set(names)
    assert [n for n in names if n.startswith("rank")] == [f"rank{r}.pt" for r in range(WORLD)]
    assert all(n.endswith(".distcp") for n in names if n not in {".metadata", "meta.pt"} and not n.startswith("rank"))
    assert sorted(p.name for p in (out / "dcp_localsgd").iterdir()) == [f"epoch={e}.ckpt" for e in range(3)] + [
        "last.ckpt"
    ]  # no temporary directory left, no file beside the directories
    for method in ("localsgd", "diloco"):  # top-1: the earlier epochs' directories removed, parts and all
        assert sorted(p.name for p in (out / f"dcp_{method}_top1").iterdir()) == ["epoch=2.ckpt"]
    last = torch.load(out / "dcp_localsgd" / "last.ckpt" / "meta.pt", weights_only=True)
    assert last["epoch"] == 2 and "state_dict" not in last and "optimizer_states" not in last
    for rank in range(WORLD):
        part = torch.load(directory / f"rank{rank}.pt", weights_only=True)
        ref = part["state_dict"]["net.0.weight"]
        assert ref[SHARD_REF] == f"replica{rank // SHARDS}.['state_dict']['net.0.weight']"
        assert ref["shape"] == (SIZES[1], SIZES[0]) and ref["local_shape"] == (SIZES[1] // SHARDS, SIZES[0])
        assert part["optimizer_states"][0]["state"][0]["momentum_buffer"][SHARD_REF].startswith(f"replica{rank // 2}.")
    consolidated = out / "dcp_localsgd_epoch0.consolidated"
    subprocess.run([sys.executable, "-m", "lightning.fabric.utilities.consolidate_checkpoint", str(directory),
                    "--output_file", str(consolidated)], check=True)  # fmt: skip
    whole = torch.load(consolidated, weights_only=False)["state_dict"]
    main = torch.load(out / "ckpt_localsgd" / "epoch=0.ckpt", weights_only=False)["state_dict"]
    assert whole.keys() == main.keys()
    assert all(torch.equal(whole[k], main[k]) for k in main)


@pytest.fixture
def ckpt_dir(suite):
    return suite[0] / "ckpt_localsgd"


def test_checkpoint_files_hold_the_whole_model_and_each_ranks_shards(ckpt_dir):
    from torch import nn

    main = torch.load(ckpt_dir / "epoch=0.ckpt", weights_only=False)
    layers: list[nn.Module] = []
    for a, b in zip(SIZES, SIZES[1:]):
        layers += [nn.Linear(a, b, dtype=torch.float64), nn.Tanh()]
    plain = nn.Sequential(*layers[:-1])
    plain.load_state_dict({k.removeprefix("net."): v for k, v in main["state_dict"].items()})  # the whole model
    assert all(type(v) is torch.Tensor for v in main["state_dict"].values())
    for rank in range(WORLD):
        part = torch.load(ckpt_dir / f"epoch=0.ckpt.rank{rank}", weights_only=False)
        shard = part["state_dict"]["net.0.weight"]
        assert type(shard) is torch.Tensor and shard.shape == (SIZES[1] // SHARDS, SIZES[0])
        momentum = part["optimizer_states"][0]["state"][0]["momentum_buffer"]
        assert type(momentum) is torch.Tensor and momentum.shape == shard.shape
    # the last layer's [1, 32] weight: one row on the first shard, none on the second (FSDP2's uneven sharding)
    shapes = [torch.load(ckpt_dir / f"epoch=0.ckpt.rank{r}", weights_only=False)["state_dict"]["net.4.weight"].shape
              for r in range(SHARDS)]  # fmt: skip
    assert shapes == [(1, SIZES[2]), (0, SIZES[2])]


def test_evaluation_outside_fit_sees_the_whole_model_after_fit_and_from_the_checkpoint(suite):
    """``trainer.validate`` after a sharded fit (``average_at_end``: the replicas' average) and from the last
    checkpoint's main file (the same average, saved at the last epoch's end) give the MSE of the whole model over the
    whole validation set, computed here without sharding."""
    _, res = suite
    for r in res:
        v = r["validate"]
        assert v["after_fit"] == pytest.approx(v["reference"], rel=1e-12, abs=0)
        assert v["from_ckpt"] == pytest.approx(v["reference"], rel=1e-12, abs=0)
        assert v["from_dcp"] == pytest.approx(v["reference"], rel=1e-12, abs=0)  # save_distributed_checkpoint
        assert r["predict_max_diff"] < 1e-12  # trainer.predict after the checkpoint's validate: the same model


def test_evaluation_after_a_fit_whose_replicas_differ_takes_replica_0s_model_on_every_replica(suite):
    """As DDP evaluates rank 0's model: the sharded parameters are skipped by Lightning's broadcast over all ranks
    (rank 0's shards would land on the other shard's ranks) and each shard index's ranks take replica 0's shard."""
    _, res = suite
    assert res[0]["diverged"]["differed"]  # not vacuous: the replicas held different models after fit
    assert all(r["diverged"]["is_replica0"] for r in res)


def test_adamw_bf16_accumulation_and_batchnorm_run_sharded_with_every_sync_verified(suite):
    _, res = suite
    for r in res:  # verify_sync raised in the run otherwise; 6 optimizer steps of 2 batches, syncs after 2 and 5
        assert r["adaptive"]["sync_steps"] == 2
        assert r["adaptive"]["outer"]["nesterov"] is True  # "auto" over AdamW: the paper's outer Nesterov momentum


# ----------------------------------------------------------------------------------------------- refusals
def test_refused_at_setup_saying_what_to_write(suite):
    _, res = suite
    for r in res:
        assert "does not override configure_model" in r["refused_plain"]
        assert "fully_shard(layer, mesh=mesh)" in r["refused_plain"]
        assert "HSDP" in r["refused_hsdp"] and 'self.device_mesh["shard"]' in r["refused_hsdp"]


def test_sharded_needs_replica_size_and_refuses_what_it_cannot_run_with():
    from lightning_sync import (
        ADPSGDStrategy,
        BSPStrategy,
        DiLoCoStrategy,
        FedAvgStrategy,
        LocalSGDStrategy,
        SelSyncStrategy,
    )
    from lightning_sync.strategies.fault_tolerance import FaultTolerance

    with pytest.raises(ValueError, match=r"sharded=True\) needs replica_size"):
        LocalSGDStrategy(sharded=True)
    # FSDP2's collectives inside a sharded replica are counted and emulated on intra_link (no longer refused)
    assert LocalSGDStrategy(sharded=True, replica_size=2, intra_link="10gbit").intra_link is not None
    ft = FaultTolerance(lighthouse="http://localhost:29510", replica_group=0, replica_groups=2)
    # fault-tolerant sharded groups: BSP, local SGD and DiLoCo (plain, streaming); the others say what runs instead
    assert LocalSGDStrategy(sharded=True, replica_size="node", fault_tolerance=ft).fault_tolerance is ft
    assert DiLoCoStrategy(sharded=True, replica_size=2, fragments=2, delay=1, fault_tolerance=ft).sharded
    assert BSPStrategy(sharded=True, replica_size="node", fault_tolerance=ft).fault_tolerance is ft
    for cls in (FedAvgStrategy, ADPSGDStrategy):
        with pytest.raises(
            ValueError,
            match=rf"{cls.__name__}\(sharded=True, fault_tolerance=...\) is not supported: fault-tolerant sharded "
            rf"replica groups .* Use BSPStrategy or LocalSGDStrategy or DiLoCoStrategy with sharded=True and "
            rf"fault_tolerance, or "
            rf"{cls.__name__} with fault_tolerance and sharded=False",
        ):
            cls(sharded=True, replica_size=2, fault_tolerance=ft)
    with pytest.raises(ValueError, match="must be None for SelSyncStrategy, which cannot run fault-tolerant"):
        SelSyncStrategy(sharded=True, replica_size=2, fault_tolerance=ft)
    with pytest.raises(ValueError, match="sharded must be a bool"):
        LocalSGDStrategy(sharded="yes", replica_size=2)
    assert LocalSGDStrategy(sharded=True, replica_size="node").sharded
    assert DiLoCoStrategy(sharded=True, replica_size=2).sharded


def test_save_distributed_checkpoint_needs_sharded_replicas_without_fault_tolerance():
    from lightning_sync import DiLoCoStrategy, LocalSGDStrategy
    from lightning_sync.strategies.fault_tolerance import FaultTolerance

    with pytest.raises(ValueError, match=r"save_distributed_checkpoint=True needs sharded=True.*use "
                       r"save_distributed_checkpoint=False"):  # fmt: skip
        LocalSGDStrategy(replica_size=2, save_distributed_checkpoint=True)
    ft = FaultTolerance(lighthouse="http://localhost:29510", replica_group=0, replica_groups=2)
    with pytest.raises(ValueError, match=r"save_distributed_checkpoint=True is not supported with fault_tolerance"):
        DiLoCoStrategy(sharded=True, replica_size=2, fault_tolerance=ft, save_distributed_checkpoint=True)
    from lightning_sync.strategies.checkpoint_dir import check_target

    with pytest.raises(TypeError, match="storage_options=.* is not supported with save_distributed_checkpoint"):
        check_target("ckpt/epoch=0.ckpt", {"region": "x"})
    with pytest.raises(ValueError, match="s3://bucket/epoch=0.ckpt is not one"):
        check_target("s3://bucket/epoch=0.ckpt", None)
    check_target("ckpt/epoch=0.ckpt", None)
    with pytest.raises(ValueError, match="save_distributed_checkpoint must be a bool"):
        LocalSGDStrategy(sharded=True, replica_size=2, save_distributed_checkpoint="yes")
    assert LocalSGDStrategy(sharded=True, replica_size=2, save_distributed_checkpoint=True).save_distributed_checkpoint
    assert not LocalSGDStrategy(sharded=True, replica_size=2).save_distributed_checkpoint


def test_fsdp2_cpu_offload_is_refused_before_it_could_move_a_shard_out_of_the_flat_buffer():
    from types import SimpleNamespace

    from lightning_sync.comm.fsdp import bind_local_shard

    offloaded = SimpleNamespace(offload_to_cpu=True, pin_memory=True, sharded_param=None)
    with pytest.raises(ValueError, match="offload_policy.*Use fully_shard without offload_policy"):
        bind_local_shard(offloaded, torch.zeros(4))


def test_a_lightningcli_yaml_turns_sharding_on_with_two_strategy_arguments():
    from lightning_sync import DiLoCoStrategy
    from lightning_sync.cli import cli_main

    config = Path(__file__).parents[1] / "examples" / "configs" / "diloco.yaml"
    args = ["--trainer.strategy.init_args.replica_size=node", "--trainer.strategy.init_args.sharded=true"]
    cli = cli_main(["--config", str(config), *args], run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, DiLoCoStrategy) and strategy.sharded and strategy.replica_size == "node"
