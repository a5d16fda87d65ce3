"""Argument checks shared by the core classes and the strategies: a ``ValueError`` that names the argument and
the allowed range, raised at construction."""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Integral, Real
from typing import Any

#: The largest count a window, a period or a seed may take: ``sys.maxsize`` on 64-bit platforms (the bound of a
#: ``deque``'s ``maxlen`` and of a signed 64-bit integer).
MAX_INT64 = (1 << 63) - 1


def check_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    """An integer (not a bool) in ``[minimum, maximum]``."""
    ok = isinstance(value, Integral) and not isinstance(value, bool) and value >= minimum
    if ok and maximum is not None:
        ok = value <= maximum
    if not ok:
        allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be an integer {allowed}, got {value!r}")
    return int(value)


def check_optional_int(name: str, value: Any, minimum: int, none_means: str, maximum: int | None = None) -> int | None:
    """``None`` (which means ``none_means``) or an integer (not a bool) in ``[minimum, maximum]``."""
    if value is None:
        return None
    try:
        return check_int(name, value, minimum, maximum)
    except ValueError:
        rng = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be an integer {rng} or None ({none_means}), got {value!r}") from None


def check_real(
    name: str,
    value: Any,
    low: float = -math.inf,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    allow_inf: bool = False,
) -> float:
    """A real number (not a bool, not NaN) in the interval described by ``low``/``high`` and their openness.

    Without ``allow_inf`` an infinite bound is written open (``[1.0, inf)``): infinity itself is rejected."""
    ok = isinstance(value, Real) and not isinstance(value, bool) and not math.isnan(value)
    if ok:
        v = float(value)
        ok = (allow_inf or math.isfinite(v)) and (v > low if low_open else v >= low)
        ok = ok and (v < high if high_open else v <= high)
    if not ok:
        left = "(" if low_open or (low == -math.inf and not allow_inf) else "["
        right = ")" if high_open or (high == math.inf and not allow_inf) else "]"
        raise ValueError(f"{name} must be a number in {left}{low}, {high}{right}, got {value!r}")
    return float(value)


def check_bool(name: str, value: Any) -> bool:
    """``True`` or ``False`` (not 0/1, not a string)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool (True or False), got {value!r}")
    return value


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> Any:
    """One of ``choices`` (compared by type and value, so ``True`` is not ``1``)."""
    if not any(type(value) is type(c) and value == c for c in choices):
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}, got {value!r}")
    return value


def check_instance(name: str, value: Any, cls: type | tuple[type, ...], what: str, none_ok: bool = True) -> Any:
    """An instance of ``cls`` (``what`` describes it in the message), or ``None`` when ``none_ok``."""
    if (value is None and none_ok) or (value is not None and isinstance(value, cls)):
        return value
    allowed = f"{what} or None" if none_ok else what
    raise ValueError(f"{name} must be {allowed}, got {value!r}")
