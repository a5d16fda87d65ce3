"""Link emulation: make one machine's nearly free loopback communication cost what a real network would."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_RATE_UNITS = {
    "bit": 1.0,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "tbit": 1e12,
    "bps": 1.0,
    "kbps": 1e3,
    "mbps": 1e6,
    "gbps": 1e9,
    "b": 8.0,
    "kb": 8e3,
    "mb": 8e6,
    "gb": 8e9,
}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def _parse_quantity(value: str | float | int, units: dict[str, float], name: str, example: str) -> float:
    """A number with an optional unit suffix (``"1gbit"``, ``"250us"``) or a bare number, scaled to base units."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must look like {example}, got {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-zA-Z/]*)\s*", str(value))
    unit = match.group(2).lower().replace("/s", "ps") if match else ""
    if not match or (unit and unit not in units):
        raise ValueError(f"{name} must look like {example}, got {value!r}")
    return float(match.group(1)) * (units[unit] if unit else 1.0)


def parse_bandwidth(value: str | float | int) -> float:
    """Bandwidth in bits per second from ``"1gbit"``, ``"10Gbps"``, ``"100mbit"``, ``"125MB"`` or a number (bit/s).

    ``bit``, ``kbit``, ``mbit``, ``gbit`` and ``bps``, ``kbps``, ``mbps``, ``gbps`` are bits per second (common
    usage; note that ``tc`` reads ``mbps`` as bytes); ``b``, ``kb``, ``mb``, ``gb`` are bytes per second.
    """
    rate = _parse_quantity(value, _RATE_UNITS, "bandwidth", "'1gbit', '10gbps', '100mbit' or bits/s (a positive rate)")
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"bandwidth must be a positive finite rate, got {value!r}")
    return rate


def parse_duration(value: str | float | int) -> float:
    """Seconds from ``"1ms"``, ``"250us"``, ``"0.5s"`` or a number of seconds (>= 0)."""
    seconds = _parse_quantity(value, _TIME_UNITS, "latency", "'1ms', '250us' or seconds (a duration >= 0)")
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"latency must be a finite duration >= 0, got {value!r}")
    return seconds


@dataclass(frozen=True)
class LinkModel:
    """An emulated network link: every communication operation costs ``latency + bytes / bandwidth``.

    ``bytes`` is what the accounting records for the operation (see :mod:`lightning_sync.comm.cost`): the
    payload this rank sends. The delay is applied where the operation is carried: a blocking collective returns
    that much later; an asynchronous handle is not complete before ``launch time + delay``, so computation
    launched after it really overlaps the emulated transfer. This is emulation on top of the real collective
    (which still runs, over loopback or the real network): a simple per-operation alpha-beta model, one latency per
    operation, no contention between concurrent operations, and the time of the real operation itself is not
    subtracted. Off by default; pass e.g. ``LinkModel(bandwidth="1gbit", latency="1ms")`` to any strategy.
    """

    bandwidth: str | float = "1gbit"
    latency: str | float = "0ms"

    def __post_init__(self) -> None:
        object.__setattr__(self, "_bps", parse_bandwidth(self.bandwidth))
        object.__setattr__(self, "_latency", parse_duration(self.latency))

    @property
    def bits_per_second(self) -> float:
        return self._bps  # type: ignore[attr-defined]

    @property
    def latency_seconds(self) -> float:
        return self._latency  # type: ignore[attr-defined]

    def delay(self, nbytes: int) -> float:
        """Seconds an operation that sends ``nbytes`` takes on this link."""
        return self.latency_seconds + 8.0 * nbytes / self.bits_per_second

    @classmethod
    def parse(cls, spec: str) -> LinkModel:
        """``"1gbit,1ms"`` -> ``LinkModel("1gbit", "1ms")`` (the ``--link`` command-line form)."""
        parts = [p.strip() for p in spec.split(",")]
        if len(parts) not in (1, 2) or not parts[0]:
            raise ValueError(f"link must look like 'BANDWIDTH[,LATENCY]', e.g. '1gbit,1ms', got {spec!r}")
        return cls(bandwidth=parts[0], latency=parts[1] if len(parts) == 2 else "0ms")
