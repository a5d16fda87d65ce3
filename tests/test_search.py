"""Sync-Switch's offline timing search (Algorithm 1): the ask/tell class, the trial configurations and the
``lightning-sync search-switch`` command (one slow end-to-end test with real subprocess trainings)."""

from __future__ import annotations

import json
import sys

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from lightning_sync import search as search_cmd
from lightning_sync.core.search import SwitchSearch
from lightning_sync.core.switch import SwitchSchedule


def drive(search: SwitchSearch, accuracy) -> list[tuple[str, float]]:
    """Run the search to the end with ``accuracy(kind, fraction, run)``; the trials asked for, in order."""
    asked = []
    while (trial := search.next_trial()) is not None:
        asked.append(trial)
        search.record(accuracy(*trial, search.run_index))
    return asked


def knee(at: float, good: float = 0.95, bad: float = 0.80):
    """Converged accuracy monotone in the switch point: BSP until ``at`` or later reaches ``good``."""
    return lambda kind, fraction, run: good if fraction >= at else bad


def test_bsp_runs_set_the_target_then_binary_search():
    search = SwitchSearch(threshold=0.01, settings=3, runs=3)
    noise = [0.001, -0.001, 0.0]
    asked = drive(search, lambda kind, s, run: (0.95 if s >= 0.3 else 0.80) + noise[run])
    assert asked == [("bsp", 1.0)] * 3 + [("switch", 0.5)] * 3 + [("switch", 0.25)] * 3 + [("switch", 0.375)] * 3
    assert search.target == pytest.approx(0.95)
    assert search.done and search.result == 0.375
    assert [(t["kind"], t["fraction"], t["accepted"]) for t in search.trials] == [
        ("bsp", 1.0, None),
        ("switch", 0.5, True),
        ("switch", 0.25, False),
        ("switch", 0.375, True),
    ]
    assert search.trials[2]["accuracies"] == pytest.approx([0.801, 0.799, 0.80])
    assert search.trials[2]["mean"] == pytest.approx(0.80)


def test_given_target_skips_bsp_and_no_success_means_bsp_throughout():
    search = SwitchSearch(threshold=0.01, settings=2, runs=1, target=0.99)
    assert search.target == 0.99
    assert drive(search, knee(0.0)) == [("switch", 0.5), ("switch", 0.75)]  # 0.95 is never within 0.99 ± 0.01
    assert search.result == 1.0


def test_mean_above_the_band_is_rejected_as_printed():
    search = SwitchSearch(threshold=0.01, settings=1, runs=1, target=0.90)
    drive(search, knee(0.0, good=0.95))
    assert search.trials[0]["accepted"] is False and search.result == 1.0


def literal_listing(accuracy, threshold, settings, runs, target):
    """Algorithm 1 exactly as printed: alpha' initialised once (line 6) and never reset."""
    upper, lower, m, alpha = 100.0, 0.0, 0, 0.0
    while m < settings:
        s = (upper + lower) / 2
        for _ in range(runs):
            alpha += accuracy("switch", s / 100, 0)
        if target - threshold <= alpha / runs <= target + threshold:
            upper = s
        else:
            lower = s
        m += 1
    return upper / 100


def test_mean_is_per_setting_not_the_listings_running_sum():
    """Every switch point reaches the target, so each setting is accepted: 0.5, 0.25, 0.125. The listing as
    printed keeps adding to alpha', so its second mean is about twice the accuracy and is rejected."""
    always = knee(0.0, good=0.90)
    search = SwitchSearch(threshold=0.02, settings=3, runs=2, target=0.90)
    drive(search, always)
    assert [t["mean"] for t in search.trials] == pytest.approx([0.90, 0.90, 0.90])
    assert search.result == 0.125
    assert literal_listing(always, 0.02, 3, 2, 0.90) == 0.5  # the defect this class does not reproduce


