"""Replica groups (``replica_size``) on 4 CPU processes (gloo) as 2 replicas x 2 ranks, started once for the module.

What is held here (the resume cases are in ``test_resume.py``, the namespace cluster's 2 hosts x 2 in
``test_multinode.py``):

* **Against PyTorch**: grouped local SGD with SGD and plain averaging equals Lightning's DDP inside each replica (the
  post-local-SGD communication hook: gradients all-reduced over the replica's ranks) with PyTorch's
  ``HierarchicalModelAverager`` (every step over the replica, every ``period`` steps over all ranks), in float64 to
  the rounding bound of ``tests/tolerance.py``. Grouped BSP (a two-level all-reduce) equals flat BSP the same way.
* **Invariants at every step**, from outside the strategy (a plain ``torch.distributed`` checksum gather): the ranks
  of a replica are bit-identical after every step, for every method that runs grouped; after every sync of a method
  whose sync hands every rank the global model, all four ranks are; between syncs the replicas differ.
* **Bytes per level equal the analytic count**: inside a replica, one gradient all-reduce over its 2 ranks per step
  and the leader's broadcast per sync; between replicas, on the leaders only, what the flat method sends with the
  number of replicas as the world size; nothing of the method's on the other ranks.
* **Validation** swaps in the replicas' average (leaders' all-reduce, a broadcast inside the replica).
* **Link emulation per level**: ``link`` delays the traffic between replicas, ``intra_link`` the traffic inside.
* **Refusals at setup**: a ``replica_size`` that does not divide the world size, ``intra_link`` without groups, and
  resuming a grouped checkpoint with another grouping.
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

from lightning_sync.comm.cost import broadcast_bytes, gloo_ring_allreduce_bytes

WORLD = 4
NODE = 2  # ranks per replica
REPLICAS = WORLD // NODE
K = 10  # steps of the equivalence runs
PERIOD = 3
BATCH = 64
TIMEOUT = timedelta(seconds=120)
#: the emulated links of the per-level run: between replicas, inside a replica (bits per second)
INTER_BPS, INTRA_BPS = 20e6, 100e6
#: grouped methods whose every sync hands every rank the global model (the four ranks identical right after it)
SYNC_MAKES_IDENTICAL = (
    "localsgd",
    "fedavg",
    "adpsgd",
    "diloco",
    "selsync",
    "selsync_exact",
    "localsgd_int8",
    "localsgd_topk_int2",
)
#: every method that runs grouped, with verify_sync on (a step-by-step probe beside it)
GROUPED = (*SYNC_MAKES_IDENTICAL, "diloco_streaming", "selsync_gradients", "bsp")


def _grouped(name: str):
    import lightning_sync.strategies as S

    kw = dict(replica_size=NODE, verify_sync=True, timeout=TIMEOUT)
    return {
        "localsgd": lambda: S.LocalSGDStrategy(period=4, **kw),
        "localsgd_int8": lambda: S.LocalSGDStrategy(period=3, compression="int8", **kw),
        # the sparse format with ternary values between the replicas' leaders, as topk goes
        "localsgd_topk_int2": lambda: S.LocalSGDStrategy(period=3, compression="topk:0.05+int2", **kw),
        "fedavg": lambda: S.FedAvgStrategy(fraction=0.5, syncs_per_epoch=3, **kw),
        "adpsgd": lambda: S.ADPSGDStrategy(p_init=2, warmup_epochs=1, **kw),
        "diloco": lambda: S.DiLoCoStrategy(sync_every=4, **kw),
        "diloco_streaming": lambda: S.DiLoCoStrategy(sync_every=4, fragments=2, delay=1, alpha=0.5, **kw),
        "selsync": lambda: S.SelSyncStrategy(delta=0.05, **kw),
        "selsync_exact": lambda: S.SelSyncStrategy(delta=0.05, vote="exact", **kw),
        "selsync_gradients": lambda: S.SelSyncStrategy(delta=0.05, aggregation="gradients", **kw),
        "bsp": lambda: S.BSPStrategy(**kw),
    }[name]()


# ----------------------------------------------------------------------------------------------- worker side
def _suite(rank: int, out_dir: str) -> None:
    from collections import OrderedDict

    import lightning.pytorch as pl
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
    from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import HierarchicalModelAverager

    from lightning_sync import BSPStrategy, LocalSGDStrategy
    from lightning_sync.data import DigitsDataModule
    from lightning_sync.launch import quiet_trainer_kwargs
    from lightning_sync.models import DigitsCNN

    out = Path(out_dir)
    res: dict = {}

    def checksum(tensors) -> torch.Tensor:
        bits = torch.cat([t.detach().reshape(-1).double() for t in tensors]).view(torch.int64)
        return torch.stack([bits.sum(), (bits * torch.arange(1, bits.numel() + 1)).sum()])

    def gather(value: torch.Tensor) -> list[torch.Tensor]:
        gathered = [torch.zeros_like(value) for _ in range(WORLD)]
        dist.all_gather(gathered, value)  # plain torch.distributed: outside the strategy's code and accounting
        return gathered

    class Probe(Callback):
        """After every step: whether it synced, whether all four ranks and whether each replica's ranks hold
        bit-identical parameters and buffers."""

        def __init__(self) -> None:
            self.rows: list[list[bool]] = []
            self._syncs = 0

        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            sums = gather(checksum(t for t in pl_module.state_dict().values() if t.is_floating_point()))
            synced = trainer.strategy.step_counter.sync_steps > self._syncs
            self._syncs = trainer.strategy.step_counter.sync_steps
            same = [torch.equal(s, sums[0]) for s in sums]
            replicas = [all(torch.equal(sums[r * NODE + i], sums[r * NODE]) for i in range(NODE)) for r in range(2)]
            self.rows.append([bool(synced), all(same), *replicas])

    class AtValidation(Callback):
        """Each replica's parameters as validation starts (callbacks run before the strategy swaps the average
        in) and what the first validation batch sees."""

        def __init__(self) -> None:
            self.rows: list[dict] = []

        def on_validation_start(self, trainer, pl_module) -> None:
            self._before = torch.cat([p.detach().reshape(-1).clone() for p in pl_module.parameters()])

        def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
            if batch_idx:
                return
            now = torch.cat([p.detach().reshape(-1).clone() for p in pl_module.parameters()])
            before, during = gather(self._before), gather(now)
            self.rows.append(
                {
                    "all_same": all(torch.equal(g, during[0]) for g in during),
                    "replicas_differed": not torch.equal(before[0], before[NODE]),
                    # the leaders' two-value sum halved: what the replicas' average is, exactly
                    "is_average": torch.equal(now, (before[0] + before[NODE]) / 2),
                }
            )

    class HierarchicalDDP(DDPStrategy):
        """Lightning's DDP inside each replica — the post-local-SGD communication hook all-reduces the gradients
        over the replica's ranks (``start_localSGD_iter=0``: from the first step) — and PyTorch's
        ``HierarchicalModelAverager`` after every optimizer step: every step over the replica (a no-op on its
        identical ranks), every ``PERIOD`` steps over all ranks. Lightning registers DDP communication hooks on
        CUDA only; on gloo the same registration is made here."""

        def _register_ddp_hooks(self) -> None:
            subgroup, _ = dist.new_subgroups(group_size=NODE)
            state = PostLocalSGDState(process_group=None, subgroup=subgroup, start_localSGD_iter=0)
            self.model.register_comm_hook(state, post_localSGD_hook)
            self._model_averager = HierarchicalModelAverager(OrderedDict([(1, NODE), (PERIOD, WORLD)]))

    def fit(name, strategy, callbacks=(), ckpt_path=None, **kw):
        pl.seed_everything(0)
        kw.setdefault("limit_val_batches", 0)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=WORLD,
            strategy=strategy,
            callbacks=list(callbacks),
            **quiet_trainer_kwargs(**kw),
        )
        model = DigitsCNN(lr=0.05, momentum=0.9, weight_decay=1e-4)
        trainer.fit(model, DigitsDataModule(batch_size=BATCH), ckpt_path=ckpt_path)
        torch.save({k: v.detach().clone() for k, v in model.named_parameters()}, out / f"{name}_params_rank{rank}.pt")
        torch.save(
            {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()},
            out / f"{name}_state_rank{rank}.pt",
        )
        return trainer

    def counts(strategy) -> dict:
        stats = strategy.comm_stats
        return {"bytes": dict(stats.bytes_sent), "ops": dict(stats.ops), "metrics": strategy.sync_metrics()}

    # 1. against PyTorch: grouped local SGD vs DDP inside the replica + HierarchicalModelAverager (float64)
    tr = fit("grouped64", LocalSGDStrategy(period=PERIOD, replica_size=NODE, timeout=TIMEOUT), max_steps=K,
             precision="64-true")  # fmt: skip
    st = tr.strategy
    res["grouped64"] = {
        **counts(st),
        "sync_steps": st.step_counter.sync_steps,
        "topology": [st.ranks_per_replica, st.num_replicas, st.replica_index, st.is_replica_leader],
    }
    fit("hierarchical", HierarchicalDDP(timeout=TIMEOUT), max_steps=K, precision="64-true")
    # a two-level all-reduce is BSP's all-reduce: grouped BSP vs flat BSP (float64)
    fit("bsp_flat64", BSPStrategy(timeout=TIMEOUT), max_steps=K, precision="64-true")
    tr = fit("bsp_grouped64", BSPStrategy(replica_size=NODE, timeout=TIMEOUT), max_steps=K, precision="64-true")
    res["bsp_grouped64"] = counts(tr.strategy)

    # 2. every grouped method, two epochs with verify_sync, probed after every step (and local SGD's validations)
    for name in GROUPED:
        probe = Probe()
        callbacks = [probe]
        kw = {}
        if name == "localsgd":
            callbacks.append(at_val := AtValidation())
            kw = dict(limit_val_batches=2)
        tr = fit(name, _grouped(name), callbacks, max_epochs=2, **kw)
        res[name] = {**counts(tr.strategy), "probe": probe.rows, "steps_per_epoch": tr.num_training_batches}
        if name == "localsgd":
            res[name]["validation"] = at_val.rows

    # 3. link emulation per level: blocking operations take at least their emulated transfer time
    class Clocks(Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            st = trainer.strategy
            self.clocks = [
                st.replicas.intra.clock is not None and st.replicas.intra.clock is not st.comm.clock,
                st.replicas.intra.link.bits_per_second == INTRA_BPS,
                st.replicas.inter is None or st.replicas.inter.clock is st.comm.clock,
            ]

    clocks = Clocks()
    tr = fit(
        "links",
        LocalSGDStrategy(period=PERIOD, replica_size=NODE, link=f"{INTER_BPS}", intra_link=f"{INTRA_BPS}"),
        [clocks],
        max_steps=K,
    )
    st = tr.strategy
    res["links"] = {**counts(st), "blocked": dict(st.comm_stats.blocked_seconds), "clocks": clocks.clocks}

    # 4. refused at setup, saying why (before any collective: the next fit runs in the same processes)
    def refused(strategy) -> str:
        try:
            fit("refused", strategy, max_steps=1)
        except ValueError as err:
            return str(err)
        return ""

    res["refused_divisor"] = refused(LocalSGDStrategy(replica_size=3, timeout=TIMEOUT))
    res["refused_intra_link"] = refused(LocalSGDStrategy(intra_link="10gbit", timeout=TIMEOUT))
    # resuming a grouped checkpoint with another grouping (last: a refusal after setup reports to the peers)
    ckpt = ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    fit("to_resume", LocalSGDStrategy(period=2, replica_size=NODE, timeout=TIMEOUT), [ckpt], max_steps=2,
        enable_checkpointing=True)  # fmt: skip
    try:
        fit("resumed_flat", LocalSGDStrategy(period=2, timeout=TIMEOUT), max_steps=4,
            ckpt_path=str(out / "ckpt" / "step=2.ckpt"))  # fmt: skip
        res["refused_resume"] = ""
    except ValueError as err:
        res["refused_resume"] = str(err)

    (out / f"res_rank{rank}.json").write_text(json.dumps(res))


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("replica_groups")
    return out, run_suite(_suite, WORLD, out)


# ----------------------------------------------------------------------------------------------- helpers
def _load(out: Path, name: str, what: str, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(out / f"{name}_{what}_rank{rank}.pt")


def _numel() -> int:
    """Elements of the flat state (parameters and floating buffers) of the digits CNN: what a sync sends."""
    from lightning_sync.models import DigitsCNN

    model = DigitsCNN()
    return sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers() if b.is_floating_point())


# ----------------------------------------------------------------------------------------------- tests
def test_grouped_local_sgd_equals_ddp_in_the_node_with_pytorchs_hierarchical_model_averager(suite):
    out, res = suite
    for rank in range(WORLD):
        ours, pytorch = _load(out, "grouped64", "params", rank), _load(out, "hierarchical", "params", rank)
        assert_equal_in_exact_arithmetic(ours, pytorch, K, f"rank {rank}: grouped local SGD vs hierarchical DDP")
    assert res[0]["grouped64"]["sync_steps"] == math.ceil(K / PERIOD)  # after steps 0, 3, 6, 9
    # not vacuous: between the averagings the two replicas really differ (rank 0 and rank 2 after step 10: in sync;
    # the local SGD runs below show the divergence step by step)
    assert [r["grouped64"]["topology"] for r in res] == [[2, 2, 0, True], [2, 2, 0, False], [2, 2, 1, True],
                                                          [2, 2, 1, False]]  # fmt: skip


def test_grouped_bsp_equals_flat_bsp(suite):
    out, _ = suite
    for rank in range(WORLD):
        flat, grouped = _load(out, "bsp_flat64", "state", rank), _load(out, "bsp_grouped64", "state", rank)
        assert_equal_in_exact_arithmetic(grouped, flat, K, f"rank {rank}: grouped BSP vs flat BSP")


@pytest.mark.parametrize("name", GROUPED)
def test_ranks_of_a_replica_are_identical_after_every_step(suite, name):
    _, res = suite
    rows = res[0][name]["probe"]
    assert len(rows) == 2 * res[0][name]["steps_per_epoch"]
    assert all(replica0 and replica1 for _, _, replica0, replica1 in rows)
    assert all(r[name]["probe"] == rows for r in res)  # every rank saw the same
    syncs = [synced for synced, *_ in rows]
    assert any(syncs), "the run never synced"
    if name == "bsp":
        assert all(syncs) and all(same for _, same, *_ in rows)
        return
    if name in SYNC_MAKES_IDENTICAL:
        assert all(same for synced, same, *_ in rows if synced)  # all four ranks identical after each sync
    assert not all(syncs) and not any(same for synced, same, *_ in rows if not synced)  # replicas diverge between


def test_bytes_per_level_equal_the_analytic_count(suite):
    """Grouped local SGD in float64 (K steps, syncs after steps 0, 3, 6, 9): inside the replica one all-reduce of
    the gradient buffer over 2 ranks per step (gloo's ring sends exactly the buffer on 2 ranks) and, on the leader,
    a broadcast of the state per sync; between replicas, on the leaders only, per sync what flat local SGD sends on
    a world of R = 2 replicas."""
    _, res = suite
    numel, elem = _numel(), 8
    syncs = math.ceil(K / PERIOD)
    for rank, r in enumerate(res):
        sent, m = r["grouped64"]["bytes"], r["grouped64"]["metrics"]
        leader, replica = rank % NODE == 0, rank // NODE
        assert sent["intra/grads"] == K * gloo_ring_allreduce_bytes(numel, elem, NODE, rank % NODE)
        assert sent.get("intra/params", 0) == syncs * broadcast_bytes(numel * elem, NODE, rank % NODE, 0)
        flat_with_r_ranks = syncs * gloo_ring_allreduce_bytes(numel, elem, REPLICAS, replica)
        assert sent.get("params", 0) == (flat_with_r_ranks if leader else 0)
        assert m["bytes_intra"] == sent["intra/grads"] + sent.get("intra/params", 0)
        assert m["bytes_inter"] == sent.get("params", 0) + sent["lightning"]  # the rest: SIGTERM checks
        assert m["bytes_sent"] == m["bytes_intra"] + m["bytes_inter"]
    # grouped BSP: the replica's gradient every step, averaged over the leaders and broadcast in the replica
    for rank, r in enumerate(res):
        sent = r["bsp_grouped64"]["bytes"]
        leader = rank % NODE == 0
        assert sent["intra/grads"] == K * numel * elem * (2 if leader else 1)  # all-reduce, and the broadcast
        assert sent.get("grads", 0) == (K * gloo_ring_allreduce_bytes(numel, elem, REPLICAS, rank // NODE) if leader
                                        else 0)  # fmt: skip


def test_validation_sees_the_replicas_average_sent_between_leaders_only(suite):
    _, res = suite
    for rank, r in enumerate(res):
        rows = r["localsgd"]["validation"]
        assert len(rows) == 2  # one per epoch
        assert all(v["all_same"] and v["is_average"] for v in rows)
        assert any(v["replicas_differed"] for v in rows)  # not vacuous: an average of different replicas
        sent = r["localsgd"]["bytes"]
        leader = rank % NODE == 0
        evals = sum(v["replicas_differed"] for v in rows)  # in sync: nothing is sent
        state = _numel() * 4
        assert sent.get("eval", 0) == (evals * state if leader else 0)
        assert sent.get("intra/eval", 0) == (evals * state if leader else 0)


def test_link_emulation_per_level(suite):
    """``link`` delays what crosses between replicas, ``intra_link`` what stays inside: each blocking transfer takes
    at least its emulated time on its own level's link (a lower bound: the emulated delay is a sleep), and each
    level has its own clock."""
    _, res = suite
    state = _numel() * 4
    syncs = math.ceil(K / PERIOD)
    for rank, r in enumerate(res):
        links = r["links"]
        assert all(links["clocks"])
        if rank % NODE == 0:  # the leaders: the average between replicas, the broadcast inside
            assert links["blocked"]["params"] >= syncs * 8 * state / INTER_BPS
            assert links["blocked"]["intra/params"] >= syncs * 8 * state / INTRA_BPS
        else:  # the broadcast's receiver is charged the payload too (the emulated link of its level)
            assert links["blocked"]["intra/params"] >= syncs * 8 * state / INTRA_BPS
            assert "params" not in links["bytes"]


def test_refused_at_setup_saying_why(suite):
    _, res = suite
    for r in res:
        assert "replica_size must divide the world size 4" in r["refused_divisor"]
        assert "intra_link emulates the link inside a replica group" in r["refused_intra_link"]
        assert "written with 2 rank(s) per replica; this run has 1" in r["refused_resume"]


def test_the_topology_says_when_a_fit_has_nobody_to_synchronise_with():
    """The warning at setup comes from the topology: one rank flat, one replica of several ranks; never for a
    fault-tolerant replica group (its peers are other processes). The run's replica count scales local clipping."""
    from types import SimpleNamespace

    from lightning_sync.strategies.ft_topology import FaultTolerantTopology
    from lightning_sync.strategies.topology import FlatTopology, GroupedTopology

    def host(world, replicas):
        ft = SimpleNamespace(replica_groups=3)
        return SimpleNamespace(world_size=world, replica_size=world, replicas=SimpleNamespace(num_replicas=replicas),
                               fault_tolerance=ft)  # fmt: skip

    assert "world size 1" in FlatTopology(host(1, 1)).alone()
    assert FlatTopology(host(2, 2)).alone() is None
    assert "all 4 ranks form one replica" in GroupedTopology(host(4, 1)).alone()
    assert GroupedTopology(host(4, 2)).alone() is None
    fault_tolerant = FaultTolerantTopology(host(1, 1), FlatTopology(host(1, 1)))
    assert fault_tolerant.alone() is None and fault_tolerant.has_peers
    assert fault_tolerant.replicas_in_run == 3 and GroupedTopology(host(4, 2)).replicas_in_run == 2
