"""Link emulation: make one machine's nearly free loopback communication cost what a real network would."""

from __future__ import annotations

import math
import re
import threading
import time
from dataclasses import dataclass

from lightning_sync.comm.forksafe import GATE

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
    launched after it really overlaps the emulated transfer. Operations of one rank share its link: a
    :class:`LinkClock` queues their transfers one after another (an asynchronous all-reduce in flight delays the
    next one by its remaining transfer time, as one network interface would). This is emulation on top of the real
    collective (which still runs, over loopback or the real network): an alpha-beta model, one latency per
    operation, and the time of the real operation itself is not subtracted. Off by default; pass e.g.
    ``LinkModel(bandwidth="1gbit", latency="1ms")`` to any strategy.
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


class LinkClock:
    """One rank's emulated outgoing link, shared by all its operations: concurrent transfers share the bandwidth.

    A fluid model of one network interface (TCP flows on one link share it fairly): while ``n`` transfers are
    active each progresses at ``bandwidth / n``; an operation completes one latency after its last byte left. So
    two 10 MB all-reduces launched together on a 1 Gbit/s link both complete after 160 ms, not 80 ms — bucketed or
    overlapped communication gains by hiding transfers behind compute, never by sending in parallel on one link —
    while a 4-byte flag sent during a long transfer is not stuck behind it (it completes after ~latency).

    :meth:`start` registers a transfer when its bytes may start to go out; :meth:`completion` answers when it
    completes: exact once it has, otherwise projected from the transfers active now (a transfer started later can
    still push it back, so waiters re-check: see :meth:`sleep_until_complete`). Thread-safe (a DDP communication
    hook completes futures from another thread). Times are ``time.perf_counter()`` seconds.
    """

    def __init__(self, link: LinkModel) -> None:
        self.link = link
        self._lock = threading.Lock()
        self._bps = link.bits_per_second
        self._now = -math.inf  # the time up to which the fluid state below is computed
        self._active: dict[int, float] = {}  # transfer id -> bits still to send
        self._done: dict[int, float] = {}  # transfer id -> when its last bit left
        self._next_id = 0

    def _advance(self, now: float) -> None:
        """Move the fluid state to ``now`` (no earlier than where it is)."""
        if now <= self._now:
            return
        t = self._now
        while self._active:
            rate = self._bps / len(self._active)
            first = min(self._active.values())
            finish = t + first / rate
            if finish > now:
                sent = (now - t) * rate
                for k in self._active:
                    self._active[k] -= sent
                break
            for k in list(self._active):
                self._active[k] -= first
                if self._active[k] <= 1e-9:
                    del self._active[k]
                    self._done[k] = finish
            t = finish
        self._now = now

    def start(self, nbytes: int, now: float) -> int:
        """A transfer of ``nbytes`` whose bytes may go out from ``now``; returns its id for :meth:`completion`."""
        with self._lock:
            self._advance(now)
            self._now = max(self._now, now)
            key = self._next_id
            self._next_id += 1
            if nbytes > 0:
                self._active[key] = 8.0 * nbytes
            else:
                self._done[key] = now
            return key

    def completion(self, key: int, now: float) -> float:
        """When transfer ``key`` completes (last bit out + latency): exact if it has, else projected from now."""
        with self._lock:
            self._advance(now)
            if key in self._done:
                return self._done[key] + self.link.latency_seconds
            # project: no further arrivals; transfers finish in order of remaining bits
            t, remaining = self._now, sorted(self._active.values())
            sent, n = 0.0, len(remaining)
            for i, bits in enumerate(remaining):
                t += (bits - sent) * (n - i) / self._bps
                sent = bits
                if bits >= self._active[key]:
                    break
            return t + self.link.latency_seconds

    def forget(self, key: int) -> None:
        """Drop the record of a completed transfer (its completion was read for the last time)."""
        with self._lock:
            self._done.pop(key, None)

    def sleep_until_complete(self, key: int) -> float:
        """Block until transfer ``key`` completes (re-checking: later transfers can push it back); return when."""
        while True:
            now = time.perf_counter()
            ready = self.completion(key, now)
            if now >= ready:
                self.forget(key)
                return ready
            with GATE.idle():  # a wait: not a busy stretch of the thread (lightning_sync.comm.forksafe)
                time.sleep(ready - now)

    def delay_alone(self, nbytes: int) -> float:
        """What one transfer of ``nbytes`` costs on an idle link (the :class:`LinkModel`'s delay)."""
        return self.link.delay(nbytes)
