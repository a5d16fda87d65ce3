"""The methods beyond local SGD and plain DiLoCo on sharded replicas (``sharded=True``): BSP, SelSync, ADPSGD, FedAvg,
streaming DiLoCo; the refusals of the parameter-server family, OSP and Sync-Switch. 4 CPU processes (gloo) as 2
replicas x 2 shards, started once for the module; the model is a float64 MLP with a BatchNorm layer (SGD with
momentum and weight decay), every run 3 epochs of 4 steps.

What is held here:

* **BSP = FSDP over all ranks (HSDP)**: sharded BSP's parameters equal Lightning's
  ``ModelParallelStrategy(data_parallel_size=4, tensor_parallel_size=1)`` with ``fully_shard`` over all 4 ranks, in
  float64 to the rounding bound of ``tests/tolerance.py``; its BatchNorm running statistics are the same on every rank
  and equal the mean of FSDP's four per-rank ones (the running average is linear). A step sends the ring all-reduce
  of the local gradient shard (with FSDP2's padding) and the buffers between replicas, and the buffers' exact
  all-reduce inside the replica; ``verify_sync`` checks the gradients and then the parameters across the replicas at
  every step; ``compression="int8"`` sends the compressed local shard.
* **SelSync**: at δ = 0 with parameter aggregation it equals FSDP over all ranks (the paper's special case: BSP, for
  SGD's linear update), with gradient aggregation it is sharded BSP bit for bit; with a fixed δ its votes, syncs and
  parameters equal grouped SelSync's (the replica's whole gradient norm is the sum of its shards' squared norms,
  8 bytes inside the replica per step) and the ranks of a replica cast the same vote (bit-identical Δ).
* **ADPSGD**: the same syncs and periods as grouped ADPSGD, parameters equal to rounding (the spread summed over the
  shards, 8 bytes inside the replica per measured sync).
* **FedAvg**: equal to grouped FedAvg with one of the two replicas drawn per round (every rank takes its shards).
* **Streaming DiLoCo**: with one fragment in flight (``delay=1``, ``alpha=0.5``) equal to grouped streaming DiLoCo
  (the fragment is the whole model either way); with two fragments each fragment is the half of every rank's packed
  local shard: after each fragment's sync that half is identical across the replicas and the other is not, the
  schedule is the same on every rank, and each launch sends the ring all-reduce of the half shard.
* **Checkpoints**: a fit of each (BSP, SelSync with a vote in flight, ADPSGD, FedAvg, streaming DiLoCo with a fragment
  in flight) resumed from the end of its first epoch ends bit-identical to the uninterrupted fit.
* **Refusals at construction** (in-process): the parameter-server family, OSP and Sync-Switch, each saying why and
  naming the methods that run sharded; BSP's ``find_unused_parameters`` with sharding.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from launch import run_suite
from tolerance import assert_equal_in_exact_arithmetic

from lightning_sync.comm.cost import compressed_allreduce_bytes, gloo_ring_allreduce_bytes

WORLD = 4
SHARDS = 2  # ranks per replica
REPLICAS = WORLD // SHARDS
EPOCHS, BATCHES = 3, 4  # every run: 3 epochs of 4 optimizer steps
K = EPOCHS * BATCHES
TIMEOUT = timedelta(seconds=120)
WIDTH = 32
#: every rank's packed local shard, in elements (FSDP2 pads each parameter to the first shard's rows): the first
#: Linear [32, 16] and bias, BatchNorm's weight and bias [32], the second Linear [32, 32] and bias, the last [1, 32]
#: weight and [1] bias (one row on the first shard, padding on the second)
PADDED = 16 * 16 + 16 + 16 + 16 + 16 * 32 + 16 + 32 + 1
BUFFERS = 2 * WIDTH  # BatchNorm's running mean and variance (floating; num_batches_tracked is an integer)
SELSYNC = dict(delta=0.1, smoothing=0.5, window=4)  # a fixed δ that syncs some steps and not others
ADPSGD = dict(p_init=2, warmup_epochs=0, sample_fraction=0.2, min_samples=1, low=0.9, high=1.1, max_period=4)
#: the module's one launch runs 21 short fits (about as many as tests/test_sharded.py's): on a loaded 2-core machine
#: that can take longer than the default 300 s
pytestmark = pytest.mark.timeout(900)
STREAM = dict(sync_every=4, fragments=2, delay=1, outer_optimizer={"name": "sgd", "lr": 0.7, "momentum": 0.9,
                                                                      "nesterov": True})  # fmt: skip


# ----------------------------------------------------------------------------------------------- worker side
def _suite(rank: int, out_dir: str) -> None:
    import lightning.pytorch as pl
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch import nn
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_sync import ADPSGDStrategy, BSPStrategy, DiLoCoStrategy, FedAvgStrategy, SelSyncStrategy
    from lightning_sync.core.streaming import fragment_ranges
    from lightning_sync.launch import quiet_trainer_kwargs

    out = Path(out_dir)
    res: dict = {}

    class MLP(pl.LightningModule):
        """A float64 MLP with BatchNorm; ``shard_over`` names the device-mesh dimension ``configure_model`` shards
        over (``None``: the whole model on every rank, grouped or flat runs)."""

        def __init__(self, shard_over: str | None) -> None:
            super().__init__()
            self.shard_over = shard_over
            f64 = dict(dtype=torch.float64)
            self.net = nn.Sequential(nn.Linear(16, WIDTH, **f64), nn.BatchNorm1d(WIDTH, **f64), nn.Tanh(),
                                     nn.Linear(WIDTH, WIDTH, **f64), nn.Tanh(), nn.Linear(WIDTH, 1, **f64))  # fmt: skip

        def configure_model(self) -> None:
            if self.shard_over is None or isinstance(self.net, FSDPModule):
                return
            mesh = self.device_mesh[self.shard_over]
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)

    class Plain(MLP):
        configure_model = pl.LightningModule.configure_model

    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g, dtype=torch.float64)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    data = TensorDataset(x, y)

    def whole(model) -> dict[str, torch.Tensor]:
        """The whole parameters (all-gathered from the shards: every rank of the mesh calls it) and the buffers."""
        state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                 for k, v in model.named_parameters()}  # fmt: skip
        state.update({k: v.detach().clone() for k, v in model.named_buffers() if v.is_floating_point()})
        return state

    def fit(name, strategy, make_model, callbacks=(), ckpt_path=None, checkpoints=False):
        pl.seed_everything(0)
        model = make_model()
        cbs = list(callbacks)
        if checkpoints:
            cbs.append(ModelCheckpoint(dirpath=out / f"ckpt_{name}", every_n_epochs=1, save_top_k=-1,
                                       filename="{epoch}"))  # fmt: skip
        trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, callbacks=cbs,
                             **quiet_trainer_kwargs(max_epochs=EPOCHS, limit_train_batches=BATCHES,
                                                    limit_val_batches=0, default_root_dir=out,
                                                    enable_checkpointing=checkpoints))  # fmt: skip
        trainer.fit(model, DataLoader(data, batch_size=8, shuffle=True), ckpt_path=ckpt_path)
        torch.save(whole(model), out / f"{name}_rank{rank}.pt")
        s = trainer.strategy
        res[name] = {"bytes": dict(s.comm_stats.bytes_sent) if hasattr(s, "comm_stats") else {},
                     "sync_steps": s.step_counter.sync_steps if hasattr(s, "step_counter") else None}  # fmt: skip
        return trainer

    def resume(name, strategy, make_model):
        fit(f"{name}_resumed", strategy, make_model, ckpt_path=str(out / f"ckpt_{name}" / "epoch=0.ckpt"))

    def gather(value: torch.Tensor) -> list[torch.Tensor]:
        gathered = [torch.zeros_like(value) for _ in range(WORLD)]
        dist.all_gather(gathered, value)  # plain torch.distributed: outside the strategy's code and accounting
        return gathered

    def bits(t: torch.Tensor) -> torch.Tensor:
        flat = t.detach().reshape(-1).view(torch.int64)
        return torch.stack([flat.sum(), (flat * torch.arange(1, flat.numel() + 1)).sum()])

    class Probe(Callback):
        """After every step: what ``values(strategy)`` says on this rank (a dict of floats), whether it synced, and
        which ranks hold identical local shards (and buffers): per rank pair, gathered with plain torch.distributed."""

        def __init__(self, values=None, regions=None) -> None:
            self.values, self.regions = values, regions
            self.rows: list[dict] = []
            self._syncs = 0

        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            s = trainer.strategy
            flat = s.flat
            row: dict = {"synced": s.step_counter.sync_steps > self._syncs}
            self._syncs = s.step_counter.sync_steps
            group = flat.groups[0]
            self.padded = group.param_numel  # this rank's packed local shard, in elements
            sums = gather(bits(group.state[: group.param_numel]))
            row["same_across"] = all(torch.equal(sums[i], sums[i + SHARDS]) for i in range(SHARDS))
            row["halves_differ"] = not torch.equal(sums[0], sums[1])
            buffers = gather(bits(group.buffers))
            row["buffers_same_everywhere"] = all(torch.equal(buffers[0], b) for b in buffers)
            if self.regions is not None:  # per region (a fragment's range): identical across the replicas?
                row["regions_same_across"] = []
                for lo, hi in self.regions(s):
                    sums = gather(bits(group.state[lo:hi]))
                    row["regions_same_across"].append(all(torch.equal(sums[i], sums[i + SHARDS])
                                                          for i in range(SHARDS)))  # fmt: skip
            if self.values is not None:
                row.update(self.values(s))
            self.rows.append(row)

    def probed(name: str, probe: Probe) -> None:
        res[name]["probe"] = probe.rows

    kw = dict(replica_size=SHARDS, timeout=TIMEOUT)
    sharded = dict(sharded=True, verify_sync=True, **kw)  # verify_sync: every sync checked across the replicas

    # 1. BSP: FSDP over all ranks (Lightning's), sharded BSP, its int8 form; SelSync at delta=0 (both aggregations)
    mp = ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1, timeout=TIMEOUT)
    fit("fsdp_all", mp, lambda: MLP("data_parallel"))
    probe = Probe()
    fit("bsp", BSPStrategy(**sharded), lambda: MLP("shard"), [probe], checkpoints=True)
    probed("bsp", probe)
    res["bsp"]["padded"] = probe.padded
    resume("bsp", BSPStrategy(**sharded), lambda: MLP("shard"))
    # the same fit saving distributed checkpoints (replicas that never diverge: one copy in the DCP files)
    fit("bsp_dcp", BSPStrategy(save_distributed_checkpoint=True, **sharded), lambda: MLP("shard"), checkpoints=True)
    resume("bsp_dcp", BSPStrategy(save_distributed_checkpoint=True, **sharded), lambda: MLP("shard"))
    probe = Probe()
    fit("bsp_int8", BSPStrategy(compression="int8", **sharded), lambda: MLP("shard"), [probe])
    probed("bsp_int8", probe)
    fit("selsync_p0", SelSyncStrategy(delta=0.0, **sharded), lambda: MLP("shard"))
    fit("selsync_g0", SelSyncStrategy(delta=0.0, aggregation="gradients", **sharded), lambda: MLP("shard"))

    # 2. SelSync with a fixed delta: sharded vs grouped (DDP inside the replica); the ranks' deltas per step
    def vote(s) -> dict:
        return {"delta": s.last_delta, "voters": s.last_voters}

    probe = Probe(vote)
    fit("selsync", SelSyncStrategy(**SELSYNC, **sharded), lambda: MLP("shard"), [probe], checkpoints=True)
    probed("selsync", probe)
    resume("selsync", SelSyncStrategy(**SELSYNC, **sharded), lambda: MLP("shard"))
    probe = Probe(vote)
    fit("selsync_grouped", SelSyncStrategy(**SELSYNC, **kw), lambda: Plain(None), [probe])
    probed("selsync_grouped", probe)

    # 3. ADPSGD: sharded vs grouped, the period at every step
    def period(s) -> dict:
        return {"period": s.controller.period, "s_k": s.controller.last_s}

    probe = Probe(period)
    fit("adpsgd", ADPSGDStrategy(**ADPSGD, **sharded), lambda: MLP("shard"), [probe], checkpoints=True)
    probed("adpsgd", probe)
    resume("adpsgd", ADPSGDStrategy(**ADPSGD, **sharded), lambda: MLP("shard"))
    probe = Probe(period)
    fit("adpsgd_grouped", ADPSGDStrategy(**ADPSGD, **kw), lambda: Plain(None), [probe])
    probed("adpsgd_grouped", probe)

    # 4. FedAvg: one of the two replicas drawn per round, twice an epoch
    def participants(s) -> dict:
        return {"participants": list(s.last_participants), "round": s.round}

    fedavg = dict(fraction=0.5, syncs_per_epoch=2, seed=3)
    probe = Probe(participants)
    fit("fedavg", FedAvgStrategy(**fedavg, **sharded), lambda: MLP("shard"), [probe], checkpoints=True)
    probed("fedavg", probe)
    resume("fedavg", FedAvgStrategy(**fedavg, **sharded), lambda: MLP("shard"))
    dcp = dict(save_distributed_checkpoint=True)
    fit("fedavg_dcp", FedAvgStrategy(**fedavg, **dcp, **sharded), lambda: MLP("shard"), checkpoints=True)
    resume("fedavg_dcp", FedAvgStrategy(**fedavg, **dcp, **sharded), lambda: MLP("shard"))
    fit("fedavg_grouped", FedAvgStrategy(**fedavg, **kw), lambda: Plain(None))

    # 5. streaming DiLoCo: the whole model in flight for one step (vs grouped), and two fragments of the local shard
    delayed = dict(STREAM, fragments=1, alpha=0.5)
    fit("diloco_delay", DiLoCoStrategy(**delayed, **sharded), lambda: MLP("shard"))
    fit("diloco_delay_grouped", DiLoCoStrategy(**delayed, **kw), lambda: Plain(None))

    def fragments(s):
        return fragment_ranges(s.flat.groups[0].param_numel, STREAM["fragments"])

    def schedule(s) -> dict:
        return {"launched": s.last_launched, "applied": s.last_applied}

    probe = Probe(schedule, fragments)
    tr = fit("diloco", DiLoCoStrategy(**STREAM, **sharded), lambda: MLP("shard"), [probe], checkpoints=True)
    probed("diloco", probe)
    res["diloco"]["fragment_syncs"] = tr.strategy.fragment_syncs
    resume("diloco", DiLoCoStrategy(**STREAM, **sharded), lambda: MLP("shard"))
    (out / f"res_rank{rank}.json").write_text(json.dumps(res))


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded_methods")
    return out, run_suite(_suite, WORLD, out)


def _load(out: Path, name: str, rank: int, buffers: bool = False) -> dict[str, torch.Tensor]:
    state = torch.load(out / f"{name}_rank{rank}.pt")
    return {k: v for k, v in state.items() if buffers or not k.startswith("net.1.running")}


def _ring(numel: int, rank: int, element_size: int = 8) -> int:
    """Bytes ``rank`` sends in gloo's ring all-reduce of ``numel`` elements over the 2 replicas (or shards)."""
    return gloo_ring_allreduce_bytes(numel, element_size, REPLICAS, rank)


