"""SelSync's relative gradient change (Tyagi & Swany, "Accelerating Distributed ML Training via Selective
Synchronization", §III-A, Eq. 2, and Alg. 1 line 8 ``RelativeGradChange``)."""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from lightning_sync.core.validation import check_int, check_real


class GradientChangeTracker:
    r"""Relative change of the EWMA-smoothed squared gradient norm, Eq. 2.

    Each step feeds :math:`x_i = \|g_i\|^2` (the squared L2 norm of this rank's local gradient). The smoothed
    value is an exponentially weighted moving average over the last ``window`` values (the paper: "EWMA with a
    window-size of 25 iterations and a smoothing factor of N/100"):

    .. math::
        s_i = \frac{\sum_{k=0}^{m-1} (1-\alpha)^k x_{i-k}}{\sum_{k=0}^{m-1} (1-\alpha)^k}, \quad m=\min(i, W)

    i.e. pandas' ``ewm(alpha, adjust=True)`` restricted to a sliding window of ``W`` steps (with ``W=1``,
    :math:`s_i=x_i`; with :math:`\alpha=1` likewise). The relative gradient change of Eq. 2 is

    .. math:: \Delta(g_i) = |s_i - s_{i-1}| / s_{i-1}.

    First step: there is no :math:`s_0`, hence no measured change, and :math:`\Delta(g_1)=0`. With
    :math:`\delta=0` the first step still syncs (:math:`0 \ge 0`), so :math:`\delta=0` is BSP from the first
    step; with any :math:`\delta>0` it is local, so a :math:`\delta` above every :math:`\Delta` never
    communicates parameters at all. (Replicas start identical: the strategy broadcasts rank 0's weights at
    setup.) If :math:`s_{i-1}=0` the change is :math:`+\infty` when :math:`s_i>0`, else 0.
    A non-finite :math:`x_i` (overflowing or NaN gradient) is not added to the window and reports
    :math:`+\infty`, so that rank asks for a sync rather than poisoning its average.

    Cost per step is O(1): the weighted sum is updated recursively (the value leaving the window is removed
    with weight :math:`(1-\alpha)^{W-1}`) and recomputed exactly every ``window`` steps to bound rounding drift.
    """

    def __init__(self, window: int = 25, smoothing: float = 0.25) -> None:
        check_int("window", window, 1)
        check_real("smoothing", smoothing, 0.0, 1.0, low_open=True)
        self.window = window
        self.smoothing = float(smoothing)
        self._decay = 1.0 - self.smoothing
        self._tail_weight = self._decay ** (window - 1)
        self._values: deque[float] = deque(maxlen=window)
        self._numerator = 0.0
        self._since_exact = 0
        self.smoothed: float | None = None
        self.last_delta: float = 0.0
        self.steps = 0

    def _denominator(self) -> float:
        m = len(self._values)
        if self._decay == 0.0:
            return 1.0
        return (1.0 - self._decay**m) / (1.0 - self._decay)

    def _exact_numerator(self) -> float:
        total = 0.0
        weight = 1.0
        for x in reversed(self._values):
            total += weight * x
            weight *= self._decay
        return total

    def update(self, sq_norm: float) -> float:
        """Feed this step's squared gradient norm; return :math:`\\Delta(g_i)` of Eq. 2."""
        self.steps += 1
        if not math.isfinite(sq_norm):
            self.last_delta = math.inf
            return self.last_delta
        if len(self._values) == self.window:
            self._numerator -= self._tail_weight * self._values[0]
        self._values.append(float(sq_norm))
        self._numerator = float(sq_norm) + self._decay * self._numerator
        self._since_exact += 1
        if self._since_exact >= self.window:
            self._numerator = self._exact_numerator()
            self._since_exact = 0
        previous = self.smoothed
        current = self._numerator / self._denominator()
        self.smoothed = current
        if previous is None:
            delta = 0.0
        elif previous == 0.0:
            delta = math.inf if current > 0.0 else 0.0
        else:
            delta = abs(current - previous) / previous
        self.last_delta = delta
        return delta

    def state_dict(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "smoothing": self.smoothing,
            "values": list(self._values),
            "numerator": self._numerator,
            "since_exact": self._since_exact,
            "smoothed": self.smoothed,
            "last_delta": self.last_delta,
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["window"] != self.window or state["smoothing"] != self.smoothing:
            raise ValueError(
                f"checkpointed tracker has window={state['window']}, smoothing={state['smoothing']}; this run "
                f"uses window={self.window}, smoothing={self.smoothing}: resume with the same SelSync arguments"
            )
        self._values = deque((float(v) for v in state["values"]), maxlen=self.window)
        self._numerator = float(state["numerator"])
        self._since_exact = int(state["since_exact"])
        self.smoothed = None if state["smoothed"] is None else float(state["smoothed"])
        self.last_delta = float(state["last_delta"])
        self.steps = int(state["steps"])


def wants_sync(delta: float, threshold: float) -> bool:
    """A rank's vote (Alg. 1 lines 10-11): synchronise when :math:`\\Delta(g_i) \\ge \\delta`.

    ``threshold=0`` always votes (BSP); the first step's :math:`\\Delta=+\\infty` votes for any finite threshold
    and for ``threshold=inf`` too. All ranks synchronise when *any* rank votes (Alg. 1 line 13): the strategy
    sums the votes with one all-reduce and syncs when the sum is positive.
    """
    return delta >= threshold
