"""Issue 18's hot path on 2 CPU processes (gloo): BSP's bucketed gradient all-reduce overlapped with backward, and
SelSync's decision on the device.

* bucketed BSP equals Lightning's ``ddp`` after K steps (SGD with momentum and weight decay) for one bucket per
  parameter, a few buckets, one for the whole model, and none (one all-reduce after backward); with gradient
  accumulation; and on a model with a parameter that no rank, or one rank, uses in some steps (with
  ``find_unused_parameters``, as DDP's). Equal in exact arithmetic, so checked in float64 (``tests/tolerance.py``);
* the bytes are the analytic count per bucket, and the buckets are launched asynchronously;
* the first bucket's all-reduce is launched, and still in flight, before backward has finished (order recorded by
  the hooks, under an emulated link slow enough to keep it in flight);
* SelSync with the device tracker takes the same decisions (votes, deltas, LSSR) and ends with bit-identical
  parameters as the host tracker it replaced, for both aggregations;
* (in-process) no host read between the end of backward and the optimizer update with parameter aggregation.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import run_suite
from probes import ProbedCNN, ReadProbe
from tolerance import assert_equal_in_exact_arithmetic, max_diff
from torch import nn
from torch.nn import functional as F

from lightning_sync import SelSyncStrategy
from lightning_sync.core import GradientChangeTracker, wants_sync
from lightning_sync.models import DigitsCNN

K = 12
WORLD = 2
CAPS = {"per_param": 1e-9, "few": 0.01, "whole": 25.0}  # 12 buckets, 3 buckets, 1 bucket on the digits CNN
DELTA_MIXED = 0.05
EMULATED = "10mbit"  # the digits CNN's largest bucket (~134 kB) takes ~107 ms; its backward takes a few ms


# ----------------------------------------------------------------------------------------------- worker side
class GatedCNN(DigitsCNN):
    """The digits CNN with a residual layer ``gate`` in the middle of the registration order (so a bucket that
    waits for it holds back the ones after it) that is skipped on every rank at steps 1, 4, 7, ... and on rank 1
    only at steps 2, 5, 8, ...: DDP needs ``find_unused_parameters=True`` for it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        head = self.head
        del self.head
        self.gate = nn.Linear(self.hparams.hidden, self.hparams.hidden)
        self.head = head  # registered after gate

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.head[1](self.head[0](self.features(x.view(-1, 1, 8, 8))))
        step = self.trainer.global_step
        if not (step % 3 == 1 or (step % 3 == 2 and self.global_rank == 1)):
            h = h + self.gate(h)
        return F.cross_entropy(self.head[3](self.head[2](h)), y)


class HostSelSync(SelSyncStrategy):
    """SelSync's decision as it was before issue 18 — the host tracker, ``float(norm)`` every step — as the
    reference for the device tracker."""

    host: GradientChangeTracker | None = None
    host_delta = 0.0

    def _on_flat_ready(self) -> None:
        super()._on_flat_ready()
        self.host = GradientChangeTracker(window=self.window, smoothing=self.effective_smoothing)
        self._vote2 = torch.zeros(2, dtype=torch.float32)

    def _cast_vote(self, vote: Any) -> torch.Tensor:
        assert self.host is not None
        self.host_delta = self.host.update(float(self.flat.grad_sq_norm()))
        self._vote2[0] = 1.0 if wants_sync(self.host_delta, self.delta) else 0.0
        self._vote2[1] = self.sigterm.flag()
        return self._vote2  # one buffer: Alg. 1's order only (vote="exact")

    def _resolve_vote(self, vote: Any) -> bool:
        vote.handle.wait()
        votes, self._sigterm_votes = self._vote2.tolist()
        self.last_voters = int(votes)
        return self.last_voters > 0

    @property
    def last_delta(self) -> float:  # type: ignore[override]
        return self.host_delta


class DeviceSelSync(SelSyncStrategy):
    """SelSync with the device tracker forced on the CPU (by default the CPU decides on the host): the path a GPU
    takes, exercised here."""

    _decide_on_host = False


class ThreadSelSync(SelSyncStrategy):
    """SelSync with the host decision on the communicator's driver thread forced on the CPU (by default only CUDA
    gradients take it): the path a GPU takes, exercised here."""

    _decide_off_thread = True


class LateDriverSelSync(ThreadSelSync):
    """The driver thread's path with each step's decision taken only once the training thread has launched the next
    step's vote (or after 2 s: the last step's): the order a loaded machine can take, forced. The decision must still
    read its own step's norm."""

    def _on_flat_ready(self) -> None:
        super()._on_flat_ready()
        self._launches = 0
        self._decisions = 0
        self._launched_cond = threading.Condition()

    def _launch_vote(self) -> Any:
        vote = super()._launch_vote()
        with self._launched_cond:
            self._launches += 1
            self._launched_cond.notify_all()
        return vote

    def _write_vote(self, *args: Any) -> float:  # on the driver thread, in launch order
        self._decisions += 1
        with self._launched_cond:
            self._launched_cond.wait_for(lambda: self._launches > self._decisions, timeout=2.0)
        return super()._write_vote(*args)


