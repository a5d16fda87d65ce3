"""Argument checks shared by the core classes and the strategies: a ``ValueError`` that names the argument and
the allowed range, raised at construction."""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any


def check_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    """An integer (not a bool) in ``[minimum, maximum]``."""
    ok = isinstance(value, Integral) and not isinstance(value, bool) and value >= minimum
    if ok and maximum is not None:
        ok = value <= maximum
    if not ok:
        allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be an integer {allowed}, got {value!r}")
    return int(value)


def check_real(
    name: str,
    value: Any,
    low: float = -math.inf,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    allow_inf: bool = False,
) -> float:
    """A real number (not a bool, not NaN) in the interval described by ``low``/``high`` and their openness."""
    ok = isinstance(value, Real) and not isinstance(value, bool) and not math.isnan(value)
    if ok:
        v = float(value)
        ok = (allow_inf or math.isfinite(v)) and (v > low if low_open else v >= low)
        ok = ok and (v < high if high_open else v <= high)
    if not ok:
        left = "(" if low_open else "["
        right = ")" if high_open else "]"
        raise ValueError(f"{name} must be a number in {left}{low}, {high}{right}, got {value!r}")
    return float(value)