# ----------------------------------------------------------------------------------------------- BSP
def test_sharded_bsp_equals_lightnings_fsdp2_over_all_ranks(suite):
    out, res = suite
    assert res[0]["bsp"]["padded"] == PADDED
    for rank in range(WORLD):
        ours, lightning = _load(out, "bsp", rank), _load(out, "fsdp_all", rank)
        assert_equal_in_exact_arithmetic(ours, lightning, K, f"rank {rank}: sharded BSP vs FSDP2 over all ranks")
    assert all(r["bsp"]["sync_steps"] == K for r in res)
    # not vacuous: the run trained
    assert not torch.equal(_load(out, "bsp", 0)["net.0.weight"], _load(out, "bsp_int8", 0)["net.0.weight"])


def test_sharded_bsp_averages_the_buffers_over_every_rank(suite):
    """FSDP2 leaves each rank its own BatchNorm statistics; sharded BSP averages them over every rank each step, as
    flat BSP does: the same bits on all 4 ranks after every step, equal to the mean of FSDP's per-rank ones (the
    running average is linear in the batch statistics, which the identical parameters make the same)."""
    out, res = suite
    assert all(row["buffers_same_everywhere"] for row in res[0]["bsp"]["probe"])
    names = ("net.1.running_mean", "net.1.running_var")
    ours = {k: v for k, v in _load(out, "bsp", 0, buffers=True).items() if k in names}
    fsdp = [_load(out, "fsdp_all", r, buffers=True) for r in range(WORLD)]
    mean = {k: sum(f[k] for f in fsdp) / WORLD for k in names}
    assert not torch.equal(fsdp[0][names[0]], fsdp[1][names[0]])  # not vacuous: FSDP's ranks differ
    assert_equal_in_exact_arithmetic(ours, mean, K, "sharded BSP's buffers vs the mean of FSDP's")


