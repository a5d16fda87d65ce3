"""In-process tests of the paper math in lightning_sync.core (no processes, no Lightning)."""

import math
import random
import struct

import pytest
import torch

from lightning_sync.core import DeviceGradientChangeTracker, GradientChangeTracker, StepCounter, wants_sync


def direct_smoothed(values, window, alpha):
    tail = values[-window:]
    r = 1.0 - alpha
    num = sum(r**k * x for k, x in enumerate(reversed(tail)))
    den = sum(r**k for k in range(len(tail)))
    return num / den


def test_delta_on_hand_computed_sequence():
    # window 3, alpha 0.5 (weights 1, 1/2, 1/4 normalised over the values present)
    t = GradientChangeTracker(window=3, smoothing=0.5)
    # s1 = 4                              -> no previous value: delta 0
    # s2 = (2 + 4/2) / 1.5      = 8/3     -> |8/3 - 4| / 4          = 1/3
    # s3 = (8 + 2/2 + 4/4)/1.75 = 40/7    -> |40/7 - 8/3| / (8/3)   = 8/7
    # s4 = (4 + 8/2 + 2/4)/1.75 = 34/7    -> |34/7 - 40/7| / (40/7) = 3/20   (4 left the window)
    # s5 = (4 + 4/2 + 8/4)/1.75 = 32/7    -> |32/7 - 34/7| / (34/7) = 1/17
    expected = [0.0, 1 / 3, 8 / 7, 3 / 20, 1 / 17]
    got = [t.update(x) for x in [4.0, 2.0, 8.0, 4.0, 4.0]]
    assert got == pytest.approx(expected, rel=1e-12)
    assert t.smoothed == pytest.approx(32 / 7, rel=1e-12)


@pytest.mark.parametrize("window,alpha", [(1, 0.3), (5, 1.0), (25, 0.02), (25, 0.16), (7, 0.5)])
def test_recursive_ewma_matches_direct_formula(window, alpha):
    rng = random.Random(0)
    t = GradientChangeTracker(window=window, smoothing=alpha)
    values = []
    for _ in range(500):
        x = rng.uniform(0.1, 10.0) * (1 + 100 * (rng.random() < 0.01))
        values.append(x)
        t.update(x)
        assert t.smoothed == pytest.approx(direct_smoothed(values, window, alpha), rel=1e-9)


def test_window_one_is_unsmoothed():
    t = GradientChangeTracker(window=1, smoothing=0.3)
    t.update(2.0)
    assert t.update(3.0) == pytest.approx(0.5)
    assert t.update(1.5) == pytest.approx(0.5)


def test_nonfinite_votes_and_does_not_poison_window():
    t = GradientChangeTracker(window=4, smoothing=0.5)
    t.update(1.0)
    t.update(1.0)
    assert t.update(math.nan) == math.inf
    assert t.update(math.inf) == math.inf
    assert t.update(1.0) == pytest.approx(0.0)
    assert math.isfinite(t.smoothed)


def test_zero_previous_smoothed_value():
    t = GradientChangeTracker(window=1, smoothing=1.0)
    t.update(0.0)
    assert t.update(0.0) == 0.0
    assert t.update(1.0) == math.inf


def test_state_dict_resumes_same_trajectory():
    rng = random.Random(1)
    seq = [rng.uniform(0, 5) for _ in range(80)]
    a = GradientChangeTracker(window=25, smoothing=0.02)
    out_a = [a.update(x) for x in seq]
    b = GradientChangeTracker(window=25, smoothing=0.02)
    out_b = [b.update(x) for x in seq[:37]]
    c = GradientChangeTracker(window=25, smoothing=0.02)
    c.load_state_dict(b.state_dict())
    out_b += [c.update(x) for x in seq[37:]]
    assert out_a == out_b  # bit-for-bit, including the periodic exact recomputation
    with pytest.raises(ValueError, match="window"):
        GradientChangeTracker(window=24, smoothing=0.02).load_state_dict(b.state_dict())


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"window": 0}, "window"),
        ({"window": 2.5}, "window"),
        ({"smoothing": 0.0}, "smoothing"),
        ({"smoothing": 1.5}, "smoothing"),
    ],
)
def test_tracker_rejects_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        GradientChangeTracker(**kwargs)


