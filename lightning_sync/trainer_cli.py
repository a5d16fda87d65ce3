"""The Trainer entry point: :class:`SyncCLI`, a LightningCLI whose model and data default to the embedded demo (a small
CNN on scikit-learn's handwritten digits, shipped inside scikit-learn: no download), and :func:`cli_main`, which
``lightning-sync fit`` / ``validate`` / ``test`` / ``predict`` run (:mod:`lightning_sync.cli` dispatches the other
subcommands) and the benchmark harness's worker processes run for every planned fit
(:mod:`lightning_sync.benchmark.workers`). It imports nothing of the harness or the command line above it."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import yaml
from jsonargparse import Namespace
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.rank_zero import rank_zero_only

import lightning_sync  # noqa: F401  (registers the strategy names)
import lightning_sync.data.digits  # noqa: F401  (the packaged models and data by their short names: --model=WideMLP)
import lightning_sync.data.text  # noqa: F401
import lightning_sync.data.words  # noqa: F401
import lightning_sync.models  # noqa: F401

DEFAULT_MODEL = "lightning_sync.models.DigitsCNN"
DEFAULT_DATA = "lightning_sync.data.DigitsDataModule"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} GB"


def _selects_class(argv: list[str], key: str) -> bool:
    """Whether ``argv`` names a ``key`` class (``--model X``, ``--model=X``, ``--model.class_path ...``) or a
    ``--config`` file that has a ``key`` section (or cannot be read, so it might)."""
    for i, arg in enumerate(argv):
        if arg in (f"--{key}", f"--{key}.class_path") or arg.startswith((f"--{key}=", f"--{key}.class_path=")):
            return True
        if arg == "--config" or arg.startswith("--config="):
            value = arg.partition("=")[2] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            try:
                data = yaml.safe_load(Path(value).read_text())
            except (OSError, yaml.YAMLError):
                return True
            if isinstance(data, dict) and data.get(key) is not None:
                return True
    return False


def with_default_classes(argv: list[str], subcommands: set[str] | None = None) -> list[str]:
    """``argv`` with ``--model=<demo CNN>`` / ``--data=<digits>`` inserted (after the subcommand) where nothing in
    it selects a model / data class (see :meth:`SyncCLI.parse_arguments`)."""
    at = 1 if argv and subcommands and argv[0] in subcommands else 0
    defaults = [f"--{key}={cls}" for key, cls in (("model", DEFAULT_MODEL), ("data", DEFAULT_DATA))]
    missing = [d for d, key in zip(defaults, ("model", "data")) if not _selects_class(argv[at:], key)]
    return argv[:at] + missing + argv[at:]


class SyncCLI(LightningCLI):
    """LightningCLI with the demo defaults and, after ``fit``, a test pass and a one-screen summary."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_argument(
            "--test_after_fit",
            type=bool,
            default=True,
            help="After fit, evaluate on the test set and print accuracy, LSSR and bytes sent.",
        )
        parser.add_argument(
            "--summary_json",
            type=Optional[str],  # noqa: UP045  (jsonargparse needs a runtime type)
            default=None,
            help="After fit (and test), write the final metrics and the fit's wall time to this JSON file.",
        )

    def parse_arguments(self, parser: Any, args: Any) -> None:
        """Parse with the demo model and data selected only when nothing else selects a model or data class.

        The demo classes are not parser defaults: jsonargparse resolves a default class's init_args and carries
        every same-named one over to a class a config or the command line selects instead (DigitsCNN's
        ``hidden=64`` into a WideMLP, DigitsDataModule's ``test_fraction=0.2`` into the text data). So
        ``--model=DigitsCNN`` / ``--data=DigitsDataModule`` are put first only when no ``--config`` file has a
        ``model`` / ``data`` section and no ``--model`` / ``--data`` argument names a class."""
        if isinstance(args, (dict, Namespace)):
            super().parse_arguments(parser, args)
            return
        argv = with_default_classes(list(sys.argv[1:] if args is None else args), set(self.subcommands()))
        if args is None:
            self.config = parser.parse_args(argv)  # what Lightning does, without its warning about args + argv
        else:
            super().parse_arguments(parser, argv)

    def before_fit(self) -> None:
        self._fit_started = time.perf_counter()

    def after_fit(self) -> None:
        fit_seconds = time.perf_counter() - getattr(self, "_fit_started", time.perf_counter())
        fit_metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items()}
        test_metrics: dict[str, float] = {}
        config = self.config[self.subcommand]
        if config.get("test_after_fit", True):
            if config.get("summary_json"):
                self.trainer.loggers = []  # keep the fit's metric history (the CSV) intact; test goes to the summary
            results = self.trainer.test(self.model, datamodule=self.datamodule, verbose=False)
            test_metrics = {k: float(v) for k, v in (results[0] if results else {}).items()}
        self._print_summary(fit_metrics, test_metrics)
        if config.get("summary_json"):
            self._write_summary(config["summary_json"], fit_metrics, test_metrics, fit_seconds)

    @rank_zero_only
    def _write_summary(self, path: str, fit: dict[str, float], test: dict[str, float], seconds: float) -> None:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        summary = {
            "strategy": type(self.trainer.strategy).__name__,
            "world_size": self.trainer.world_size,
            "fit_seconds": seconds,
            "global_step": self.trainer.global_step,
            "fit": fit,
            "test": test,
        }
        out.write_text(json.dumps(summary, indent=2))

    @rank_zero_only
    def _print_summary(self, fit: dict[str, float], test: dict[str, float]) -> None:
        strategy = self.trainer.strategy
        rows = [("strategy", type(strategy).__name__), ("world size", str(self.trainer.world_size))]
        for key, label in (("test/acc", "test accuracy"), ("val/acc", "val accuracy")):
            source = test if key in test else fit
            if key in source:
                rows.append((label, f"{source[key]:.4f}"))
        if "sync/lssr" in fit:
            rows.append(("LSSR", f"{fit['sync/lssr']:.3f}"))
            rows.append(
                ("sync / local steps", f"{fit.get('sync/sync_steps', 0):.0f} / {fit.get('sync/local_steps', 0):.0f}")
            )
            rows.append(("bytes sent per rank", _fmt_bytes(fit.get("sync/bytes_sent", 0.0))))
            rows.append(("blocked in communication", f"{fit.get('sync/blocked_s', 0.0):.3f} s"))
        width = max(len(k) for k, _ in rows)
        print("\nlightning-sync summary")
        for key, value in rows:
            print(f"  {key:<{width}}  {value}")
        sys.stdout.flush()


def cli_main(args: list[str] | None = None, run: bool = True) -> SyncCLI:
    """``lightning-sync fit|validate|test|predict ARGS``: a :class:`SyncCLI` over any LightningModule and
    LightningDataModule (``args``: the command line, default ``sys.argv[1:]``; ``run=False``: parse and instantiate
    only)."""
    return SyncCLI(
        pl.LightningModule,
        pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        run=run,
        save_config_kwargs={"overwrite": True},
    )