@given(
    at=st.floats(min_value=0.001, max_value=1.0),
    settings=st.integers(1, 8),
    runs=st.integers(1, 3),
    with_target=st.booleans(),
)
def test_result_brackets_the_knee(at, settings, runs, with_target):
    search = SwitchSearch(threshold=0.01, settings=settings, runs=runs, target=0.95 if with_target else None)
    asked = drive(search, knee(at))
    assert len(asked) == runs * (settings + (not with_target))
    assert search.lower < at <= search.upper == search.result
    assert search.upper - search.lower == pytest.approx(2.0**-settings)
    assert all(0.0 < s < 1.0 for kind, s in asked if kind == "switch")


def test_ask_tell_protocol():
    search = SwitchSearch(threshold=0.05, settings=1, runs=2)
    assert search.target is None and search.run_index == 0
    with pytest.raises(RuntimeError, match="not finished"):
        _ = search.result
    assert search.next_trial() == search.next_trial() == ("bsp", 1.0)  # asking again does not advance
    state = search.record(0.9)
    assert state == {"kind": "bsp", "fraction": 1.0, "accuracies": [0.9], "mean": 0.9, "accepted": None}
    assert search.run_index == 1 and search.target is None
    search.record(0.8)
    assert search.target == pytest.approx(0.85) and search.run_index == 0
    assert search.record(0.85)["kind"] == "switch"  # record without asking: the pending trial is asked for
    search.record(0.85)
    assert search.next_trial() is None and search.result == 0.5
    with pytest.raises(RuntimeError, match="finished"):
        search.record(0.9)
    with pytest.raises(ValueError, match="accuracy"):
        SwitchSearch(0.1, 1, 1).record(float("nan"))


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"threshold": 0.0}, "threshold"),
        ({"threshold": -0.01}, "threshold"),
        ({"threshold": float("nan")}, "threshold"),
        ({"settings": 0}, "settings"),
        ({"settings": 1.5}, "settings"),
        ({"runs": 0}, "runs"),
        ({"target": float("inf")}, "target"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SwitchSearch(**{"threshold": 0.01, "settings": 3, "runs": 3, **kwargs})


@pytest.mark.parametrize(
    ("args", "name"),
    [
        (["--threshold", "0"], "threshold"),
        (["--threshold", "-1"], "threshold"),
        (["--threshold", "0.01", "--runs", "0"], "runs"),
        (["--threshold", "0.01", "--settings", "0"], "settings"),
        (["--threshold", "0.01", "--timeout", "0"], "timeout"),
        (["--threshold", "0.01", "--devices", "0"], "devices"),
    ],
)
def test_command_rejects_bad_arguments(tmp_path, capsys, args, name):
    config = tmp_path / "run.yaml"
    config.write_text("trainer: {max_epochs: 1}\n")
    with pytest.raises(SystemExit):
        search_cmd.main(["--config", str(config), "--out", str(tmp_path / "out"), *args])
    assert name in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing ran


SCHEDULE = [["bsp", 0.25], ["asp", 1.0]]

USER_CONFIG = {
    "seed_everything": 7,
    "trainer": {
        "devices": 2,
        "strategy": {
            "class_path": "lightning_sync.ASPStrategy",
            "init_args": {"shard_size": 1024, "process_group_backend": "gloo", "timeout": "0:02:00"},
        },
        "callbacks": [
            {"class_path": "lightning_sync.callbacks.SyncStats"},
            {"class_path": "lightning_sync.callbacks.SyncSwitch", "init_args": {"schedule": [["bsp", 1.0]]}},
            {"class_path": "lightning_sync.callbacks.EpochPrinter"},
        ],
        "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "runs", "name": "x"}},
    },
    "model": {"class_path": "lightning_sync.models.DigitsCNN"},
}


def test_trial_config_sets_strategy_and_replaces_the_schedule():
    original = json.dumps(USER_CONFIG)
    config = search_cmd.build_trial_config(USER_CONFIG, SCHEDULE, "out/trial_3", 2, {"max_epochs": 4})
    assert json.dumps(USER_CONFIG) == original  # the user's configuration is not modified
    trainer = config["trainer"]
    assert trainer["strategy"] == {
        "class_path": "lightning_sync.SyncSwitchStrategy",
        "init_args": {"process_group_backend": "gloo", "timeout": "0:02:00"},  # shard_size is ASP's own
    }
    assert trainer["callbacks"] == [
        {"class_path": "lightning_sync.callbacks.SyncStats"},
        {"class_path": "lightning_sync.callbacks.SyncSwitch", "init_args": {"schedule": SCHEDULE}},
        {"class_path": "lightning_sync.callbacks.EpochPrinter"},
    ]
    assert trainer["default_root_dir"] == "out/trial_3"
    assert trainer["logger"]["init_args"] == {"save_dir": "out/trial_3", "name": "x"}
    assert trainer["max_epochs"] == 4 and trainer["devices"] == 2
    assert config["seed_everything"] == 9 and config["model"] == USER_CONFIG["model"]
    assert yaml.safe_load(yaml.safe_dump(config)) == config  # the trial YAML round-trips ("0:02:00" stays a string)


def test_trial_config_edge_cases():
    own = {"class_path": "my.pkg.SyncSwitchStrategy", "init_args": {"link": "1gbit,1ms", "verify_sync": True}}
    assert search_cmd.trial_strategy(own) == own  # a SyncSwitchStrategy keeps all its init_args
    assert search_cmd.trial_strategy("ddp") == {"class_path": "lightning_sync.SyncSwitchStrategy"}
    assert search_cmd.trial_strategy("sync_switch") == {"class_path": "lightning_sync.SyncSwitchStrategy"}
    assert search_cmd.trial_strategy(None) == {"class_path": "lightning_sync.SyncSwitchStrategy"}
    entry = {"class_path": "lightning_sync.callbacks.SyncSwitch", "init_args": {"schedule": SCHEDULE}}
    assert search_cmd.trial_callbacks(None, SCHEDULE) == [entry]
    stats = {"class_path": "lightning_sync.callbacks.SyncStats"}
    assert search_cmd.trial_callbacks(stats, SCHEDULE) == [stats, entry]  # a single mapping
    two = [{"class_path": "lightning_sync.callbacks.SyncSwitch"}, stats, {"class_path": "x.SyncSwitch"}]
    assert search_cmd.trial_callbacks(two, SCHEDULE) == [entry, stats]  # exactly one SyncSwitch
    config = search_cmd.build_trial_config({"seed_everything": True, "trainer": {"logger": False}}, SCHEDULE, "o")
    assert config["seed_everything"] is True and config["trainer"]["logger"] is False


def test_run_trial_failures_and_metric(tmp_path):
    log = tmp_path / "t.log"
    assert search_cmd.run_trial([sys.executable, "-c", "print('fine')"], log) >= 0 and "fine" in log.read_text()
    with pytest.raises(RuntimeError, match=r"exit code 3(.|\n)*boom"):
        search_cmd.run_trial([sys.executable, "-c", "print('boom'); raise SystemExit(3)"], log)
    with pytest.raises(RuntimeError, match="timed out after 0.5 s"):
        search_cmd.run_trial([sys.executable, "-c", "import time; time.sleep(60)"], log, timeout=0.5)
    summary = tmp_path / "s.json"
    summary.write_text(json.dumps({"fit": {"val/acc": 0.5, "test/acc": 0.1}, "test": {"test/acc": 0.75}}))
    assert search_cmd.read_metric(summary, "test/acc") == 0.75
    assert search_cmd.read_metric(summary, "val/acc") == 0.5  # not tested: the end of fit
    with pytest.raises(RuntimeError, match="'test/ppl' is not in .*test/acc, val/acc"):
        search_cmd.read_metric(summary, "test/ppl")


def test_command_with_stand_in_trainings(tmp_path, monkeypatch, capsys):
    """The command's loop without training: each trial's "run" writes the summary its schedule earns."""

    def fake_run(cmd, log_path, timeout=None):
        config = yaml.safe_load(open(cmd[cmd.index("--config") + 1]))
        (schedule,) = [c["init_args"]["schedule"] for c in config["trainer"]["callbacks"] if "init_args" in c]
        bsp_until = schedule[0][1] if schedule[0][0] == "bsp" else 0.0
        accuracy = 0.95 if bsp_until >= 0.3 else 0.80
        summary = {"fit": {}, "test": {"test/acc": accuracy}}
        open(cmd[cmd.index("--summary_json") + 1], "w").write(json.dumps(summary))
        return 1.0

    monkeypatch.setattr(search_cmd, "run_trial", fake_run)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(USER_CONFIG))
    out = tmp_path / "out"
    result = search_cmd.main(["--config", str(config), "--threshold", "0.01", "--runs", "1", "--out", str(out)])
    assert result == 0.375
    report = json.loads((out / "search.json").read_text())
    assert [t["fraction"] for t in report["trials"]] == [1.0, 0.5, 0.25, 0.375]
    assert report["target"] == 0.95 and report["result"] == 0.375
    assert sorted(p.name for p in out.glob("trial_*.yaml")) == [f"trial_{i}.yaml" for i in range(1, 5)]
    assert SwitchSchedule.parse(str(out / "schedule.yaml")).as_list() == [["bsp", 0.375], ["asp", 1.0]]
    printed = capsys.readouterr().out
    assert "trial 3/4 switch at 0.2500: test/acc=0.8000" in printed and "-> rejected" in printed


