"""A language-model workload on text that ships with Python itself: the help topics of ``pydoc_data`` (the text
``help("assert")`` prints; about 465k characters of English prose and grammar in CPython 3.11), no download."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from ..core.validation import check_int, check_real
from .loader import ResumableDataLoader, ordered_loader


def python_help_text() -> str:
    """All ``pydoc_data.topics`` entries joined in sorted key order (deterministic for a given Python version)."""
    from pydoc_data.topics import topics

    return "\n".join(topics[key] for key in sorted(topics))


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
    ``num_workers``, ``val_fraction``, ``test_fraction`` and call :meth:`_split` from ``setup``."""

    seq_len: int
    batch_size: int
    num_workers: int
    val_fraction: float
    test_fraction: float
    splits: dict[str, Tensor]

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

    @property
    def vocab_size(self) -> int:
        self.setup()
        assert self.vocab is not None
        return len(self.vocab)

    def setup(self, stage: str | None = None) -> None:
        if self.vocab is not None:
            return
        text = python_help_text()
        self.vocab = CharVocab(text)  # over the whole text, so every split encodes
        if self.max_chars is not None:
            text = text[: self.max_chars]
        ids = self.vocab.encode(text)
        self._split(ids)
