"""Parameter-server math in-process: sharding, the ASP/SSP/ALADDIN server rules, mixing, argument checks."""

from __future__ import annotations

import math
import re

import pytest
import torch

from lightning_sync import ALADDINStrategy, ASPStrategy, SSPStrategy
from lightning_sync.comm.ps import check_cpu
from lightning_sync.core.ps import ShardPlan, ShardServer, aladdin_alpha, check_alpha, mix_, per_push_alpha


# ----------------------------------------------------------------------------------------------- sharding
@pytest.mark.parametrize("total,world,max_shard", [(10, 3, 4), (1003, 3, 100), (7, 4, 100), (5, 8, 2), (64, 2, 64)])
def test_shard_plan_covers_the_vector_once_with_bounded_shards(total, world, max_shard):
    plan = ShardPlan(total, world, max_shard)
    covered = torch.zeros(total, dtype=torch.int64)
    for start, end in plan.shards:
        assert 0 < end - start <= max_shard
        covered[start:end] += 1
    assert bool((covered == 1).all())
    assert sum(plan.numel(r) for r in range(world)) == total
    assert plan.servers() == sorted(r for r in range(world) if plan.numel(r) > 0)


def test_shard_plan_spreads_a_large_layer_over_every_rank():
    # memory-wise sharding (ALADDIN §3.3): one 1000-element "layer" is served by all 4 ranks, at most 100 each shard
    plan = ShardPlan(1000, 4, 100)
    assert len(plan.shards) == 10 and plan.servers() == [0, 1, 2, 3]
    assert [plan.numel(r) for r in range(4)] == [300, 300, 200, 200]
    # with a large bound the vector is split evenly, one contiguous shard per rank
    plan = ShardPlan(1000, 4, 1 << 22)
    assert plan.shards == ((0, 250), (250, 500), (500, 750), (750, 1000))


def test_gather_scatter_round_trip():
    plan = ShardPlan(23, 3, 4)
    flat = torch.arange(23.0)
    out = torch.zeros(23)
    for r in range(3):
        packed = plan.gather(flat, r)
        assert packed.numel() == plan.numel(r)
        plan.scatter(packed, r, out)
    assert torch.equal(out, flat)


# ----------------------------------------------------------------------------------------------- ASP
def test_asp_server_applies_every_push_once_and_replies_at_once():
    server = ShardServer(torch.zeros(5), num_workers=3, mode="asp")
    total = torch.zeros(5)
    for i in range(30):
        delta = torch.full((5,), float(i % 7 - 3))
        total += delta
        replies = server.push(i % 3, delta, epoch=0, want_reply=True)
        assert [r.worker for r in replies] == [i % 3] and replies[0].alpha is None
    assert torch.equal(server.params, total)
    assert server.clocks == [10, 10, 10] and server.replies == [10, 10, 10]


# ----------------------------------------------------------------------------------------------- SSP
def test_ssp_holds_back_a_worker_more_than_s_ahead_until_the_slowest_catches_up():
    s = 2
    server = ShardServer(torch.zeros(1), num_workers=2, mode="ssp", staleness=s)
    # worker 0 runs ahead of worker 1 (clock 0): answered at clocks 1 and 2, held at 3
    for _ in range(1, s + 1):
        assert [r.worker for r in server.push(0, torch.ones(1), 0, True)] == [0]
    assert server.push(0, torch.ones(1), 0, True) == []  # clock 3, slowest 0: 3 > 2, held
    assert server.waiting == [0]
    # worker 1 reaches clock 1: it is answered, and worker 0 (3 - 1 <= 2) is released
    assert sorted(r.worker for r in server.push(1, torch.ones(1), 0, True)) == [0, 1]
    assert all(c - m <= s for _, c, m in server.pull_log)
    assert float(server.params) == 4.0


