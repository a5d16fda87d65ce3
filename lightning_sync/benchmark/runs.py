"""One row of a comparison and one run of it: which strategy with which arguments, the run's configuration (the
workload's base config plus an overlay this module writes), its ``lightning-sync fit`` command, running it, and
reading back what it recorded.

Every run is a real ``lightning-sync fit`` in a subprocess (processes launched by Lightning, or one per host on a
namespace cluster); nothing is simulated.
"""

from __future__ import annotations

import contextlib
import csv
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lightning_sync.benchmark.recipes import Recipe
from lightning_sync.benchmark.ttt import Outcome, lower_is_better, outcome, read_records

__all__ = [
    "FSDP2",
    "LIGHTNING_ROWS",
    "REFERENCE",
    "TIME_TO_TARGET",
    "Row",
    "RunResult",
    "Target",
    "apply_class_overrides",
    "base_lr",
    "build_command",
    "describe",
    "find_target",
    "finish_run",
    "make_row",
    "overlay",
    "resolve_strategy",
    "run_one",
    "slug",
]

#: the reference row's name: Lightning's DDPStrategy (as :class:`~lightning_sync.strategies.CountedDDPStrategy`)
REFERENCE = "ddp"
#: the row of Lightning's FSDP2 over all ranks: ``ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)``
#: (as :class:`~lightning_sync.strategies.CountedFSDP2Strategy`), the reference a user who shards a model runs today
FSDP2 = "fsdp2"
#: the rows that are Lightning's own strategies, measured (no codecs, variants or recipes)
LIGHTNING_ROWS = (REFERENCE, FSDP2)
TIME_TO_TARGET = "lightning_sync.benchmark.TimeToTarget"
_SYNC_STATS = "lightning_sync.callbacks.SyncStats"


def slug(text: str) -> str:
    """A file-system friendly name: ``"selsync (tuned)"`` -> ``"selsync-tuned"``, ``"1gbit,1ms"`` -> ``"1gbit-1ms"``."""
    return re.sub(r"[^A-Za-z0-9_.]+", "-", text).strip("-") or "none"


def resolve_strategy(name: str) -> tuple[str, str, bool]:
    """``(registered name, class path, counts through SyncStats)`` of a strategy name: ``ddp`` is Lightning's
    ``DDPStrategy`` measured (:class:`~lightning_sync.strategies.CountedDDPStrategy`), ``fsdp2`` Lightning's
    ``ModelParallelStrategy`` as FSDP2 over all ranks (:class:`~lightning_sync.strategies.CountedFSDP2Strategy`:
    the model's ``configure_model`` must shard over ``device_mesh["data_parallel"]``); any other name must be
    registered in Lightning's ``StrategyRegistry`` by a strategy of the pack (a ``SyncStrategy``), so a strategy
    added later is a row without a change here. Raises ``ValueError`` listing the names available."""
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_sync.strategies import CountedDDPStrategy, CountedFSDP2Strategy, SyncStrategy

    key = name.strip().replace("-", "_")  # "sync-switch" as the papers write it
    if key in LIGHTNING_ROWS:
        cls: type = CountedDDPStrategy if key == REFERENCE else CountedFSDP2Strategy
        return key, f"{cls.__module__}.{cls.__qualname__}", False
    ours = sorted(
        n
        for n in StrategyRegistry.available_strategies()
        if isinstance(StrategyRegistry[n]["strategy"], type)
        and issubclass(StrategyRegistry[n]["strategy"], SyncStrategy)
    )
    if key not in ours:
        raise ValueError(
            f"unknown or not yet implemented strategy {name!r}; available: {', '.join([*LIGHTNING_ROWS, *ours])} "
            f"({REFERENCE}: Lightning's DDPStrategy, the reference row; {FSDP2}: Lightning's ModelParallelStrategy, "
            "FSDP2 over all ranks)"
        )
    cls = StrategyRegistry[key]["strategy"]
    return key, f"{cls.__module__}.{cls.__qualname__}", True


@dataclass
class Row:
    """One row of the table: a strategy with its arguments (default, or a recipe's)."""

    label: str
    strategy: str
    class_path: str
    sync_stats: bool
    init_args: dict[str, Any] = field(default_factory=dict)  #: typed, from a recipe
    cli_args: list[str] = field(default_factory=list)  #: ``KEY=VALUE`` from ``--strategy-arg``
    extra: list[str] = field(default_factory=list)  #: further ``fit`` arguments (a recipe's, its learning rate)
    tuned: bool = False
    error: str = ""  #: why the row cannot run (an unknown strategy): reported in the table
    #: further ``TimeToTarget`` arguments for this row's runs (``compare --project-ddp``'s step-timing runs:
    #: ``stop=False``, ``record_steps=True``)
    ttt_args: dict[str, Any] = field(default_factory=dict)
    #: ``fit`` arguments after ``compare``'s pass-through ones, so that they win over them (a step-timing run's
    #: length: ``--trainer.max_epochs=1 --trainer.limit_train_batches=N``)
    last: list[str] = field(default_factory=list)


