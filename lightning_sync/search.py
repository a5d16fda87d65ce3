"""``lightning-sync search-switch``: Sync-Switch's offline timing search (§IV-B1, Algorithm 1) on your own run.

Each trial is a real training: your LightningCLI YAML with the strategy set to ``SyncSwitchStrategy`` and a
``SyncSwitch`` callback holding the trial's schedule, run as ``lightning-sync fit`` in a subprocess. The search
(:class:`~lightning_sync.core.search.SwitchSearch`) picks the earliest BSP→ASP switch whose converged accuracy
stays within ``--threshold`` of the target, and writes it as a YAML snippet for the ``SyncSwitch`` callback.

    lightning-sync search-switch --config my_run.yaml --threshold 0.01 --runs 3 --settings 3
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from lightning_sync.core.search import SwitchSearch
from lightning_sync.launch import kill_session

STRATEGY_CLASS_PATH = "lightning_sync.SyncSwitchStrategy"
CALLBACK_CLASS_PATH = "lightning_sync.callbacks.SyncSwitch"
# init_args carried over from the user's own strategy (another class): the ones SyncSwitchStrategy accepts too.
KEPT_STRATEGY_ARGS = ("process_group_backend", "timeout", "link")
TAG = "[search-switch]"


def _class_name(entry: Any) -> str:
    """``SyncSwitch`` for ``{"class_path": "lightning_sync.callbacks.SyncSwitch"}``; ``""`` if not a class entry."""
    path = entry.get("class_path", "") if isinstance(entry, dict) else ""
    return str(path).rsplit(".", 1)[-1]


def trial_strategy(strategy: Any) -> dict[str, Any]:
    """The trial's ``trainer.strategy``: ``SyncSwitchStrategy``. A ``SyncSwitchStrategy`` (or ``"sync_switch"``)
    keeps all its ``init_args``; any other strategy passes on only :data:`KEPT_STRATEGY_ARGS`."""
    if strategy == "sync_switch":
        return {"class_path": STRATEGY_CLASS_PATH}
    init_args = dict(strategy.get("init_args") or {}) if isinstance(strategy, dict) else {}
    if _class_name(strategy) != "SyncSwitchStrategy":
        init_args = {k: v for k, v in init_args.items() if k in KEPT_STRATEGY_ARGS}
        strategy = {"class_path": STRATEGY_CLASS_PATH}
    result = {"class_path": strategy["class_path"]}
    if init_args:
        result["init_args"] = init_args
    return result


def trial_callbacks(callbacks: Any, schedule: list[list[Any]]) -> list[Any]:
    """The user's callbacks with exactly one ``SyncSwitch`` entry holding ``schedule``: it replaces the first
    existing one (keeping its other ``init_args``) or is appended; other callbacks are kept in order."""
    if callbacks is None:
        callbacks = []
    elif not isinstance(callbacks, list):
        callbacks = [callbacks]
    result: list[Any] = []
    replaced = False
    for callback in callbacks:
        if _class_name(callback) != "SyncSwitch":
            result.append(callback)
        elif not replaced:
            init_args = {**(callback.get("init_args") or {}), "schedule": schedule}
            result.append({"class_path": callback["class_path"], "init_args": init_args})
            replaced = True
    if not replaced:
        result.append({"class_path": CALLBACK_CLASS_PATH, "init_args": {"schedule": schedule}})
    return result


def _trial_logger(logger: Any, root_dir: str) -> Any:
    """Loggers given as class entries write under the trial's folder; ``False``/``True``/absent are kept."""
    if isinstance(logger, list):
        return [_trial_logger(item, root_dir) for item in logger]
    if isinstance(logger, dict) and "class_path" in logger:
        return {**logger, "init_args": {**(logger.get("init_args") or {}), "save_dir": root_dir}}
    return logger


