"""Drop-in check: an ordinary Lightning script, with only ``strategy=`` changed from ``"ddp"`` to each of ours.

The script is what a user writes (issue 20): a small ResNet-style CNN with BatchNorm on a learnable 10-class image
task (scikit-learn's handwritten digits, embedded: no download), torchmetrics accuracy, SGD with Nesterov momentum and
a per-step OneCycleLR, gradient clipping, bf16-mixed, ``ModelCheckpoint`` on ``val_acc`` with ``save_last``,
``EarlyStopping``, ``LearningRateMonitor``, ``CSVLogger``, ``val_check_interval=0.5``; then validate / test /
predict and a resume from ``last.ckpt``.

    python benchmarks/dropin.py                       # table: every strategy at its defaults vs ddp, 2 and 4 ranks
    python benchmarks/dropin.py --world 2 --seeds 0 1 # fewer runs
    python benchmarks/dropin.py --selsync-sweep       # SelSync's sync_fraction vs accuracy (the default's measurements)
    python benchmarks/dropin.py --diloco-outer --world 2 --seeds 0 1 2
                                                      # DiLoCo's outer optimizer, with and without inner_lr_scaling
    python benchmarks/dropin.py script --strategy selsync --devices 2 --out DIR
                                                      # the user script itself, launched by Lightning (popen)

Each table row is one real run per seed; the runs of one world size share processes started once
(``lightning_sync.launch.launch_local``, torchrun-like), so Lightning's import is paid once, not per run. A strategy
that refuses a setting of the script at setup is reported with the reason and run again with the change the message
names (OSP: no gradient clipping; the parameter-server strategies: validation at epoch ends), so every strategy gets
an accuracy. ``ddp`` is Lightning's own ``DDPStrategy``. Runs on the CPU (gloo), one thread per rank: with more ranks
than cores, wall times say little; accuracies and step counts do not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

#: every strategy name of the pack, in the order its tables list them (Lightning's ``ddp`` is the reference)
STRATEGIES = (
    "bsp", "selsync", "localsgd", "fedavg", "adpsgd", "osp", "diloco", "asp", "ssp", "aladdin", "sync_switch"
)  # fmt: skip
EPOCHS = 6


# ----------------------------------------------------------------------------------------------- the user's code
class Block(nn.Module):
    """A basic residual block: conv-BN-ReLU-conv-BN plus the identity (or a 1x1 projection when the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.skip(x))


class ResNetish(pl.LightningModule):
    """Small ResNet-style classifier with the training recipe of an ordinary script."""

    def __init__(
        self,
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        width: int = 8,
        schedule: str = "onecycle",
        nesterov: bool = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.Sequential(Block(width, width), Block(width, 2 * width, stride=2))
        self.head = nn.Linear(2 * width, 10)
        self.train_acc = MulticlassAccuracy(num_classes=10)
        self.val_acc = MulticlassAccuracy(num_classes=10)
        self.test_acc = MulticlassAccuracy(num_classes=10)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)  # one of the most common lines in Lightning code
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.test_acc(self(x), y)
        self.log("test_acc", self.test_acc)

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self(batch[0]).argmax(dim=1)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        opt = torch.optim.SGD(
            self.parameters(), lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay, nesterov=hp.nesterov
        )
        if hp.schedule == "constant":  # an ablation (--schedule constant): no schedule
            return opt
        total = self.trainer.estimated_stepping_batches
        if math.isfinite(total) and total >= 1:
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=hp.lr, total_steps=int(total))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        # The parameter-server strategies assign batches dynamically: the training loader has no length, so Lightning
        # estimates max_steps (-1) stepping batches, and a rank's share of an epoch is only known on average. Size the
        # cycle from that average and hold the final rate should this rank take more (OneCycleLR itself raises when
        # stepped past its total).
        world = self.trainer.world_size
        expected = self.trainer.max_epochs * math.ceil(len(self.trainer.datamodule.train_dataloader()) / world)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, partial(one_cycle, total=expected))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def one_cycle(step: int, total: int, pct_start: float = 0.3, div: float = 25.0, final_div: float = 1e4) -> float:
    """OneCycleLR's default shape (cosine up from max/div for ``pct_start``, cosine down to max/(div*final_div)) as a
    factor of the maximum, held at its final value after ``total`` steps."""
    x = min(step, total) / max(total, 1)
    start, end = 1.0 / div, 1.0 / (div * final_div)
    if x < pct_start:
        return start + (1.0 - start) * (1 - math.cos(math.pi * x / pct_start)) / 2
    return end + (1.0 - end) * (1 + math.cos(math.pi * (x - pct_start) / (1 - pct_start))) / 2


