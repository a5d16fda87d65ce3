"""Golden trajectories (issue 58): the recorded values of ``tests/golden/golden.json`` replayed.

``benchmarks/golden.py record`` wrote, for every case of ``benchmarks/golden_cases.py`` (every strategy x {flat,
replica groups, fault-tolerant} x {fp32, bf16} where accepted), the final parameters of a short fixed fit and of the
fit resumed from its middle, the bytes and collectives per tag and the step counters, per rank. Here the cases run
again and must match within a tolerance that holds on any machine: parameter statistics within ``RTOL`` (relative
to their scale), byte and collective counts and step counters exactly (``benchmarks/golden.py``'s
``differences``). The bit-for-bit comparison against a reference commit on one machine is ``python
benchmarks/golden.py compare --ref <commit>``, run before a refactoring commit lands.

CI replays a representative subset (one launch of 2 ranks, one of 4: plain and compressed averaging, gradient and
parameter averaging, streaming DiLoCo's fragments in flight, Sync-Switch's BSP phase and switch,
replica groups; no decision that a threshold takes on floating-point data, so another machine's rounding cannot
flip one); ``LIGHTNING_SYNC_SLOW_TESTS=1`` replays every case, the fault-tolerant ones included.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import golden  # noqa: E402  (benchmarks/golden.py)
from golden_cases import CASES, FAULT_TOLERANT, GROUPED, METHODS, UNCOMPRESSED  # noqa: E402

SLOW = os.environ.get("LIGHTNING_SYNC_SLOW_TESTS") == "1"
SUBSET = (
    "bsp/flat/fp32",
    "localsgd/flat/bf16",
    "diloco/flat/bf16",
    "diloco_streaming/flat/fp32",
    "sync_switch/flat/bf16",
    "diloco/grouped/fp32",
)
REPLAYED = tuple(CASES) if SLOW else SUBSET


@pytest.fixture(scope="module")
def recorded() -> dict:
    return json.loads(golden.GOLDEN.read_text())


@pytest.fixture(scope="module")
def replayed() -> dict:
    return golden._run_here(list(REPLAYED))


@pytest.mark.parametrize("name", REPLAYED)
def test_case_replays_its_recorded_trajectory(recorded, replayed, name):
    rows = golden.check([name], recorded, replayed)
    assert not rows, "\n" + golden.table(rows, "recorded", "now")


def test_every_case_is_recorded_and_every_strategy_layout_has_cases(recorded):
    """The registry covers every strategy in every layout it accepts, and the JSON holds every case of it."""
    import lightning_sync.strategies as S

    assert set(recorded["cases"]) == set(CASES), "run: python benchmarks/golden.py record --cases ..."
    classes = {name: getattr(S, cls) for name, (cls, _) in METHODS.items()}
    assert {cls.strategy_name for cls in classes.values()} == {cls.strategy_name for cls in S.STRATEGIES}
    grouped = {m for m, cls in classes.items() if cls.replica_groups_refusal is None}
    assert grouped == set(GROUPED)
    assert {m for m, cls in classes.items() if cls.fault_tolerance_refusal is None} == set(FAULT_TOLERANT)
    refused = set()
    for method, (cls, kwargs) in METHODS.items():
        try:
            getattr(S, cls)(compression="bf16", **kwargs)
        except ValueError:
            refused.add(method)
    assert refused == set(UNCOMPRESSED)  # bf16 is left out exactly where the method refuses it
    for method in METHODS:
        precisions = {"fp32"} if method in UNCOMPRESSED else {"fp32", "bf16"}
        layouts = {(c.layout, c.precision) for c in CASES.values() if c.method == method}
        assert {("flat", p) for p in precisions} <= layouts or ("single", "fp32") in layouts
        if method in grouped:
            assert {("grouped", p) for p in precisions} <= layouts
        if method in FAULT_TOLERANT:
            assert ("ft", "fp32") in layouts


def test_recorded_runs_resume_exactly_where_deterministic(recorded):
    """A fit resumed from its middle ends bit-identical to the uninterrupted fit, with the same traffic, in every
    recorded case that records both (what ``tests/test_resume.py`` holds, here for every case of the registry)."""
    for name, entry in recorded["cases"].items():
        for rank in entry["ranks"]:
            if "resumed" in rank:
                assert rank["resumed"] == rank["full"], name


def test_the_tolerance_tells_a_rounding_difference_from_a_behaviour_change():
    params = {"sha256": "a", "n": 4, "sum": 1.0, "sum_abs": 3.0, "sum_sq": 2.5, "elements": [0.5, -1.0]}
    rec = {"ranks": [{"full": {"params": params, "bytes": {"grads": 100}, "ops": {"grads": 3}, "sync_steps": 2}}]}

    def changed(**kw) -> dict:
        new = json.loads(json.dumps(rec))
        full = new["ranks"][0]["full"]
        for key, value in kw.items():
            (full["params"] if key in params else full)[key] = value
        return new

    assert golden.differences(rec, changed(sha256="b", sum=1.0 + 1e-6), golden.RTOL) == []  # rounding: tolerated
    assert golden.differences(rec, changed(sha256="b"), None) != []  # bit for bit: any change of the bytes
    assert golden.differences(rec, changed(sum=1.0 + 1e-3), golden.RTOL) != []
    assert golden.differences(rec, changed(elements=[0.5, -1.001]), golden.RTOL) != []
    assert golden.differences(rec, changed(bytes={"grads": 101}), golden.RTOL) != []  # counts: exact
    assert golden.differences(rec, changed(sync_steps=3), golden.RTOL) != []