def _suite(rank: int, out_dir: str) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_sync import BSPStrategy, LinkModel
    from lightning_sync.data import DigitsDataModule
    from lightning_sync.launch import quiet_trainer_kwargs

    out = Path(out_dir)
    res: dict[str, Any] = {}

    def fit(name, strategy, model=None, max_steps=K, callbacks=(), **kw):
        pl.seed_everything(0)
        model = model() if model is not None else DigitsCNN(lr=0.05, momentum=0.9, weight_decay=1e-4)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=WORLD,
            strategy=strategy,
            max_steps=max_steps,
            callbacks=list(callbacks),
            **quiet_trainer_kwargs(limit_val_batches=0, **kw),
        )
        trainer.fit(model, DigitsDataModule(batch_size=32))
        torch.save({k: v.detach().clone() for k, v in model.named_parameters()}, out / f"{name}_rank{rank}.pt")
        stats = trainer.strategy.comm_stats if hasattr(trainer.strategy, "comm_stats") else None
        if stats is not None:
            res[name] = {
                "bytes_grads": stats.bytes_sent["grads"],
                "ops_grads": stats.ops["grads"],
                "blocking_grads": stats.blocking["grads"],
                "ops_unused": stats.ops["unused"],
                "steps": trainer.strategy.step_counter.steps,
            }
        return trainer

    # 1. equivalence with Lightning's DDP in float64, several bucket sizes, accumulation, unused parameters
    f64 = {"precision": "64-true"}
    fit("ddp", DDPStrategy(), **f64)
    for label, cap in {**CAPS, "none": None}.items():
        fit(f"bsp_{label}", BSPStrategy(bucket_cap_mb=cap, verify_sync=True), **f64)
    fit("ddp_acc", DDPStrategy(), accumulate_grad_batches=2, **f64)
    fit("bsp_acc", BSPStrategy(bucket_cap_mb=CAPS["per_param"], verify_sync=True), accumulate_grad_batches=2, **f64)

    def gated():
        return GatedCNN(lr=0.05, momentum=0.9, weight_decay=1e-4)

    fit("ddp_gated", DDPStrategy(find_unused_parameters=True), model=gated, **f64)
    for label, cap in CAPS.items():
        strategy = BSPStrategy(bucket_cap_mb=cap, find_unused_parameters=True, verify_sync=True)
        fit(f"bsp_gated_{label}", strategy, model=gated, **f64)
    # without find_unused_parameters: no hang, replicas identical, but a parameter no rank used gets a zero gradient
    fit("bsp_gated_zeros", BSPStrategy(bucket_cap_mb=CAPS["few"], verify_sync=True), model=gated, **f64)

    # 2. the first bucket is in flight before backward ends (recorded by hooks), under a slow emulated link
    class EventOrder(Callback):
        def __init__(self) -> None:
            self.steps: list[list[Any]] = []
            self.handles: list[Any] = []

        def on_train_start(self, trainer, pl_module):
            strategy = trainer.strategy
            launch = strategy.comm.all_reduce

            def recording(tensor, op="sum", tag="other", async_op=False):
                handle = launch(tensor, op=op, tag=tag, async_op=async_op)
                if tag == "grads":
                    self.steps[-1].append(["launch", tensor.numel()])
                    self.handles.append(handle)
                return handle

            strategy.comm.all_reduce = recording
            params = list(pl_module.parameters())
            for i, p in enumerate(params):
                p.register_post_accumulate_grad_hook(lambda _, i=i: self._grad(i))

        def _grad(self, i):  # with whether the step's first bucket is still in flight
            self.steps[-1].append(["grad", i, not self.handles[0].is_completed() if self.handles else None])

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.steps.append([])
            self.handles = []

        def on_after_backward(self, trainer, pl_module):
            self.steps[-1].append(["backward_end", trainer.strategy.overlap.buckets.launched_during_backward])

    order = EventOrder()
    link = LinkModel(EMULATED)
    fit("order", BSPStrategy(bucket_cap_mb=CAPS["few"], link=link), max_steps=4, callbacks=[order])
    res["order"] = order.steps

    # 3. SelSync: the device tracker against the host tracker it replaced, bit for bit
    class Decisions(Callback):
        def __init__(self) -> None:
            self.rows: list[list[float]] = []

        def on_train_batch_end(self, trainer, pl_module, *args):
            s = trainer.strategy
            self.rows.append([s.last_voters, s.last_delta, s.step_counter.sync_steps])

    # in Alg. 1's vote order (the host reference's) for both aggregations, and in the overlapped order (the default
    # with parameters) among the three decision paths
    for agg, vote in (("parameters", "exact"), ("gradients", "exact"), ("parameters", "overlapped")):
        for label, cls in (
            ("device", DeviceSelSync),
            ("host", HostSelSync),
            ("default", SelSyncStrategy),
            ("thread", ThreadSelSync),
            ("late", LateDriverSelSync),
        ):
            if (cls is HostSelSync and vote == "overlapped") or (cls is LateDriverSelSync and vote != "overlapped"):
                continue
            decisions = Decisions()
            name = f"sel_{agg}_{label}" + ("_overlapped" if vote == "overlapped" else "")
            strategy = cls(delta=DELTA_MIXED, aggregation=agg, vote=vote)
            trainer = fit(name, strategy, max_steps=40, callbacks=[decisions])
            res[name] = {
                "rows": decisions.rows,
                "lssr": trainer.strategy.step_counter.lssr,
                "tracker": type(trainer.strategy.tracker).__name__,
                "off_thread": trainer.strategy._sq_host is not None,
                "vote_ops": trainer.strategy.comm_stats.ops["vote"],
                "vote_bytes": trainer.strategy.comm_stats.bytes_sent["vote"],
            }

    (out / f"res_rank{rank}.json").write_text(json.dumps(res))