class DigitsImages(pl.LightningDataModule):
    """scikit-learn's 8x8 handwritten digits as 1x8x8 images, stratified 60/20/20 train/val/test split."""

    def __init__(self, batch_size: int = 32, seed: int = 0) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.seed = seed

    def setup(self, stage: str) -> None:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        x, y = load_digits(return_X_y=True)
        x = torch.tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
        x = (x - x.mean()) / x.std()
        y = torch.tensor(y, dtype=torch.int64)
        idx = list(range(len(y)))
        train, rest = train_test_split(idx, test_size=0.4, stratify=y, random_state=self.seed)
        val, test = train_test_split(rest, test_size=0.5, stratify=y[rest], random_state=self.seed)
        self.parts = {name: TensorDataset(x[i], y[i]) for name, i in (("train", train), ("val", val), ("test", test))}

    def train_dataloader(self) -> DataLoader:
        if not hasattr(self, "parts"):
            self.setup("fit")
        return DataLoader(self.parts["train"], batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.parts["val"], batch_size=128)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.parts["test"], batch_size=128)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.parts["test"], batch_size=128)


def user_trainer(strategy: Any, root: Path, devices: int, max_epochs: int, **overrides: Any) -> pl.Trainer:
    """The user's Trainer; ``overrides`` are what a refusal at setup asked to change."""
    kwargs: dict[str, Any] = dict(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=max_epochs,
        precision="bf16-mixed",
        gradient_clip_val=1.0,
        val_check_interval=0.5,
        log_every_n_steps=5,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=CSVLogger(str(root), name="logs"),
        callbacks=[
            ModelCheckpoint(dirpath=str(root / "ckpt"), monitor="val_acc", mode="max", save_last=True),
            EarlyStopping(monitor="val_acc", mode="max", patience=4),
            LearningRateMonitor(logging_interval="step"),
        ],
    )
    kwargs.update(overrides)
    return pl.Trainer(**kwargs)


#: what each kind of refusal at setup asks the user to change (matched on the error message)
ADAPTATIONS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("gradient_clip_val", {"gradient_clip_val": None}),
    ("val_check_interval", {"val_check_interval": 1.0}),
)


def adaptation_for(message: str) -> dict[str, Any] | None:
    for needle, change in ADAPTATIONS:
        if needle in message:
            return change
    return None


#: the ordinary user scripts of the drop-in check (issue 57: more than one model; ``dropin_grid.py --scripts``)
SCRIPTS = ("cnn", "transformer")


def user_script(script: str) -> tuple[Callable[..., pl.LightningModule], Callable[..., pl.LightningDataModule]]:
    """The user's LightningModule and LightningDataModule classes of ``script`` (one of ``SCRIPTS``): ``"cnn"`` is
    this file's ResNet-style CNN on the digits (SGD + OneCycleLR), ``"transformer"`` the character Transformer of
    ``benchmarks/dropin_text.py`` (AdamW + linear warm-up)."""
    if script == "cnn":
        return ResNetish, DigitsImages
    if script == "transformer":
        import dropin_text

        return dropin_text.TinyGPT, dropin_text.HelpTextChars
    raise ValueError(f"script must be one of {SCRIPTS}, got {script!r}")


def make_strategy(name: str, **kwargs: Any) -> Any:
    """``name`` as a user would pass it, or an instance (with ``kwargs``) where a test needs options."""
    if name == "ddp" or not kwargs:
        return name
    from lightning_sync.strategies import STRATEGIES as CLASSES

    (cls,) = [c for c in CLASSES if c.strategy_name == name]
    return cls(**kwargs)


