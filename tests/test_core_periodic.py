"""In-process tests of lightning_sync.core.periodic (CPSGD, ADPSGD, FedAvg schedules): no processes."""

import copy
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sync.core.periodic import (
    ADPSGDController,
    ConstantPeriod,
    fedavg_participants,
    fedavg_sync_positions,
    mean_squared_deviation,
)

# --------------------------------------------------------------------------------------------- ConstantPeriod


@pytest.mark.parametrize(
    "period,warmup,expected",
    [
        (3, 0, [0, 3, 6, 9]),  # Alg. 1: k mod p == 0, first averaging after step 0
        (3, 2, [0, 1, 2, 5, 8]),
        (4, 5, [0, 1, 2, 3, 4, 5, 9]),
        (1, 0, list(range(10))),
        (1, 3, list(range(10))),
        (20, 0, [0]),
    ],
)
def test_constant_period_exact_steps(period, warmup, expected):
    cp = ConstantPeriod(period, warmup_steps=warmup)
    got = [k for k in range(10) if cp.should_average(k)]
    assert got == expected
    assert ConstantPeriod.count(10, period, warmup) == len(expected)


@pytest.mark.parametrize(
    "period,warmup,offset,expected",
    [
        (3, 0, 2, [2, 5, 8]),  # after every 3 local steps (torchft's LocalSGD, DiLoCo's sync_every)
        (3, 0, 1, [1, 4, 7]),
        (5, 0, 4, [4, 9]),  # epochs of 5 steps: every epoch ends on an averaging, none before the first ends
        (3, 2, 2, [0, 1, 4, 7]),  # the offset counts from the end of the warm-up
        (1, 0, 0, list(range(10))),
        (20, 0, 19, []),
    ],
)
def test_constant_period_offset_exact_steps(period, warmup, offset, expected):
    cp = ConstantPeriod(period, warmup_steps=warmup, offset=offset)
    got = [k for k in range(10) if cp.should_average(k)]
    assert got == expected
    assert ConstantPeriod.count(10, period, warmup, offset) == len(expected)


def test_constant_period_aligned_with_epochs():
    """offset=period-1 with the period dividing the epoch: the last step of every epoch averages, and the
    averagings are K/p (no warm-up spent lining them up; with offset 0 the same alignment took p-1 warm-up steps)."""
    steps_per_epoch, period, epochs = 20, 10, 3
    cp = ConstantPeriod(period, offset=period - 1)
    for epoch in range(epochs):
        assert cp.should_average((epoch + 1) * steps_per_epoch - 1)
    total = epochs * steps_per_epoch
    assert ConstantPeriod.count(total, period, 0, period - 1) == total // period
    aligned_by_warmup = ConstantPeriod.count(total, period, period - 1)
    assert aligned_by_warmup == total // period + period - 1


