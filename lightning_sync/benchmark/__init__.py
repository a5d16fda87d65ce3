"""The time-to-target harness behind ``lightning-sync compare``: the :class:`TimeToTarget` callback that records
every evaluation where it happens, the arithmetic over seeds (:mod:`~lightning_sync.benchmark.ttt`), per-workload
recipes (:mod:`~lightning_sync.benchmark.recipes`), the runs (:mod:`~lightning_sync.benchmark.runs`), the grid
(:mod:`~lightning_sync.benchmark.grid`), the tables (:mod:`~lightning_sync.benchmark.tables`), the plots
(:mod:`~lightning_sync.benchmark.plots`) and the report (:mod:`~lightning_sync.benchmark.merge`).

``TimeToTarget`` is imported lazily (it pulls in Lightning, seconds to import), so the pure parts stay cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_sync.benchmark.ttt import Outcome, Summary, outcome, read_records, speedup, summarize_runs

if TYPE_CHECKING:
    from lightning_sync.benchmark.recorder import TimeToTarget

__all__ = ["Outcome", "Summary", "TimeToTarget", "outcome", "read_records", "speedup", "summarize_runs"]


def __getattr__(name: str) -> Any:
    if name == "TimeToTarget":
        from lightning_sync.benchmark.recorder import TimeToTarget

        return TimeToTarget
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
