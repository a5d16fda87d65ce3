"""In-process tests of lightning_sync.core.switch (Sync-Switch schedule, straggler detection, online policies)."""

import copy
import math
import random
from pathlib import Path

import pytest

from lightning_sync.core.switch import (
    PROTOCOLS,
    ElasticPolicy,
    GreedyPolicy,
    StragglerDetector,
    SwitchSchedule,
    ThroughputWindow,
)

# --------------------------------------------------------------------------------------------- SwitchSchedule

EXPECTED = ((("bsp", 0.25), ("asp", 1.0)),)


def test_protocols():
    assert PROTOCOLS == ("bsp", "asp")


@pytest.mark.parametrize(
    "value",
    [
        [("bsp", 0.25), ("asp", 1.0)],
        [["bsp", 0.25], ["asp", 1]],
        (("BSP", 0.25), ("Asp", 1.0)),
        [{"protocol": "bsp", "until": 0.25}, {"protocol": "asp", "until": 1.0}],
        "bsp:0.25,asp:1.0",
        " bsp : 0.25 , ASP:1 ",
        SwitchSchedule([("bsp", 0.25), ("asp", 1.0)]),
    ],
)
def test_parse_forms(value):
    sched = SwitchSchedule.parse(value)
    assert sched.segments == (("bsp", 0.25), ("asp", 1.0))
    assert all(type(end) is float for _, end in sched.segments)
    assert sched == SwitchSchedule([("bsp", 0.25), ("asp", 1.0)])


def test_parse_returns_schedule_as_is():
    sched = SwitchSchedule.switch_at(0.5)
    assert SwitchSchedule.parse(sched) is sched


@pytest.mark.parametrize("as_path", [True, False])
def test_parse_yaml_file(tmp_path, as_path):
    path = tmp_path / "sched.yaml"
    path.write_text("# a comment\nschedule:\n  - protocol: bsp\n    until: 0.4\n  - protocol: asp\n    until: 1.0\n")
    sched = SwitchSchedule.parse(path if as_path else str(path))
    assert sched.segments == (("bsp", 0.4), ("asp", 1.0))
    pairs = tmp_path / "pairs.yaml"
    pairs.write_text("schedule:\n- [bsp, 0.3]\n- [asp, 0.6]\n- [bsp, 1.0]\n")
    assert SwitchSchedule.parse(pairs).segments == (("bsp", 0.3), ("asp", 0.6), ("bsp", 1.0))


@pytest.mark.parametrize(
    "segments",
    [
        [("bsp", 0.25), ("asp", 1.0)],
        [("bsp", 1e-05), ("asp", 1.0)],  # repr '1e-05' is a string in YAML 1.1 unless written '1.0e-05'
        [("asp", 1.0)],
        [("bsp", 0.1), ("asp", 0.2), ("bsp", 1 / 3), ("asp", 1.0)],
    ],
)
@pytest.mark.parametrize("comment", [None, "found by binary search\nrun 3"])
def test_to_yaml_round_trip(tmp_path, segments, comment):
    sched = SwitchSchedule(segments)
    text = sched.to_yaml(comment)
    assert text.startswith("# found by binary search\n# run 3\nschedule:" if comment else "schedule:")
    path = tmp_path / "s.yaml"
    path.write_text(text)
    again = SwitchSchedule.parse(path)
    assert again == sched
    assert again.segments == sched.segments


def test_as_list_repr_eq_hash():
    sched = SwitchSchedule([("bsp", 0.25), ("asp", 1.0)])
    assert sched.as_list() == [["bsp", 0.25], ["asp", 1.0]]
    assert all(type(p) is list for p in sched.as_list())
    assert eval(repr(sched), {"SwitchSchedule": SwitchSchedule}) == sched
    assert sched != SwitchSchedule([("bsp", 0.5), ("asp", 1.0)])
    assert sched != "bsp:0.25,asp:1.0"
    assert len({sched, SwitchSchedule.parse("bsp:0.25,asp:1.0")}) == 1


def test_merges_consecutive_same_protocol():
    sched = SwitchSchedule([("bsp", 0.1), ("BSP", 0.3), ("asp", 0.5), ("asp", 1.0)])
    assert sched.segments == (("bsp", 0.3), ("asp", 1.0))