def test_ssp_worker_done_with_its_epoch_stops_holding_others_back():
    server = ShardServer(torch.zeros(1), num_workers=2, mode="ssp", staleness=0)
    assert [r.worker for r in server.push(0, torch.ones(1), 0, True)] == []  # 1 ahead of worker 1 at 0
    assert [r.worker for r in server.finish_epoch(1, 0)] == [0]  # worker 1 ran out of data in epoch 0
    # next epoch: worker 1 counts again
    assert server.push(0, torch.ones(1), 1, True) == []
    assert [r.worker for r in server.push(1, torch.ones(1), 1, True)] == [1]  # 1 at clock 1, 0 at 2: holds 0
    assert server.waiting == [0]
    assert sorted(r.worker for r in server.push(1, torch.ones(1), 1, True)) == [0, 1]


# ----------------------------------------------------------------------------------------------- ALADDIN
def test_aladdin_accumulates_lazily_and_replies_every_period_pushes_of_a_worker():
    period, n = 3, 2
    server = ShardServer(torch.zeros(2), num_workers=n, mode="aladdin", period=period)
    sent = {0: 0, 1: 0}
    for _ in range(12):
        for w in range(n):
            before = server.params.clone()
            replies = server.push(w, torch.ones(2), 0, want_reply=False)
            if replies:
                (r,) = replies
                assert r.worker == w
                sent[w] += 1
            else:
                assert torch.equal(server.params, before)  # lazy: nothing applied between triggers
    assert sent == {0: 12 // period, 1: 12 // period}
    # the view includes what is accumulated but not applied: every push counted exactly once, with weight 1/n
    assert torch.equal(server.view(), torch.full((2,), 24.0 / n))


def test_aladdin_per_push_alpha_is_one_minus_inverse_sqrt_of_accumulated_pushes():
    server = ShardServer(torch.zeros(1), num_workers=2, mode="aladdin", period=2)
    assert server.push(0, torch.ones(1), 0, False) == []  # c~=1, c_0=1
    assert server.push(1, torch.ones(1), 0, False) == []  # c~=2, c_1=1
    (reply,) = server.push(1, torch.ones(1), 0, False)  # c~=3, c_1=2: lazy update, alpha_1 = 1 - 1/sqrt(3)
    assert reply.worker == 1 and reply.alpha == pytest.approx(1 - 1 / math.sqrt(3))
    assert float(server.params) == 1.5 and server.pushes_since_update == 0  # (1 + 1 + 1) / n
    (reply,) = server.push(0, torch.ones(1), 0, False)  # c~=1 since the update, c_0=2
    assert reply.worker == 0 and reply.alpha == 0.0


def test_aladdin_sum_applies_the_listing_literally():
    server = ShardServer(torch.zeros(1), num_workers=4, mode="aladdin", period=1, aggregate="sum")
    server.push(0, torch.ones(1), 0, False)
    assert float(server.params) == 1.0  # weight 1, not 1/n


def test_alpha_formulas_and_mixing_arithmetic():
    assert aladdin_alpha(4, 4) == pytest.approx(1 - 1 / 4)  # §3.2: 1 - 1/sqrt(n*pi)
    assert aladdin_alpha(1, 1) == 0.0
    assert per_push_alpha(9) == pytest.approx(1 - 1 / 3)
    x, g = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([5.0, 6.0, 7.0])
    assert torch.allclose(mix_(x.clone(), g, 0.25), 0.75 * x + 0.25 * g)
    assert torch.equal(mix_(x.clone(), g, 1.0), g)


def test_server_state_round_trips():
    a = ShardServer(torch.zeros(3), num_workers=2, mode="aladdin", period=2)
    for i in range(5):
        a.push(i % 2, torch.full((3,), float(i)), 0, False)
    b = ShardServer(torch.zeros(3), num_workers=2, mode="aladdin", period=2)
    b.load_state_dict(a.state_dict())
    assert b.state_dict()["clocks"] == a.clocks and torch.equal(b.view(), a.view())
    with pytest.raises(ValueError, match="mode"):
        ShardServer(torch.zeros(3), num_workers=2, mode="asp").load_state_dict(a.state_dict())


# ----------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "factory,name",
    [
        (lambda: SSPStrategy(staleness=-1), "staleness"),
        (lambda: SSPStrategy(staleness=1.5), "staleness"),
        (lambda: ALADDINStrategy(period=0), "period"),
        (lambda: ALADDINStrategy(alpha=0.0), "alpha"),
        (lambda: ALADDINStrategy(alpha=1.5), "alpha"),
        (lambda: ALADDINStrategy(alpha=-0.2), "alpha"),
        (lambda: ALADDINStrategy(alpha="half"), "alpha"),
        (lambda: ALADDINStrategy(aggregate="median"), "aggregate"),
        (lambda: ASPStrategy(shard_size=0), "shard_size"),
        (lambda: ASPStrategy(injection=(0.5, 0.5)), "injection"),
        (lambda: ShardServer(torch.zeros(1), 2, mode="bsp"), "mode"),
        (lambda: ShardPlan(0, 2, 4), "total"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_argument(factory, name):
    with pytest.raises(ValueError, match=name):
        factory()


def test_alpha_accepts_the_documented_forms():
    assert check_alpha(None) is None and check_alpha("per_push") == "per_push" and check_alpha(1) == 1.0


def test_server_transport_rejects_non_cpu_tensors():
    # the server groups are gloo point-to-point: a CUDA (NCCL-only) tensor is an error, not a silent copy
    with pytest.raises(ValueError, match="CPU tensors over gloo"):
        check_cpu(torch.empty(2, device="meta"), "the pushed delta")


def test_update_scale_is_one_over_the_pushers_by_default():
    from lightning_sync.core.ps import update_scale_for, warmup_factor

    assert update_scale_for("auto", 1) == 1.0  # one worker: its step is DDP's step
    assert update_scale_for("auto", 4) == 0.25
    assert update_scale_for(1.0, 4) == 1.0 and update_scale_for(0.5, 4) == 0.5
    for bad in ("AUTO", 0, -1.0, math.nan, math.inf, True, None):
        with pytest.raises(ValueError, match="update_scale must be 'auto'"):
            update_scale_for(bad, 4)
    assert [warmup_factor(k, 4) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert warmup_factor(0, 0) == 1.0


def test_worker_momentum_auto_widens_the_gap_to_one_by_m_plus_one_over_two():
    from lightning_sync.core.ps import worker_momentum_for

    assert worker_momentum_for("auto", 0.9, 1) == pytest.approx(0.9)  # one worker: no asynchrony, DDP's momentum
    assert worker_momentum_for("auto", 0.9, 4) == pytest.approx(0.75)  # 1 - 0.1 * 5/2
    assert worker_momentum_for("auto", 0.9, 10) == pytest.approx(0.45)
    assert worker_momentum_for("auto", 0.9, 19) == pytest.approx(0.0, abs=1e-12)  # (0.9 is not exact in binary)
    assert worker_momentum_for("auto", 0.9, 64) == 0.0
    assert worker_momentum_for("auto", 0.0, 4) == 0.0  # no momentum stays none
    ms = [worker_momentum_for("auto", 0.99, m) for m in range(1, 40)]
    assert all(a >= b for a, b in zip(ms, ms[1:]))  # never more momentum for more workers
    assert worker_momentum_for(None, 0.9, 4) == 0.9  # the user's, unchanged
    assert worker_momentum_for(0.5, 0.9, 4) == 0.5
    message = re.escape("worker_momentum must be 'auto', None or a number in [0.0, 1.0)")
    for bad in ("AUTO", 1.0, -0.1, math.nan, True, "0.5"):
        with pytest.raises(ValueError, match=message):
            worker_momentum_for(bad, 0.9, 4)


def test_m_pushes_scaled_by_auto_move_the_server_as_one_averaged_step():
    """Per-sample step equivalence on a known state: m workers' steps -eta*g_i, each scaled by 1/m and added by an
    ASP server, move the global model exactly as DDP's one step -eta * mean(g_i)."""
    from lightning_sync.core.ps import update_scale_for

    m, eta = 4, 0.1
    x = torch.arange(6, dtype=torch.float64)
    grads = [torch.full((6,), float(i + 1), dtype=torch.float64) for i in range(m)]
    server = ShardServer(x.clone(), m, mode="asp")
    for i, g in enumerate(grads):
        server.push(i, -eta * g * update_scale_for("auto", m), epoch=0, want_reply=False)
    ddp = x - eta * torch.stack(grads).mean(0)
    assert torch.allclose(server.params, ddp, rtol=0, atol=1e-12)
