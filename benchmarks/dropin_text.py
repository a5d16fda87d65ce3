"""The drop-in check's second ordinary script (issue 57): a small Transformer with AdamW and a linear warm-up.

What a user writes for next-character prediction on a text: a 2-layer causal Transformer (width 32, 2 heads) over the
characters of Python's help text (the snapshot embedded in ``lightning_sync.data``: no download), torchmetrics
accuracy of the next character, AdamW (weight decay 0.01) with the usual per-step schedule — a linear warm-up over
the first 10% of the steps, then a linear decay to zero (``get_linear_schedule_with_warmup``'s shape) — and the same
Trainer as ``benchmarks/dropin.py``'s CNN script (``ModelCheckpoint`` / ``EarlyStopping`` on ``val_acc``,
``val_check_interval=0.5``). ``benchmarks/dropin.py --model transformer`` runs it with every strategy.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

#: the start of the help text the script uses: 1225 windows, 1041 of them train (32 steps of 16 per rank on 2 ranks)
TEXT_CHARS = 39_232
SEQ_LEN = 32


def help_text_ids(chars: int = TEXT_CHARS) -> tuple[Tensor, int]:
    """The first ``chars`` characters of Python's help text as ids into its sorted character set, and that set's
    size (the whole text's, so every length has one vocabulary)."""
    from lightning_sync.data.text import CharVocab, python_help_text

    text = python_help_text()
    vocab = CharVocab(text)
    return vocab.encode(text[:chars]), len(vocab)


class HelpTextChars(pl.LightningDataModule):
    """Non-overlapping windows of ``SEQ_LEN`` characters: the first 85% of the text trains, the rest validates (and
    tests). The split is the text's order, so every seed sees the same windows (the seed varies the model's
    initialisation and the shuffle)."""

    def __init__(self, batch_size: int = 16, seed: int = 0) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.seed = seed

    def setup(self, stage: str) -> None:
        ids, self.vocab_size = help_text_ids()
        n = (len(ids) - 1) // SEQ_LEN
        windows = ids[: n * SEQ_LEN + 1].unfold(0, SEQ_LEN + 1, SEQ_LEN)
        cut = int(0.85 * n)
        parts = {"train": windows[:cut], "val": windows[cut:]}
        self.parts = {name: TensorDataset(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for name, w in parts.items()}

    def train_dataloader(self) -> DataLoader:
        if not hasattr(self, "parts"):
            self.setup("fit")
        return DataLoader(self.parts["train"], batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.parts["val"], batch_size=64)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.parts["val"], batch_size=64)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.parts["val"], batch_size=64)


def warmup_then_linear(step: int, warmup: int, total: int) -> float:
    """The learning rate's factor: linear from 0 to 1 over ``warmup`` steps, then linear to 0 at ``total`` (held at
    0 after it)."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    return max(0.0, (total - step) / max(1, total - warmup))


class TinyGPT(pl.LightningModule):
    """A 2-layer causal Transformer over characters with AdamW and a linear warm-up, as an ordinary script has it
    (``vocab_size``: the help text's 103 characters)."""

    def __init__(
        self,
        vocab_size: int = 103,
        dim: int = 32,
        heads: int = 2,
        layers: int = 2,
        lr: float = 1e-2,
        weight_decay: float = 0.01,
        warmup: float = 0.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.zeros(SEQ_LEN, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ_LEN), persistent=False)
        self.val_acc = MulticlassAccuracy(num_classes=vocab_size, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=vocab_size, average="micro")

    def forward(self, x: Tensor) -> Tensor:
        t = x.shape[1]
        h = self.encoder(self.embed(x) + self.pos[:t], mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))

    def _logits_targets(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        x, y = batch
        logits = self(x)
        return logits.reshape(-1, logits.shape[-1]), y.reshape(-1)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        logits, y = self._logits_targets(batch)
        loss = F.cross_entropy(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        logits, y = self._logits_targets(batch)
        self.val_acc(logits, y)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        logits, y = self._logits_targets(batch)
        self.test_acc(logits, y)
        self.log("test_acc", self.test_acc)

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self(batch[0]).argmax(dim=-1)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        opt = torch.optim.AdamW(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
        total = self.trainer.estimated_stepping_batches
        if not (math.isfinite(total) and total >= 1):
            # the parameter-server strategies' dynamic loaders have no length: size the schedule from a rank's
            # average share of an epoch (as benchmarks/dropin.py's CNN script does)
            world = self.trainer.world_size
            total = self.trainer.max_epochs * math.ceil(len(self.trainer.datamodule.train_dataloader()) / world)
        total = int(total)
        factor = partial(warmup_then_linear, warmup=max(1, round(hp.warmup * total)), total=total)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
