"""A word-level language-model workload on the text that ships with Python itself (``pydoc_data``'s help topics,
see :func:`~lightning_sync.data.text.python_help_text`), no download."""

from __future__ import annotations

import re
from collections import Counter

from torch import Tensor

from ..core.validation import check_int, check_real
from .text import TokenWindowsDataModule, python_help_text

__all__ = ["PythonWordsDataModule", "WordVocab", "tokenize_words"]

#: a token: a word (letters and underscores), a number, or one punctuation character
_TOKEN = re.compile(r"[A-Za-z_]+|[0-9]+|[^\sA-Za-z_0-9]")


def tokenize_words(text: str) -> list[str]:
    """Words, numbers and single punctuation characters, in order (whitespace dropped; case kept)."""
    return _TOKEN.findall(text)


class WordVocab:
    """The ``size - 1`` most frequent tokens of a text (ties by token, so deterministic) plus ``<unk>`` (id 0) for
    the rest."""

    UNK = "<unk>"

    def __init__(self, tokens: list[str], size: int) -> None:
        counts = Counter(tokens)
        common = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[: size - 1]
        self.words = [self.UNK] + [w for w, _ in common]
        self.index = {w: i for i, w in enumerate(self.words)}

    def __len__(self) -> int:
        return len(self.words)

    def encode(self, tokens: list[str]) -> Tensor:
        import torch

        return torch.tensor([self.index.get(t, 0) for t in tokens], dtype=torch.long)

    def decode(self, ids: Tensor) -> str:
        return " ".join(self.words[int(i)] for i in ids)


class PythonWordsDataModule(TokenWindowsDataModule):
    """Word-level language modelling on :func:`~lightning_sync.data.text.python_help_text` (about 114k tokens, 4133
    distinct ones).

    The token stream is split into contiguous train / validation / test parts (the last ``val_fraction`` and
    ``test_fraction`` are validation and test) and cut into non-overlapping windows of ``seq_len`` tokens (input and
    the next-token target). The vocabulary is the ``vocab_size - 1`` most frequent tokens of the whole text plus
    ``<unk>`` (id 0); a model's ``vocab_size`` must be at least this one's. Deterministic: no randomness in the split.
    """

    def __init__(
        self,
        seq_len: int = 32,
        batch_size: int = 8,
        vocab_size: int = 4096,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.seq_len = check_int("seq_len", seq_len, 2)
        self.batch_size = check_int("batch_size", batch_size, 1)
        self.max_vocab = check_int("vocab_size", vocab_size, 2)
        self.val_fraction = check_real("val_fraction", val_fraction, 0.0, 0.5, low_open=True)
        self.test_fraction = check_real("test_fraction", test_fraction, 0.0, 0.5, low_open=True)
        self.num_workers = check_int("num_workers", num_workers, 0)
        self.save_hyperparameters()
        self.vocab: WordVocab | None = None
        self.splits: dict[str, Tensor] = {}

    def _encode(self) -> Tensor:
        tokens = tokenize_words(python_help_text())
        self.vocab = WordVocab(tokens, self.max_vocab)
        return self.vocab.encode(tokens)