TINY_CONFIG = {
    "seed_everything": 0,
    "trainer": {
        "accelerator": "cpu",
        "devices": 2,
        "max_epochs": 2,
        "limit_train_batches": 8,
        "limit_val_batches": 8,
        "limit_test_batches": 4,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "logger": False,
        "strategy": {
            "class_path": "lightning_sync.SyncSwitchStrategy",
            "init_args": {"process_group_backend": "gloo", "timeout": "0:02:00"},
        },
    },
    "model": {"class_path": "lightning_sync.models.DigitsCNN"},
    "data": {"class_path": "lightning_sync.data.DigitsDataModule", "init_args": {"batch_size": 32}},
}


@pytest.mark.timeout(900)
def test_slow_end_to_end_search_switch(tmp_path):
    """SLOW (3 real trainings, 2 processes each): ``lightning-sync search-switch`` with R=1, M=2. β=1 accepts
    every setting, so the result is deterministic: 0.5 then 0.25."""
    from lightning_sync.callbacks import SyncSwitch
    from lightning_sync.cli import main as cli_main

    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY_CONFIG))
    out = tmp_path / "search"
    args = ["--config", str(config), "--runs", "1", "--settings", "2", "--threshold", "1.0", "--out", str(out)]
    cli_main(["search-switch", *args, "--timeout", "400"])
    report = json.loads((out / "search.json").read_text())
    assert [(t["kind"], t["fraction"]) for t in report["trials"]] == [("bsp", 1.0), ("switch", 0.5), ("switch", 0.25)]
    assert all(0.0 <= t["accuracy"] <= 1.0 for t in report["trials"])
    assert report["result"] == 0.25 and report["target"] == report["trials"][0]["accuracy"]
    for i in (1, 2, 3):
        summary = json.loads((out / f"trial_{i}.json").read_text())
        assert summary["strategy"] == "SyncSwitchStrategy" and summary["world_size"] == 2
    schedule_path = out / "schedule.yaml"
    assert SwitchSchedule.parse(str(schedule_path)).as_list() == [["bsp", 0.25], ["asp", 1.0]]
    SyncSwitch(schedule=str(schedule_path))