def test_vote_logic():
    assert wants_sync(0.0, 0.0)  # delta = 0: always sync, first step included (BSP)
    assert wants_sync(0.3, 0.3)  # >= (Alg. 1 line 10)
    assert not wants_sync(0.29, 0.3)
    assert not wants_sync(0.0, 0.3)  # the first step's delta is 0: local unless delta == 0
    assert wants_sync(math.inf, math.inf)  # a non-finite gradient always asks for a sync
    assert not wants_sync(1e300, math.inf)


def test_step_counter_lssr():
    c = StepCounter()
    assert c.lssr == 0.0
    for synced in [True, False, False, False, True, False, False, False, False, False]:
        c.record(synced)
    assert (c.local_steps, c.sync_steps) == (8, 2)
    assert c.lssr == pytest.approx(8 / 10)  # Eq. 4
    d = StepCounter()
    d.load_state_dict(c.state_dict())
    assert d.lssr == c.lssr


# ----------------------------------------------------------------------- the device tracker (SelSync on the device)
_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _adversarial(seed: int, n: int) -> list[float]:
    """Squared norms over many magnitudes, with zeros, NaN, inf and values whose EWMA overflows to inf."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.03:
            out.append(math.nan)
        elif r < 0.06:
            out.append(math.inf)
        elif r < 0.10:
            out.append(0.0)
        elif r < 0.12:
            out.append(1e308)
        else:
            out.append(rng.uniform(0.0, 10.0) * 10.0 ** rng.randint(-6, 6))
    return out


def _same(a, b) -> bool:
    """Equal bits (NaN equals NaN), recursively through the state dicts."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or struct.pack("<d", a) == struct.pack("<d", b)
    return a == b and type(a) is type(b)


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("window", [1, 2, 3, 25, 40, 100])
@pytest.mark.parametrize("alpha", [1.0, 0.5, 0.02, 1e-9])
def test_device_tracker_is_bit_identical_to_the_host_tracker(device, window, alpha):
    host = GradientChangeTracker(window=window, smoothing=alpha)
    dev = DeviceGradientChangeTracker(window=window, smoothing=alpha, device=device)
    for i, x in enumerate(_adversarial(window * 1000 + int(alpha * 100), 260)):
        expected = host.update(x)
        delta, finite = dev.update(torch.tensor(x, dtype=torch.float64, device=device))
        assert delta.device.type == device and finite.device.type == device  # nothing moved to the host
        dev.commit(bool(finite))
        assert _same(float(delta), expected), (i, x, float(delta), expected)
        assert bool(finite) == math.isfinite(x)
    assert _same(dev.state_dict(), host.state_dict())


@pytest.mark.parametrize("device", _DEVICES)
def test_device_tracker_checkpoints_interchange_with_the_host_tracker(device):
    seq = _adversarial(7, 120)
    host = GradientChangeTracker(window=25, smoothing=0.02)
    out_host = [host.update(x) for x in seq]
    # device for 50 steps -> host for 30 -> device again: the same deltas, bit for bit
    dev = DeviceGradientChangeTracker(window=25, smoothing=0.02, device=device)
    out = [float(dev.update(torch.tensor(x, dtype=torch.float64, device=device))[0]) for x in seq[:50]]
    mid = GradientChangeTracker(window=25, smoothing=0.02)
    mid.load_state_dict(dev.state_dict())  # an uncommitted update is committed (reading its flag) by state_dict
    out += [mid.update(x) for x in seq[50:80]]
    end = DeviceGradientChangeTracker(window=25, smoothing=0.02, device=device)
    end.load_state_dict(mid.state_dict())
    for x in seq[80:]:
        delta, finite = end.update(torch.tensor(x, dtype=torch.float64, device=device))
        end.commit(bool(finite))
        out.append(float(delta))
    assert _same(out, out_host)
    assert _same(end.state_dict(), host.state_dict())
    with pytest.raises(ValueError, match="window"):
        DeviceGradientChangeTracker(window=24, smoothing=0.02).load_state_dict(host.state_dict())


def test_device_tracker_memory_follows_the_values_seen_not_the_window():
    dev = DeviceGradientChangeTracker(window=2**62, smoothing=0.5)  # a window no buffer could hold
    host = GradientChangeTracker(window=2**62, smoothing=0.5)
    for x in _adversarial(3, 100):
        delta, finite = dev.update(torch.tensor(x, dtype=torch.float64))
        dev.commit(bool(finite))
        assert _same(float(delta), host.update(x))
    assert dev._values.numel() <= 128
    state = dev.state_dict()
    dev.commit(True)  # already settled: nothing changes
    assert _same(dev.state_dict(), state)