def test_sharded_bsp_keeps_every_shard_identical_across_replicas_and_sends_the_local_shard(suite):
    """Every step: the local gradient shard with FSDP2's padding and the buffers staged beside it in one all-reduce
    between replicas (``grads``), the buffers' exact all-reduce inside the replica (``intra/grads``), and the
    SIGTERM check; ``verify_sync`` checked the gradients and the parameters after the update across the replicas."""
    _, res = suite
    for rank, r in enumerate(res):
        rows = r["bsp"]["probe"]
        assert len(rows) == K and all(row["synced"] and row["same_across"] and row["halves_differ"] for row in rows)
        assert r["bsp"]["bytes"]["grads"] == K * _ring(PADDED + BUFFERS, rank // SHARDS)
        assert r["bsp"]["bytes"]["intra/grads"] == K * _ring(BUFFERS, rank % SHARDS)
        assert "params" not in r["bsp"]["bytes"]


def test_sharded_bsp_compresses_the_local_gradient_shard(suite):
    """int8 on the gradient path: the local gradient shard compressed (a quarter of its bytes plus the per-256 scales),
    the buffers exact beside it; every shard identical across the replicas after every step."""
    from lightning_sync.comm.compression import wire_format

    _, res = suite
    fmt = wire_format("int8")
    compressed = sum(compressed_allreduce_bytes(PADDED, fmt.element_size, REPLICAS, fmt.block, fmt.scale_bytes))
    for rank, r in enumerate(res):
        assert all(row["same_across"] for row in r["bsp_int8"]["probe"])
        assert r["bsp_int8"]["bytes"]["grads"] == K * (compressed + _ring(BUFFERS, rank // SHARDS))
        assert compressed < _ring(PADDED, rank // SHARDS) / 3


# ----------------------------------------------------------------------------------------------- SelSync
def test_sharded_selsync_at_delta_0_is_bsp(suite):
    """The paper's special case: δ = 0 syncs every step. Parameter aggregation then equals FSDP over all ranks (SGD's
    update is linear); gradient aggregation takes sharded BSP's gradient path and is sharded BSP bit for bit."""
    out, res = suite
    for rank in range(WORLD):
        ours, lightning = _load(out, "selsync_p0", rank), _load(out, "fsdp_all", rank)
        assert_equal_in_exact_arithmetic(ours, lightning, K, f"rank {rank}: SelSync delta=0 vs FSDP2 over all ranks")
        grads, bsp = _load(out, "selsync_g0", rank, buffers=True), _load(out, "bsp", rank, buffers=True)
        assert all(torch.equal(grads[k], bsp[k]) for k in bsp), f"rank {rank}"
    assert all(r["selsync_p0"]["sync_steps"] == K and r["selsync_g0"]["sync_steps"] == K for r in res)


def test_sharded_selsync_votes_on_the_replicas_whole_gradient_as_grouped_selsync(suite):
    """Δ from the squared norm of the replica's gradient, summed over its shards: the ranks of a replica hold the same
    Δ bit for bit (they cast the same vote), the syncs are grouped SelSync's, and so are the parameters."""
    out, res = suite
    rows = [r["selsync"]["probe"] for r in res]
    grouped = [r["selsync_grouped"]["probe"] for r in res]
    syncs = [row["synced"] for row in rows[0]]
    assert all([row["synced"] for row in ranks] == syncs for ranks in rows + grouped)
    assert 0 < sum(syncs) < K  # not vacuous: some steps synced and some did not
    for replica in range(REPLICAS):
        deltas = [[row["delta"] for row in rows[replica * SHARDS + s]] for s in range(SHARDS)]
        assert deltas[0] == deltas[1], f"replica {replica}: its shards' ranks saw different Δ"
        reference = [row["delta"] for row in grouped[replica * SHARDS]]
        assert deltas[0] == pytest.approx(reference, rel=1e-9, abs=1e-12)
    assert rows[0] and any(row["delta"] != rows[0][1]["delta"] for row in rows[0][1:])
    assert all(row["same_across"] for row in rows[0] if row["synced"])
    for rank in range(WORLD):
        assert_equal_in_exact_arithmetic(_load(out, "selsync", rank), _load(out, "selsync_grouped", rank), K,
                                         f"rank {rank}: sharded vs grouped SelSync")  # fmt: skip
        # the vote's norm: one 8-byte all-reduce inside the replica per step
        assert res[rank]["selsync"]["bytes"]["intra/vote"] == K * _ring(1, rank % SHARDS)


# ----------------------------------------------------------------------------------------------- ADPSGD
def test_sharded_adpsgd_takes_grouped_adpsgds_periods_and_parameters(suite):
    out, res = suite
    rows = [r["adpsgd"]["probe"] for r in res]
    grouped = res[0]["adpsgd_grouped"]["probe"]
    periods = [row["period"] for row in grouped]
    assert len(set(periods)) > 1  # not vacuous: the period adapted
    for ranks in rows:
        assert [row["period"] for row in ranks] == periods
        assert [row["synced"] for row in ranks] == [row["synced"] for row in grouped]
        for ours, reference in zip([row["s_k"] for row in ranks], [row["s_k"] for row in grouped]):
            assert (ours is None and reference is None) or ours == pytest.approx(reference, rel=1e-9)
    assert all(row["same_across"] for row in rows[0] if row["synced"])
    measured = sum(1 for row in grouped if row["synced"])  # every sync after the warm-up measures S_k
    for rank in range(WORLD):
        assert_equal_in_exact_arithmetic(_load(out, "adpsgd", rank), _load(out, "adpsgd_grouped", rank), K,
                                         f"rank {rank}: sharded vs grouped ADPSGD")  # fmt: skip
        assert res[rank]["adpsgd"]["bytes"]["intra/stat"] == measured * _ring(1, rank % SHARDS)


# ----------------------------------------------------------------------------------------------- FedAvg
def test_sharded_fedavg_equals_grouped_fedavg_with_replicas_as_participants(suite):
    out, res = suite
    rows = res[0]["fedavg"]["probe"]
    drawn = [row["participants"] for row in rows if row["synced"]]
    assert len(drawn) == EPOCHS * 2 and all(len(p) == 1 for p in drawn)
    assert len({p[0] for p in drawn}) == REPLICAS  # not vacuous: both replicas were drawn in some round
    assert all(r["fedavg"]["probe"] == rows for r in res)  # every rank drew the same, and saw the same sync state
    assert all(row["same_across"] for row in rows if row["synced"])
    for rank in range(WORLD):
        assert_equal_in_exact_arithmetic(_load(out, "fedavg", rank), _load(out, "fedavg_grouped", rank), K,
                                         f"rank {rank}: sharded vs grouped FedAvg")  # fmt: skip


# ----------------------------------------------------------------------------------------------- streaming DiLoCo
def test_sharded_diloco_with_the_model_in_flight_equals_grouped(suite):
    out, _ = suite
    for rank in range(WORLD):
        assert_equal_in_exact_arithmetic(_load(out, "diloco_delay", rank), _load(out, "diloco_delay_grouped", rank),
                                         K, f"rank {rank}: sharded vs grouped DiLoCo, delay=1")  # fmt: skip


def test_sharded_streaming_diloco_syncs_each_fragment_of_the_local_shard(suite):
    """Two fragments, each the half of every rank's packed local shard, in flight for one step: the same schedule on
    every rank; after a fragment is applied its half is identical across the replicas (and the other half not,
    between syncs); each launch sends the ring all-reduce of its half shard (the buffers with the last fragment)."""
    _, res = suite
    rows = res[0]["diloco"]["probe"]
    assert all([(row["launched"], row["applied"]) for row in r["diloco"]["probe"]]
               == [(row["launched"], row["applied"]) for row in rows] for r in res)  # fmt: skip
    assert [row["launched"] for row in rows] == [None, 0, None, 1] * EPOCHS
    # fragment 0 launched after steps 1, 5, 9, fragment 1 after 3, 7, 11; each applied a step later (the last at end)
    assert [row["applied"] for row in rows] == [None, None, 0, None] + [1, None, 0, None] * 2
    for r in res:
        for row in r["diloco"]["probe"]:
            if row["applied"] is not None:
                same = row["regions_same_across"]
                assert same[row["applied"]], row
                assert not same[1 - row["applied"]], row  # the other half took a local step since its sync
    half = [hi - lo for lo, hi in [(0, PADDED // 2), (PADDED // 2, PADDED)]]
    for rank, r in enumerate(res):
        assert r["diloco"]["fragment_syncs"] == [EPOCHS, EPOCHS]
        sent = EPOCHS * (_ring(half[0], rank // SHARDS) + _ring(half[1] + BUFFERS, rank // SHARDS))
        assert r["diloco"]["bytes"]["params"] == sent


# ----------------------------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("method", ["bsp", "selsync", "adpsgd", "fedavg", "diloco"])
def test_a_resumed_sharded_fit_is_bit_identical_to_the_uninterrupted_one(suite, method):
    out, _ = suite
    for rank in range(WORLD):
        whole, resumed = _load(out, method, rank, buffers=True), _load(out, f"{method}_resumed", rank, buffers=True)
        assert whole.keys() == resumed.keys()
        assert all(torch.equal(whole[k], resumed[k]) for k in whole), f"rank {rank}"
    first = torch.load(out / f"ckpt_{method}" / "epoch=0.ckpt", weights_only=False)["state_dict"]
    assert not torch.equal(first["net.0.weight"], _load(out, method, 0)["net.0.weight"])  # training went on after it
    part = torch.load(out / f"ckpt_{method}" / "epoch=0.ckpt.rank1", weights_only=False)
    assert part["state_dict"]["net.0.weight"].shape == (WIDTH // SHARDS, 16)  # each rank's part holds its shards


@pytest.mark.parametrize("method", ["bsp", "fedavg"])
def test_a_fit_saving_distributed_checkpoints_and_one_resumed_from_its_first_are_the_plain_fit(suite, method):
    """``save_distributed_checkpoint=True`` for a method whose replicas never diverge (BSP: one copy of each shard in
    the DCP files, ``replica.<path>``) and for one whose replicas differ between rounds (FedAvg, a drawn subset)."""
    from lightning_sync.comm.dcp import SHARD_REF

    out, _ = suite
    for rank in range(WORLD):
        whole = _load(out, method, rank, buffers=True)
        for name in (f"{method}_dcp", f"{method}_dcp_resumed"):
            other = _load(out, name, rank, buffers=True)
            assert whole.keys() == other.keys()
            assert all(torch.equal(whole[k], other[k]) for k in whole), f"{name}, rank {rank}"
    part = torch.load(out / f"ckpt_{method}_dcp" / "epoch=0.ckpt" / "rank1.pt", weights_only=True)
    prefix = "replica." if method == "bsp" else "replica0."
    assert part["state_dict"]["net.0.weight"][SHARD_REF] == f"{prefix}['state_dict']['net.0.weight']"


# ----------------------------------------------------------------------------------------------- refusals
def _refused():
    import lightning_sync.strategies as S

    return {
        "osp": (S.OSPStrategy, "FSDP2 reduce-scatters each layer's gradient"),
        "asp": (S.ASPStrategy, "in lockstep"),
        "ssp": (S.SSPStrategy, "in lockstep"),
        "aladdin": (S.ALADDINStrategy, "in lockstep"),
        "sync_switch": (S.SyncSwitchStrategy, "cannot leave"),
    }


@pytest.mark.parametrize("name", list(_refused()))
def test_methods_that_do_not_run_sharded_refuse_it_at_construction_saying_why_and_what_to_use(name):
    cls, reason = _refused()[name]
    with pytest.raises(ValueError, match=f"sharded=True is not supported by {cls.__name__}") as err:
        cls(sharded=True, replica_size=2)
    message = str(err.value)
    assert reason in message
    assert "Use a method that runs on sharded replicas (BSPStrategy, SelSyncStrategy, LocalSGDStrategy" in message
    assert f"or {cls.__name__} without replica_size and sharded" in message
    cls()  # unsharded: fine


def test_the_methods_that_run_sharded_construct_with_it():
    import lightning_sync.strategies as S

    for make in (S.BSPStrategy, S.SelSyncStrategy, S.ADPSGDStrategy, S.FedAvgStrategy, S.LocalSGDStrategy,
                 lambda **kw: S.DiLoCoStrategy(fragments=2, delay=1, alpha=0.5, **kw)):  # fmt: skip
        assert make(sharded=True, replica_size=2).sharded
    with pytest.raises(ValueError, match=r"sharded=True\) does not support find_unused_parameters=True"):
        S.BSPStrategy(sharded=True, replica_size=2, find_unused_parameters=True)
