"""StragglerInjection: chosen ranks sleep (slowdown - 1) x their own measured step time (in-process, one rank)."""

from __future__ import annotations

import math
import time
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from lightning_sync.callbacks import StragglerInjection

STEP_S = 0.02  # natural step time of TinyModel: its training_step sleeps this long
BATCHES = 4  # training batches per epoch


class TinyModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        time.sleep(STEP_S)  # a deterministic step time to multiply
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(4 * BATCHES, 4, generator=g), torch.randn(4 * BATCHES, 1, generator=g))
        return DataLoader(data, batch_size=4)


class Recorder(Callback):
    """Placed after the StragglerInjection: records the batch indices it slowed and the training wall time."""

    def __init__(self, straggler: StragglerInjection | None = None) -> None:
        self.straggler = straggler
        self.slowed: list[int] = []
        self.train_s = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        s = self.straggler
        if s is not None and s.slowed_steps > len(self.slowed):
            self.slowed.append(s.batches_seen - 1)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.train_s = time.perf_counter() - self._t0


def _fit(straggler: StragglerInjection | None, max_epochs: int = 1, **kwargs: Any) -> Recorder:
    recorder = Recorder(straggler)
    callbacks = [recorder] if straggler is None else [straggler, recorder]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=max_epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(TinyModel(), **kwargs)
    return recorder


def test_slows_own_rank_by_factor_of_own_step_time():
    cb = StragglerInjection(ranks=0, slowdown=4.0)
    rec = _fit(cb)
    assert cb.batches_seen == cb.slowed_steps == BATCHES
    assert rec.slowed == list(range(BATCHES))
    # each slowed batch sleeps 3x its own measured time, which is at least the 0.02 s of training_step
    assert cb.measured_seconds >= STEP_S * BATCHES
    assert cb.injected_seconds == pytest.approx(3.0 * cb.measured_seconds)
    assert cb.injected_seconds >= 2.5 * STEP_S * cb.slowed_steps
    # the fit really spends the injected time: the measured steps and the sleeps after them are disjoint parts of
    # the fit (a sleep lasts at least what was asked), so both are in its wall time (by construction, no margin)
    assert rec.train_s >= 4.0 * STEP_S * BATCHES
    assert rec.train_s >= cb.measured_seconds + cb.injected_seconds


def test_other_rank_untouched():
    cb = StragglerInjection(ranks=(1,), slowdown=100.0)
    assert not cb.is_straggler(0) and cb.is_straggler(1)
    rec = _fit(cb)
    assert cb.batches_seen == BATCHES
    assert cb.slowed_steps == 0 and cb.injected_seconds == 0.0 and rec.slowed == []
    assert rec.train_s < 100.0 * STEP_S * BATCHES / 2


@pytest.mark.parametrize("start, duration", [(0, 1), (3, 3), (6, None), (1, 100)])
def test_window_counts_batches_across_epochs(start: int, duration: int | None):
    cb = StragglerInjection(slowdown=1.5, start=start, duration=duration)
    rec = _fit(cb, max_epochs=2)
    total = 2 * BATCHES
    end = total if duration is None else min(start + duration, total)
    assert cb.batches_seen == total
    assert rec.slowed == list(range(start, end))
    assert cb.slowed_steps == end - start
    assert cb.injected_seconds >= 0.4 * STEP_S * cb.slowed_steps


def test_slowdown_one_injects_nothing():
    cb = StragglerInjection(slowdown=1.0)
    _fit(cb)
    assert cb.injected_seconds == 0.0
    assert cb.batches_seen == BATCHES


def test_state_dict_round_trip():
    cb = StragglerInjection(slowdown=2.0, duration=2)
    _fit(cb)
    state = cb.state_dict()
    assert state["batches_seen"] == BATCHES and state["slowed_steps"] == 2 and state["injected_seconds"] > 0
    other = StragglerInjection(slowdown=2.0, duration=2)
    other.load_state_dict(state)
    assert other.state_dict() == state
    assert (other.batches_seen, other.slowed_steps, other.injected_seconds) == (
        cb.batches_seen,
        cb.slowed_steps,
        cb.injected_seconds,
    )
    # a new fit counts from 0 again
    _fit(cb)
    assert cb.batches_seen == BATCHES and cb.slowed_steps == 2


def test_resume_from_checkpoint_continues_the_count(tmp_path):
    # window = the second epoch's first two batches: nothing slowed in epoch 0, so only a resumed count reaches it
    cb = StragglerInjection(slowdown=1.5, start=BATCHES, duration=2)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[cb],
    )
    trainer.fit(TinyModel())
    assert cb.batches_seen == BATCHES and cb.slowed_steps == 0
    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    resumed = StragglerInjection(slowdown=1.5, start=BATCHES, duration=2)
    rec = _fit(resumed, max_epochs=2, ckpt_path=str(ckpt))
    assert resumed.batches_seen == 2 * BATCHES
    assert rec.slowed == [BATCHES, BATCHES + 1]
    assert resumed.slowed_steps == 2


def test_valid_arguments_normalised():
    assert StragglerInjection(ranks=3).ranks == (3,)
    cb = StragglerInjection(ranks=[2, 0, 2], slowdown=1, start=5, duration=1)
    assert cb.ranks == (0, 2) and cb.slowdown == 1.0 and isinstance(cb.slowdown, float)
    assert cb.is_straggler(0) and cb.is_straggler(2) and not cb.is_straggler(1)
    assert StragglerInjection(duration=None).duration is None


@pytest.mark.parametrize(
    "kwargs, name, allowed",
    [
        ({"ranks": -1}, "ranks", ">= 0"),
        ({"ranks": []}, "ranks", "non-empty"),
        ({"ranks": True}, "ranks", ">= 0"),
        ({"ranks": [0, True]}, "ranks", ">= 0"),
        ({"ranks": [0, -2]}, "ranks", ">= 0"),
        ({"ranks": "0"}, "ranks", ">= 0"),
        ({"ranks": 1.0}, "ranks", ">= 0"),
        ({"ranks": None}, "ranks", ">= 0"),
        ({"slowdown": 0.5}, "slowdown", "[1.0, inf)"),
        ({"slowdown": 0}, "slowdown", "[1.0, inf)"),
        ({"slowdown": math.nan}, "slowdown", "[1.0, inf)"),
        ({"slowdown": math.inf}, "slowdown", "[1.0, inf)"),
        ({"slowdown": True}, "slowdown", "[1.0, inf)"),
        ({"slowdown": "4"}, "slowdown", "[1.0, inf)"),
        ({"start": -1}, "start", ">= 0"),
        ({"start": 1.5}, "start", ">= 0"),
        ({"start": True}, "start", ">= 0"),
        ({"duration": 0}, "duration", ">= 1 or None"),
        ({"duration": -3}, "duration", ">= 1 or None"),
        ({"duration": 2.0}, "duration", ">= 1 or None"),
        ({"duration": False}, "duration", ">= 1 or None"),
    ],
)
def test_invalid_arguments_raise(kwargs: dict[str, Any], name: str, allowed: str):
    with pytest.raises(ValueError, match=name) as info:
        StragglerInjection(**kwargs)
    assert str(info.value).startswith(f"{name} must be") and allowed in str(info.value)
