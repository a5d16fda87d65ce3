"""Data utilities: SelDP partitioning (SelSync §III-D), dynamic work assignment, a resumable DataLoader and
an embedded dataset.

``DigitsDataModule`` is imported lazily (it pulls in ``lightning.pytorch``, several seconds to import), so
``from lightning_sync.data import SelDPSampler`` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .dynamic import DynamicBatchSampler, LocalCounter, dynamic_loader
from .loader import ResumableDataLoader
from .noniid import Dirichlet, LabelSkew, format_label_counts, label_counts
from .seldp import SelDPSampler, seldp_indices

if TYPE_CHECKING:
    from .cifar import CIFAR10DataModule
    from .digits import DigitsDataModule
    from .text import PythonTextDataModule
    from .words import PythonWordsDataModule

__all__ = [
    "CIFAR10DataModule",
    "Dirichlet",
    "DigitsDataModule",
    "DynamicBatchSampler",
    "LabelSkew",
    "LocalCounter",
    "PythonTextDataModule",
    "PythonWordsDataModule",
    "ResumableDataLoader",
    "SelDPSampler",
    "dynamic_loader",
    "format_label_counts",
    "label_counts",
    "seldp_indices",
]


def __getattr__(name: str) -> Any:
    if name == "DigitsDataModule":
        from .digits import DigitsDataModule

        return DigitsDataModule
    if name == "CIFAR10DataModule":
        from .cifar import CIFAR10DataModule

        return CIFAR10DataModule
    if name == "PythonTextDataModule":
        from .text import PythonTextDataModule

        return PythonTextDataModule
    if name == "PythonWordsDataModule":
        from .words import PythonWordsDataModule

        return PythonWordsDataModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