def test_protocol_at_boundaries():
    sched = SwitchSchedule([("bsp", 0.25), ("asp", 0.5), ("bsp", 1.0)])
    cases = {
        -1.0: ("bsp", 0.25),
        0.0: ("bsp", 0.25),
        0.2499: ("bsp", 0.25),
        0.25: ("asp", 0.5),  # segment i covers [end_{i-1}, end_i)
        0.4999: ("asp", 0.5),
        0.5: ("bsp", 1.0),
        0.99: ("bsp", 1.0),
        1.0: ("bsp", 1.0),  # 1.0 belongs to the last segment
        7.0: ("bsp", 1.0),
    }
    for progress, (protocol, boundary) in cases.items():
        assert sched.protocol_at(progress) == protocol, progress
        assert sched.next_boundary(progress) == boundary, progress
    with pytest.raises(ValueError, match="progress"):
        sched.protocol_at(float("nan"))


@pytest.mark.parametrize(
    "segments,bsp",
    [
        ([("bsp", 0.25), ("asp", 1.0)], 0.25),
        ([("asp", 1.0)], 0.0),
        ([("bsp", 1.0)], 1.0),
        ([("bsp", 0.25), ("asp", 0.5), ("bsp", 1.0)], 0.75),
        ([("asp", 0.2), ("bsp", 0.7), ("asp", 1.0)], 0.5),
    ],
)
def test_bsp_fraction(segments, bsp):
    assert SwitchSchedule(segments).bsp_fraction == pytest.approx(bsp, abs=1e-12)


def test_switch_at():
    assert SwitchSchedule.switch_at(0.3).segments == (("bsp", 0.3), ("asp", 1.0))
    assert SwitchSchedule.switch_at(1.0).segments == (("bsp", 1.0),)
    assert SwitchSchedule.switch_at(0).segments == (("asp", 1.0),)
    assert SwitchSchedule.switch_at(0.3).bsp_fraction == pytest.approx(0.3)
    for bad in (-0.1, 1.5, float("nan"), True, "0.5"):
        with pytest.raises(ValueError, match=r"fraction must be a number in \[0, 1\]"):
            SwitchSchedule.switch_at(bad)


@pytest.mark.parametrize(
    "segments,match",
    [
        ([], "non-empty sequence"),
        (None, "non-empty sequence"),
        ("bsp", "non-empty sequence"),
        ({"bsp": 1.0}, "non-empty sequence"),
        ([("bsp",)], r"pair"),
        ([("bsp", 0.5, 1.0)], r"pair"),
        (["bsp1"], r"pair"),
        ([("ssp", 1.0)], r"one of bsp, asp"),
        ([(1, 1.0)], r"one of bsp, asp"),
        ([("bsp", 0.0), ("asp", 1.0)], r"in \(0, 1\]"),
        ([("bsp", -0.5), ("asp", 1.0)], r"in \(0, 1\]"),
        ([("bsp", 0.5), ("asp", 1.5)], r"in \(0, 1\]"),
        ([("bsp", float("nan")), ("asp", 1.0)], r"in \(0, 1\]"),
        ([("bsp", float("inf"))], r"in \(0, 1\]"),
        ([("bsp", True)], r"in \(0, 1\]"),
        ([("bsp", "0.5"), ("asp", 1.0)], r"in \(0, 1\]"),
        ([("bsp", 0.5), ("asp", 0.5), ("bsp", 1.0)], "strictly increasing"),
        ([("bsp", 0.6), ("asp", 0.4), ("bsp", 1.0)], "strictly increasing"),
        ([("bsp", 0.25), ("asp", 0.9)], "must cover the whole run.*1.0"),
    ],
)
def test_bad_schedules(segments, match):
    with pytest.raises(ValueError, match=match) as info:
        SwitchSchedule(segments)
    assert str(info.value).startswith("schedule")