def test_constant_period_count_matches_brute_force():
    for num_steps in range(0, 41):
        for period in range(1, 8):
            for warmup in range(0, 7):
                for offset in range(period):
                    cp = ConstantPeriod(period, warmup, offset)
                    brute = sum(cp.should_average(k) for k in range(num_steps))
                    got = ConstantPeriod.count(num_steps, period, warmup, offset)
                    assert got == brute, (num_steps, period, warmup, offset)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"period": 0}, "period"),
        ({"period": -1}, "period"),
        ({"period": 2.0}, "period"),
        ({"period": True}, "period"),
        ({"period": 2, "warmup_steps": -1}, "warmup_steps"),
        ({"period": 2, "warmup_steps": 0.5}, "warmup_steps"),
        ({"period": 2, "offset": 2}, r"offset must be an integer in \[0, 1\]"),
        ({"period": 2, "offset": -1}, "offset"),
        ({"period": 1, "offset": 1}, r"offset must be an integer in \[0, 0\]"),
    ],
)
def test_constant_period_bad_args(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ConstantPeriod(**kwargs)


def test_constant_period_bad_step_and_count_args():
    with pytest.raises(ValueError, match="step"):
        ConstantPeriod(2).should_average(-1)
    with pytest.raises(ValueError, match="num_steps"):
        ConstantPeriod.count(-1, 2)
    with pytest.raises(ValueError, match="period"):
        ConstantPeriod.count(10, 0)
    with pytest.raises(ValueError, match="warmup_steps"):
        ConstantPeriod.count(10, 2, -3)
    with pytest.raises(ValueError, match="offset"):
        ConstantPeriod.count(10, 2, 0, 2)


# -------------------------------------------------------------------------------------------- ADPSGDController


def run_until_average(c: ADPSGDController, max_steps: int = 10_000) -> int:
    """Step until an averaging; return the number of steps taken."""
    for n in range(1, max_steps + 1):
        if c.step():
            return n
    raise AssertionError("no averaging")


def test_adpsgd_warmup_averages_every_step_without_statistic():
    c = ADPSGDController(p_init=4, warmup_steps=5, sample_steps=0)
    assert c.phase == "warmup" and c.period == 1
    for k in range(5):
        assert c.step() is True
        assert c.steps == k + 1
        assert c.phase == "warmup"
        assert c.period == 1
        assert c.since_sync == 0
        assert c.needs_statistic() is False
        c.observe(123.0, 0.1)  # a no-op during warm-up
        assert c.samples == 0 and c.c2 == 0.0 and c.last_s is None
    # Alg. 2 starts after the warm-up with cnt = 0 and p = p_init
    decisions = [c.step() for _ in range(4)]
    assert decisions == [False, False, False, True]
    assert c.period == 4
    assert c.phase == "sampling"
    assert c.needs_statistic() is True


def test_adpsgd_no_warmup_is_algorithm_2():
    c = ADPSGDController(p_init=3, warmup_steps=0, sample_steps=100)
    assert c.phase == "sampling" and c.period == 3
    decisions = [c.step() for _ in range(9)]
    assert decisions == [False, False, True] * 3


def test_adpsgd_sampling_keeps_p_and_averages_s_over_gamma():
    rng = random.Random(1)
    c = ADPSGDController(p_init=3, warmup_steps=0, sample_steps=30)
    ratios = []
    k = -1
    while True:
        if not c.step():
            continue
        k = c.steps - 1
        if k >= 30:
            break
        assert c.phase == "sampling" and c.needs_statistic()
        lr = 0.1 if k < 12 else (0.01 if k < 24 else 0.003)  # a changing learning rate
        s = rng.uniform(0.0, 5.0) * lr
        ratios.append(s / lr)
        c.observe(s, lr)
        assert c.period == 3
        assert c.last_s == s
        assert c.samples == len(ratios)
        assert c.c2 == pytest.approx(sum(ratios) / len(ratios), rel=1e-12)
    assert len(ratios) == 10  # averagings after steps 2, 5, ..., 29
    assert k == 32 and c.phase == "adaptive"


def sampled_controller(**kwargs) -> ADPSGDController:
    """A controller right after its sampling phase, with C2 = 2.0 (S/gamma = 2 at every sample)."""
    kwargs.setdefault("p_init", 4)
    kwargs.setdefault("sample_steps", 2 * kwargs["p_init"])  # two samples, ending on an averaging
    c = ADPSGDController(**kwargs)
    while c.steps < kwargs["sample_steps"]:
        if c.step() and c.needs_statistic():
            c.observe(2.0 * 0.1, 0.1)
    assert c.c2 == pytest.approx(2.0)
    assert c.since_sync == 0
    return c


def test_adpsgd_low_variance_increases_period_by_one_per_averaging():
    c = sampled_controller(max_period=64)
    lr = 0.05
    expected_p = 4
    for _ in range(10):
        gap = run_until_average(c)
        assert gap == expected_p  # step() is True exactly when cnt reaches p
        assert c.phase == "adaptive"
        c.observe(0.5 * lr * c.c2, lr)
        expected_p += 1
        assert c.period == expected_p


def test_adpsgd_high_variance_decreases_period_down_to_one():
    c = sampled_controller(p_init=6)
    lr = 0.2
    periods = []
    for _ in range(8):
        run_until_average(c)
        c.observe(1.5 * lr * c.c2, lr)
        periods.append(c.period)
    assert periods == [5, 4, 3, 2, 1, 1, 1, 1]
    assert [c.step() for _ in range(3)] == [True, True, True]


@pytest.mark.parametrize("factor", [0.7, 0.71, 1.0, 1.29, 1.3])
def test_adpsgd_in_between_keeps_period(factor):
    c = sampled_controller(p_init=5)
    lr = 0.03
    for _ in range(5):
        run_until_average(c)
        c.observe(factor * (lr * c.c2), lr)  # 0.7 and 1.3 exactly: strict comparisons (lines 16, 18)
        assert c.period == 5


def test_adpsgd_period_clamped_to_max_period():
    c = sampled_controller(p_init=3, max_period=5)
    for _ in range(6):
        run_until_average(c)
        c.observe(0.0, 0.1)
    assert c.period == 5
    assert run_until_average(c) == 5


def test_adpsgd_keeps_sampling_until_one_sample_exists():
    # warm-up ends after K_s: the first averaging after warm-up still samples C2
    c = ADPSGDController(p_init=4, warmup_steps=10, sample_steps=5)
    for _ in range(10):
        assert c.step()
    assert run_until_average(c) == 4
    assert c.steps - 1 == 13 >= c.sample_steps
    assert c.phase == "sampling"
    c.observe(0.3, 0.1)
    assert c.samples == 1 and c.c2 == pytest.approx(3.0) and c.period == 4
    assert c.phase == "adaptive"
    run_until_average(c)
    c.observe(0.1 * 0.1, 0.1)  # S/gamma = 0.1 < 0.7 * 3
    assert c.period == 5 and c.samples == 1

    # sample_steps == 0: the very first averaging samples, then it adapts
    c = ADPSGDController(p_init=2, sample_steps=0)
    run_until_average(c)
    assert c.phase == "sampling"
    c.observe(1.0, 0.5)
    assert c.c2 == 2.0 and c.period == 2 and c.phase == "adaptive"
    run_until_average(c)
    c.observe(100.0, 0.5)
    assert c.period == 1


def test_adpsgd_samples_at_least_min_samples_after_k_s():
    # K_s = 6 is reached after two averagings at p = 3; min_samples=4 keeps sampling for two more, at p_init
    c = ADPSGDController(p_init=3, sample_steps=6, min_samples=4)
    for expected in range(1, 5):
        assert run_until_average(c) == 3 and c.phase == "sampling"
        c.observe(0.1 * expected, 0.1)  # S/gamma = 1, 2, 3, 4
        assert c.samples == expected and c.period == 3
    assert c.c2 == pytest.approx(2.5) and c.phase == "adaptive"
    run_until_average(c)
    c.observe(0.1, 0.1)  # S/gamma = 1 < 0.7 * 2.5: adapts now
    assert c.period == 4 and c.samples == 4


def test_adpsgd_restores_a_checkpoint_from_before_min_samples_as_one_sample():
    a = ADPSGDController(p_init=3, sample_steps=6)
    state = a.state_dict()
    del state["min_samples"]
    ADPSGDController(p_init=3).load_state_dict(state)
    with pytest.raises(ValueError, match="min_samples"):
        ADPSGDController(p_init=3, min_samples=4).load_state_dict(state)


def test_adpsgd_zero_c2_keeps_period_while_s_is_zero():
    c = ADPSGDController(p_init=3, sample_steps=3)
    run_until_average(c)
    c.observe(0.0, 0.1)
    for _ in range(4):
        run_until_average(c)
        c.observe(0.0, 0.1)
        assert c.period == 3


@settings(max_examples=200, deadline=None)
@given(
    p_init=st.integers(1, 6),
    extra=st.integers(0, 6),
    warmup=st.integers(0, 15),
    sample_steps=st.integers(0, 40),
    events=st.lists(st.tuples(st.floats(0.0, 3.0), st.sampled_from([1.0, 0.1, 0.01, 0.5])), min_size=1, max_size=120),
)
def test_adpsgd_period_stays_in_range_and_gaps_match_period(p_init, extra, warmup, sample_steps, events):
    max_period = p_init + extra
    c = ADPSGDController(p_init=p_init, warmup_steps=warmup, sample_steps=sample_steps, max_period=max_period)
    events_iter = iter(events)
    gap = 0
    expected_period = p_init
    while True:
        predicted = c.averages_next()  # what a fault-tolerant run asks the quorum for, a step ahead
        averaged = c.step()
        assert predicted == averaged
        gap += 1
        k = c.steps - 1
        assert 1 <= c.period <= max_period
        if k < warmup:
            assert averaged and c.phase == "warmup" and not c.needs_statistic() and c.period == 1
            gap = 0
            continue
        assert c.period == expected_period
        assert c.since_sync == (0 if averaged else gap)
        if not averaged:
            assert gap < expected_period
            continue
        assert gap == expected_period
        gap = 0
        try:
            ratio, lr = next(events_iter)
        except StopIteration:
            break
        phase = c.phase
        before = c.period
        c.observe(ratio * lr * max(c.c2, 1.0), lr)
        assert 1 <= c.period <= max_period
        if phase == "sampling":
            assert c.period == p_init and c.samples >= 1
        else:
            assert abs(c.period - before) <= 1
        expected_period = c.period


def drive(c: ADPSGDController, rng: random.Random, num_steps: int) -> list:
    trace = []
    for _ in range(num_steps):
        predicted = c.averages_next()
        averaged = c.step()
        assert predicted == averaged
        if averaged and c.needs_statistic():
            lr = rng.choice([0.1, 0.05, 0.01])
            c.observe(rng.uniform(0.0, 2.0) * lr * (c.c2 or 1.0), lr)
        trace.append((averaged, c.period, c.c2, c.samples, c.since_sync, c.last_s, c.phase))
    return trace


def test_adpsgd_state_dict_round_trip_is_bit_for_bit():
    kwargs = {"p_init": 3, "warmup_steps": 7, "sample_steps": 40, "max_period": 12}
    a = ADPSGDController(**kwargs)
    drive(a, random.Random(0), 113)
    state = copy.deepcopy(a.state_dict())
    # as the strategy restores: warmup_steps / sample_steps come from the checkpoint
    b = ADPSGDController(p_init=3, max_period=12)
    b.load_state_dict(state)
    assert (b.warmup_steps, b.sample_steps) == (7, 40)
    assert b.state_dict() == a.state_dict()
    trace_a = drive(a, random.Random(5), 400)
    trace_b = drive(b, random.Random(5), 400)
    assert trace_a == trace_b
    assert a.state_dict() == b.state_dict()


def test_adpsgd_load_state_dict_rejects_other_config():
    a = ADPSGDController(p_init=3, sample_steps=10)
    with pytest.raises(ValueError, match="same ADPSGD arguments"):
        ADPSGDController(p_init=4, sample_steps=10).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="same ADPSGD arguments"):
        ADPSGDController(p_init=3, high=1.5).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="same ADPSGD arguments"):
        ADPSGDController(p_init=3, max_period=32).load_state_dict(a.state_dict())


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"p_init": 0}, "p_init"),
        ({"p_init": 65}, "p_init"),
        ({"p_init": 5, "max_period": 4}, "p_init"),
        ({"max_period": 0}, "max_period"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"sample_steps": -2}, "sample_steps"),
        ({"min_samples": 0}, "min_samples"),
        ({"min_samples": 1.5}, "min_samples"),
        ({"low": 0.0}, "low"),
        ({"low": -0.5}, "low"),
        ({"low": 1.3, "high": 1.3}, "low must be < high"),
        ({"low": 1.5, "high": 1.3}, "low must be < high"),
        ({"high": float("inf")}, "high"),
        ({"p_init": 2.5}, "p_init"),
    ],
)
def test_adpsgd_bad_args(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ADPSGDController(**kwargs)


@pytest.mark.parametrize(
    "s_k,lr,name",
    [
        (1.0, 0.0, "lr"),
        (1.0, -0.1, "lr"),
        (1.0, float("nan"), "lr"),
        (float("nan"), 0.1, "s_k"),
        (math.inf, 0.1, "s_k"),
    ],
)
def test_adpsgd_observe_bad_args(s_k, lr, name):
    c = ADPSGDController(p_init=1)
    c.step()
    with pytest.raises(ValueError, match=name):
        c.observe(s_k, lr)
    assert c.samples == 0


# ------------------------------------------------------------------------------------------------------- FedAvg


@pytest.mark.parametrize("world_size,fraction", [(16, 0.5), (10, 0.3), (10, 0.1), (7, 0.5), (4, 0.01), (5, 0.99)])
def test_fedavg_participants_size_sorted_distinct(world_size, fraction):
    expected = max(1, math.ceil(round(fraction * world_size, 9)))
    for r in range(50):
        ranks = fedavg_participants(world_size, fraction, seed=3, round_index=r)
        assert len(ranks) == expected == len(set(ranks))
        assert ranks == sorted(ranks)
        assert all(0 <= x < world_size for x in ranks)
        assert ranks == fedavg_participants(world_size, fraction, seed=3, round_index=r)


def test_fedavg_participants_float_fraction_does_not_add_a_rank():
    assert len(fedavg_participants(10, 0.1, 0, 0)) == 1
    assert len(fedavg_participants(10, 0.3, 0, 0)) == 3
    assert len(fedavg_participants(10, 0.7, 0, 0)) == 7
    assert len(fedavg_participants(3, 0.5, 0, 0)) == 2


def test_fedavg_participants_vary_over_rounds_and_seeds_and_cover_all_ranks():
    sets = {tuple(fedavg_participants(16, 0.5, 0, r)) for r in range(20)}
    assert len(sets) > 1
    assert fedavg_participants(16, 0.5, 0, 1) != fedavg_participants(16, 0.5, 1, 1) or (
        fedavg_participants(16, 0.5, 0, 2) != fedavg_participants(16, 0.5, 1, 2)
    )
    seen = set()
    for r in range(200):
        seen.update(fedavg_participants(8, 0.25, 7, r))
    assert seen == set(range(8))


def test_fedavg_participants_does_not_touch_global_rng():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    fedavg_participants(8, 0.5, 1, 2)
    assert torch.equal(torch.rand(3), expected)


def test_fedavg_participants_full_fraction_is_all_ranks():
    for n in (1, 2, 5, 16):
        assert fedavg_participants(n, 1.0, 123, 9) == list(range(n))
    assert fedavg_participants(1, 0.1, 0, 0) == [0]


@pytest.mark.parametrize(
    "args,name",
    [
        ((8, 0.0, 0, 0), "fraction"),
        ((8, -0.5, 0, 0), "fraction"),
        ((8, 1.5, 0, 0), "fraction"),
        ((8, float("nan"), 0, 0), "fraction"),
        ((8, True, 0, 0), "fraction"),
        ((0, 0.5, 0, 0), "world_size"),
        ((8, 0.5, 0, -1), "round_index"),
        ((8, 0.5, 0.5, 0), "seed"),
    ],
)
def test_fedavg_participants_bad_args(args, name):
    with pytest.raises(ValueError, match=name):
        fedavg_participants(*args)


@pytest.mark.parametrize(
    "spe,x,expected",
    [
        (100, 4, [25, 50, 75, 100]),
        (10, 3, [3, 7, 10]),
        (10, 4, [3, 5, 8, 10]),  # 2.5 and 7.5 round half up
        (5, 5, [1, 2, 3, 4, 5]),
        (7, 1, [7]),
    ],
)
def test_fedavg_sync_positions_examples(spe, x, expected):
    assert fedavg_sync_positions(spe, x) == expected


def test_fedavg_sync_positions_uniform_spacing():
    for spe in range(1, 60):
        for x in range(1, spe + 1):
            pos = fedavg_sync_positions(spe, x)
            assert len(pos) == x
            assert pos[-1] == spe
            assert all(b > a for a, b in zip(pos, pos[1:]))
            assert pos[0] >= 1
            assert all(abs(p - j * spe / x) <= 0.5 for j, p in enumerate(pos, start=1))
            if spe % x == 0:
                assert pos == [j * (spe // x) for j in range(1, x + 1)]


@pytest.mark.parametrize(
    "spe,x,name",
    [(10, 0, "syncs_per_epoch"), (10, 11, "syncs_per_epoch"), (10, 2.0, "syncs_per_epoch"), (0, 1, "steps")],
)
def test_fedavg_sync_positions_bad_args(spe, x, name):
    with pytest.raises(ValueError, match=name):
        fedavg_sync_positions(spe, x)


# ---------------------------------------------------------------------------------------- mean_squared_deviation


def test_mean_squared_deviation_is_population_variance_of_parameter_vectors():
    torch.manual_seed(0)
    w = torch.randn(4, 10, dtype=torch.float64)  # 4 ranks, 10 parameters each
    mean = w.mean(dim=0)
    per_rank = [float(((w[i] - mean) ** 2).sum()) for i in range(4)]
    s = mean_squared_deviation(sum(per_rank), 4)
    assert s == pytest.approx(float(w.var(dim=0, unbiased=False).sum()), rel=1e-12)
    assert mean_squared_deviation(6.0, 3) == 2.0
    assert mean_squared_deviation(0.0, 1) == 0.0
    with pytest.raises(ValueError, match="world_size"):
        mean_squared_deviation(1.0, 0)
    with pytest.raises(ValueError, match="sum_sq_dev"):
        mean_squared_deviation(-1.0, 2)
