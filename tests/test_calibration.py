"""SelSync's online threshold (``delta="auto"``): :class:`~lightning_sync.core.calibration.DeltaCalibrator`."""

from __future__ import annotations

import math
import random

import pytest

from lightning_sync.core.calibration import DeltaCalibrator


def test_warmup_syncs_every_step_then_the_threshold_is_a_quantile_of_the_window():
    cal = DeltaCalibrator(0.25, window=8, warmup=3)
    for value in (5.0, 1.0):
        assert cal.threshold() == 0.0
        cal.observe(value)
    assert cal.threshold() == 0.0  # 2 < warmup observations
    for value in (3.0, 8.0, 2.0, 7.0, 4.0, 6.0):
        cal.observe(value)
    # window [5, 1, 3, 8, 2, 7, 4, 6]: ceil(0.25 * 8) = 2 values pass, so delta is the second largest
    assert cal.threshold() == 7.0
    cal.observe(0.5)  # 5.0 leaves the window: [1, 3, 8, 2, 7, 4, 6, 0.5]
    assert cal.threshold() == 7.0
    cal.observe(9.0)  # [3, 8, 2, 7, 4, 6, 0.5, 9]
    assert cal.threshold() == 8.0


@pytest.mark.parametrize("fraction", [0.05, 0.25, 0.5, 0.9])
def test_a_stationary_stream_syncs_the_target_fraction(fraction):
    rng = random.Random(0)
    cal = DeltaCalibrator(fraction, window=100, warmup=10)
    synced = 0
    steps = 20_000
    for _ in range(steps):
        value = rng.lognormvariate(0.0, 1.0)
        synced += value >= cal.threshold()
        cal.observe(value)
    assert synced / steps == pytest.approx(fraction, abs=0.02 + 0.1 * fraction)


def test_fraction_one_syncs_every_step_and_nonfinite_values_always_sync():
    cal = DeltaCalibrator(1.0, window=4, warmup=0)
    for value in (3.0, 2.0, 1.0, 0.5, 0.25):
        assert value >= cal.threshold()
        cal.observe(value)
    cal = DeltaCalibrator(0.1, window=4, warmup=0)
    for value in (1.0, 2.0, math.nan, math.inf):
        cal.observe(value)
    assert cal.threshold() == math.inf  # the NaN entered as +inf; inf >= inf still syncs
    assert math.inf >= cal.threshold()


def test_state_round_trip_continues_identically():
    rng = random.Random(1)
    a = DeltaCalibrator(0.3, window=16, warmup=4)
    for _ in range(40):
        a.observe(rng.random())
    b = DeltaCalibrator(0.3, window=16, warmup=4)
    b.load_state_dict(a.state_dict())
    for _ in range(40):
        value = rng.random()
        assert a.threshold() == b.threshold()
        a.observe(value)
        b.observe(value)
    assert a.state_dict() == b.state_dict()
    with pytest.raises(ValueError, match="sync_fraction=0.3; this run uses sync_fraction=0.5"):
        DeltaCalibrator(0.5, window=16, warmup=4).load_state_dict(a.state_dict())


@pytest.mark.parametrize(
    "kwargs,name",
    [({"sync_fraction": 0.0}, "sync_fraction"), ({"sync_fraction": 1.5}, "sync_fraction"), ({"window": 0}, "window")],
)
def test_bad_arguments(kwargs, name):
    kwargs = {"sync_fraction": 0.5, **kwargs}
    with pytest.raises(ValueError, match=name):
        DeltaCalibrator(**kwargs)


def test_selsync_calibration_warmup_is_the_calibrators_and_only_with_an_online_delta():
    from lightning_sync import SelSyncStrategy
    from lightning_sync.core.calibration import CALIBRATION_WARMUP

    assert SelSyncStrategy()._new_calibrator().warmup == CALIBRATION_WARMUP
    calibrator = SelSyncStrategy(sync_fraction=0.5, calibration_warmup=2)._new_calibrator()
    assert calibrator.warmup == 2 and calibrator.sync_fraction == 0.5
    values = [0.4, 0.1, 0.3, 0.2]
    thresholds = []
    for v in values:  # two unconditional syncs (delta 0), then the window's median
        thresholds.append(calibrator.threshold())
        calibrator.observe(v)
    assert thresholds == [0.0, 0.0, 0.4, 0.3]
    with pytest.raises(ValueError, match="calibration_warmup applies to delta='auto' only"):
        SelSyncStrategy(delta=0.3, calibration_warmup=2)
    with pytest.raises(ValueError, match="calibration_warmup must be an integer in"):
        SelSyncStrategy(calibration_warmup=-1)
    assert SelSyncStrategy(delta=0.3).calibration_warmup is None