@pytest.mark.parametrize(
    "value,match",
    [
        ("bsp:0.25,ssp:1.0", "one of bsp, asp"),
        ("bsp:0.25,asp:0.9", "whole run"),
        ("bsp:abc,asp:1.0", "neither an existing YAML file nor a compact"),
        ("no/such/file.yaml", "neither an existing YAML file nor a compact"),
        ("", "neither"),
        (Path("/no/such/file.yaml"), "does not exist"),
        (3, "must be a SwitchSchedule"),
        ({"schedule": []}, "must be a SwitchSchedule"),
        ([{"protocol": "bsp"}], "keys 'protocol' and 'until'"),
        ([{"protocol": "bsp", "until": 1.0, "x": 1}], "keys 'protocol' and 'until'"),
        ([{"protocol": "bsp", "until": True}], r"in \(0, 1\]"),
    ],
)
def test_parse_bad_values(value, match):
    with pytest.raises(ValueError, match=match) as info:
        SwitchSchedule.parse(value)
    assert str(info.value).startswith("schedule")


@pytest.mark.parametrize(
    "text,match",
    [
        ("other: 1\n", "key 'schedule'"),
        ("- [bsp, 1.0]\n", "key 'schedule'"),
        ("schedule: bsp\n", "must be a SwitchSchedule"),
        ("schedule:\n- [bsp, true]\n", r"in \(0, 1\]"),
        ("schedule: [\n", "not valid YAML"),
    ],
)
def test_parse_bad_yaml_files(tmp_path, text, match):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as info:
        SwitchSchedule.parse(str(path))
    assert str(info.value).startswith("schedule")


# ------------------------------------------------------------------------------------------ ThroughputWindow


def test_throughput_window_tumbling():
    tw = ThroughputWindow(3)
    assert tw.record(10, 1.0) is None
    assert tw.record(20, 1.0) is None
    assert tw.record(30, 2.0) == pytest.approx(60 / 4.0)
    assert tw.last == pytest.approx(15.0)
    # a new window starts: the previous steps do not count
    assert tw.record(8, 1.0) is None
    assert tw.record(8, 1.0) is None
    assert tw.record(8, 2.0) == pytest.approx(6.0)


def test_throughput_window_one_step_and_zero_seconds():
    tw = ThroughputWindow(1)
    assert tw.record(32, 0.5) == pytest.approx(64.0)
    assert tw.record(32, 0.0) == math.inf


def test_throughput_window_reset_and_state():
    tw = ThroughputWindow(2)
    tw.record(10, 1.0)
    tw.reset()
    assert tw.record(10, 1.0) is None  # the reset dropped the partial window
    state = copy.deepcopy(tw.state_dict())
    other = ThroughputWindow(2)
    other.load_state_dict(state)
    assert other.record(30, 1.0) == pytest.approx(20.0)
    assert tw.record(30, 1.0) == pytest.approx(20.0)
    with pytest.raises(ValueError, match="window=2"):
        ThroughputWindow(3).load_state_dict(state)


@pytest.mark.parametrize("window", [0, -1, 1.5, True, None])
def test_throughput_window_bad_window(window):
    with pytest.raises(ValueError, match=r"window must be an integer >= 1"):
        ThroughputWindow(window)


def test_throughput_window_bad_record():
    tw = ThroughputWindow(2)
    with pytest.raises(ValueError, match="samples"):
        tw.record(-1, 1.0)
    with pytest.raises(ValueError, match="seconds"):
        tw.record(1, -1.0)
    with pytest.raises(ValueError, match="seconds"):
        tw.record(1, float("nan"))


# ----------------------------------------------------------------------------------------- StragglerDetector