def build_trial_config(
    base: dict[str, Any],
    schedule: list[list[Any]],
    root_dir: str,
    seed_offset: int = 0,
    trainer_overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One trial's LightningCLI configuration from the user's (``base`` is not modified).

    Sets ``trainer.strategy`` (:func:`trial_strategy`), ``trainer.callbacks`` (:func:`trial_callbacks`),
    ``trainer.default_root_dir`` and class-entry loggers' ``save_dir`` to ``root_dir``, and
    ``trainer_overrides`` (e.g. ``devices``). An integer ``seed_everything`` is shifted by ``seed_offset``, so the
    ``R`` runs of a setting differ and run ``r`` of every setting shares its seed."""
    config = copy.deepcopy(base)
    trainer = config.get("trainer") or {}
    config["trainer"] = trainer
    trainer["strategy"] = trial_strategy(trainer.get("strategy"))
    trainer["callbacks"] = trial_callbacks(trainer.get("callbacks"), schedule)
    trainer["default_root_dir"] = root_dir
    if "logger" in trainer:
        trainer["logger"] = _trial_logger(trainer["logger"], root_dir)
    trainer.update(trainer_overrides or {})
    seed = config.get("seed_everything")
    if isinstance(seed, int) and not isinstance(seed, bool):
        config["seed_everything"] = seed + seed_offset
    return config


def fit_command(config_path: Path, summary_path: Path) -> list[str]:
    """The ``lightning-sync fit`` command line of one trial."""
    return [
        sys.executable,
        "-m",
        "lightning_sync.cli",
        "fit",
        "--config",
        str(config_path),
        "--summary_json",
        str(summary_path),
    ]


def run_trial(cmd: list[str], log_path: Path, timeout: float | None = None) -> float:
    """Run one trial with its output in ``log_path``; its wall seconds. A failure or a timeout raises
    ``RuntimeError`` with the command and the tail of the output."""
    start = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if proc.poll() is None:
                kill_session(proc)
    if code != 0:
        what = f"timed out after {timeout:g} s" if code is None else f"failed with exit code {code}"
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-25:])
        raise RuntimeError(f"trial {what}: {shlex.join(cmd)}\n--- last lines of {log_path} ---\n{tail}")
    return time.perf_counter() - start


def read_metric(summary_path: Path, metric: str) -> float:
    """``metric`` from a run's summary JSON: its test value, else its value at the end of fit."""
    summary = json.loads(summary_path.read_text())
    for section in ("test", "fit"):
        if metric in summary.get(section, {}):
            return float(summary[section][metric])
    found = sorted({*summary.get("test", {}), *summary.get("fit", {})})
    raise RuntimeError(f"metric {metric!r} is not in {summary_path}; logged metrics: {', '.join(found) or 'none'}")


def _describe(kind: str, fraction: float) -> str:
    return "BSP throughout" if kind == "bsp" else f"switch at {fraction:.4f}"


def _run_line(index: int, total: int, run: dict[str, Any], state: dict[str, Any], runs: int, metric: str) -> str:
    """The progress line of a finished trial."""
    done = len(state["accuracies"])
    line = (
        f"{TAG} trial {index}/{total} {_describe(run['kind'], run['fraction'])}: {metric}={run['accuracy']:.4f} "
        f"mean={state['mean']:.4f} ({done}/{runs} runs) {run['seconds']:.1f}s"
    )
    if done == runs:
        verdict = {None: "target", True: "accepted", False: "rejected"}[state["accepted"]]
        line += f" -> {verdict}"
    return line


def trials_table(search: SwitchSearch) -> str:
    """One line per decided setting: kind, switch fraction, mean, verdict and the runs' accuracies."""
    lines = ["#        kind    switch  mean    verdict   accuracies"]
    for i, t in enumerate(search.trials):
        verdict = {None: "target", True: "accepted", False: "rejected"}[t["accepted"]]
        accuracies = " ".join(f"{a:.4f}" for a in t["accuracies"])
        lines.append(f"{i:<7}  {t['kind']:<6}  {t['fraction']:.4f}  {t['mean']:.4f}  {verdict:<8}  {accuracies}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-sync search-switch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="LightningCLI YAML of your run (model, data, trainer)")
    parser.add_argument("--threshold", type=float, required=True, help="β > 0: accepted margin around the target")
    parser.add_argument("--runs", type=int, default=3, help="R: runs per setting (default 3, as the paper recommends)")
    parser.add_argument("--settings", type=int, default=3, help="M: switch points to try (default 3)")
    parser.add_argument("--target-accuracy", type=float, default=None, help="A (default: the mean of R BSP runs)")
    parser.add_argument(
        "--metric",
        default="test/acc",
        help="converged metric: its test value, else its end-of-fit value (default test/acc)",
    )
    parser.add_argument(
        "--out", default="runs/search-switch", help="folder for trials, logs and results (default runs/search-switch)"
    )
    parser.add_argument("--devices", type=int, default=None, help="override trainer.devices")
    parser.add_argument("--max-epochs", type=int, default=None, help="override trainer.max_epochs")
    parser.add_argument("--schedule-out", default=None, help="schedule YAML to write (default: <out>/schedule.yaml)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per trial (default: no limit)")
    return parser


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> SwitchSearch:
    try:
        search = SwitchSearch(args.threshold, args.settings, args.runs, args.target_accuracy)
    except ValueError as err:
        parser.error(str(err))
    for name in ("devices", "max_epochs"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.timeout is not None and not args.timeout > 0:
        parser.error(f"--timeout must be > 0 seconds, got {args.timeout}")
    if not Path(args.config).is_file():
        parser.error(f"--config {args.config!r} is not a file")
    return search


def _load_config(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    config = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(config, dict):
        parser.error(f"--config {path!r} must hold a YAML mapping (a LightningCLI configuration)")
    return config


def _comment(argv: list[str], search: SwitchSearch, given_target: bool, metric: str) -> str:
    target = f"{search.target:.4f}" + ("" if given_target else f" (mean of {search.runs} BSP runs)")
    return "\n".join(
        [
            "lightning-sync search-switch " + shlex.join(argv),
            f"target A={target}, threshold β={search.threshold:g}, settings M={search.settings}, "
            f"runs R={search.runs}, metric {metric}",
            trials_table(search),
        ]
    )


def _run_trials(search: SwitchSearch, base: dict[str, Any], args: argparse.Namespace, report: dict[str, Any]) -> None:
    """Ask, train, tell until the search is done; ``search.json`` is rewritten after every trial."""
    from lightning_sync.core.switch import SwitchSchedule

    out = Path(args.out)
    overrides = {k: v for k, v in (("devices", args.devices), ("max_epochs", args.max_epochs)) if v is not None}
    total = args.runs * (args.settings + (args.target_accuracy is None))
    while (trial := search.next_trial()) is not None:
        kind, fraction = trial
        index = len(report["trials"]) + 1
        name = f"trial_{index}"
        schedule = SwitchSchedule.switch_at(fraction).as_list()
        config = build_trial_config(base, schedule, str(out / name), search.run_index, overrides)
        config_path, summary_path, log_path = (out / f"{name}{ext}" for ext in (".yaml", ".json", ".log"))
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        print(f"{TAG} trial {index}/{total} {_describe(kind, fraction)}: starting (log {log_path})", flush=True)
        seconds = run_trial(fit_command(config_path, summary_path), log_path, args.timeout)
        run = {"index": index, "kind": kind, "fraction": fraction, "config": str(config_path), "seconds": seconds}
        run["accuracy"] = read_metric(summary_path, args.metric)
        report["trials"].append(run)
        state = search.record(run["accuracy"])
        print(_run_line(index, total, run, state, args.runs, args.metric), flush=True)
        (out / "search.json").write_text(json.dumps({**report, "settings_tried": search.trials}, indent=2))


def main(argv: list[str] | None = None) -> float:
    """Run the search; returns the chosen switch fraction (``1.0``: BSP throughout)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    args = parser.parse_args(argv)
    search = _check_args(parser, args)
    base = _load_config(parser, args.config)
    from lightning_sync.core.switch import SwitchSchedule

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"command": ["lightning-sync", "search-switch", *argv], "config": args.config}
    report.update(metric=args.metric, threshold=args.threshold, settings=args.settings, runs=args.runs, trials=[])
    _run_trials(search, base, args, report)
    result = search.result
    schedule = SwitchSchedule.switch_at(result)
    schedule_path = Path(args.schedule_out) if args.schedule_out else out / "schedule.yaml"
    schedule_path.parent.mkdir(parents=True, exist_ok=True)
    comment = _comment(argv, search, args.target_accuracy is not None, args.metric)
    schedule_path.write_text(schedule.to_yaml(comment=comment))
    report.update(target=search.target, result=result, schedule=schedule.as_list(), settings_tried=search.trials)
    (out / "search.json").write_text(json.dumps(report, indent=2))
    print(f"\n{TAG} " + trials_table(search).replace("\n", f"\n{TAG} "))
    print(f"{TAG} chosen: {_describe('bsp' if result >= 1.0 else 'switch', result)} -> {schedule.as_list()}")
    print(f"{TAG} written: {schedule_path}, {out / 'search.json'}", flush=True)
    return result
