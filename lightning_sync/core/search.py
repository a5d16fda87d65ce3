"""Sync-Switch's offline timing policy: the binary search of Li et al., "Sync-Switch: Hybrid Parameter
Synchronization for Distributed Deep Learning", §IV-B1 and Appendix B, Algorithm 1.

The search is an ask/tell object: :meth:`SwitchSearch.next_trial` says which training to run next,
:meth:`SwitchSearch.record` is told its converged accuracy. Running the trainings is the caller's business
(``lightning-sync search-switch`` runs each as a real ``lightning-sync fit`` subprocess).
"""

from __future__ import annotations

import math
from typing import Any

from lightning_sync.core.validation import check_int, check_real

__all__ = ["SwitchSearch"]


class SwitchSearch:
    r"""Algorithm 1: binary search for the earliest BSP→ASP switch whose converged accuracy stays within
    :math:`\beta` of the target.

    * If no target :math:`A` is given, BSP is trained :math:`R` times first (lines 2-5) and :math:`A` is the
      mean of those accuracies: :meth:`next_trial` returns ``("bsp", 1.0)`` for those runs.
    * Then, for :math:`m = 0, \dots, M-1` (lines 7-22), the switch point
      :math:`s = (\mathit{upper} + \mathit{lower}) / 2` is trained :math:`R` times (``("switch", s)``: BSP for
      the fraction :math:`s` of the workload, ASP for the rest). If the mean accuracy of those :math:`R` runs is
      in :math:`[A - \beta, A + \beta]` then :math:`\mathit{upper} = s`, else :math:`\mathit{lower} = s`.
    * :attr:`result` is :math:`\mathit{upper}` after :math:`M` settings: the earliest switch that met the target,
      or ``1.0`` (BSP throughout) if none did.

    Switch points are fractions of the workload in ``(0, 1)``; the paper writes percentages (``upper=100``).
    As printed, a mean above :math:`A + \beta` also counts as a miss (line 16): kept as printed.

    Deviation from the listing as printed: line 6 initialises the accumulator :math:`\alpha'` once, outside the
    loop over settings, and nothing resets it, so from the second setting on :math:`\alpha' / R` would add up
    the previous settings' accuracies too (about :math:`m+1` times the true mean). Here the mean of each setting
    is over that setting's own :math:`R` runs only (:math:`\alpha'` is reset per setting, as the text means).

    Args:
        threshold: :math:`\beta > 0`, the accepted margin around the target, in the metric's units.
        settings: :math:`M \ge 1`, the number of switch points to try.
        runs: :math:`R \ge 1`, the runs per switch point (and of the BSP baseline).
        target: :math:`A`, the target converged accuracy; ``None`` to measure it with :math:`R` BSP runs.
    """

    def __init__(self, threshold: float, settings: int, runs: int, target: float | None = None) -> None:
        self.threshold = check_real("threshold", threshold, low=0.0, low_open=True)
        self.settings = check_int("settings", settings, 1)
        self.runs = check_int("runs", runs, 1)
        self._target = None if target is None else check_real("target", target)
        self.upper = 1.0
        self.lower = 0.0
        self.trials: list[dict[str, Any]] = []  # one per setting: kind, fraction, accuracies, mean, accepted
        self._current: dict[str, Any] | None = None

    @property
    def target(self) -> float | None:
        """:math:`A`: as given, or the mean of the BSP runs once they are recorded (``None`` until then)."""
        return self._target

    @property
    def done(self) -> bool:
        """Whether all :math:`M` settings have been decided."""
        return sum(t["kind"] == "switch" for t in self.trials) >= self.settings

    @property
    def result(self) -> float:
        r"""The chosen switch fraction (:math:`\mathit{upper}`); ``1.0`` means BSP throughout."""
        if not self.done:
            raise RuntimeError("the search is not finished: call next_trial() and record() until next_trial() is None")
        return self.upper

    @property
    def run_index(self) -> int:
        """0-based index, within its trial, of the run :meth:`record` expects next."""
        return len(self._current["accuracies"]) if self._current is not None else 0

    def next_trial(self) -> tuple[str, float] | None:
        """The next training to run: ``("bsp", 1.0)``, ``("switch", s)`` with ``s`` in ``(0, 1)``, or ``None``
        when the search is done. Asking again before :meth:`record` returns the same trial."""
        if self._current is not None:
            return self._current["kind"], self._current["fraction"]
        if self.done:
            return None
        if self._target is None:
            kind, fraction = "bsp", 1.0
        else:
            kind, fraction = "switch", (self.upper + self.lower) / 2
        self._current = {"kind": kind, "fraction": fraction, "accuracies": [], "mean": None, "accepted": None}
        return kind, fraction

    def record(self, accuracy: float) -> dict[str, Any]:
        """Record the converged accuracy of one run of the current trial (the one :meth:`next_trial` returned).

        Returns the trial's state: ``accuracies`` so far and their ``mean``; once its :math:`R` runs are in,
        ``accepted`` (``True``/``False`` for a switch point, ``None`` for the BSP baseline) is decided and the
        next :meth:`next_trial` moves on."""
        accuracy = check_real("accuracy", accuracy)
        if self._current is None and self.next_trial() is None:
            raise RuntimeError("the search is finished: there is no trial to record")
        trial = self._current
        assert trial is not None
        trial["accuracies"].append(accuracy)
        trial["mean"] = math.fsum(trial["accuracies"]) / len(trial["accuracies"])  # this setting's runs only
        if len(trial["accuracies"]) == self.runs:
            self._settle(trial)
        return dict(trial, accuracies=list(trial["accuracies"]))

    def _settle(self, trial: dict[str, Any]) -> None:
        if trial["kind"] == "bsp":
            self._target = trial["mean"]  # line 3
        else:
            assert self._target is not None
            trial["accepted"] = self._target - self.threshold <= trial["mean"] <= self._target + self.threshold
            if trial["accepted"]:
                self.upper = trial["fraction"]  # line 17
            else:
                self.lower = trial["fraction"]  # line 19
        self.trials.append(trial)
        self._current = None
