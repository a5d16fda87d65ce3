"""DiLoCo and Streaming DiLoCo, and the outer optimizer on the periodic strategies: 2 CPU processes (gloo),
started once torchrun-style for the module (resume: tests/test_resume.py; the math: tests/test_outer.py)."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from launch import run_suite
from tolerance import assert_equal_in_exact_arithmetic, max_diff

WORLD = 2
K = 10  # steps of the equivalence runs: syncs after steps 2, 5, 8 (H = 3), and a final one after step 9
H = 3
NESTEROV = {"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True}
LR1 = {"name": "sgd", "lr": 1.0}
SLOWMO = {"name": "sgd", "lr": 1.0, "momentum": 0.5}
CLIP = 0.05  # gradient_clip_val of the clipping runs: small enough that DigitsCNN's gradients are clipped
STREAM_STEPS = 13
STREAM = dict(sync_every=4, fragments=2, delay=1, alpha=0.5)


def _suite(rank: int, out_dir: str) -> None:
    from lightning.pytorch.callbacks import Callback

    from lightning_sync import (
        ADPSGDStrategy,
        BSPStrategy,
        DiLoCoStrategy,
        FedAvgStrategy,
        LocalSGDStrategy,
        SelSyncStrategy,
    )
    from lightning_sync.data import DigitsDataModule
    from lightning_sync.launch import quiet_trainer_kwargs
    from lightning_sync.models import DigitsCNN

    out = Path(out_dir)
    res: dict = {}

    def local_sgd_after_every_h(**kw):
        """The reference: local SGD itself (``LocalSGDStrategy``), averaging after every ``H`` local steps (steps
        H-1, 2H-1, ...: DiLoCo's schedule; ``offset=H-1``, as torchft's LocalSGD — by default it follows CPSGD and
        averages after step 0 too)."""
        return LocalSGDStrategy(period=H, offset=H - 1, **kw)

    def fit(name, strategy, max_steps=K, callbacks=(), model_class=DigitsCNN, **kw):
        pl.seed_everything(0)
        model = model_class(lr=0.05, momentum=0.9, weight_decay=1e-4)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=WORLD,
            strategy=strategy,
            max_steps=max_steps,
            limit_val_batches=0,
            callbacks=list(callbacks),
            **quiet_trainer_kwargs(**kw),
        )
        trainer.fit(model, DigitsDataModule(batch_size=16))
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"{name}_rank{rank}.pt")
        return trainer

    f64 = {"precision": "64-true"}
    # 1. outer lr 1 without momentum is plain averaging: DiLoCo equals local SGD averaging at the same steps
    fit("localsgd_after_h", local_sgd_after_every_h(), **f64)
    tr = fit("diloco_lr1", DiLoCoStrategy(sync_every=H, outer_optimizer=LR1, verify_sync=True), **f64)
    res["diloco_lr1"] = {"syncs": tr.strategy.step_counter.sync_steps, "final_ops": tr.strategy.comm_stats.ops["final"]}
    # 2. K = 1, delay 0 is plain DiLoCo: the periodic strategies' averaging path with the paper's outer optimizer
    fit("plain_diloco", local_sgd_after_every_h(outer_optimizer=NESTEROV), **f64)
    tr = fit(
        "diloco", DiLoCoStrategy(sync_every=H, outer_optimizer=NESTEROV, fragments=1, delay=0, verify_sync=True), **f64
    )
    res["diloco"] = {"outer_steps": tr.strategy.outer.steps, "verify_ops": tr.strategy.comm_stats.ops["verify"]}
    # 2b. compressed plain DiLoCo (bf16 changes since the last global model, int8 with error feedback) is the
    #     periodic strategies' compressed averaging path with the same outer optimizer; bytes are the wire's
    for codec in ("bf16", "int8"):
        ref = local_sgd_after_every_h(outer_optimizer=NESTEROV, compression=codec)
        fit(f"plain_diloco_{codec}", ref, **f64)
        tr = fit(
            f"diloco_{codec}",
            DiLoCoStrategy(sync_every=H, outer_optimizer=NESTEROV, compression=codec, verify_sync=True),
            **f64,
        )
        stats = tr.strategy.comm_stats
        res[f"diloco_{codec}"] = {
            "bytes": [stats.bytes_sent["params"], stats.bytes_sent["final"]],
            "ops": [stats.ops["params"], stats.ops["final"]],
            "ref_bytes": [ref.comm_stats.bytes_sent["params"], ref.comm_stats.bytes_sent["final"]],
            # one flat group (one dtype, one device): the parameters compressed, the floating buffers exact
            "numel": sum(t.numel() for t in tr.lightning_module.parameters()),
            "buffers": [(b.numel(), b.element_size()) for b in tr.lightning_module.buffers() if b.is_floating_point()],
        }
    # 3. the shared path on the periodic family: outer lr 1 reproduces plain averaging bit for bit (ADPSGD's S_k is
    #    measured against the mean before the outer step, so its periods are the same too; FedAvg averages one of the
    #    two ranks per round, SelSync with delta 0 syncs every step)
    for name, make in {
        "localsgd": lambda outer: LocalSGDStrategy(period=3, outer_optimizer=outer),
        "adpsgd": lambda outer: ADPSGDStrategy(p_init=2, warmup_epochs=0, sample_fraction=0.2, outer_optimizer=outer),
        "fedavg": lambda outer: FedAvgStrategy(fraction=0.5, syncs_per_epoch=8, outer_optimizer=outer),
        "selsync": lambda outer: SelSyncStrategy(delta=0.0, outer_optimizer=outer),
    }.items():
        for suffix, outer in (("plain", None), ("outer_lr1", LR1)):
            tr = fit(f"{name}_{suffix}", make(outer), max_steps=20)
            controller = getattr(tr.strategy, "controller", None)
            res[f"{name}_{suffix}"] = {
                "syncs": tr.strategy.step_counter.sync_steps,
                "controller": controller.state_dict() if controller is not None else None,
            }

    # 4. streaming: 2 fragments, each launched asynchronously and applied one step later, over an emulated 2 Mbit/s
    #    link, so the all-reduce is still in flight when the next step starts
    class Probe(Callback):
        def __init__(self):
            self.rows = []
            self.parts = None

        def on_train_batch_end(self, trainer, pl_module, *args):
            s = trainer.strategy
            self.parts = [[(p.start, p.param_end, p.end) for p in parts] for parts in s._parts]
            self.rows.append(
                {
                    "launched": s.last_launched,
                    "applied": s.last_applied,
                    "in_flight_at_start": s.in_flight_at_step_start,
                    "bytes_params": s.comm_stats.bytes_sent["params"],
                    "global": [t.detach().clone() for t in s.outer.global_params],
                }
            )

    probe = Probe()
    strategy = DiLoCoStrategy(**STREAM, outer_optimizer=SLOWMO, link="2mbit,1ms", verify_sync=True)
    tr = fit("stream", strategy, max_steps=STREAM_STEPS, callbacks=[probe])
    torch.save(probe.rows, out / f"stream_rows_rank{rank}.pt")
    model = DigitsCNN()
    res["stream"] = {
        "fragment_syncs": strategy.fragment_syncs,
        "parts": probe.parts,
        "numel": sum(t.numel() for t in model.parameters())
        + sum(b.numel() for b in model.buffers() if b.is_floating_point()),
        "param_numel": sum(t.numel() for t in model.parameters()),
        "metrics": strategy.sync_metrics(),
        "verify_ops": strategy.comm_stats.ops["verify"],
    }

    # 5. the outer momentum follows the inner learning rate: a per-step schedule halves the rate every step, and each
    #    outer step receives the rate its round's last inner step used
    class Halving(DigitsCNN):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Rates(Callback):
        def __init__(self):
            self.rows = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.lr = trainer.optimizers[0].param_groups[0]["lr"]  # the rate this step uses

        def on_train_batch_end(self, trainer, pl_module, *args):
            s = trainer.strategy
            self.rows.append(
                {"lr": self.lr, "synced": s.last_applied is not None, "seen": s.outer.inner_lrs.get((0, 0))}
            )

    rates = Rates()
    tr = fit("halving", DiLoCoStrategy(sync_every=H, outer_optimizer=SLOWMO), callbacks=[rates], model_class=Halving)
    res["halving"] = rates.rows

    # 6. outer_optimizer="auto" (the default) chooses from the inner optimizer: plain averaging over SGD (the same
    #    model as local SGD after every H steps, case 1), the paper's outer step over AdamW
    class WithAdamW(DigitsCNN):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    auto = fit("auto_sgd", DiLoCoStrategy(sync_every=H), **f64).strategy
    tr = fit("adamw", DiLoCoStrategy(sync_every=H), max_steps=H, model_class=WithAdamW)
    res["auto"] = {
        "sgd": [auto.outer_config, auto.outer_reason, auto.outer],
        "adamw": [tr.strategy.outer_config.spec(), tr.strategy.outer_reason, tr.strategy.outer.steps],
    }

    # 7. gradient clipping on local steps (local_clipping, every strategy): "scaled" clips a local gradient at
    #    gradient_clip_val * sqrt(2), the same run as "as_given" at that value; SelSync's gradient syncs (every step
    #    with delta=0 and aggregation="gradients") and BSP's steps clip the ranks' average at gradient_clip_val, as
    #    "as_given"
    def clipped(name, strategy, clip):
        tr = fit(name, strategy, gradient_clip_val=clip)
        return tr.strategy.clipping.factor

    res["clip_factor"] = clipped("clip_scaled", DiLoCoStrategy(sync_every=H), CLIP)
    clipped("clip_as_given_sqrt2", DiLoCoStrategy(sync_every=H, local_clipping="as_given"), CLIP * 2**0.5)
    clipped("clip_as_given", DiLoCoStrategy(sync_every=H, local_clipping="as_given"), CLIP)
    clipped("selsync_clip_scaled", SelSyncStrategy(delta=0.0), CLIP)
    clipped("selsync_clip_as_given_sqrt2", SelSyncStrategy(delta=0.0, local_clipping="as_given"), CLIP * 2**0.5)
    clipped("selsync_grads_clip_scaled", SelSyncStrategy(delta=0.0, aggregation="gradients"), CLIP)
    clipped(
        "selsync_grads_clip_as_given",
        SelSyncStrategy(delta=0.0, aggregation="gradients", local_clipping="as_given"),
        CLIP,
    )
    clipped("localsgd_clip_scaled", LocalSGDStrategy(period=H), CLIP)
    clipped("localsgd_clip_as_given_sqrt2", LocalSGDStrategy(period=H, local_clipping="as_given"), CLIP * 2**0.5)
    clipped("bsp_clip_scaled", BSPStrategy(), CLIP)
    clipped("bsp_clip_as_given", BSPStrategy(local_clipping="as_given"), CLIP)
    tr = fit("clip_plugin", DiLoCoStrategy(sync_every=H), gradient_clip_val=CLIP)
    res["clip_plugin_restored"] = "clip_gradients" not in vars(tr.precision_plugin)  # teardown put it back
    (out / f"res_rank{rank}.json").write_text(json.dumps(res))


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("diloco")
    return out, run_suite(_suite, WORLD, out)


def _load(out: Path, name: str, rank: int = 0) -> dict[str, torch.Tensor]:
    return {k: v for k, v in torch.load(out / f"{name}_rank{rank}.pt").items() if v.is_floating_point()}


def test_outer_lr_one_without_momentum_equals_local_sgd(suite):
    out, res = suite
    assert res[0]["diloco_lr1"] == {"syncs": 3, "final_ops": 1}  # after steps 2, 5, 8; and the final sync
    for rank in range(WORLD):
        a, b = _load(out, "diloco_lr1", rank), _load(out, "localsgd_after_h", rank)
        assert_equal_in_exact_arithmetic(a, b, K, "DiLoCo(outer lr 1) vs local SGD")


def test_one_fragment_without_delay_equals_plain_diloco(suite):
    out, res = suite
    assert res[0]["diloco"]["outer_steps"] == 4  # 3 syncs and the final one
    assert res[0]["diloco"]["verify_ops"] >= 4  # verify_sync checked every sync of the run
    for rank in range(WORLD):
        a, b = _load(out, "diloco", rank), _load(out, "plain_diloco", rank)
        assert_equal_in_exact_arithmetic(a, b, K, "DiLoCo(K=1, delay 0) vs plain DiLoCo")
    # the outer optimizer really changes the trajectory (not plain averaging), and the replicas end identical
    assert max_diff(_load(out, "diloco"), _load(out, "diloco_lr1")) > 1e-4
    assert max_diff(_load(out, "diloco", 0), _load(out, "diloco", 1)) == 0.0


@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_compressed_plain_diloco_is_the_periodic_compressed_path_and_counts_wire_bytes(suite, codec):
    from lightning_sync.comm.compression import wire_format
    from lightning_sync.comm.cost import compressed_allreduce_bytes, gloo_ring_allreduce_bytes

    out, res = suite
    for rank in range(WORLD):
        a, b = _load(out, f"diloco_{codec}", rank), _load(out, f"plain_diloco_{codec}", rank)
        assert_equal_in_exact_arithmetic(a, b, K, f"DiLoCo({codec}) vs the periodic compressed path")
        assert max_diff(_load(out, f"diloco_{codec}", 0), a) == 0.0  # identical global models
    fmt = wire_format(codec)
    for rank, r in enumerate(res):
        m = r[f"diloco_{codec}"]
        # the parameters' changes in the wire format, the BatchNorm statistics exact beside them (one all-reduce)
        (size,) = {e for _, e in m["buffers"]}  # the model's one dtype
        buffers = sum(n for n, _ in m["buffers"])
        assert buffers > 0  # the workload has BatchNorm
        per_sync = sum(compressed_allreduce_bytes(m["numel"], fmt.element_size, WORLD, fmt.block, fmt.scale_bytes))
        per_sync += gloo_ring_allreduce_bytes(buffers, size, WORLD, rank)
        assert m["bytes"] == [3 * per_sync, per_sync]  # 3 syncs (steps 2, 5, 8) and the final one
        assert m["bytes"] == m["ref_bytes"]
    # the compressed mean moves the trajectory a little, not a lot, from the exact one
    assert 0 < max_diff(_load(out, f"diloco_{codec}"), _load(out, "diloco")) < 0.05


def test_diloco_refuses_compression_with_streaming():
    from lightning_sync import DiLoCoStrategy

    for codec in ("bf16", "int4", "int2"):
        for kw in (dict(fragments=2), dict(delay=1), dict(alpha=0.5)):
            with pytest.raises(ValueError, match=rf"compression='{codec}' needs plain DiLoCo \(fragments=1, delay=0"):
                DiLoCoStrategy(sync_every=4, compression=codec, **kw)
    for codec in ("int8", "int4", "int2"):
        assert DiLoCoStrategy(sync_every=4, compression=codec).compression == codec


@pytest.mark.parametrize("name", ["localsgd", "adpsgd", "fedavg", "selsync"])
def test_outer_lr_one_on_a_periodic_strategy_reproduces_plain_averaging_bit_for_bit(suite, name):
    out, res = suite
    assert res[0][f"{name}_outer_lr1"] == res[0][f"{name}_plain"]  # same syncs (ADPSGD: same S_k, C2, periods)
    assert res[0][f"{name}_plain"]["syncs"] > 3
    for rank in range(WORLD):
        assert max_diff(_load(out, f"{name}_outer_lr1", rank), _load(out, f"{name}_plain", rank)) == 0.0


def test_streaming_fragments_are_each_synced_once_per_period(suite):
    out, res = suite
    rows = torch.load(out / "stream_rows_rank0.pt")
    h, k, tau = STREAM["sync_every"], STREAM["fragments"], STREAM["delay"]
    launched = [r["launched"] for r in rows]
    # fragment 0 after steps 1, 5, 9; fragment 1 after steps 3, 7, 11 (one every H/K = 2 steps, each once per H)
    assert launched == [(None if (i + 1) % (h // k) else ((i + 1) // (h // k) - 1) % k) for i in range(STREAM_STEPS)]
    for f in range(k):
        at = [i for i, x in enumerate(launched) if x == f]
        assert at == list(range((f + 1) * h // k - 1, STREAM_STEPS, h))
    assert [r["applied"] for r in rows] == [None] * tau + launched[:-tau]
    s = res[0]["stream"]
    assert s["fragment_syncs"] == [launched.count(f) for f in range(k)] == [3, 3]
    # two contiguous halves of the parameters; the floating buffers travel with the last one
    (first,), (last,) = s["parts"]
    assert first[0] == 0 and first[1] == first[2] == last[0] and last[1] == s["param_numel"] and last[2] == s["numel"]
    assert abs((first[1] - first[0]) - (last[1] - last[0])) <= 1
    # bytes: each launch all-reduces its fragment once (float32; 2 ranks on gloo's ring send B exactly once)
    sizes = [first[2] - first[0], last[2] - last[0]]
    expected = 0
    for i, f in enumerate(launched):
        expected += 0 if f is None else 4 * sizes[f]
        assert rows[i]["bytes_params"] == expected
    assert s["metrics"]["bytes_params"] == expected


def test_streaming_all_reduce_is_in_flight_while_the_next_step_computes(suite):
    out, _ = suite
    rows = torch.load(out / "stream_rows_rank0.pt")
    # recorded order: launch after step i, step i+1 starts with the all-reduce incomplete, applied after step i+1
    launches = [i for i, r in enumerate(rows) if r["launched"] is not None and i + 1 < len(rows)]
    assert launches
    for i in launches:
        assert rows[i + 1]["in_flight_at_start"] is True, f"launched after step {i}, complete before step {i + 1}"
        assert rows[i + 1]["applied"] == rows[i]["launched"]
        assert rows[i + 1]["launched"] is None


def test_streaming_ranks_hold_identical_global_parameters_after_every_sync(suite):
    out, res = suite
    assert res[0]["stream"]["verify_ops"] >= sum(res[0]["stream"]["fragment_syncs"])  # verify_sync at every apply
    rows = [torch.load(out / f"stream_rows_rank{r}.pt") for r in range(WORLD)]
    for step, (a, b) in enumerate(zip(*rows)):
        assert all(torch.equal(x, y) for x, y in zip(a["global"], b["global"])), f"global params differ, step {step}"
    # with alpha = 0.5 the replicas keep half of their local fragment, so they differ during training; the final
    # sync hands back one global model
    assert max_diff(_load(out, "stream", 0), _load(out, "stream", 1)) == 0.0


def test_each_outer_step_receives_the_inner_learning_rate_of_its_rounds_last_step(suite):
    """``inner_lr_scaling`` (the default) in a real fit: under a per-step schedule the outer optimizer records, at
    every sync, the rate the round's last inner step used, which scales its momentum (the math: test_outer.py)."""
    _, results = suite
    for r in results:
        rows = r["halving"]
        synced = [row for row in rows if row["synced"]]
        assert len(synced) == K // H and all(row["seen"] == row["lr"] for row in synced)
        assert [row["lr"] for row in synced] == [0.05 * 0.5 ** (H * i + H - 1) for i in range(K // H)]


def test_auto_outer_optimizer_is_chosen_from_the_inner_optimizer_at_setup(suite):
    """The default: plain averaging over SGD (no outer state: the model of local SGD averaging after every H steps,
    bit for bit), the paper's outer step over AdamW, each with its reason."""
    from lightning_sync.core.outer import DILOCO_OUTER

    out, results = suite
    for r in results:
        (sgd, sgd_why, sgd_outer), (adamw, adamw_why, adamw_steps) = r["auto"]["sgd"], r["auto"]["adamw"]
        assert sgd is None and sgd_outer is None and "plain averaging" in sgd_why and "SGD" in sgd_why
        assert adamw == dict(DILOCO_OUTER) and "AdamW" in adamw_why and adamw_steps == 1
    for rank in range(WORLD):
        assert max_diff(_load(out, "auto_sgd", rank), _load(out, "localsgd_after_h", rank)) == 0.0


def test_a_local_gradient_is_clipped_at_sqrt_replicas_times_gradient_clip_val(suite):
    """local_clipping="scaled" (default) is "as_given" at gradient_clip_val * sqrt(N), bit for bit, and differs from
    "as_given" at gradient_clip_val (the clipping acts); SelSync's parameter aggregation clips local gradients
    likewise, and its gradient syncs clip the average at gradient_clip_val; local SGD as DiLoCo; BSP's gradient is the
    average: as given; teardown restores the plugin."""
    out, results = suite
    assert all(r["clip_factor"] == pytest.approx(2**0.5) for r in results)

    def diff(a: str, b: str, rank: int) -> float:
        return max_diff(_load(out, a, rank), _load(out, b, rank))

    for rank in range(WORLD):
        assert (
            diff("clip_scaled", "clip_as_given_sqrt2", rank) == 0.0 and diff("clip_scaled", "clip_as_given", rank) > 0
        )
        assert diff("selsync_clip_scaled", "selsync_clip_as_given_sqrt2", rank) == 0.0
        assert diff("selsync_grads_clip_scaled", "selsync_grads_clip_as_given", rank) == 0.0
        assert diff("localsgd_clip_scaled", "localsgd_clip_as_given_sqrt2", rank) == 0.0
        assert diff("bsp_clip_scaled", "bsp_clip_as_given", rank) == 0.0
    assert all(r["clip_plugin_restored"] for r in results)


def test_selsync_refuses_an_outer_optimizer_with_gradient_aggregation():
    from lightning_sync import SelSyncStrategy

    with pytest.raises(ValueError, match=r"outer_optimizer must be None with aggregation='gradients'.*parameters"):
        SelSyncStrategy(aggregation="gradients", outer_optimizer=NESTEROV)
    assert SelSyncStrategy(aggregation="parameters", outer_optimizer=NESTEROV).outer_config is not None


def test_yaml_config_and_name():
    from lightning_sync import DiLoCoStrategy
    from lightning_sync.cli import cli_main
    from lightning_sync.core.outer import OuterSGD

    config = Path(__file__).resolve().parent.parent / "examples" / "configs" / "diloco.yaml"
    cli = cli_main(["--config", str(config)], run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, DiLoCoStrategy) and strategy.outer_auto and strategy.outer_config is None
    paper = '{"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": true}'
    cli = cli_main(["--config", str(config), f"--trainer.strategy.init_args.outer_optimizer={paper}"], run=False)
    assert cli.trainer.strategy.outer_config == OuterSGD(0.7, 0.9, True) and not cli.trainer.strategy.outer_auto
    cli = cli_main(
        ["--config", str(config), '--trainer.strategy.init_args.outer_optimizer={"name": "sgd", "lr": 1.0}'], run=False
    )
    assert cli.trainer.strategy.outer_config == OuterSGD(1.0)
    trainer = pl.Trainer(strategy="diloco", accelerator="cpu", devices=2, logger=False)
    assert type(trainer.strategy) is DiLoCoStrategy and trainer.strategy.sync_every == 16


def test_the_clip_factor_counts_replicas_not_ranks():
    """sqrt(N) for N replicas: with replica groups a local gradient is already its replica's mean (4 ranks as 2
    replicas of 2: sqrt 2); a fault-tolerant run counts every replica group; "as_given": 1."""
    from types import SimpleNamespace

    from lightning_sync.strategies.clipping import LocalClipping
    from lightning_sync.strategies.ft_topology import FaultTolerantTopology
    from lightning_sync.strategies.topology import FlatTopology

    class FT:
        replica_groups = 3

    def factor(replicas, ft=None, mode="scaled"):
        host = SimpleNamespace(replicas=SimpleNamespace(num_replicas=replicas), fault_tolerance=ft, local_clipping=mode)
        topology = FlatTopology(host)  # the layout's replicas (with replica groups: the replicas, not the ranks)
        host.topology = topology if ft is None else FaultTolerantTopology(host, topology)
        return LocalClipping(host).factor

    assert factor(2) == pytest.approx(2**0.5)
    assert factor(1) == 1.0
    assert factor(1, FT()) == pytest.approx(3**0.5)
    assert factor(4, mode="as_given") == 1.0