@pytest.mark.parametrize("world_size", [3, 4, 8])
@pytest.mark.parametrize("consecutive", [1, 3, 5])
def test_detector_flags_x4_straggler_at_consecutive_window(world_size, consecutive):
    det = StragglerDetector(world_size, consecutive=consecutive)
    tputs = [100.0] * world_size
    tputs[world_size - 1] = 25.0
    for w in range(1, consecutive + 3):
        flagged = det.update(tputs)
        assert flagged == ({world_size - 1} if w >= consecutive else set()), w
        assert det.flagged == flagged
    assert det.windows == consecutive + 2
    assert det.history[0]["below"] == [world_size - 1]
    assert det.history[0]["window"] == 0
    mean = (100.0 * (world_size - 1) + 25.0) / world_size
    std = math.sqrt(((world_size - 1) * (100.0 - mean) ** 2 + (25.0 - mean) ** 2) / world_size)
    assert det.history[0]["mean"] == pytest.approx(mean)
    assert det.history[0]["std"] == pytest.approx(std)  # population std (ddof=0)
    assert det.history[0]["threshold"] == pytest.approx(min(mean - std, 0.8 * mean))


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_detector_equal_throughputs_never_flag(world_size):
    det = StragglerDetector(world_size, consecutive=1, margin=0.0)
    for _ in range(10):
        assert det.update([50.0] * world_size) == set()
    assert det.counters == [0] * world_size


@pytest.mark.parametrize("world_size", [3, 4, 8])
def test_detector_noise_never_flags(world_size):
    rng = random.Random(1234 + world_size)
    det = StragglerDetector(world_size, consecutive=1)
    for _ in range(200):
        assert det.update([100.0 * (1 + rng.uniform(-0.03, 0.03)) for _ in range(world_size)]) == set()
    assert all(not h["below"] for h in det.history)


def test_detector_margin_zero_is_paper_rule_and_flags_small_outlier():
    # S - sigma alone flags a worker only 3% slower; the margin is what prevents it
    paper = StragglerDetector(3, consecutive=1, margin=0.0)
    assert paper.update([100.0, 100.0, 97.0]) == {2}
    assert paper.history[-1]["threshold"] == pytest.approx(paper.history[-1]["mean"] - paper.history[-1]["std"])
    default = StragglerDetector(3, consecutive=1)
    assert default.update([100.0, 100.0, 97.0]) == set()
    assert default.history[-1]["threshold"] == pytest.approx(0.8 * 99.0)


def test_detector_two_workers_never_flagged():
    rng = random.Random(7)
    for margin in (0.0, 0.2):
        det = StragglerDetector(2, consecutive=1, margin=margin)
        assert det.update([100.0, 1.0]) == set()
        for _ in range(500):
            assert det.update([rng.uniform(1e-3, 1e6), rng.uniform(1e-3, 1e6)]) == set()
        assert det.counters == [0, 0]
    # two measured workers out of three are just as undecidable
    det = StragglerDetector(3, consecutive=1, margin=0.0)
    assert det.update([100.0, None, 1.0]) == set()


def test_detector_none_and_nan_are_ignored():
    det = StragglerDetector(4, consecutive=2, margin=0.0)
    assert det.update([100.0, 100.0, 100.0, 25.0]) == set()
    assert det.counters == [0, 0, 0, 1]
    # rank 3 unmeasured: its count stays 1; rank 0..2 equal -> nobody below
    assert det.update([100.0, 100.0, 100.0, None]) == set()
    assert det.counters == [0, 0, 0, 1]
    assert det.history[-1]["mean"] == pytest.approx(100.0)  # the unmeasured rank is not in S
    assert det.update([100.0, float("nan"), 100.0, 25.0]) == {3}
    assert det.history[-1]["mean"] == pytest.approx(75.0)  # NaN left out of S and sigma
    assert det.counters == [0, 0, 0, 2]
    # a flagged rank that is not measured stays flagged (its count is unchanged)
    assert det.update([100.0, 100.0, 100.0, None]) == {3}
    # infinite throughput (zero measured seconds) is "not measured" too
    assert det.update([100.0, 100.0, math.inf, 25.0]) == {3}
    assert det.counters == [0, 0, 0, 3]


def test_detector_fewer_than_two_measured():
    det = StragglerDetector(3, consecutive=1, margin=0.0)
    assert det.update([100.0, 100.0, 10.0]) == {2}
    assert det.update([None, None, 10.0]) == set()
    assert det.flagged == set()
    assert det.counters == [0, 0, 1]  # unchanged
    assert det.history[-1]["below"] == [] and det.history[-1]["mean"] is None
    assert det.windows == 2
    assert det.update([None, None, None]) == set()