# ----------------------------------------------------------------------------------------------- parent side
@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("overlap")
    res = run_suite(_suite, WORLD, out)

    def params(name, rank=0):
        return torch.load(out / f"{name}_rank{rank}.pt")

    return res, params


def _plan(model: nn.Module, cap: float) -> list[int]:
    from lightning_sync.comm import FlatState
    from lightning_sync.comm.buckets import plan_buckets

    return [b.numel for b in plan_buckets(FlatState(model), cap)]


@pytest.mark.parametrize("label", [*CAPS, "none"])
def test_bucketed_bsp_equals_lightning_ddp(suite, label):
    _, params = suite
    assert_equal_in_exact_arithmetic(params(f"bsp_{label}"), params("ddp"), K, f"BSP(bucket_cap_mb={label}) vs DDP")
    assert max_diff(params(f"bsp_{label}", 0), params(f"bsp_{label}", 1)) == 0.0  # replicas bit-identical


def test_bucketed_bsp_with_accumulation_equals_lightning_ddp(suite):
    _, params = suite
    assert_equal_in_exact_arithmetic(params("bsp_acc"), params("ddp_acc"), K, "BSP per-parameter buckets, acc 2")
    assert max_diff(params("bsp_acc"), params("bsp_per_param")) > 1e-4  # accumulation changed the trajectory


@pytest.mark.parametrize("label", list(CAPS))
def test_parameter_unused_in_some_steps_equals_ddp_find_unused(suite, label):
    res, params = suite
    assert_equal_in_exact_arithmetic(params(f"bsp_gated_{label}"), params("ddp_gated"), K, f"gated, {label}")
    assert res[0][f"bsp_gated_{label}"]["ops_unused"] == K  # DDP's used-map exchange, one per step


def test_without_find_unused_a_parameter_no_rank_used_gets_a_zero_gradient(suite):
    res, params = suite
    zeros, ddp = params("bsp_gated_zeros"), params("ddp_gated")
    assert max_diff(params("bsp_gated_zeros", 0), params("bsp_gated_zeros", 1)) == 0.0  # no hang, still in sync
    # the parameters DDP leaves alone at the steps nobody uses the gate still get weight decay and momentum here
    assert float((zeros["gate.weight"] - ddp["gate.weight"]).abs().max()) > 1e-8
    assert res[0]["bsp_gated_zeros"]["ops_unused"] == 0


@pytest.mark.parametrize("label", [*CAPS, "none"])
def test_bytes_are_the_analytic_count_per_bucket(suite, label):
    """On 2 ranks gloo's ring sends each bucket once: bytes = 8 bytes x its elements (float64), per bucket and
    step, which sums to one all-reduce of the whole buffer. Launched asynchronously: no blocking collective."""
    res, _ = suite
    sizes = _plan(DigitsCNN().double(), CAPS.get(label, 25.0))
    for r in res:
        m = r[f"bsp_{label}"]
        assert m["steps"] == K
        assert m["bytes_grads"] == K * sum(8 * n for n in sizes) == K * 8 * sum(sizes)
        assert m["ops_grads"] == K * (len(sizes) if label != "none" else 1)
        assert m["blocking_grads"] == (0 if label != "none" else K)
    assert len(sizes) == {"per_param": 12, "few": 3, "whole": 1, "none": 1}[label]