def run_user_script(
    name: str,
    root: Path,
    devices: int,
    epochs: int = EPOCHS,
    seed: int = 0,
    strategy_kwargs: dict[str, Any] | None = None,
    interrupt_at: int | None = None,
    callbacks: Callable[[], list[pl.Callback]] | None = None,
    trainer_overrides: dict[str, Any] | None = None,
    model_kwargs: dict[str, Any] | None = None,
    batch_size: int = 32,
    evaluate: bool = True,
    script: str = "cnn",
) -> dict[str, Any]:
    """The user's whole script with ``strategy=name``: fit, validate, test (also from the best checkpoint), predict.

    With ``interrupt_at=k`` the fit stops after epoch k (as a preempted job would) and is resumed from ``last.ckpt``
    by a new Trainer of the same configuration, which then trains to the end and is evaluated. Returns what this
    rank read: whether setup refused a setting (and why, and what was changed), the accuracies, the predictions'
    size, epochs and steps (where the resume started), and the strategy's metrics. ``callbacks`` makes extra callbacks
    for each Trainer (tests use it to look inside). ``trainer_overrides`` change the Trainer's arguments (``CONFIGS``:
    precision and clipping), ``model_kwargs`` the model's (``lr``, ``width``...), ``batch_size`` the per-rank batch;
    ``evaluate=False`` stops after fit (no validate / test / predict: ``val_acc`` is the last validation's); ``script``
    picks the user's model and data (``SCRIPTS``: this CNN, or ``benchmarks/dropin_text.py``'s Transformer)."""
    model_cls, data_cls = user_script(script)
    res: dict[str, Any] = {"strategy": name, "refused": None, "changed": {}}
    overrides: dict[str, Any] = dict(trainer_overrides or {})

    def trainer_for(*extra: pl.Callback) -> pl.Trainer:
        pl.seed_everything(seed, verbose=False)
        trainer = user_trainer(make_strategy(name, **(strategy_kwargs or {})), root, devices, epochs, **overrides)
        trainer.callbacks.extend(extra)
        trainer.callbacks.extend(callbacks() if callbacks is not None else [])
        return trainer

    stop = [_StopAfter(interrupt_at)] if interrupt_at is not None else []
    for attempt in range(len(ADAPTATIONS) + 1):
        trainer = trainer_for(*stop)
        model, data = model_cls(**(model_kwargs or {})), data_cls(batch_size=batch_size, seed=seed)
        t0 = time.perf_counter()
        try:
            trainer.fit(model, data)
        except ValueError as err:  # refused at setup: say why, apply the change it names, run again
            change = adaptation_for(str(err))
            if change is None or attempt == len(ADAPTATIONS):
                raise
            res["refused"] = res["refused"] or str(err)
            overrides.update(change)
            res["changed"].update(change)
            continue
        break
    if interrupt_at is not None:
        ckpt = trainer.checkpoint_callback
        assert isinstance(ckpt, ModelCheckpoint)
        res["interrupted"] = {"epoch": trainer.current_epoch, "global_step": trainer.global_step}
        saved = torch.load(ckpt.last_model_path, map_location="cpu", weights_only=False)
        batches = saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["completed"]
        per_epoch = trainer.num_training_batches  # inf for the dynamic loaders: they checkpoint at epoch ends only
        res["resumed_from"] = {
            "epoch": saved["epoch"],
            "global_step": saved["global_step"],
            "batches_done_in_epoch": batches,
            "epoch_complete": not math.isfinite(per_epoch) or batches >= per_epoch,
        }
        trainer = trainer_for(start := _ResumeStart())
        model = model_cls(**(model_kwargs or {}))
        trainer.fit(model, data, ckpt_path=ckpt.last_model_path)
        res["resume_start"] = start.start
    res["fit_s"] = time.perf_counter() - t0
    ckpt = trainer.checkpoint_callback
    assert isinstance(ckpt, ModelCheckpoint)
    res["val_acc"] = float(trainer.callback_metrics["val_acc"])
    res["best_val_acc"] = float(ckpt.best_model_score) if ckpt.best_model_score is not None else None
    res["epoch"], res["global_step"] = trainer.current_epoch, trainer.global_step
    res["metrics"] = trainer.strategy.sync_metrics() if hasattr(trainer.strategy, "sync_metrics") else {}
    if not evaluate:
        return res
    res["validate_acc"] = float(trainer.validate(model, data, verbose=False)[0]["val_acc"])
    res["test_acc"] = float(trainer.test(model, data, verbose=False)[0]["test_acc"])
    res["best_test_acc"] = float(trainer.test(model, data, ckpt_path="best", verbose=False)[0]["test_acc"])
    res["best_validate_acc"] = float(trainer.validate(model, data, ckpt_path="best", verbose=False)[0]["val_acc"])
    predictions = trainer.predict(model, data)
    res["predictions"] = None if predictions is None else int(sum(p.numel() for p in predictions))
    return res