def test_detector_counter_resets_when_worker_recovers():
    det = StragglerDetector(3, consecutive=3)
    slow, fine = [100.0, 100.0, 25.0], [100.0, 100.0, 100.0]
    assert det.update(slow) == set()
    assert det.update(slow) == set()
    assert det.update(fine) == set()  # recovered: the count restarts
    assert det.counters == [0, 0, 0]
    assert det.update(slow) == set()
    assert det.update(slow) == set()
    assert det.update(slow) == {2}
    assert det.update(fine) == set()  # a flagged worker that recovers is unflagged at once
    assert det.flagged == set()


def test_detector_accepts_tensor():
    torch = pytest.importorskip("torch")
    det = StragglerDetector(3, consecutive=1)
    assert det.update(torch.tensor([100.0, 100.0, 25.0])) == {2}


def test_detector_state_round_trip():
    det = StragglerDetector(4, consecutive=3)
    det.update([100.0, 100.0, 100.0, 25.0])
    det.update([100.0, 100.0, 100.0, 25.0])
    state = copy.deepcopy(det.state_dict())
    other = StragglerDetector(4, consecutive=3)
    other.load_state_dict(state)
    assert other.counters == det.counters == [0, 0, 0, 2]
    assert other.windows == 2 and other.history == det.history
    assert other.update([100.0, 100.0, 100.0, 25.0]) == {3}  # the third window flags it after resume
    assert other.history[-1]["window"] == 2
    with pytest.raises(ValueError, match="world_size=4"):
        StragglerDetector(3).load_state_dict(state)


def test_detector_bad_arguments():
    with pytest.raises(ValueError, match=r"world_size must be an integer >= 1"):
        StragglerDetector(0)
    with pytest.raises(ValueError, match=r"consecutive must be an integer >= 1"):
        StragglerDetector(3, consecutive=0)
    for margin in (-0.1, 1.0, float("nan"), True):
        with pytest.raises(ValueError, match=r"margin must be a number in \[0, 1\)"):
            StragglerDetector(3, margin=margin)
    det = StragglerDetector(3)
    with pytest.raises(ValueError, match="world_size=3"):
        det.update([1.0, 2.0])
    with pytest.raises(ValueError, match=r"throughputs\[1\]"):
        det.update([1.0, -2.0, 1.0])
    with pytest.raises(ValueError, match=r"throughputs\[2\]"):
        det.update([1.0, 2.0, "x"])
    with pytest.raises(ValueError, match="throughputs"):
        det.update(5.0)
    assert det.windows == 0


# --------------------------------------------------------------------------------------------- GreedyPolicy

# windows of a transient straggler: clear, rank 2 slow for 3 windows, clear, then the BSP quota is reached
TRANSIENT = [
    (100, 0.1, set()),
    (200, 0.2, {2}),
    (300, 0.2, {2}),
    (400, 0.2, {2}),
    (500, 0.3, set()),
    (600, 0.5, set()),
    (700, 0.5, {1}),
]


def test_greedy_transient_straggler_events():
    policy = GreedyPolicy(bsp_quota=0.5)
    protocol, used = "bsp", []
    for step, progress, stragglers in TRANSIENT:
        protocol = policy.decide(step, protocol, progress, stragglers)
        used.append(protocol)
    assert used == ["bsp", "asp", "asp", "asp", "bsp", "asp", "asp"]
    assert policy.events == [
        {"step": 200, "event": "straggler_switch_to_asp", "ranks": [2], "protocol": "asp"},
        {"step": 500, "event": "clear_switch_to_bsp", "ranks": [], "protocol": "bsp"},
        {"step": 600, "event": "quota_done", "ranks": [], "protocol": "asp"},
    ]


def test_greedy_overlapping_stragglers_and_no_event_without_change():
    policy = GreedyPolicy(0.5)
    assert policy.decide(0, "bsp", 0.0, set()) == "bsp"
    assert policy.decide(1, "bsp", 0.1, {3, 1}) == "asp"
    assert policy.decide(2, "asp", 0.1, {1, 2}) == "asp"  # already ASP: no second switch
    assert [e["ranks"] for e in policy.events] == [[1, 3]]
    # told it is in ASP with a clear cluster and quota not done -> back to BSP
    assert policy.decide(3, "ASP", 0.1, set()) == "bsp"
    assert [e["event"] for e in policy.events] == ["straggler_switch_to_asp", "clear_switch_to_bsp"]