def make_row(
    name: str, cli_args: list[str] | None = None, recipe: Recipe | None = None, lr: float | None = None
) -> Row:
    """The default row of ``name``, or its tuned row from ``recipe`` (``lr``: the base config's learning rate, needed
    when the recipe scales it)."""
    strategy, class_path, sync_stats = resolve_strategy(name)
    row = Row(
        label=strategy, strategy=strategy, class_path=class_path, sync_stats=sync_stats, cli_args=list(cli_args or [])
    )
    if recipe is None:
        return row
    if resolve_strategy(recipe.strategy)[0] != strategy:
        raise ValueError(f"recipe {recipe.source} is for {recipe.strategy!r}, not {name!r}")
    row.label = f"{strategy} (tuned)"
    row.tuned = True
    row.init_args = dict(recipe.init_args)
    row.extra = list(recipe.args)
    if recipe.lr_scale is not None:
        if lr is None:
            raise ValueError(f"recipe {recipe.source} scales the learning rate, but the model has no 'lr' argument")
        row.extra.append(f"--model.init_args.lr={lr * recipe.lr_scale!r}")
    return row


# ---------------------------------------------------------------------------------------------- configuration
@dataclass(frozen=True)
class Target:
    """The quality target of a workload: a validation metric, the value to reach and its direction."""

    metric: str
    value: float
    mode: str  #: "max" or "min"

    def describe(self) -> str:
        return f"{self.metric} {'>=' if self.mode == 'max' else '<='} {self.value:g}"


def load_config(path: str | Path) -> dict[str, Any]:
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"config {path}: expected a mapping (a LightningCLI YAML)")
    return data


def _callbacks(config: dict[str, Any]) -> list[Any]:
    callbacks = (config.get("trainer") or {}).get("callbacks") or []
    return list(callbacks) if isinstance(callbacks, list) else [callbacks]


def _class_path(entry: Any) -> str:
    return entry.get("class_path", "") if isinstance(entry, dict) else str(entry)


def _is(entry: Any, class_path: str) -> bool:
    cp = _class_path(entry)
    return cp == class_path or cp.split(".")[-1] == class_path.split(".")[-1]


def find_target(config: dict[str, Any], metric: str | None = None, value: float | None = None) -> Target:
    """The target named by the config's ``TimeToTarget`` callback, with ``metric``/``value`` overriding it; without
    such a callback both must be given. ``ValueError`` says what is missing."""
    entries = [c for c in _callbacks(config) if _is(c, TIME_TO_TARGET)]
    if len(entries) > 1:
        raise ValueError("the config lists TimeToTarget more than once; name one target")
    args = dict((entries[0].get("init_args") or {}) if entries and isinstance(entries[0], dict) else {})
    metric = metric or args.get("metric")
    value = value if value is not None else args.get("target")
    if not metric or value is None:
        raise ValueError(
            "the config names no target: add a lightning_sync.benchmark.TimeToTarget callback (metric, target) to "
            "trainer.callbacks, or pass --metric and --target"
        )
    mode = args.get("mode", "auto") if args.get("metric") == metric else "auto"
    if mode == "auto":
        mode = "min" if lower_is_better(metric) else "max"
    if mode not in ("max", "min"):
        raise ValueError(f"TimeToTarget mode must be 'auto', 'max' or 'min', got {mode!r}")
    return Target(str(metric), float(value), mode)


_CLASS_ARG = re.compile(r"^--(model|data)(?:\.class_path)?(?:=(.*))?$")


def apply_class_overrides(config: dict[str, Any], extra: list[str]) -> tuple[dict[str, Any], list[str], list[str]]:
    """Take ``--model.class_path=X`` / ``--model X`` (and ``--data``) out of ``extra`` and apply them to a copy of
    ``config``: when the class changes, its ``init_args`` are **reset** (jsonargparse would otherwise carry the old
    class's same-named arguments over, e.g. DigitsCNN's ``hidden: 64`` into a WideMLP); ``--model.init_args.*`` and
    ``--model.*`` arguments in ``extra`` still apply after. Returns ``(config, remaining extra, notes)``."""
    config = json.loads(json.dumps(config))  # deep copy of plain YAML data
    rest: list[str] = []
    notes: list[str] = []
    i = 0
    while i < len(extra):
        match = _CLASS_ARG.match(extra[i])
        value = match.group(2) if match else None
        if match and value is None and i + 1 < len(extra) and not extra[i + 1].startswith("--"):
            value = extra[i + 1]
            i += 1
        if match is None or value is None or not re.fullmatch(r"[A-Za-z_][\w.]*", value):
            rest.append(extra[i])  # not a bare class name (a dict, a config file): jsonargparse's own handling
            i += 1
            continue
        key = match.group(1)
        section = config.get(key) or {}
        old = section.get("class_path", "") if isinstance(section, dict) else str(section)
        if old != value and old.split(".")[-1] != value.split(".")[-1]:
            config[key] = {"class_path": value}
            if isinstance(section, dict) and section.get("init_args"):
                notes.append(f"--{key}: class changed from {old} to {value}; its init_args were reset")
        i += 1
    return config, rest, notes


