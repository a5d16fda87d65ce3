"""DiLoCo's outer optimizer and Streaming DiLoCo's schedule (``lightning_sync.core.outer``, ``core.streaming``):
in-process, no Lightning, no processes."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_sync.core.outer import DILOCO_OUTER, OuterOptimizer, OuterSGD, parse_outer_optimizer
from lightning_sync.core.streaming import FragmentSchedule, fragment_ranges

NESTEROV = {"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True}


# ------------------------------------------------------------------------------------------------ the spec
def test_spec_parses_to_outer_sgd_with_torch_defaults():
    assert parse_outer_optimizer(None) is None
    assert parse_outer_optimizer(DILOCO_OUTER) == OuterSGD(lr=0.7, momentum=0.9, nesterov=True)
    assert parse_outer_optimizer({"name": "sgd", "lr": 1}) == OuterSGD(lr=1.0, momentum=0.0, nesterov=False)
    assert parse_outer_optimizer(OuterSGD(0.5)) == OuterSGD(0.5)
    assert parse_outer_optimizer(OuterSGD(0.5, 0.9, True).spec()) == OuterSGD(0.5, 0.9, True)


@pytest.mark.parametrize(
    "spec,match",
    [
        ("sgd", r"outer_optimizer must be None \(plain averaging\) or a mapping"),
        ({"name": "sgd"}, r"outer_optimizer must give 'lr'"),
        ({"lr": 0.7}, r"outer_optimizer must give 'name'"),
        ({"name": "adam", "lr": 0.7}, r"outer_optimizer\['name'\] must be 'sgd'"),
        ({"name": "sgd", "lr": 0.7, "dampening": 0.1}, r"unknown keys \['dampening'\].*name, lr, momentum, nesterov"),
        ({"name": "sgd", "lr": 0.0}, re_ := r"outer_optimizer\['lr'\] must be a number in \(0.0, inf\)"),
        ({"name": "sgd", "lr": math.inf}, re_),
        ({"name": "sgd", "lr": True}, re_),
        (
            {"name": "sgd", "lr": 0.7, "momentum": 1.0},
            r"outer_optimizer\['momentum'\] must be a number in \[0.0, 1.0\)",
        ),
        (
            {"name": "sgd", "lr": 0.7, "momentum": -0.1},
            r"outer_optimizer\['momentum'\] must be a number in \[0.0, 1.0\)",
        ),
        ({"name": "sgd", "lr": 0.7, "nesterov": 1}, r"outer_optimizer\['nesterov'\] must be a bool"),
        ({"name": "sgd", "lr": 0.7, "nesterov": True}, r"nesterov'\] = True needs outer_optimizer\['momentum'\] in"),
    ],
)
def test_bad_specs_raise_naming_the_key_and_range(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_outer_optimizer(spec)


# ------------------------------------------------------------------------------------------------ the step
def test_lr_one_without_momentum_gives_the_mean_exactly():
    """Plain averaging: θ_prev − 1·(θ_prev − mean) = mean, bit for bit — also where computing it through Δ rounds
    (θ_prev large against the mean: (1e8 − 0.1) is not exact in float32)."""
    prev = torch.tensor([1e8, -3.0, 0.5, 7.25], dtype=torch.float32)
    mean = torch.tensor([0.1, 2.0, -1e-20, 7.0], dtype=torch.float32)
    assert not torch.equal(prev - (prev - mean), mean)  # the rounding the shortcut avoids
    outer = OuterOptimizer(parse_outer_optimizer({"name": "sgd", "lr": 1.0}), [prev])
    result = mean.clone()
    outer.step(result)
    assert torch.equal(result, mean) and torch.equal(outer.global_params[0], mean)
    assert outer.momentum_buffers == []  # no momentum: one persistent model-sized buffer only


def _hand_nesterov(prev: list[float], means: list[list[float]], lr: float, mu: float) -> list[list[float]]:
    """DiLoCo's outer step written out per element in Python floats (float64): Δ = θ − mean; b = μb + Δ;
    θ = θ − lr (Δ + μ b)."""
    theta, buf, out = list(prev), [0.0] * len(prev), []
    for mean in means:
        for j in range(len(theta)):
            delta = theta[j] - mean[j]
            buf[j] = mu * buf[j] + delta
            theta[j] = theta[j] - lr * (delta + mu * buf[j])
        out.append(list(theta))
    return out


def test_nesterov_step_equals_a_hand_computation_and_torch_sgd():
    prev = [1.0, -2.0, 0.5, 4.0]
    means = [[0.75, -1.5, 0.5, 3.0], [0.25, -1.0, 1.0, 3.5], [0.0, -1.25, 0.75, 2.0]]
    outer = OuterOptimizer(parse_outer_optimizer(NESTEROV), [torch.tensor(prev, dtype=torch.float64)])
    param = torch.nn.Parameter(torch.tensor(prev, dtype=torch.float64))
    reference = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True)
    hand = _hand_nesterov(prev, means, 0.7, 0.9)
    for t, mean in enumerate(means):
        mean_t = torch.tensor(mean, dtype=torch.float64)
        param.grad = outer.global_params[0] - mean_t  # the outer gradient Δ
        reference.step()
        got = mean_t.clone()
        outer.step(got)
        assert torch.equal(got, param.data), f"step {t}: differs from torch.optim.SGD"
        assert got.tolist() == pytest.approx(hand[t], abs=1e-15), f"step {t}: differs from the hand computation"
        assert torch.equal(outer.global_params[0], got)
    # the first step by hand: Δ = (0.25, -0.5, 0, 1), b = Δ, θ = θ − 0.7 · 1.9 Δ
    assert hand[0] == pytest.approx([1.0 - 1.33 * 0.25, -2.0 + 1.33 * 0.5, 0.5, 4.0 - 1.33], abs=1e-15)


@pytest.mark.parametrize("spec", [NESTEROV, {"name": "sgd", "lr": 0.5, "momentum": 0.8}, {"name": "sgd", "lr": 0.3}])
def test_matches_torch_sgd_bit_for_bit_over_many_steps_in_float32(spec):
    torch.manual_seed(0)
    config = parse_outer_optimizer(spec)
    prev = torch.randn(1000)
    outer = OuterOptimizer(config, [prev])
    param = torch.nn.Parameter(prev.clone())
    reference = torch.optim.SGD([param], lr=config.lr, momentum=config.momentum, nesterov=config.nesterov)
    buffers = [t.data_ptr() for t in outer.global_params + outer.momentum_buffers]
    for _ in range(20):
        mean = param.data + 0.01 * torch.randn(1000)
        param.grad = outer.global_params[0] - mean
        reference.step()
        outer.step(mean)
        assert torch.equal(mean, param.data)
    assert [t.data_ptr() for t in outer.global_params + outer.momentum_buffers] == buffers  # persistent, in place


def test_stepping_ranges_equals_stepping_the_whole_buffer():
    """Streaming DiLoCo steps one fragment (a contiguous range) at a time; the update is elementwise, so fragment by
    fragment equals the whole buffer at once, and a range step touches nothing outside it."""
    torch.manual_seed(1)
    prev, means = torch.randn(10), [torch.randn(10) for _ in range(3)]
    whole, parts = (OuterOptimizer(parse_outer_optimizer(NESTEROV), [prev]) for _ in range(2))
    for mean in means:
        a = mean.clone()
        whole.step(a)
        b = mean.clone()
        before = parts.global_params[0].clone()
        parts.step(b[:4], 0, 0)
        assert torch.equal(parts.global_params[0][4:], before[4:])
        parts.step(b[4:], 0, 4)
        assert torch.equal(a, b)
    assert torch.equal(whole.momentum_buffers[0], parts.momentum_buffers[0])
    with pytest.raises(ValueError, match="outside"):
        parts.step(torch.zeros(3), 0, 8)


def test_several_buffers_are_independent():
    outer = OuterOptimizer(parse_outer_optimizer(NESTEROV), [torch.ones(3), torch.zeros(2, dtype=torch.float64)])
    outer.step(torch.zeros(2, dtype=torch.float64), 1)
    assert torch.equal(outer.global_params[0], torch.ones(3)) and outer.global_params[1].dtype == torch.float64


def test_state_dict_round_trip_and_mismatches():
    torch.manual_seed(2)
    a = OuterOptimizer(parse_outer_optimizer(NESTEROV), [torch.randn(5)])
    a.step(torch.randn(5))
    state = a.state_dict()
    a.step(torch.randn(5))  # the saved state is a copy, not a view of the live buffers
    b = OuterOptimizer(parse_outer_optimizer(NESTEROV), [torch.zeros(5)])
    b.load_state_dict(state)
    c = OuterOptimizer(parse_outer_optimizer(NESTEROV), [torch.zeros(5)])
    c.load_state_dict(state)
    mean = torch.randn(5)
    x, y = mean.clone(), mean.clone()
    b.step(x)
    c.step(y)
    assert torch.equal(x, y) and b.steps == 2
    with pytest.raises(ValueError, match="resume with the same outer_optimizer"):
        OuterOptimizer(
            parse_outer_optimizer({"name": "sgd", "lr": 0.7, "momentum": 0.9}), [torch.zeros(5)]
        ).load_state_dict(state)
    with pytest.raises(ValueError, match="resume with the same model"):
        OuterOptimizer(parse_outer_optimizer(NESTEROV), [torch.zeros(6)]).load_state_dict(state)


def _hand_slowmo(prev: list[float], means: list[list[float]], rates: list[float], alpha: float, beta: float):
    """SlowMo's Algorithm 1 (Wang et al. 2020) per element in Python floats, the slow momentum in units of the inner
    learning rate γ: u = βu + Δ/γ; θ = θ − αγu."""
    theta, u, out = list(prev), [0.0] * len(prev), []
    for mean, gamma in zip(means, rates):
        for j in range(len(theta)):
            u[j] = beta * u[j] + (theta[j] - mean[j]) / gamma
            theta[j] = theta[j] - alpha * gamma * u[j]
        out.append(list(theta))
    return out


def test_inner_lr_scaling_equals_slowmo_in_inner_rate_units():
    """Under a schedule the outer momentum follows the inner rate (SlowMo's slow momentum): a hand computation of
    SlowMo's Algorithm 1 with rates falling tenfold and rising again; the same steps without the scaling differ."""
    prev = [1.0, -2.0, 0.5, 4.0]
    means = [[0.75, -1.5, 0.5, 3.0], [0.25, -1.0, 1.0, 3.5], [0.0, -1.25, 0.75, 2.0], [0.5, -1.0, 0.5, 2.5]]
    rates = [0.1, 0.01, 0.001, 0.05]
    hand = _hand_slowmo(prev, means, rates, alpha=1.0, beta=0.5)
    scaled, plain = (
        OuterOptimizer(
            parse_outer_optimizer({"name": "sgd", "lr": 1.0, "momentum": 0.5, **extra}),
            [torch.tensor(prev, dtype=torch.float64)],
        )
        for extra in ({}, {"inner_lr_scaling": False})
    )
    for t, (mean, rate) in enumerate(zip(means, rates)):
        a, b = (torch.tensor(mean, dtype=torch.float64) for _ in range(2))
        scaled.step(a, inner_lr=rate)
        plain.step(b, inner_lr=rate)
        assert a.tolist() == pytest.approx(hand[t], abs=1e-12), f"step {t}: differs from SlowMo by hand"
        if t > 0:
            assert not torch.allclose(a, b), f"step {t}: the scaling changed nothing"


@pytest.mark.parametrize("spec", [NESTEROV, {"name": "sgd", "lr": 0.5, "momentum": 0.8}])
def test_a_constant_inner_lr_keeps_torch_sgd_bit_for_bit(spec):
    torch.manual_seed(3)
    config = parse_outer_optimizer(spec)
    assert config.inner_lr_scaling  # the default
    prev = torch.randn(100)
    outer = OuterOptimizer(config, [prev])
    param = torch.nn.Parameter(prev.clone())
    reference = torch.optim.SGD([param], lr=config.lr, momentum=config.momentum, nesterov=config.nesterov)
    for _ in range(10):
        mean = param.data + 0.01 * torch.randn(100)
        param.grad = outer.global_params[0] - mean
        reference.step()
        outer.step(mean, inner_lr=0.05)
        assert torch.equal(mean, param.data)


def test_inner_rates_are_kept_per_range_and_survive_the_state_dict():
    """Streaming fragments keep their own previous rate; a checkpoint carries them, so the resumed step scales as
    the uninterrupted one."""
    torch.manual_seed(4)
    a = OuterOptimizer(parse_outer_optimizer(NESTEROV), [torch.randn(6)])
    a.step(torch.randn(3), 0, 0, inner_lr=0.1)
    a.step(torch.randn(3), 0, 3, inner_lr=0.2)
    assert a.inner_lrs == {(0, 0): 0.1, (0, 3): 0.2}
    b = OuterOptimizer(parse_outer_optimizer(NESTEROV), [torch.zeros(6)])
    b.load_state_dict(a.state_dict())
    assert b.inner_lrs == a.inner_lrs
    mean = torch.randn(3)
    x, y = mean.clone(), mean.clone()
    a.step(x, 0, 3, inner_lr=0.02)
    b.step(y, 0, 3, inner_lr=0.02)
    assert torch.equal(x, y)
    a.reset([torch.zeros(6)])
    assert a.inner_lrs == {}


def test_inner_lr_scaling_must_be_a_bool():
    with pytest.raises(ValueError, match=r"outer_optimizer\['inner_lr_scaling'\] must be a bool"):
        parse_outer_optimizer({**NESTEROV, "inner_lr_scaling": 1})
    assert not parse_outer_optimizer({**NESTEROV, "inner_lr_scaling": False}).inner_lr_scaling


def test_auto_outer_optimizer_follows_the_kind_of_inner_optimizer():
    """The paper's outer step over adaptive inner optimizers; plain averaging (None) over SGD and anything else (an
    outer momentum over SGD did not hold on an ordinary model, issue 51); SlowMo's step stays a spec."""
    from lightning_sync.core.outer import SLOWMO_OUTER, auto_outer_optimizer

    p = [torch.nn.Parameter(torch.zeros(2))]
    sgd, adamw, adam = torch.optim.SGD(p, lr=0.1, momentum=0.9), torch.optim.AdamW(p), torch.optim.Adam(p)
    assert auto_outer_optimizer([adamw])[0] == parse_outer_optimizer(DILOCO_OUTER)
    assert auto_outer_optimizer([adamw, adam])[0] == parse_outer_optimizer(DILOCO_OUTER)
    for inner in ([sgd], [sgd, adamw], [torch.optim.LBFGS(p)]):
        config, why = auto_outer_optimizer(inner)
        assert config is None and "plain averaging" in why and "issue 51" in why
    assert parse_outer_optimizer(SLOWMO_OUTER) == OuterSGD(lr=1.0, momentum=0.5)
    with pytest.raises(ValueError, match="needs the inner optimizer"):
        auto_outer_optimizer([])


# ------------------------------------------------------------------------------------------------ the schedule
def test_plain_diloco_syncs_after_every_h_inner_steps():
    s = FragmentSchedule(4)
    assert [k for k in range(13) if s.launched_after(k) is not None] == [3, 7, 11]
    assert [s.applied_after(k) for k in range(8)] == [None, None, None, 0, None, None, None, 0]


@pytest.mark.parametrize("h,k,tau", [(8, 4, 1), (6, 3, 0), (12, 4, 2), (5, 5, 0), (16, 2, 7)])
def test_every_fragment_is_launched_once_per_period_at_staggered_steps_and_applied_tau_later(h, k, tau):
    s = FragmentSchedule(h, k, tau)
    steps = 5 * h
    launches = [s.launched_after(i) for i in range(steps)]
    for f in range(k):
        at = [i for i, x in enumerate(launches) if x == f]
        assert at == list(range(s.offset(f), steps, h))  # once per period, from its own offset
        assert at[0] == (f + 1) * h // k - 1
        for i in range(steps):
            assert s.last_launch(f, i) == max((j for j in at if j <= i), default=None)
    # one fragment every H/K steps, in order
    assert [x for x in launches if x is not None][:k] == list(range(k))
    for i in range(steps):
        assert s.applied_after(i) == (launches[i - tau] if i >= tau else None)
    # at most one fragment in flight: the next launch comes after the previous application
    for i, f in enumerate(launches):
        if f is not None and tau:
            assert all(launches[j] is None for j in range(i + 1, min(i + tau + 1, steps)))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"sync_every": 0}, r"sync_every must be an integer >= 1"),
        ({"sync_every": 4, "fragments": 5}, r"fragments must be an integer in \[1, 4\]"),
        ({"sync_every": 6, "fragments": 4}, r"fragments must divide sync_every"),
        ({"sync_every": 8, "fragments": 2, "delay": 4}, r"delay must be an integer in \[0, 3\]"),
        ({"sync_every": 8, "delay": -1}, r"delay must be an integer in \[0, 7\]"),
    ],
)
def test_schedule_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FragmentSchedule(**kwargs)


def test_fragment_ranges_are_contiguous_balanced_and_cover_the_buffer():
    for numel, k in [(10, 3), (38378, 4), (7, 7), (100, 1)]:
        ranges = fragment_ranges(numel, k)
        assert ranges[0][0] == 0 and ranges[-1][1] == numel and len(ranges) == k
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        sizes = [e - s for s, e in ranges]
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    with pytest.raises(ValueError, match=r"fragments must be an integer in \[1, 3\]"):
        fragment_ranges(3, 4)