def test_greedy_quota():
    policy = GreedyPolicy(0.25)
    assert not policy.quota_done(0.2)
    assert policy.quota_done(0.25 - 1e-12)
    assert policy.quota_done(0.3)
    assert policy.decide(5, "bsp", 0.25, {1}) == "asp"
    assert policy.decide(6, "asp", 0.25, set()) == "asp"
    assert policy.events == [{"step": 5, "event": "quota_done", "ranks": [], "protocol": "asp"}]
    zero = GreedyPolicy(0.0)
    assert zero.decide(0, "bsp", 0.0, set()) == "asp"


def test_greedy_state_round_trip():
    policy = GreedyPolicy(0.5)
    for step, progress, stragglers in TRANSIENT[:3]:
        policy.decide(step, "bsp", progress, stragglers)
    policy.decide(600, "asp", 0.5, set())
    state = copy.deepcopy(policy.state_dict())
    other = GreedyPolicy(0.5)
    other.load_state_dict(state)
    assert other.events == policy.events
    assert other.decide(700, "asp", 0.6, set()) == "asp"
    assert other.events == policy.events  # quota_done is not reported twice after a resume
    with pytest.raises(ValueError, match="bsp_quota"):
        GreedyPolicy(0.4).load_state_dict(state)


def test_greedy_bad_arguments():
    for quota in (-0.1, 1.1, float("nan"), None):
        with pytest.raises(ValueError, match=r"bsp_quota must be a number in \[0, 1\]"):
            GreedyPolicy(quota)
    policy = GreedyPolicy(0.5)
    with pytest.raises(ValueError, match="protocol must be one of bsp, asp"):
        policy.decide(0, "ssp", 0.0, set())
    with pytest.raises(ValueError, match="bsp_progress"):
        policy.decide(0, "bsp", -0.1, set())


# -------------------------------------------------------------------------------------------- ElasticPolicy


def test_elastic_transient_straggler_events():
    policy = ElasticPolicy(bsp_quota=0.5, world_size=4)
    decisions = [policy.decide(step, progress, stragglers) for step, progress, stragglers in TRANSIENT]
    assert decisions == [
        ("bsp", frozenset()),
        ("bsp", frozenset({2})),
        ("bsp", frozenset({2})),
        ("bsp", frozenset({2})),
        ("bsp", frozenset({2})),  # never re-admitted before the quota is done
        ("asp", frozenset()),
        ("asp", frozenset()),
    ]
    assert policy.events == [
        {"step": 200, "event": "exclude", "ranks": [2], "protocol": "bsp"},
        {"step": 600, "event": "quota_done_restore", "ranks": [2], "protocol": "asp"},
    ]
    assert policy.excluded == set()


def test_elastic_min_participants_refusal():
    policy = ElasticPolicy(0.5, world_size=4, min_participants=2)
    assert policy.decide(10, 0.1, {3, 1, 0}) == ("bsp", frozenset({0, 1}))
    assert policy.decide(20, 0.2, {3, 1, 0}) == ("bsp", frozenset({0, 1}))  # refusal reported once per rank
    assert policy.decide(30, 0.2, {2, 3}) == ("bsp", frozenset({0, 1}))
    assert policy.events == [
        {"step": 10, "event": "exclude", "ranks": [0, 1], "protocol": "bsp"},
        {"step": 10, "event": "exclude_refused", "ranks": [3], "protocol": "bsp"},
        {"step": 30, "event": "exclude_refused", "ranks": [2], "protocol": "bsp"},
    ]
    assert policy.decide(40, 0.5, set()) == ("asp", frozenset())
    assert policy.events[-1] == {"step": 40, "event": "quota_done_restore", "ranks": [0, 1], "protocol": "asp"}
    three = ElasticPolicy(0.5, world_size=3, min_participants=3)
    assert three.decide(0, 0.0, {1}) == ("bsp", frozenset())
    assert [e["event"] for e in three.events] == ["exclude_refused"]


