"""SelSync's relative gradient change (Tyagi & Swany, "Accelerating Distributed ML Training via Selective
Synchronization", §III-A, Eq. 2, and Alg. 1 line 8 ``RelativeGradChange``)."""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import torch
from torch import Tensor

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


class DeviceGradientChangeTracker:
    r""":class:`GradientChangeTracker`'s arithmetic on float64 tensors on the gradients' device: a step's
    :math:`\Delta(g_i)` and vote without bringing anything to the host.

    The same operations in the same order on 0-d float64 tensors, so results are bit-identical to the host tracker
    (tested): every product, sum and quotient is its own correctly rounded IEEE operation (separate kernels, so none
    is contracted into a fused multiply-add), divisors are device tensors (CUDA divides by a host scalar as a
    multiplication by its reciprocal, which is not correctly rounded), and the data-independent constants — the
    normalising denominators :math:`\sum_{k<m}(1-\alpha)^k` and the weights of the periodic exact recomputation — are
    the host tracker's own Python floats.

    What depends on the data — whether :math:`x_i` was finite (a non-finite value is not added to the window) — is
    settled one step late: :meth:`update` computes the new state as if :math:`x_i` were finite and returns
    :math:`\Delta(g_i)` (``inf`` if it was not) with the finite flag, both on the device; :meth:`commit` adopts or
    drops that state once the caller has read the flag (SelSync reads it with the vote, after the optimizer step has
    been queued). An update made while the previous one is uncommitted commits it first, reading the flag itself.
    Window bookkeeping (how many values, where the oldest is, steps since the exact recomputation) stays on the host.
    Memory: ``min(window, steps)`` values.
    """

    def __init__(self, window: int = 25, smoothing: float = 0.25, device: torch.device | str = "cpu") -> None:
        check_int("window", window, 1)
        check_real("smoothing", smoothing, 0.0, 1.0, low_open=True)
        self.window = window
        self.smoothing = float(smoothing)
        self.device = torch.device(device)
        self._decay = 1.0 - self.smoothing
        self._tail_weight = self._decay ** (window - 1)
        f64 = dict(dtype=torch.float64, device=self.device)
        self._zero = torch.zeros((), **f64)
        self._values = torch.zeros(min(window, 32), **f64)  # ring of the window's values, grown as needed
        self._count = 0  # values in the window (host tracker: len(self._values))
        self._head = 0  # ring index of the oldest value
        self._since_exact = 0
        self._numerator = torch.zeros((), **f64)
        self._smoothed = torch.zeros((), **f64)
        self._has_smoothed = False
        self._last_delta = torch.zeros((), **f64)
        self._denominators = self._denominator_table(self._values.numel())
        self._pending: dict[str, Any] | None = None
        self.steps = 0

    # ------------------------------------------------------------------ constants (host floats, as the host tracker)
    def _denominator(self, m: int) -> float:
        if self._decay == 0.0:
            return 1.0
        return (1.0 - self._decay**m) / (1.0 - self._decay)

    def _denominator_table(self, capacity: int) -> Tensor:
        return torch.tensor(
            [self._denominator(m) for m in range(capacity + 1)], dtype=torch.float64, device=self.device
        )

    def _grow(self) -> None:
        """Room for one more value (only while the window is not full, so the values are ``[0, count)``)."""
        capacity = min(self.window, 2 * self._values.numel())
        values = torch.zeros(capacity, dtype=torch.float64, device=self.device)
        values[: self._count].copy_(self._values[: self._count])
        self._values = values
        self._denominators = self._denominator_table(capacity)

    # ------------------------------------------------------------------ per step
    def update(self, sq_norm: Tensor) -> tuple[Tensor, Tensor]:
        r"""Feed this step's squared gradient norm (a 0-d tensor on :attr:`device`); return :math:`\Delta(g_i)` of
        Eq. 2 (0-d float64, ``inf`` for a non-finite input) and whether the input was finite (0-d bool), both on the
        device. Call :meth:`commit` with the flag's value before the next update."""
        if self._pending is not None:
            self.commit(bool(self._pending["finite"]))
        self.steps += 1
        x = sq_norm.detach().to(device=self.device, dtype=torch.float64)
        finite = torch.isfinite(x)
        m = self._count
        if m == self._values.numel() and m < self.window:
            self._grow()
        capacity = self._values.numel()
        numerator = self._numerator
        if m == self.window:
            numerator = numerator - self._tail_weight * self._values[self._head]
        numerator = x + self._decay * numerator
        new_count = min(m + 1, self.window)
        since_exact = self._since_exact + 1
        if since_exact >= self.window:
            # the host tracker's exact recomputation: newest first, weights 1, d, d*d, ... (its own loop)
            newest = [(self._head + m - 1 - k) % capacity for k in range(new_count - 1)]
            total, weight = self._zero + 1.0 * x, self._decay
            for i in newest:
                total = total + weight * self._values[i]
                weight *= self._decay
            numerator = total
            since_exact = 0
        current = numerator / self._denominators[new_count]
        if self._has_smoothed:
            previous = self._smoothed
            change = (current - previous).abs() / previous
            at_zero = torch.where(current > 0.0, math.inf, 0.0)
            delta = torch.where(previous == 0.0, at_zero, change)
        else:
            delta = self._zero
        delta = torch.where(finite, delta, math.inf)
        self._last_delta = delta
        slot = (self._head + m) % capacity if m < self.window else self._head
        self._pending = {
            "finite": finite,
            "x": x,
            "numerator": numerator,
            "smoothed": current,
            "count": new_count,
            "head": self._head if m < self.window else (self._head + 1) % capacity,
            "since_exact": since_exact,
            "slot": slot,
        }
        return delta, finite

    def commit(self, finite: bool) -> None:
        """Adopt the last update's state if its input was ``finite`` (the value of the flag it returned), else keep
        the state from before it. Nothing to do when the update was already settled (e.g. by :meth:`state_dict`)."""
        pending, self._pending = self._pending, None
        if pending is None or not finite:
            return
        self._values[pending["slot"]].copy_(pending["x"])
        self._numerator = pending["numerator"]
        self._smoothed = pending["smoothed"]
        self._has_smoothed = True
        self._count = pending["count"]
        self._head = pending["head"]
        self._since_exact = pending["since_exact"]

    @property
    def last_delta(self) -> float:
        """The last :math:`\\Delta(g_i)` (reads the device)."""
        return float(self._last_delta)

    @property
    def smoothed(self) -> float | None:
        """The current smoothed squared norm (reads the device; commits a pending update first)."""
        self._settle()
        return float(self._smoothed) if self._has_smoothed else None

    def _settle(self) -> None:
        if self._pending is not None:
            self.commit(bool(self._pending["finite"]))

    # ------------------------------------------------------------------ state (the host tracker's format)
    def _window_values(self) -> list[float]:
        capacity = self._values.numel()
        order = [(self._head + k) % capacity for k in range(self._count)]
        return [float(v) for v in self._values.cpu()[order].tolist()] if order else []

    def state_dict(self) -> dict[str, Any]:
        """The same dict as :meth:`GradientChangeTracker.state_dict` (checkpoints are interchangeable)."""
        self._settle()
        return {
            "window": self.window,
            "smoothing": self.smoothing,
            "values": self._window_values(),
            "numerator": float(self._numerator),
            "since_exact": self._since_exact,
            "smoothed": float(self._smoothed) if self._has_smoothed else None,
            "last_delta": self.last_delta,
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["window"] != self.window or state["smoothing"] != self.smoothing:
            raise ValueError(
                f"checkpointed tracker has window={state['window']}, smoothing={state['smoothing']}; this run "
                f"uses window={self.window}, smoothing={self.smoothing}: resume with the same SelSync arguments"
            )
        values = [float(v) for v in state["values"]]
        f64 = dict(dtype=torch.float64, device=self.device)
        capacity = min(self.window, max(32, len(values)))
        self._values = torch.zeros(capacity, **f64)
        if values:
            self._values[: len(values)].copy_(torch.tensor(values, dtype=torch.float64))
        self._denominators = self._denominator_table(capacity)
        self._count, self._head = len(values), 0
        self._since_exact = int(state["since_exact"])
        self._numerator = torch.tensor(float(state["numerator"]), **f64)
        self._has_smoothed = state["smoothed"] is not None
        self._smoothed = torch.tensor(float(state["smoothed"]) if self._has_smoothed else 0.0, **f64)
        self._last_delta = torch.tensor(float(state["last_delta"]), **f64)
        self.steps = int(state["steps"])
        self._pending = None
