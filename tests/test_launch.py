"""How users launch: by name with Lightning's own spawn launcher, from a LightningCLI YAML, with one process,
and what is rejected. The spawn-based tests here are the only ones that pay Lightning's import per fit.

``strategy="<name>"`` launches as Lightning's ``ddp``, by re-running the script (popen): from pytest that would run
pytest again, so tests launch through Lightning with ``"<name>_spawn"`` or ``start_method="spawn"`` (conftest refuses
a popen launch from inside pytest). The popen launch of a real script is tested in test_dropin.py."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

import lightning_sync
from lightning_sync import BSPStrategy, LinkModel, SelSyncStrategy
from lightning_sync.callbacks import SelDP, SyncStats
from lightning_sync.cli import cli_main
from lightning_sync.data import DigitsDataModule
from lightning_sync.launch import quiet_trainer_kwargs
from lightning_sync.models import DigitsCNN

CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "configs"


def _quiet(**kw):
    return quiet_trainer_kwargs(**kw)


def test_strategy_by_name_with_lightning_spawn():
    assert lightning_sync.SelSyncStrategy.strategy_name in pl.strategies.StrategyRegistry
    pl.seed_everything(0)
    model = DigitsCNN()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="selsync_spawn",
        max_steps=6,
        limit_val_batches=0,
        callbacks=[SyncStats()],
        **_quiet(),
    )
    assert isinstance(trainer.strategy, SelSyncStrategy)
    trainer.fit(model, DigitsDataModule())
    m = trainer.callback_metrics  # rank 0's logged metrics come back to the parent
    assert m["sync/sync_steps"] + m["sync/local_steps"] == 6
    assert m["sync/lssr"] == pytest.approx(float(m["sync/local_steps"]) / 6)
    assert m["sync/bytes_vote"] == 4 * (2 + 2) * 6  # delta="auto": [votes, SIGTERM, each rank's delta], float32
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())  # weights came back
    # the launching process reads the workers' values (shipped back by the launcher), not its own untouched ones
    assert trainer.global_step == 6
    metrics = trainer.strategy.sync_metrics()
    assert metrics["sync_steps"] == m["sync/sync_steps"] and metrics["bytes_vote"] == m["sync/bytes_vote"]
    assert trainer.strategy.step_counter.steps == 6 and trainer.strategy.comm_stats.bytes_sent["vote"] == 96
    with pytest.raises(RuntimeError, match="not available in the launching process after a spawn launch"):
        trainer.strategy.strategy_state()


def test_lightning_cli_yaml_class_path(tmp_path):
    cli = cli_main(
        [
            "fit",
            "--config",
            str(CONFIGS / "selsync.yaml"),
            "--trainer.max_steps=5",
            "--trainer.limit_val_batches=2",
            "--trainer.enable_progress_bar=false",
            "--trainer.log_every_n_steps=2",  # (the YAML's 10 would write no row in 5 steps)
            "--trainer.strategy.init_args.delta=0.0",
            "--trainer.strategy.init_args.vote=exact",  # Alg. 1's order: the step that voted syncs
            "--trainer.strategy.init_args.link=1gbit,1ms",
            "--trainer.strategy.init_args.start_method=spawn",  # popen would re-run pytest
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            "--test_after_fit=false",
        ]
    )
    strategy = cli.trainer.strategy
    assert isinstance(strategy, SelSyncStrategy)
    assert strategy.delta == 0.0 and strategy.vote == "exact" and strategy.link == LinkModel("1gbit", "1ms")
    m = cli.trainer.callback_metrics
    assert m["sync/sync_steps"] == 5 and m["sync/lssr"] == 0.0  # delta=0 syncs every step
    assert m["sync/blocked_s"] >= 5 * 2 * 1e-3  # two collectives per step, each at least the 1 ms latency
    # the CSV logger of the YAML wrote there, SyncStats' values included (it logs to the loggers when there are any)
    (csv,) = (tmp_path / "selsync").glob("version_*/metrics.csv")
    header = csv.read_text().splitlines()[0].split(",")
    assert {"sync/lssr", "sync/sync_steps", "sync/bytes_sent", "sync/blocked_s"} <= set(header)


def test_bsp_yaml_parses():
    cli = cli_main(["--config", str(CONFIGS / "bsp.yaml")], run=False)
    assert isinstance(cli.trainer.strategy, BSPStrategy)
    assert isinstance(cli.model, DigitsCNN) and isinstance(cli.datamodule, DigitsDataModule)


def _fit_local(strategy, model=None, **kw):
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=3, limit_val_batches=0, **_quiet(**kw)
    )
    trainer.fit(model or DigitsCNN(), DigitsDataModule())
    return trainer


def test_world_size_one_trains_locally_with_a_warning(single_process):
    with pytest.warns(UserWarning, match="world size 1"):
        trainer = _fit_local(SelSyncStrategy(delta=0.0, timeout=timedelta(seconds=30)))
    assert trainer.strategy.step_counter.steps == 3
    assert trainer.strategy.comm_stats.total_bytes() == 0  # nothing to send to


class ManualModel(DigitsCNN):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = torch.nn.functional.cross_entropy(self(batch[0]), batch[1])
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()


def test_manual_optimization_is_rejected_at_setup(single_process):
    with pytest.raises(ValueError, match="manual optimization"):
        _fit_local(SelSyncStrategy(), model=ManualModel())


def test_gradient_accumulation_is_rejected_at_setup(single_process):
    from lightning_sync import ADPSGDStrategy, FedAvgStrategy, OSPStrategy

    for strategy in (FedAvgStrategy(), ADPSGDStrategy(), OSPStrategy()):
        with pytest.raises(ValueError, match="accumulate_grad_batches"):
            _fit_local(strategy, accumulate_grad_batches=2)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"delta": -0.1}, "delta"),
        ({"delta": float("nan")}, "delta"),
        ({"delta": "0.3"}, "delta"),
        ({"window": 0}, "window"),
        ({"window": 1.5}, "window"),
        ({"smoothing": 0.0}, "smoothing"),
        ({"smoothing": 2.0}, "smoothing"),
        ({"aggregation": "weights"}, "aggregation"),
        ({"link": 5}, "link"),
        ({"link": "fast,1ms"}, "bandwidth"),
        ({"verify_sync": "yes"}, "verify_sync"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SelSyncStrategy(**kwargs)


def test_callbacks_require_a_lightning_sync_strategy():
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, callbacks=[SyncStats()], **_quiet())
    with pytest.raises(ValueError, match="lightning_sync strategy"):
        trainer.fit(DigitsCNN(), DigitsDataModule())
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, callbacks=[SelDP()], **_quiet())
    with pytest.raises(ValueError, match="lightning_sync strategy"):
        trainer.fit(DigitsCNN(), DigitsDataModule())


@pytest.mark.parametrize("name", ["bsp", "selsync", "localsgd", "fedavg", "adpsgd", "osp"])
def test_every_strategy_is_registered_by_name(name):
    from lightning_sync.strategies import STRATEGIES

    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=name, **_quiet())
    assert type(trainer.strategy).strategy_name == name
    assert type(trainer.strategy) in STRATEGIES


def test_names_launch_as_lightning_ddp_and_variants_as_ddp_spawn_and_ddp_notebook():
    from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

    from lightning_sync.strategies import STRATEGIES
    from lightning_sync.strategies.launcher import SyncLauncher

    for cls in STRATEGIES:
        name = cls.strategy_name
        by_name = pl.Trainer(accelerator="cpu", devices=2, strategy=name, **_quiet()).strategy
        spawned = pl.Trainer(accelerator="cpu", devices=2, strategy=f"{name}_spawn", **_quiet()).strategy
        forked = pl.Trainer(accelerator="cpu", devices=2, strategy=f"{name}_notebook", **_quiet()).strategy
        assert type(by_name) is cls and type(spawned) is cls and type(forked) is cls
        assert by_name._start_method == "popen" and isinstance(by_name.launcher, _SubprocessScriptLauncher)
        assert spawned._start_method == "spawn" and isinstance(spawned.launcher, SyncLauncher)
        assert forked._start_method == "fork" and forked.launcher.is_interactive_compatible  # allowed in notebooks
        assert cls()._start_method == "popen"  # the constructor's default is ddp's