def base_lr(config: dict[str, Any]) -> float | None:
    """The model's learning rate in ``config``: ``model.init_args.lr``, else the model class's default (``None`` when
    the model has no ``lr`` argument)."""
    model = config.get("model") or {}
    args = (model.get("init_args") or {}) if isinstance(model, dict) else {}
    if "lr" in args:
        return float(args["lr"])
    class_path = model.get("class_path", "") if isinstance(model, dict) else str(model)
    if "." not in class_path:
        return None
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    param = inspect.signature(cls).parameters.get("lr")
    return float(param.default) if param is not None and param.default is not inspect.Parameter.empty else None


def overlay(
    config: dict[str, Any],
    row: Row,
    seed: int,
    run_dir: Path,
    devices: int,
    link: str | None,
    target: Target,
    stop: bool,
) -> dict[str, Any]:
    """The second config of a run (it overrides the base): seed, strategy, devices, output places, and the callbacks:
    the base's, with its ``TimeToTarget`` replaced by one writing to this run's folder (``SyncStats`` added for the
    pack's strategies, removed for ``ddp``, which it cannot read)."""
    callbacks = [c for c in _callbacks(config) if not _is(c, TIME_TO_TARGET) and not _is(c, _SYNC_STATS)]
    if row.sync_stats:
        callbacks.append({"class_path": _SYNC_STATS})
    callbacks.append(
        {
            "class_path": TIME_TO_TARGET,
            "init_args": {
                "metric": target.metric,
                "target": target.value,
                "mode": target.mode,
                "stop": stop,
                "path": str(run_dir / "time_to_target.jsonl"),
                **row.ttt_args,
            },
        }
    )
    init_args = dict(row.init_args)
    if link:
        init_args["link"] = link
    return {
        "seed_everything": seed,
        "trainer": {
            "devices": devices,
            "strategy": {"class_path": row.class_path, "init_args": init_args},
            "default_root_dir": str(run_dir),
            "logger": {
                "class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": str(run_dir), "name": "logs", "version": 0},
            },
            "callbacks": callbacks,
        },
    }


def build_command(base_config: Path, overlay_path: Path, row: Row, run_dir: Path, extra: list[str]) -> list[str]:
    """The ``lightning-sync fit`` command line of one run."""
    cmd = [
        sys.executable,
        "-m",
        "lightning_sync.cli",
        "fit",
        "--config",
        str(base_config),
        "--config",
        str(overlay_path),
        "--test_after_fit=false",
        f"--summary_json={run_dir / 'summary.json'}",
    ]
    cmd += [f"--trainer.strategy.init_args.{arg}" for arg in row.cli_args]
    return cmd + list(row.extra) + list(extra) + list(row.last)


# ---------------------------------------------------------------------------------------------- running
@dataclass
class RunResult:
    """What one run produced."""

    label: str
    seed: int
    link: str
    run_dir: Path
    ok: bool = False
    error: str = ""
    seconds: float = 0.0
    outcome: Outcome | None = None
    killed: bool = False  #: stopped by ``--run-timeout`` (its recorded evaluations still count)
    #: a committed report's run, its folder packed (``benchmarks/pack_records.py``): its entry of
    #: ``records.jsonl.gz`` (``records``, and the folder's other files as text in ``files``); None: read the folder
    packed: dict[str, Any] | None = None

    @property
    def records(self) -> list[dict[str, Any]]:
        """The run's ``time_to_target.jsonl`` records, from its folder or its packed entry."""
        if self.packed is not None:
            return list(self.packed.get("records", []))
        return read_records(self.run_dir / "time_to_target.jsonl")

    @property
    def history(self) -> list[dict[str, float]]:
        """The run's CSV metrics (``SyncStats``' ``sync/*`` rows, losses), as logged."""
        if self.packed is not None:
            text = self.packed.get("files", {}).get("logs/version_0/metrics.csv", "")
            return _csv_rows(text.splitlines())
        return read_csv_history(self.run_dir / "logs" / "version_0" / "metrics.csv")


def _csv_rows(lines: Any) -> list[dict[str, float]]:
    return [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(lines)]