def test_elastic_release():
    policy = ElasticPolicy(0.5, world_size=5)
    policy.decide(1, 0.1, {4})
    policy.decide(2, 0.1, {4, 3})
    assert policy.excluded == {3, 4}
    assert policy.release(3, "excluded worker timed out") == frozenset({3, 4})
    assert policy.excluded == set()
    assert policy.events[-1] == {
        "step": 3,
        "event": "release",
        "ranks": [3, 4],
        "protocol": "bsp",
        "reason": "excluded worker timed out",
    }
    assert policy.decide(4, 0.2, set()) == ("bsp", frozenset())  # released ranks stay admitted when clear
    assert policy.decide(5, 0.2, {3}) == ("bsp", frozenset({3}))  # and can be excluded again
    assert policy.decide(6, 0.6, set()) == ("asp", frozenset())
    assert policy.release(7, "late") == frozenset()
    assert policy.events[-1]["protocol"] == "asp"
    assert [e["event"] for e in policy.events] == [
        "exclude",
        "exclude",
        "release",
        "exclude",
        "quota_done_restore",
        "release",
    ]


def test_elastic_quota_done_once_without_exclusions():
    policy = ElasticPolicy(0.0, world_size=3)
    assert policy.decide(0, 0.0, {1}) == ("asp", frozenset())
    assert policy.decide(1, 0.0, {1}) == ("asp", frozenset())
    assert policy.events == [{"step": 0, "event": "quota_done_restore", "ranks": [], "protocol": "asp"}]


def test_elastic_state_round_trip():
    policy = ElasticPolicy(0.5, world_size=4, min_participants=3)
    policy.decide(1, 0.1, {2, 3})
    state = copy.deepcopy(policy.state_dict())
    other = ElasticPolicy(0.5, world_size=4, min_participants=3)
    other.load_state_dict(state)
    assert other.excluded == {2} and other.events == policy.events
    assert other.decide(2, 0.2, {2, 3}) == ("bsp", frozenset({2}))
    assert other.events == policy.events  # rank 3's refusal was already reported before the checkpoint
    assert other.decide(3, 0.5, set()) == ("asp", frozenset())
    assert other.events[-1]["ranks"] == [2]
    with pytest.raises(ValueError, match="world_size=4"):
        ElasticPolicy(0.5, world_size=5).load_state_dict(state)


def test_elastic_bad_arguments():
    with pytest.raises(ValueError, match=r"world_size must be an integer >= 1"):
        ElasticPolicy(0.5, world_size=0)
    with pytest.raises(ValueError, match=r"min_participants must be an integer >= 1"):
        ElasticPolicy(0.5, world_size=4, min_participants=0)
    with pytest.raises(ValueError, match=r"bsp_quota must be a number in \[0, 1\]"):
        ElasticPolicy(2.0, world_size=4)
    policy = ElasticPolicy(0.5, world_size=4)
    with pytest.raises(ValueError, match=r"straggler rank must be an integer in \[0, 3\]"):
        policy.decide(0, 0.1, {4})
    with pytest.raises(ValueError, match="step"):
        policy.decide(-1, 0.1, set())


def test_detector_feeds_policies():
    """End to end: throughputs -> detector (consecutive=2) -> greedy and elastic."""
    det = StragglerDetector(4, consecutive=2)
    greedy, elastic = GreedyPolicy(0.5), ElasticPolicy(0.5, world_size=4)
    protocol = "bsp"
    slow = [100.0, 100.0, 20.0, 100.0]
    fine = [100.0] * 4
    for i, tputs in enumerate([fine, slow, slow, slow, fine, fine]):
        flagged = det.update(tputs)
        protocol = greedy.decide(i, protocol, 0.1 * i, flagged)
        elastic.decide(i, 0.1 * i, flagged)
    assert [(e["step"], e["event"]) for e in greedy.events] == [
        (2, "straggler_switch_to_asp"),
        (4, "clear_switch_to_bsp"),
        (5, "quota_done"),
    ]
    assert [(e["step"], e["event"], e["ranks"]) for e in elastic.events] == [
        (2, "exclude", [2]),
        (5, "quota_done_restore", [2]),
    ]