def test_first_bucket_is_in_flight_before_backward_finishes(suite):
    res, _ = suite
    numels = _plan(DigitsCNN(), CAPS["few"])
    for r in res:
        for events in r["order"]:
            kinds = [e[0] for e in events]
            launches = [i for i, k in enumerate(kinds) if k == "launch"]
            first_grad = kinds.index("grad")
            last_grad = max(i for i, k in enumerate(kinds) if k == "grad")
            end = kinds.index("backward_end")
            assert [events[i][1] for i in launches] == numels  # buckets in plan order, all launched from hooks
            assert first_grad < launches[0] < last_grad < end  # launched in the middle of backward
            assert events[last_grad][2] is True  # ... and still in flight when backward's last gradient landed
            assert sorted(e[1] for e in events if e[0] == "grad") == list(range(len(_plan(DigitsCNN(), 1e-9))))
            assert events[end][1] == 3


@pytest.mark.parametrize("agg", ["parameters", "gradients", "parameters_overlapped"])
def test_selsync_device_tracker_matches_the_host_tracker_bit_for_bit(suite, agg):
    """Alg. 1's vote order against the host reference; the overlapped order (two vote buffers in turn, the threshold
    read on the training thread) among the device, inline host and driver-thread paths."""
    res, params = suite
    overlapped = agg.endswith("_overlapped")
    agg = agg.removesuffix("_overlapped")
    key = "_overlapped" if overlapped else ""
    for r in res:
        device, default = r[f"sel_{agg}_device{key}"], r[f"sel_{agg}_default{key}"]
        host = default if overlapped else r[f"sel_{agg}_host"]
        thread = r[f"sel_{agg}_thread{key}"]
        assert device["tracker"] == "DeviceGradientChangeTracker"
        assert default["tracker"] == "GradientChangeTracker"  # gradients on the CPU: decided on the host, inline
        assert thread["tracker"] == "GradientChangeTracker" and thread["off_thread"] and not default["off_thread"]
        others = (default, thread, r[f"sel_{agg}_late{key}"]) if overlapped else (host, default, thread)
        for other in others:
            assert device["rows"] == other["rows"]  # voters, Delta (exact float), syncs so far, at every step
            assert device["lssr"] == other["lssr"]
        assert 0 < device["rows"][-1][2] < 40  # a mix of sync and local steps
        # the driver thread's vote is counted once, as the inline one: 8 bytes (2 floats) per step on 2 ranks
        assert thread["vote_ops"] == device["vote_ops"] == 40
        assert thread["vote_bytes"] == device["vote_bytes"] == default["vote_bytes"]
    for rank in range(WORLD):
        dev = params(f"sel_{agg}_device{key}", rank)
        for label in ("default", "thread", "late") if overlapped else ("host", "default", "thread"):
            other = params(f"sel_{agg}_{label}{key}", rank)
            assert all(torch.equal(dev[k], other[k]) for k in dev)


# ------------------------------------------------------------------------------------ no host read (in-process)
@pytest.mark.parametrize(
    "agg, vote, path",
    [
        ("parameters", "exact", "device"),
        ("parameters", "exact", "thread"),
        ("parameters", "overlapped", "thread"),
        ("parameters", "overlapped", "device"),
        ("gradients", "exact", "device"),
        ("gradients", "exact", "thread"),
    ],
)
def test_selsync_reads_nothing_on_the_host_before_the_update(single_process, agg, vote, path):
    """Between the end of backward and the update. The driver-thread path (CUDA's) reads nothing in either vote order
    with parameter aggregation. The device tracker (accelerators other than CPU and CUDA) in the overlapped order
    reads one flag a step: whether the previous step's norm was finite, computed a step earlier, which its window
    needs before this step's update of it (the vote that carries it is read only after this step's update)."""
    import lightning.pytorch as pl

    from lightning_sync.data import DigitsDataModule
    from lightning_sync.launch import quiet_trainer_kwargs

    probe = ReadProbe()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy={"device": DeviceSelSync, "thread": ThreadSelSync}[path](
            delta=DELTA_MIXED, aggregation=agg, vote=vote
        ),
        max_steps=8,
        callbacks=[probe],
        **quiet_trainer_kwargs(limit_val_batches=0),
    )
    trainer.fit(ProbedCNN(), DigitsDataModule(batch_size=32))
    assert len(probe.per_step) == 8
    if agg == "parameters" and (vote == "exact" or path == "thread"):
        assert probe.per_step == [[]] * 8  # the vote is read after the update was launched
    elif agg == "parameters":
        assert probe.per_step == [[]] + [["__bool__"]] * 7  # the previous step's finite flag (the docstring)
    else:
        # gradient aggregation must know the vote before the update: one read per step (the documented cost)
        assert all(calls == ["tolist"] for calls in probe.per_step), probe.per_step
