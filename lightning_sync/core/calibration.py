"""SelSync's threshold set online (``delta="auto"``): δ follows the observed distribution of the relative gradient
change Δ so that a target fraction of the steps synchronise, whatever the world size, model or smoothing.

The paper fixes δ = 0.3 with an EWMA smoothing of N/100 (Tyagi & Swany, §III-A, Eq. 2), calibrated on 16 workers.
The smoothing factor scales with N, and Δ with it: with 2-4 ranks the smoothed norm moves so slowly that Δ almost
never reaches 0.3 and SelSync stops synchronising. Instead of a fixed δ, :class:`DeltaCalibrator` keeps the last
``window`` values of the statistic the decision compares with δ and takes the quantile that lets a fraction
``sync_fraction`` of them through.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from typing import Any

from lightning_sync.core.validation import check_int, check_real

#: Steps of Δ history the threshold is a quantile of. Long enough that the fraction is met on average, short enough
#: to follow the drift of Δ through an LR schedule (a few epochs of a small job).
CALIBRATION_WINDOW = 100
#: Steps at the start that synchronise unconditionally while the first observations come in (δ = 0).
CALIBRATION_WARMUP = 10


class DeltaCalibrator:
    r"""The threshold δ of Alg. 1 line 10, set from the recent distribution of Δ.

    At step :math:`i` the strategy compares :math:`D_i = \max_r \Delta_r(g_i)` (a step synchronises when *any* rank's
    Δ reaches δ, Alg. 1 line 13) with

    .. math::
        \delta_i = D_{(k)} \text{ of the last } m = \min(i-1, W) \text{ values}, \quad k = m - \lceil f m \rceil + 1

    (:math:`D_{(1)} \le \dots \le D_{(m)}` sorted; :math:`f` = ``sync_fraction``): exactly :math:`\lceil f m\rceil`
    of the window's values are :math:`\ge \delta_i`, so over a window in which the distribution of Δ is stationary a
    fraction :math:`\approx f` of the steps synchronise (more when values tie). ``sync_fraction=1`` is δ = 0: every
    step syncs. During the first ``warmup`` steps δ = 0 (every step syncs, as BSP) while the window fills. Non-finite
    Δ (an overflowing gradient reports +inf) enter the window like any value and always sync.

    Every rank must feed the same :math:`D_i` (the strategy carries each rank's Δ in its vote all-reduce), so every rank
    holds the same δ without a further message. O(W) per step (a sorted list beside the window).
    """

    def __init__(
        self, sync_fraction: float, window: int = CALIBRATION_WINDOW, warmup: int = CALIBRATION_WARMUP
    ) -> None:
        self.sync_fraction = check_real("sync_fraction", sync_fraction, 0.0, 1.0, low_open=True)
        self.window = check_int("window", window, 1)
        self.warmup = check_int("warmup", warmup, 0)
        self._values: deque[float] = deque()
        self._sorted: list[float] = []
        self.observed = 0

    def threshold(self) -> float:
        """δ for the coming step."""
        if self.observed < self.warmup or not self._sorted or self.sync_fraction >= 1.0:
            return 0.0
        m = len(self._sorted)
        passing = math.ceil(self.sync_fraction * m)
        return self._sorted[m - passing]

    def observe(self, value: float) -> None:
        """Record this step's :math:`D_i` (after the decision that used :meth:`threshold`)."""
        value = float(value)
        if math.isnan(value):
            value = math.inf  # a NaN gradient asks for a sync, like the tracker's non-finite case
        if len(self._values) == self.window:
            old = self._values.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._values.append(value)
        bisect.insort(self._sorted, value)
        self.observed += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "sync_fraction": self.sync_fraction,
            "window": self.window,
            "warmup": self.warmup,
            "values": list(self._values),
            "observed": self.observed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("sync_fraction", "window", "warmup"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"checkpointed delta calibration has {key}={state[key]}; this run uses {key}="
                    f"{getattr(self, key)}: resume with the same SelSync arguments"
                )
        self._values = deque(float(v) for v in state["values"])
        self._sorted = sorted(self._values)
        self.observed = int(state["observed"])
