"""The reference row: Lightning's own DDP under the pack's accounting and link emulation
(``lightning_sync.comm.ddp_hook``, ``CountedDDPStrategy``).

Two processes are started once for the module (``tests/launch.py``); each runs the hook on its own and several
``Trainer.fit`` calls, and writes what it observed; the tests assert on that.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from launch import run_suite

WORLD = 2
LINK = "80mbit,20ms"  # 10 MB/s: 1 MB costs 20 ms + 100 ms
NUMEL = 250_000  # 1 MB of float32
STEPS = 4


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    x = torch.ones(64, 64)
    while time.perf_counter() < end:
        x = x @ x * 1e-3


# ----------------------------------------------------------------------------------------------- worker side
def _suite(rank: int, out_dir: str) -> None:
    import json

    import lightning.pytorch as pl
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_sync.comm import CommStats, LinkModel
    from lightning_sync.comm.ddp_hook import DDPHookState, emulated_allreduce
    from lightning_sync.data import DigitsDataModule
    from lightning_sync.launch import quiet_trainer_kwargs
    from lightning_sync.models import DigitsCNN
    from lightning_sync.strategies import CountedDDPStrategy

    res: dict = {}
    dist.init_process_group("gloo")

    # 1. one bucket: the hook returns at once, work launched after it runs while the bucket is in flight, the future
    #    completes after latency + bytes / bandwidth, with the average
    stats = CommStats()
    state = DDPHookState(stats, LinkModel.parse(LINK))
    tensor = torch.full((NUMEL,), float(1 + 2 * rank))
    dist.barrier()
    launched = time.perf_counter()
    fut = emulated_allreduce(state, tensor, index=0, is_last=True)
    returned = time.perf_counter()
    _busy(0.03)  # work launched after the bucket
    worked = time.perf_counter()
    done_while_working = fut.done()
    value = fut.wait()
    completed = time.perf_counter()
    res["single"] = {
        "return_s": returned - launched,
        "worked_s": worked - launched,
        "done_while_working": done_while_working,
        "complete_s": completed - launched,
        "value": [float(value.min()), float(value.max())],
        "bytes": stats.bytes_sent["grads"],
        "blocked_s": stats.blocked_seconds["grads"],
    }

    # 2. two buckets launched together share the link: both complete after latency + 2 MB / bandwidth; the blocked
    #    time charged is from the last bucket's launch to the last completion
    stats = CommStats()
    state.close()
    state = DDPHookState(stats, LinkModel.parse(LINK))
    a, b = torch.ones(NUMEL), torch.ones(NUMEL)
    dist.barrier()
    launched = time.perf_counter()
    fa = emulated_allreduce(state, a, index=0, is_last=False)
    fb = emulated_allreduce(state, b, index=1, is_last=True)
    last_launch = time.perf_counter()
    fa.wait()
    first_done = time.perf_counter() - launched
    fb.wait()
    both_done = time.perf_counter()
    time.sleep(0.05)  # the completer thread charges the blocked time right after completing
    res["pair"] = {
        "first_s": first_done,
        "both_s": both_done - launched,
        "blocked_s": stats.blocked_seconds["grads"],
        "launch_to_done_s": both_done - last_launch,
        "gap_s": last_launch - launched,  # the second bucket went out at most this much after the first
        "iterations": state.iterations,
    }
    state.close()
    dist.destroy_process_group()

    # 3. Lightning fits: plain DDPStrategy, CountedDDPStrategy without and with a link: the same parameters; the
    #    bytes counted are the analytic count of the buckets DDP reports in its logging data
    logging_data: dict = {}

    class Grab(Callback):
        def on_train_end(self, trainer, pl_module):
            data = trainer.strategy.model._get_ddp_logging_data()
            logging_data.update({k: v for k, v in data.items() if "bucket" in k})

    def fit(strategy, callbacks=()):
        pl.seed_everything(0)
        model = DigitsCNN(hidden=1024)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=WORLD,
            strategy=strategy,
            max_steps=STEPS,
            limit_val_batches=0,
            callbacks=list(callbacks),
            **quiet_trainer_kwargs(),
        )
        trainer.fit(model, DigitsDataModule(batch_size=32))
        return trainer, [p.detach().clone() for p in model.parameters()]

    _, ddp_params = fit(DDPStrategy())
    trainer, counted_params = fit(CountedDDPStrategy(bucket_cap_mb=1), callbacks=[Grab()])
    counted = trainer.strategy
    bn_buffers = [b for b in trainer.lightning_module.buffers()]
    res["counted"] = {
        "metrics": counted.sync_metrics(),
        "bytes": dict(counted.comm_stats.bytes_sent),
        "logging": dict(logging_data),
        "buffer_payloads": sorted(
            {
                dt: sum(b.numel() * b.element_size() for b in bn_buffers if b.dtype == dt)
                for dt in {b.dtype for b in bn_buffers}
            }.values()
        ),
        "same_params_as_ddp": all(torch.equal(a, b) for a, b in zip(ddp_params, counted_params)),
    }
    start = time.perf_counter()
    trainer, link_params = fit(CountedDDPStrategy(link="100mbit,5ms", bucket_cap_mb=1))
    res["link"] = {
        "seconds": time.perf_counter() - start,
        "metrics": trainer.strategy.sync_metrics(),
        "same_params_as_ddp": all(torch.equal(a, b) for a, b in zip(ddp_params, link_params)),
    }
    Path(out_dir, f"res_rank{rank}.json").write_text(json.dumps(res))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_suite(_suite, WORLD, tmp_path_factory.mktemp("ddp_hook"))


# ----------------------------------------------------------------------------------------------- assertions
def test_hook_returns_at_once_and_completes_after_the_emulated_transfer(results):
    delay = 0.020 + 8 * 4 * NUMEL / 80e6  # latency + bytes / bandwidth (2 ranks: gloo's ring sends B bytes)
    for res in results:
        single = res["single"]
        assert single["bytes"] == 4 * NUMEL
        assert single["return_s"] < 0.05, single  # the hook does not block
        assert not single["done_while_working"], single  # work launched after the bucket ran while it was in flight
        assert single["worked_s"] < single["complete_s"]
        assert delay - 0.002 <= single["complete_s"] <= delay + 0.25, single  # sleep jitter tolerance
        assert single["value"] == [2.0, 2.0]  # (1 + 3) / 2: the average, as DDP's default hook
        assert delay - 0.03 - 0.002 <= single["blocked_s"] <= delay + 0.25  # blocked after its launch (minus the work)


def test_concurrent_buckets_share_the_link(results):
    both = 0.020 + 2 * 8 * 4 * NUMEL / 80e6  # fair share: each progresses at half the bandwidth
    for res in results:
        pair = res["pair"]
        # not 0.12 s: the two transfers share one link (the first one alone only until the second starts)
        assert pair["first_s"] >= both - pair["gap_s"] - 0.002 and pair["first_s"] > 0.12 + 0.05, pair
        assert both - 0.002 <= pair["both_s"] <= both + 0.25, pair
        assert pair["iterations"] == 1
        assert pair["blocked_s"] == pytest.approx(pair["launch_to_done_s"], abs=0.02)


def _gloo_bytes(sizes: str, rank: int) -> int:
    from lightning_sync.comm.cost import gloo_ring_allreduce_bytes

    return sum(gloo_ring_allreduce_bytes(int(s) // 4, 4, WORLD, rank) for s in sizes.split(","))


def test_ddp_bytes_equal_the_analytic_ring_count_of_its_buckets(results):
    for rank, res in enumerate(results):
        counted = res["counted"]
        logging = counted["logging"]
        assert logging["has_rebuilt_buckets"] == 1 and len(logging["rebuilt_bucket_sizes"].split(",")) >= 2
        # the first iteration reduces DDP's initial buckets, the others the buckets it rebuilt after it
        expected = _gloo_bytes(logging["bucket_sizes"], rank) + (STEPS - 1) * _gloo_bytes(
            logging["rebuilt_bucket_sizes"], rank
        )
        assert counted["bytes"]["grads"] == expected
        assert counted["metrics"]["sync_steps"] == STEPS and counted["metrics"]["lssr"] == 0.0
        # DDP broadcasts rank 0's BatchNorm buffers before every forward: one broadcast per dtype; rank 0 sends each
        # payload once to its one peer, rank 1 sends nothing
        per_forward = sum(counted["buffer_payloads"]) if rank == 0 else 0
        assert counted["bytes"]["buffers"] == STEPS * per_forward
        assert counted["metrics"]["bytes_sent"] == counted["bytes"]["grads"] + counted["bytes"]["buffers"]


def test_counted_ddp_is_lightnings_ddp_with_or_without_a_link(results):
    for res in results:
        assert res["counted"]["same_params_as_ddp"]
        assert res["link"]["same_params_as_ddp"]  # the emulation delays, it never changes the math
        assert res["link"]["metrics"]["bytes_grads"] == res["counted"]["metrics"]["bytes_grads"]
        # 100 Mbit/s: the gradients' transfer time is charged as blocked (a few ms of backward cannot hide it)
        transfer = 8 * res["link"]["metrics"]["bytes_grads"] / 100e6
        assert 0.8 * transfer <= res["link"]["metrics"]["blocked_s"] <= res["link"]["seconds"], res["link"]


def test_counted_ddp_rejects_a_second_hook_and_bad_links():
    from lightning_sync.strategies import CountedDDPStrategy

    with pytest.raises(ValueError, match="ddp_comm_hook is not accepted"):
        CountedDDPStrategy(ddp_comm_hook=lambda state, bucket: None)
    with pytest.raises(ValueError, match="model_averaging_period is not accepted"):
        CountedDDPStrategy(model_averaging_period=4)
    with pytest.raises(ValueError, match="link must be"):
        CountedDDPStrategy(link="fast")
    with pytest.raises(ValueError, match="record_buckets must be a bool"):
        CountedDDPStrategy(record_buckets=1)
    assert CountedDDPStrategy(link="1gbit,1ms").link.bits_per_second == 1e9


def test_ddp_is_registered_and_is_the_reference_row():
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_sync.benchmark.runs import resolve_strategy
    from lightning_sync.strategies import CountedDDPStrategy

    assert StrategyRegistry["ddp_counted"]["strategy"] is CountedDDPStrategy
    assert resolve_strategy("ddp") == ("ddp", "lightning_sync.strategies.ddp.CountedDDPStrategy", False)