def read_csv_history(path: Path) -> list[dict[str, float]]:
    if not path.exists():
        return []
    with path.open() as f:
        return _csv_rows(f)


def run_one(
    result: RunResult,
    cmd: list[str],
    progress: str,
    cluster: Any = None,
    timeout: float | None = None,
    clock_start: float | None = None,
    procs_per_host: int = 1,
) -> RunResult:
    """Run one ``fit``, streaming its per-epoch progress lines, then read what it recorded into ``result``.

    With a :class:`~lightning_sync.cluster.NamespaceCluster`, ``procs_per_host`` processes per host are started in
    its namespace (``num_nodes`` = hosts, ``devices`` = ``procs_per_host``, torchrun-style environment; the processes
    of one host talk over its loopback, only traffic between hosts crosses the rate-limited links); rank 0's output
    is streamed. ``timeout``
    (seconds) kills a run that has not finished by then (its process group); what it recorded is kept, and a run
    that had not reached the target is missed."""
    from lightning_sync.launch import kill_session

    run_dir = result.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "run.log"
    start = time.perf_counter()
    print(f"[compare] {progress}: starting", flush=True)
    others: list[subprocess.Popen] = []
    other_logs: list[Path] = []
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(log_path.open("w"))
        if cluster is None:
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=os.environ.copy(),
                start_new_session=True,
            )
        else:
            from lightning_sync.launch import free_port

            port = free_port()
            node_cmd = [*cmd, f"--trainer.num_nodes={cluster.hosts}", f"--trainer.devices={procs_per_host}"]

            def env(host: int, local: int) -> dict[str, str]:
                return cluster.env(host, port, local_rank=local, procs_per_host=procs_per_host)

            proc = cluster.popen(0, node_cmd, env(0, 0), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i in range(cluster.hosts):  # the other processes' output is kept too: a failure there is explained
                for local in range(procs_per_host):
                    if (i, local) == (0, 0):
                        continue
                    name = f"run.host{i}.log" if procs_per_host == 1 else f"run.host{i}.proc{local}.log"
                    other_logs.append(run_dir / name)
                    out = stack.enter_context(other_logs[-1].open("w"))
                    others.append(cluster.popen(i, node_cmd, env(i, local), stdout=out, stderr=subprocess.STDOUT))
        assert proc.stdout is not None
        timer = None
        if timeout is not None:
            import threading

            def expire() -> None:
                result.killed = True
                for p in (proc, *others):
                    kill_session(p)

            timer = threading.Timer(timeout, expire)
            timer.daemon = True
            timer.start()
        for line in proc.stdout:
            log.write(line)
            if line.startswith("[progress]"):
                print(f"[compare] {progress}: {line[len('[progress] ') :].rstrip()}", flush=True)
        code = proc.wait()
        if timer is not None:
            timer.cancel()
        failed_log = log_path if code else None
        for other, other_log in zip(others, other_logs):
            try:
                other_code = other.wait(timeout=120)
            except subprocess.TimeoutExpired:
                kill_session(other)
                other_code = 1
            if other_code and not code:
                code, failed_log = other_code, other_log
    result.seconds = time.perf_counter() - start
    error = ""
    if code and not result.killed:
        failed_log = failed_log or log_path
        tail = failed_log.read_text().strip().splitlines()[-3:]
        where = "" if failed_log == log_path else f"{failed_log.name}: "
        error = where + (" | ".join(tail)[-300:] or f"exit code {code}")
    finish_run(result, code, error, timeout)
    so_far = "" if clock_start is None else f", {time.perf_counter() - clock_start:.0f}s so far"
    print(f"[compare] {progress}: {describe(result)}; {result.seconds:.1f}s in all{so_far}", flush=True)
    return result


def finish_run(result: RunResult, code: int, error: str, timeout: float | None) -> None:
    """Read what a finished run recorded into ``result``: it is ``ok`` when it exited cleanly with records, or was
    killed at ``timeout`` after recording something (its evaluations count; a run that had not reached the target
    is missed); otherwise it failed with ``error``."""
    records = read_records(result.run_dir / "time_to_target.jsonl")
    result.outcome = outcome(records) if records else None
    if code == 0 and result.outcome is not None:
        result.ok = True
    elif result.killed:
        result.ok = result.outcome is not None
        result.error = f"stopped after the run timeout ({timeout:.0f} s)"
    else:
        result.error = error or f"exit code {code}" + ("" if result.outcome is not None else ", nothing recorded")


def describe(result: RunResult) -> str:
    """The one-line status of a finished run."""
    if result.ok and result.outcome is not None:
        o = result.outcome
        status = f"reached in {o.time_s:.1f}s (step {o.steps:.0f})" if o.reached else f"missed (best {o.best:.4g})"
        return status + (", killed at the run timeout" if result.killed else "")
    return f"FAILED ({result.error})"
