"""A language-model workload on text that ships with Python: the help topics of ``pydoc_data`` (the text
``help("assert")`` prints; about 465k characters of English prose and grammar), as CPython 3.11.7 ships them, kept
in this package so every Python version trains on the same text. No download."""

from __future__ import annotations

import gzip
import hashlib
from functools import lru_cache
from importlib import resources
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from ..core.validation import check_int, check_real
from .loader import ResumableDataLoader, ordered_loader

#: The snapshot of the help text in this package (gzip of its UTF-8 bytes) and the SHA-256 of those bytes.
PYTHON_HELP_TEXT_FILE = "python_help_topics.txt.gz"
PYTHON_HELP_TEXT_SHA256 = "2a95af4ac93f5b719944030ce3769070ddf827d847cba42192afa8da989e5dc4"


@lru_cache(maxsize=1)
def python_help_text() -> str:
    """CPython 3.11.7's ``pydoc_data.topics`` entries joined by newlines in sorted key order, read from this package.

    Each Python release ships its own help text, patch releases included (3.11.2's is 466,097 characters, 3.11.7's
    465,048), so reading the running interpreter's ``pydoc_data`` would make the ``text`` and ``words`` workloads, and
    their fixed targets, depend on the Python version: on a machine with CPython 3.12.3 (and torch 2.11), Lightning's
    DDP on ``words`` at 1 Gbit/s got no lower than perplexity 20.8 in 225 steps, where with 3.11.7's text it reaches
    the target 17 in 100-150 (``docs/benchmarks.md``, "The text workloads' data: one snapshot for every Python"). The
    snapshot is checked against its SHA-256 on its first read in a process. The text is the Python Software
    Foundation's, under the PSF License (``PYTHON_LICENSE.txt`` beside it).
    """
    data = gzip.decompress(resources.files(__package__).joinpath(PYTHON_HELP_TEXT_FILE).read_bytes())
    digest = hashlib.sha256(data).hexdigest()
    if digest != PYTHON_HELP_TEXT_SHA256:
        raise RuntimeError(
            f"lightning_sync/data/{PYTHON_HELP_TEXT_FILE} is not the shipped snapshot (sha256 {digest}, expected "
            f"{PYTHON_HELP_TEXT_SHA256}): reinstall lightning-sync"
        )
    return data.decode("utf-8")


class CharVocab:
    """Character-level tokenizer: the sorted set of characters of a text; ids are positions in that order."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> Tensor:
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids: Tensor) -> str:
        return "".join(self.chars[int(i)] for i in ids)


class CharWindows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` token ids: input ``ids[:-1]``, target ``ids[1:]``."""

    def __init__(self, ids: Tensor, seq_len: int) -> None:
        n = (len(ids) - 1) // seq_len
        self.ids = ids
        self.seq_len = seq_len
        self.n = max(0, n)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        start = i * self.seq_len
        chunk = self.ids[start : start + self.seq_len + 1]
        return chunk[:-1], chunk[1:]


class TokenWindowsDataModule(pl.LightningDataModule):
    """What the text and words data modules share: a contiguous train/val/test split of one token-id sequence (the
    last ``val_fraction`` and ``test_fraction`` of it) and next-token windows of ``seq_len`` over each split —
    shuffled and resumable for training, in order for evaluation. Subclasses set ``seq_len``, ``batch_size``,
    ``num_workers``, ``val_fraction``, ``test_fraction``, ``vocab = None`` and implement :meth:`_encode`, which
    builds ``vocab`` and returns the text's token ids; :meth:`setup` splits them once."""

    seq_len: int
    batch_size: int
    num_workers: int
    val_fraction: float
    test_fraction: float
    splits: dict[str, Tensor]
    vocab: Any

    @property
    def vocab_size(self) -> int:
        self.setup()
        assert self.vocab is not None
        return len(self.vocab)

    def setup(self, stage: str | None = None) -> None:
        if self.vocab is not None:
            return
        self._split(self._encode())

    def _encode(self) -> Tensor:
        """Build ``self.vocab`` and return the token ids of the whole text (each subclass: its tokenizer)."""
        raise NotImplementedError(f"{type(self).__name__} must implement _encode (its tokenizer)")

    def _split(self, ids: Tensor) -> None:
        n_test = int(len(ids) * self.test_fraction)
        n_val = int(len(ids) * self.val_fraction)
        n_train = len(ids) - n_val - n_test
        self.splits = {
            "train": ids[:n_train],
            "val": ids[n_train : n_train + n_val],
            "test": ids[n_train + n_val :],
        }

    def train_dataloader(self) -> ResumableDataLoader:
        self.setup()
        return ResumableDataLoader(
            CharWindows(self.splits["train"], self.seq_len),
            batch_size=self.batch_size,
            shuffle=True,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        self.setup()
        return ordered_loader(CharWindows(self.splits["val"], self.seq_len), self.batch_size)

    def test_dataloader(self) -> DataLoader:
        self.setup()
        return ordered_loader(CharWindows(self.splits["test"], self.seq_len), self.batch_size)


class PythonTextDataModule(TokenWindowsDataModule):
    """Character-level language modelling on :func:`python_help_text`.

    The text is split into contiguous train / validation / test parts (the last ``val_fraction`` and
    ``test_fraction`` of it are validation and test), cut into non-overlapping windows of ``seq_len`` characters.
    ``max_chars`` keeps only the start of the text (quick runs). Deterministic: no randomness in the split.
    """

    def __init__(
        self,
        seq_len: int = 64,
        batch_size: int = 32,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        max_chars: int | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.seq_len = check_int("seq_len", seq_len, 2)
        self.batch_size = check_int("batch_size", batch_size, 1)
        self.val_fraction = check_real("val_fraction", val_fraction, 0.0, 0.5, low_open=True)
        self.test_fraction = check_real("test_fraction", test_fraction, 0.0, 0.5, low_open=True)
        self.max_chars = None if max_chars is None else check_int("max_chars", max_chars, 10 * seq_len)
        self.num_workers = check_int("num_workers", num_workers, 0)
        self.save_hyperparameters()
        self.vocab: CharVocab | None = None
        self.splits: dict[str, Tensor] = {}

    def _encode(self) -> Tensor:
        text = python_help_text()
        self.vocab = CharVocab(text)  # over the whole text, so every split encodes
        if self.max_chars is not None:
            text = text[: self.max_chars]
        return self.vocab.encode(text)
