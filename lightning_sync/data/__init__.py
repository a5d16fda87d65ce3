"""Data utilities: SelDP partitioning (SelSync §III-D), a resumable DataLoader and an embedded dataset.

``DigitsDataModule`` is imported lazily (it pulls in ``lightning.pytorch``, several seconds to import), so
``from lightning_sync.data import SelDPSampler`` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .loader import ResumableDataLoader
from .noniid import Dirichlet, LabelSkew, format_label_counts, label_counts
from .seldp import SelDPSampler, seldp_indices

if TYPE_CHECKING:
    from .digits import DigitsDataModule

__all__ = [
    "Dirichlet",
    "DigitsDataModule",
    "LabelSkew",
    "ResumableDataLoader",
    "SelDPSampler",
    "format_label_counts",
    "label_counts",
    "seldp_indices",
]


def __getattr__(name: str) -> Any:
    if name == "DigitsDataModule":
        from .digits import DigitsDataModule

        return DigitsDataModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
