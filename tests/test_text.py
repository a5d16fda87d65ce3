"""The language-model workload on text shipped with Python (pydoc_data help topics)."""

from __future__ import annotations

import hashlib
import sys

import lightning.pytorch as pl
import pytest
import torch

from lightning_sync.data import text as text_module
from lightning_sync.data.text import (
    PYTHON_HELP_TEXT_SHA256,
    CharVocab,
    CharWindows,
    PythonTextDataModule,
    python_help_text,
)
from lightning_sync.launch import quiet_trainer_kwargs
from lightning_sync.models import CharTransformerLM


def test_tokenization_and_split_are_deterministic():
    text = python_help_text()
    assert text == python_help_text() and len(text) > 100_000
    a, b = CharVocab(text), CharVocab(text)
    assert a.chars == b.chars and a.chars == sorted(set(text))
    sample = text[:500]
    assert a.decode(a.encode(sample)) == sample
    dm1, dm2 = PythonTextDataModule(max_chars=20_000), PythonTextDataModule(max_chars=20_000)
    dm1.setup()
    dm2.setup()
    for split in ("train", "val", "test"):
        assert torch.equal(dm1.splits[split], dm2.splits[split])
    joined = torch.cat([dm1.splits["train"], dm1.splits["val"], dm1.splits["test"]])
    assert torch.equal(joined, a.encode(text[:20_000]))  # contiguous, disjoint, in order


def test_the_help_text_is_the_shipped_snapshot_on_every_python():
    text = python_help_text()
    assert hashlib.sha256(text.encode("utf-8")).hexdigest() == PYTHON_HELP_TEXT_SHA256
    assert len(text) == 465_048 and text.startswith('The "assert" statement\n')


@pytest.mark.skipif(sys.version_info[:3] != (3, 11, 7), reason="the snapshot is CPython 3.11.7's pydoc_data text")
def test_the_snapshot_is_cpython_3_11_7s_pydoc_topics():
    from pydoc_data.topics import topics

    assert python_help_text() == "\n".join(topics[key] for key in sorted(topics))


def test_a_snapshot_that_is_not_the_shipped_one_is_refused(monkeypatch):
    python_help_text.cache_clear()
    monkeypatch.setattr(text_module, "PYTHON_HELP_TEXT_SHA256", "0" * 64)
    try:
        with pytest.raises(RuntimeError, match="is not the shipped snapshot.*reinstall lightning-sync"):
            python_help_text()
    finally:
        python_help_text.cache_clear()


def test_windows_shift_targets_by_one():
    ids = torch.arange(100)
    ds = CharWindows(ids, seq_len=10)
    assert len(ds) == 9
    x, y = ds[3]
    assert torch.equal(x, torch.arange(30, 40)) and torch.equal(y, torch.arange(31, 41))


@pytest.mark.parametrize("kwargs,name", [({"seq_len": 1}, "seq_len"), ({"val_fraction": 0.0}, "val_fraction")])
def test_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        PythonTextDataModule(**kwargs)


def test_short_training_lowers_validation_perplexity():
    torch.set_num_threads(1)  # restored after the test (conftest)
    dm = PythonTextDataModule(max_chars=40_000, batch_size=32)
    pl.seed_everything(0)
    model = CharTransformerLM(vocab_size=dm.vocab_size)
    before = pl.Trainer(accelerator="cpu", devices=1, limit_val_batches=8, **quiet_trainer_kwargs()).validate(
        model, dm, verbose=False
    )[0]["val/ppl"]
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, limit_val_batches=8, **quiet_trainer_kwargs())
    trainer.fit(model, dm)
    after = float(trainer.callback_metrics["val/ppl"])
    assert after < 0.5 * before, (before, after)


@pytest.mark.parametrize("stage", ["validate", "test"])
def test_perplexity_is_exp_of_the_mean_token_loss_of_the_whole_evaluation(stage):
    """Not the mean of per-batch exp(loss), which Jensen's inequality makes larger (by 2.4x on the words workload)."""
    torch.set_num_threads(1)  # restored after the test (conftest)
    dm = PythonTextDataModule(max_chars=40_000, batch_size=8)
    pl.seed_everything(0)
    model = CharTransformerLM(vocab_size=dm.vocab_size)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, limit_val_batches=6, limit_test_batches=6, **quiet_trainer_kwargs()
    )
    key = "val" if stage == "validate" else "test"
    logged = getattr(trainer, stage)(model, dm, verbose=False)[0]
    loader = dm.val_dataloader() if stage == "validate" else dm.test_dataloader()
    losses, tokens = [], []
    with torch.no_grad():
        for _, batch in zip(range(6), loader):
            losses.append(float(model._loss(batch)) * batch[1].numel())
            tokens.append(batch[1].numel())
    expected = float(torch.exp(torch.tensor(sum(losses) / sum(tokens), dtype=torch.float64)))
    assert logged[f"{key}/ppl"] == pytest.approx(expected, rel=1e-6)
    mean_of_exp = sum(float(torch.exp(torch.tensor(v / n))) for v, n in zip(losses, tokens)) / len(tokens)
    assert mean_of_exp > expected * (1 + 1e-5)  # the two definitions differ on these batches: the test tells them apart