class _StopAfter(pl.Callback):
    """Stops the fit after epoch ``epoch`` (0-based count of finished epochs), as a preempted job ends."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch + 1 >= self.epoch:
            trainer.should_stop = True


class _ResumeStart(pl.Callback):
    """Where a resumed fit starts: epoch and global step at its first training batch."""

    start: dict[str, int] | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if self.start is None:
            self.start = {"epoch": trainer.current_epoch, "global_step": trainer.global_step, "batch_idx": idx}


# ----------------------------------------------------------------------------------------------- the table
def parse_row(entry: str) -> tuple[str, dict[str, Any]]:
    """``NAME`` or ``NAME@KEY=VALUE[@...]`` (``diloco@sync_every=8@outer_optimizer=None``): the strategy and its init
    arguments (values are Python literals: numbers, None, True, strings, dicts; anything else is taken as a string)."""
    import ast

    name, *items = entry.split("@")
    kwargs: dict[str, Any] = {}
    for item in items:
        key, eq, text = item.partition("=")
        if not eq or not key:
            raise ValueError(f"a row must look like NAME@KEY=VALUE, e.g. diloco@sync_every=8; got @{item!r}")
        try:
            kwargs[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            kwargs[key] = text
    if name == "ddp" and kwargs:
        raise ValueError("ddp@KEY=VALUE: the ddp row is Lightning's own DDPStrategy, the reference; it has no variants")
    return name, kwargs


def split_rows(text: str) -> list[str]:
    """``--strategies``' rows: split on the commas outside brackets (a row's dict value holds commas)."""
    rows, depth, current = [], 0, ""
    for ch in text:
        depth += ch in "{[(" and 1 or 0
        depth -= ch in "}])" and 1 or 0
        if ch == "," and depth == 0:
            rows.append(current.strip())
            current = ""
        else:
            current += ch
    rows.append(current.strip())
    return [r for r in rows if r]


#: ``--config``: the user script's Trainer precision and clipping (the script's own: clipping + bf16-mixed)
CONFIGS: dict[str, dict[str, Any]] = {
    "clip+bf16": {},
    "fp32": {"precision": "32-true", "gradient_clip_val": None},
    "clip": {"precision": "32-true"},
    "bf16": {"gradient_clip_val": None},
}


def _worker(
    rank: int,
    out: str,
    names: list[str],
    seeds: list[int],
    epochs: int,
    config: str = "clip+bf16",
    model_kwargs: dict[str, Any] | None = None,
    batch_size: int = 32,
    evaluate: bool = True,
    script: str = "cnn",
    straggler: float = 1.0,
) -> None:
    import warnings

    import lightning_sync  # noqa: F401  (registers the names)
    from lightning_sync.callbacks import StragglerInjection

    warnings.filterwarnings("ignore")
    world = int(os.environ["WORLD_SIZE"])
    slow = None if straggler == 1.0 else (lambda: [StragglerInjection(ranks=world - 1, slowdown=straggler)])
    rows = []
    for seed in seeds:
        for entry in names:
            name, kwargs = parse_row(entry)
            root = Path(out) / f"r{names.index(entry)}_s{seed}"
            res = run_user_script(
                name,
                root,
                world,
                epochs=epochs,
                seed=seed,
                strategy_kwargs=kwargs,
                trainer_overrides=CONFIGS[config],
                model_kwargs=model_kwargs,
                batch_size=batch_size,
                evaluate=evaluate,
                script=script,
                callbacks=slow,
            )
            res.update(seed=seed, world=world, strategy=entry, config=config, script=script, straggler=straggler)
            rows.append(res)
    if rank == 0:
        (Path(out) / "rows.json").write_text(json.dumps(rows, indent=1, default=str))


def _sweep_worker(rank: int, out: str, fractions: list[float], seeds: list[int], epochs: int) -> None:
    import warnings

    from lightning_sync.callbacks import SyncStats
    from lightning_sync.data import DigitsDataModule
    from lightning_sync.launch import quiet_trainer_kwargs
    from lightning_sync.models import DigitsCNN
    from lightning_sync.strategies import SelSyncStrategy

    warnings.filterwarnings("ignore")
    world = int(os.environ["WORLD_SIZE"])
    rows = []
    for seed in seeds:
        configs: list[tuple[str, dict[str, Any]]] = [("paper (0.3, N/100)", {"delta": 0.3})]
        configs += [(f"auto f={f}", {"sync_fraction": f}) for f in fractions]
        for label, kwargs in configs:
            # the user script's task
            res = run_user_script(
                "selsync", Path(out) / f"u_{label}_{seed}", world, epochs, seed=seed, strategy_kwargs=kwargs
            )
            row = {
                "label": label,
                "seed": seed,
                "world": world,
                "user_val_acc": res["val_acc"],
                "user_test_acc": res["test_acc"],
                "user_lssr": res["metrics"]["lssr"],
            }
            # the embedded digits workload (lightning-sync compare's default)
            pl.seed_everything(seed, verbose=False)
            strategy = SelSyncStrategy(**kwargs)
            trainer = pl.Trainer(
                accelerator="cpu",
                devices=world,
                strategy=strategy,
                max_epochs=10,
                callbacks=[SyncStats()],
                **quiet_trainer_kwargs(limit_val_batches=0),
            )
            model, data = DigitsCNN(), DigitsDataModule(batch_size=32, seed=seed)
            trainer.fit(model, data)
            row["digits_test_acc"] = float(trainer.test(model, data, verbose=False)[0]["test/acc"])
            row["digits_lssr"] = strategy.sync_metrics()["lssr"]
            rows.append(row)
    if rank == 0:
        (Path(out) / "sweep.json").write_text(json.dumps(rows, indent=1))


#: DiLoCo outer optimizers compared by ``--diloco-outer`` (label -> outer_optimizer; ``ddp`` is the reference)
DILOCO_OUTERS: dict[str, dict[str, Any] | None] = {
    "paper's (0.7, Nesterov 0.9), no scaling": {
        "name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True, "inner_lr_scaling": False
    },
    "paper's, inner_lr_scaling": {
        "name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True, "inner_lr_scaling": True
    },
    "SlowMo's (lr 1, heavy-ball 0.5), scaling: the default over SGD": {"name": "sgd", "lr": 1.0, "momentum": 0.5},
    "plain averaging (outer_optimizer=None)": None,
}  # fmt: skip


def _diloco_worker(rank: int, out: str, seeds: list[int], epochs: int) -> None:
    import warnings

    import lightning_sync  # noqa: F401  (registers the names)

    warnings.filterwarnings("ignore")
    world = int(os.environ["WORLD_SIZE"])
    rows = []
    for seed in seeds:
        res = run_user_script("ddp", Path(out) / f"ddp_{seed}", world, epochs, seed=seed)
        rows.append({"label": "ddp (reference)", "seed": seed, "val_acc": res["val_acc"], "test_acc": res["test_acc"]})
        for i, (label, outer) in enumerate(DILOCO_OUTERS.items()):
            kwargs = {"outer_optimizer": outer}
            res = run_user_script(
                "diloco", Path(out) / f"d{i}_{seed}", world, epochs, seed=seed, strategy_kwargs=kwargs
            )
            rows.append({"label": label, "seed": seed, "val_acc": res["val_acc"], "test_acc": res["test_acc"]})
    if rank == 0:
        (Path(out) / "diloco.json").write_text(json.dumps(rows, indent=1))


def _table(rows: list[dict[str, Any]]) -> str:
    by: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault((r.get("config", "clip+bf16"), r["world"], r["strategy"]), []).append(r)
    lines = []
    with_test = any("test_acc" in r for r in rows)  # --fit-only: no test columns
    for config, world in sorted({(c, w) for c, w, _ in by}):
        refs = by[(config, world, "ddp")]
        ref = statistics.mean(r["val_acc"] for r in refs)
        ref_test = statistics.mean(r.get("test_acc", math.nan) for r in refs)
        seeds = [r["seed"] for r in refs]
        lines.append(
            f"\n## {config}, {world} ranks, {len(refs)} seed(s) {seeds}: every strategy at its defaults vs ddp"
        )
        test_head, test_rule = ("test acc | vs ddp | ", "---:|---:|") if with_test else ("", "")
        lines.append(
            f"| strategy | val acc mean (worst) | vs ddp (points) | per seed | {test_head}LSSR | steps | "
            "refused at setup -> changed |"
        )
        lines.append(f"|---|---:|---:|---|{test_rule}---:|---:|---|")
        for (c, w, name), rs in by.items():
            if (c, w) != (config, world):
                continue
            val = statistics.mean(r["val_acc"] for r in rs)
            worst = min(r["val_acc"] for r in rs)
            test = statistics.mean(r.get("test_acc", math.nan) for r in rs)
            lssr = [r["metrics"].get("lssr") for r in rs if r["metrics"].get("lssr") is not None]
            refused = rs[0]["refused"]
            why = f"{refused.split(':')[0][:60]}... -> {rs[0]['changed']}" if refused else ""
            per_seed = " ".join(f"{r['val_acc']:.3f}" for r in rs)
            if not with_test:
                tests = "|"
            elif math.isnan(test):
                tests = "| | |"
            else:
                tests = f"| {test:.4f} | {100 * (test - ref_test):+.2f} |"
            lines.append(
                f"| {name} | {val:.4f} ({worst:.3f}) | {100 * (val - ref):+.2f} | {per_seed} {tests} "
                f"{'' if not lssr else f'{statistics.mean(lssr):.3f}'} | {rs[0]['global_step']} | {why} |"
            )
    return "\n".join(lines)


def seed_analysis(rows: list[dict[str, Any]], check_seeds: int = 5, margin: float = 3.0) -> str:
    """What a check "the mean over ``check_seeds`` seeds within ``margin`` points of ddp's, on the same seeds" sees,
    per configuration and strategy, from runs over more seeds: the mean gap over all seeds, the gap on the first
    ``check_seeds`` seeds (the test's), the worst gap over every subset of that size, the share of subsets that
    fail, and a normal estimate of the chance that a new draw of seeds (another machine's arithmetic) fails
    (the per-seed gaps' spread over sqrt(check_seeds)); then the sum of those chances over the checks (a bound on
    the chance that any fails). Also the lowest single run against ddp's lowest (the collapse check's margin)."""
    by: dict[tuple[str, str], dict[int, float]] = {}
    for r in rows:
        by.setdefault((r.get("config", "clip+bf16"), r["strategy"]), {})[r["seed"]] = r["val_acc"]
    lines = [
        f"| config | strategy | seeds | mean gap | first {check_seeds} | worst {check_seeds}-subset | subsets failing "
        f"| P(new draw fails) | lowest run - ddp's lowest |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    total = 0.0
    for (config, name), accs in sorted(by.items()):
        ddp = by.get((config, "ddp"))
        if name == "ddp" or ddp is None:
            continue
        seeds = sorted(set(accs) & set(ddp))
        gaps = [100 * (accs[s] - ddp[s]) for s in seeds]
        mean = statistics.mean(gaps)
        spread = statistics.stdev(gaps) / math.sqrt(check_seeds) if len(gaps) > 1 else 0.0
        p = 0.5 * (1 + math.erf((-margin - mean) / (spread * math.sqrt(2)))) if spread > 0 else float(mean < -margin)
        total += p
        subsets = list(itertools.combinations(range(len(seeds)), min(check_seeds, len(seeds))))
        subset_gaps = [statistics.mean(gaps[i] for i in c) for c in subsets]
        first = statistics.mean(gaps[:check_seeds])
        failing = sum(g < -margin for g in subset_gaps)
        lowest = 100 * (min(accs[s] for s in seeds) - min(ddp[s] for s in seeds))
        lines.append(
            f"| {config} | {name} | {len(seeds)} | {mean:+.2f} | {first:+.2f} | {min(subset_gaps):+.2f} | "
            f"{failing}/{len(subsets)} | {p:.1e} | {lowest:+.1f} |"
        )
    lines.append(f"\nsum of P(new draw fails) over the checks: {total:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "script":
        return script_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument(
        "--strategies",
        default=",".join(("ddp", *STRATEGIES)),
        help="comma-separated rows: NAME, or NAME@KEY=VALUE[@...] for a strategy with those init arguments "
        "(e.g. diloco@sync_every=8, diloco@outer_optimizer=None, selsync@vote='exact')",
    )
    parser.add_argument(
        "--config",
        nargs="+",
        default=["clip+bf16"],
        choices=list(CONFIGS),
        help="the script's precision and clipping: clip+bf16 (the script's own: gradient_clip_val=1.0, "
        "bf16-mixed), fp32 (no clipping, 32-true), clip (clipping, 32-true), bf16 (bf16-mixed, no clipping)",
    )
    parser.add_argument("--json", default=None, help="also write every run's row here")
    parser.add_argument("--batch-size", type=int, default=32, help="per-rank training batch (the script's: 32)")
    parser.add_argument("--lr", type=float, default=0.1, help="the script's maximum learning rate (0.1)")
    parser.add_argument("--width", type=int, default=8, help="the model's width (8)")
    parser.add_argument(
        "--no-nesterov", action="store_true", help="plain heavy-ball momentum instead of the script's Nesterov"
    )
    parser.add_argument(
        "--schedule",
        choices=("onecycle", "constant"),
        default="onecycle",
        help="the script's per-step OneCycleLR, or a constant rate (an ablation)",
    )
    parser.add_argument(
        "--fit-only", action="store_true", help="stop after fit (validation accuracy only: no validate/test/predict)"
    )
    parser.add_argument("--selsync-sweep", action="store_true", help="SelSync's sync_fraction vs accuracy")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    parser.add_argument("--diloco-outer", action="store_true", help="DiLoCo's outer optimizer variants vs ddp")
    parser.add_argument("--out", default=None, help="keep the runs' files here (default: a temporary directory)")
    parser.add_argument(
        "--analyse",
        metavar="ROWS_JSON",
        default=None,
        help="no runs: read the rows --json wrote and print, per strategy and configuration, what a check of the "
        "mean over --check-seeds seeds against ddp's would see (tests/test_dropin.py's ordinary-model check)",
    )
    parser.add_argument(
        "--straggler",
        type=float,
        default=1.0,
        help="the last rank takes this many times its own step time (StragglerInjection; 1: none), in every row",
    )
    parser.add_argument("--check-seeds", type=int, default=5, help="seeds per check (--analyse; 5)")
    parser.add_argument("--margin", type=float, default=3.0, help="the check's margin in points (--analyse; 3)")
    args = parser.parse_args(argv)
    if args.analyse:
        print(seed_analysis(json.loads(Path(args.analyse).read_text()), args.check_seeds, args.margin))
        return None

    from lightning_sync.launch import launch_local

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        out.mkdir(parents=True, exist_ok=True)
        if args.selsync_sweep:
            rows = []
            for world in args.world:
                launch_local(_sweep_worker, world, str(out / f"w{world}"), args.fractions, args.seeds, args.epochs)
                rows += json.loads((out / f"w{world}" / "sweep.json").read_text())
            print("| world | SelSync | seed | user script val acc | test acc | LSSR | digits test acc | LSSR |")
            print("|---:|---|---:|---:|---:|---:|---:|---:|")
            for r in rows:
                print(
                    f"| {r['world']} | {r['label']} | {r['seed']} | {r['user_val_acc']:.4f} | {r['user_test_acc']:.4f} "
                    f"| {r['user_lssr']:.3f} | {r['digits_test_acc']:.4f} | {r['digits_lssr']:.3f} |"
                )
            return None
        if args.diloco_outer:
            for world in args.world:
                launch_local(_diloco_worker, world, str(out / f"w{world}"), args.seeds, args.epochs)
                rows = json.loads((out / f"w{world}" / "diloco.json").read_text())
                seeds = sorted({r["seed"] for r in rows})
                print(f"\n{world} ranks, {args.epochs} epochs, validation accuracy (test accuracy)")
                print("| outer optimizer | " + " | ".join(f"seed {x}" for x in seeds) + " |")
                print("|---|" + "---:|" * len(seeds))
                for label in dict.fromkeys(r["label"] for r in rows):
                    cells = [f"{r['val_acc']:.4f} ({r['test_acc']:.4f})" for r in rows if r["label"] == label]
                    print(f"| {label} | " + " | ".join(cells) + " |")
            return None
        names = split_rows(args.strategies)
        for entry in names:
            parse_row(entry)  # fail now, not in every run
        rows = []
        for config in args.config:
            for world in args.world:
                t0 = time.perf_counter()
                where = out / f"{config}_w{world}"
                model_kwargs = {
                    "lr": args.lr,
                    "width": args.width,
                    "schedule": args.schedule,
                    "nesterov": not args.no_nesterov,
                }
                launch_local(
                    _worker,
                    world,
                    str(where),
                    names,
                    args.seeds,
                    args.epochs,
                    config,
                    model_kwargs,
                    args.batch_size,
                    not args.fit_only,
                    "cnn",
                    args.straggler,
                )
                rows += json.loads((where / "rows.json").read_text())
                print(f"[dropin] {config}, {world} ranks: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
        print(
            f"Drop-in check (benchmarks/dropin.py): user-style script, {args.epochs} epochs, digits 8x8, ResNet-style "
            "CNN, SGD Nesterov + OneCycleLR, val_check_interval=0.5; CPU, 1 thread per rank; validation accuracy "
            "after fit" + (f"; the last rank a x{args.straggler:g} straggler" if args.straggler != 1.0 else "")
        )
        print(_table(rows))
    return None


# ----------------------------------------------------------------------------------------------- the script
def script_main(argv: list[str]) -> None:
    """The user script as a user runs it: ``python benchmarks/dropin.py script --strategy NAME --devices 2 --out D``.

    Lightning launches the ranks (``"<name>"``: re-runs this script; ``"<name>_spawn"``: spawns). Each rank writes
    what it saw inside fit (``inside_rank<r>.json``, from a callback at the end of fit); the launching process writes
    what it reads afterwards (``launcher.json``): they must agree."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    import lightning_sync  # noqa: F401  (registers the names)

    torch.set_num_threads(1)
    out = Path(args.out)
    pl.seed_everything(0, verbose=False)
    trainer = user_trainer(args.strategy, out, args.devices, args.epochs, val_check_interval=1.0)
    trainer.callbacks.append(RecordInside(str(out)))
    model, data = ResNetish(), DigitsImages()
    trainer.fit(model, data)
    outside = launcher_view(trainer)
    predictions = trainer.predict(model, data)
    outside["predictions"] = None if predictions is None else int(sum(p.numel() for p in predictions))
    if trainer.is_global_zero:
        (out / "launcher.json").write_text(json.dumps(outside, indent=1))
    return None


def launcher_view(trainer: pl.Trainer) -> dict[str, Any]:
    """What a user reads from the Trainer after fit."""
    ckpt = trainer.checkpoint_callback
    assert isinstance(ckpt, ModelCheckpoint)
    early = trainer.early_stopping_callback
    strategy = trainer.strategy
    return {
        "pid": os.getpid(),
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "best_model_score": None if ckpt.best_model_score is None else float(ckpt.best_model_score),
        "best_model_path": ckpt.best_model_path,
        "last_model_path": ckpt.last_model_path,
        "early_stopping_wait": None if early is None else early.wait_count,
        "val_acc": float(trainer.callback_metrics["val_acc"]),
        "sync_metrics": strategy.sync_metrics() if hasattr(strategy, "sync_metrics") else {},
        "server_summary": json.loads(json.dumps(getattr(strategy, "server_summary", None))),
        "log_dir": trainer.logger.log_dir if trainer.logger is not None else None,
    }


class RecordInside(pl.Callback):
    """Writes, on every rank at the end of fit, what the trainer and strategy hold there."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        view = launcher_view(trainer)
        Path(self.out, f"inside_rank{trainer.global_rank}.json").write_text(json.dumps(view, indent=1))


if __name__ == "__main__":
    main()
