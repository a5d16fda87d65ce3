"""Sync-Switch: which synchronization protocol to train with, and when to switch (pure math, no Lightning).

Li et al., "Sync-Switch: Hybrid Parameter Synchronization for Distributed Deep Learning":

* §IV-A (protocol policy): start with BSP, then switch to ASP -> :class:`SwitchSchedule`.
* §IV-B1 (offline timing policy): the switch point is a fraction of the training workload; the binary search
  that finds it runs whole training jobs and is not part of this module -> :meth:`SwitchSchedule.switch_at`.
* §IV-B2 (online policies for transient stragglers): sliding-window throughput (:class:`ThroughputWindow`),
  the ``S - sigma`` straggler test (:class:`StragglerDetector`), and the greedy and elastic policies
  (:class:`GreedyPolicy`, :class:`ElasticPolicy`).
* §IV-C (configuration policy: batch ``nB`` and learning rate ``n * eta`` under BSP, ``B`` and ``eta`` under
  ASP, same momentum) is applied by the strategy when it switches; nothing here depends on it.

"Progress" is the fraction of the total training workload done, in ``[0, 1]``; "BSP progress" is the fraction
of the total workload trained with BSP so far (its target is :attr:`SwitchSchedule.bsp_fraction`).
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from numbers import Real
from pathlib import Path
from typing import Any

from lightning_sync.core.validation import check_int, check_real

__all__ = [
    "PROTOCOLS",
    "ElasticPolicy",
    "GreedyPolicy",
    "StragglerDetector",
    "SwitchSchedule",
    "ThroughputWindow",
]

PROTOCOLS = ("bsp", "asp")

_QUOTA_TOL = 1e-9
# Relative slack of the straggler test: ``S - sigma`` is computed in floating point, and for two workers it
# equals the slower one's throughput only up to rounding (half of random pairs would otherwise be "below").
_BELOW_REL_TOL = 1e-9
_COMPACT_ITEM = re.compile(r"^\s*([A-Za-z]+)\s*:\s*([^\s,:]+)\s*$")


def _check_protocol(name: str, value: Any) -> str:
    if not isinstance(value, str) or value.strip().lower() not in PROTOCOLS:
        raise ValueError(f"{name} must be one of {', '.join(PROTOCOLS)} (case-insensitive), got {value!r}")
    return value.strip().lower()


class SwitchSchedule:
    """Protocol per fraction of the total training workload (§IV-A: BSP first, then ASP; §IV-B1: the switch
    point is a fraction of the workload).

    ``segments`` is a non-empty sequence of ``(protocol, end_fraction)`` pairs; segment ``i`` covers progress
    ``[end_{i-1}, end_i)`` with ``end_{-1} = 0``. Ends are strictly increasing real numbers in ``(0, 1]`` and
    the last one is 1.0, so the schedule covers the whole run. Consecutive segments with the same protocol are
    merged. Any order of protocols is accepted (the paper recommends BSP -> ASP; §IV-A, Fig. 5a).
    """

    def __init__(self, segments: Sequence[Sequence[Any]]) -> None:
        if isinstance(segments, (str, bytes, Mapping)) or not isinstance(segments, Sequence) or not segments:
            raise ValueError(
                f"schedule must be a non-empty sequence of (protocol, end_fraction) pairs, got {segments!r}"
            )
        merged: list[tuple[str, float]] = []
        previous = 0.0
        for i, pair in enumerate(segments):
            if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
                raise ValueError(f"schedule[{i}] must be a (protocol, end_fraction) pair, got {pair!r}")
            protocol = _check_protocol(f"schedule[{i}] protocol", pair[0])
            end = check_real(f"schedule[{i}] end fraction", pair[1], 0, 1, low_open=True)
            if end <= previous:
                raise ValueError(
                    f"schedule end fractions must be strictly increasing, got {end!r} at schedule[{i}] after "
                    f"{previous!r}"
                )
            previous = end
            if merged and merged[-1][0] == protocol:
                merged[-1] = (protocol, end)
            else:
                merged.append((protocol, end))
        if previous != 1.0:
            raise ValueError(f"schedule must cover the whole run: the last end fraction must be 1.0, got {previous!r}")
        self.segments: tuple[tuple[str, float], ...] = tuple(merged)

    def _index(self, progress: float) -> int:
        p = min(max(check_real("progress", progress, allow_inf=True), 0.0), 1.0)
        for i, (_, end) in enumerate(self.segments):
            if p < end:
                return i
        return len(self.segments) - 1  # progress == 1.0 belongs to the last segment

    def protocol_at(self, progress: float) -> str:
        """Protocol of the segment containing ``progress`` (clamped to ``[0, 1]``)."""
        return self.segments[self._index(progress)][0]

    def next_boundary(self, progress: float) -> float:
        """End fraction of the segment containing ``progress`` (clamped to ``[0, 1]``)."""
        return self.segments[self._index(progress)][1]

    @property
    def bsp_fraction(self) -> float:
        """Total fraction of the workload trained with BSP: the BSP quota of the online policies (§IV-B2)."""
        total, start = 0.0, 0.0
        for protocol, end in self.segments:
            if protocol == "bsp":
                total += end - start
            start = end
        return total

    @classmethod
    def switch_at(cls, fraction: float) -> SwitchSchedule:
        """BSP until ``fraction`` of the workload, then ASP (§IV-B1's switch point ``s``); 0 is all ASP, 1 all
        BSP."""
        fraction = check_real("fraction", fraction, 0, 1)
        if fraction == 0.0:
            return cls([("asp", 1.0)])
        if fraction == 1.0:
            return cls([("bsp", 1.0)])
        return cls([("bsp", fraction), ("asp", 1.0)])

    @classmethod
    def parse(cls, value: Any) -> SwitchSchedule:
        """A schedule from: a :class:`SwitchSchedule` (returned as is); a sequence of ``(protocol, end)`` pairs;
        a sequence of ``{"protocol": ..., "until": ...}`` dicts; a compact string ``"bsp:0.25,asp:1.0"``; or a
        path (``str`` or :class:`~pathlib.Path`) to an existing YAML file whose top-level mapping has the key
        ``schedule`` holding one of the list forms."""
        if isinstance(value, SwitchSchedule):
            return value
        if isinstance(value, Path):
            if not value.is_file():
                raise ValueError(f"schedule file {str(value)!r} does not exist")
            return cls._from_yaml_file(value)
        if isinstance(value, str):
            if Path(value).is_file():
                return cls._from_yaml_file(Path(value))
            pairs = cls._compact_pairs(value)
            if pairs is None:
                raise ValueError(
                    f"schedule {value!r} is neither an existing YAML file nor a compact schedule like "
                    f"'bsp:0.25,asp:1.0'"
                )
            return cls(pairs)
        return cls._from_list(value)

    @staticmethod
    def _compact_pairs(text: str) -> list[tuple[str, float]] | None:
        pairs = []
        for item in text.split(","):
            match = _COMPACT_ITEM.match(item)
            if match is None:
                return None
            try:
                pairs.append((match.group(1), float(match.group(2))))
            except ValueError:
                return None
        return pairs

    @classmethod
    def _from_list(cls, value: Any) -> SwitchSchedule:
        if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
            raise ValueError(
                "schedule must be a SwitchSchedule, a list of (protocol, end_fraction) pairs, a list of "
                f"{{'protocol': ..., 'until': ...}} dicts, a compact string or a YAML file path, got {value!r}"
            )
        pairs: list[Any] = []
        for i, item in enumerate(value):
            if isinstance(item, Mapping):
                if set(item) != {"protocol", "until"}:
                    raise ValueError(
                        f"schedule[{i}] must have exactly the keys 'protocol' and 'until', got {dict(item)!r}"
                    )
                item = (item["protocol"], item["until"])
            pairs.append(item)
        return cls(pairs)

    @classmethod
    def _from_yaml_file(cls, path: Path) -> SwitchSchedule:
        import yaml

        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            raise ValueError(f"schedule file {str(path)!r} is not valid YAML: {err}") from err
        if not isinstance(data, Mapping) or "schedule" not in data:
            raise ValueError(f"schedule file {str(path)!r} must be a YAML mapping with the key 'schedule'")
        return cls._from_list(data["schedule"])

    def as_list(self) -> list[list[Any]]:
        """``[[protocol, end_fraction], ...]`` as plain lists, for YAML and JSON."""
        return [[protocol, end] for protocol, end in self.segments]

    def to_yaml(self, comment: str | None = None) -> str:
        """A YAML snippet ``schedule: [[protocol, end], ...]`` (one pair per line), preceded by ``# comment``
        lines when ``comment`` is given; :meth:`parse` reads a file holding it back."""
        import yaml

        body = yaml.safe_dump({"schedule": self.as_list()}, default_flow_style=None, sort_keys=False)
        if comment is None:
            return body
        header = "".join(f"# {line}".rstrip() + "\n" for line in comment.splitlines())
        return header + body

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SwitchSchedule):
            return NotImplemented
        return self.segments == other.segments

    def __hash__(self) -> int:
        return hash(self.segments)

    def __repr__(self) -> str:
        return f"SwitchSchedule({list(self.segments)!r})"


class ThroughputWindow:
    """Training throughput of one worker over tumbling windows of ``window`` consecutive steps (§IV-B2: "its
    training throughput over a sliding window S_k").

    :meth:`record` adds one step; every ``window``-th call returns that window's samples per second and starts
    a new window. A window with zero measured seconds has infinite throughput.
    """

    def __init__(self, window: int) -> None:
        self.window = check_int("window", window, 1)
        self.last: float | None = None
        self.reset()

    def reset(self) -> None:
        """Drop the partial window (``last``, the latest completed window's throughput, is kept)."""
        self._steps = 0
        self._samples = 0
        self._seconds = 0.0

    def record(self, samples: int, seconds: float) -> float | None:
        """Add one step; the window's throughput (samples/s) when this step completes it, else None."""
        self._samples += check_int("samples", samples, 0)
        self._seconds += check_real("seconds", seconds, 0)
        self._steps += 1
        if self._steps < self.window:
            return None
        throughput = self._samples / self._seconds if self._seconds > 0 else math.inf
        self.last = throughput
        self.reset()
        return throughput

    def state_dict(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "steps": self._steps,
            "samples": self._samples,
            "seconds": self._seconds,
            "last": self.last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["window"] != self.window:
            raise ValueError(
                f"checkpointed throughput window has window={state['window']}; this run uses window={self.window}"
            )
        self._steps = int(state["steps"])
        self._samples = int(state["samples"])
        self._seconds = float(state["seconds"])
        self.last = None if state["last"] is None else float(state["last"])


class StragglerDetector:
    r"""Transient-straggler test of §IV-B2: "a worker k is identified as a straggler if its training throughput
    over a sliding window :math:`S_k` is lower than the difference between the cluster average and standard
    deviation :math:`S - \sigma`, for a number of consecutive detection windows".

    Per detection window (:meth:`update`), :math:`S` and :math:`\sigma` (population standard deviation,
    ddof=0) are taken over the workers measured in that window. A measured worker is *below* when its
    throughput is under the threshold :math:`\min(S - \sigma, (1 - m) S)`, strictly; it is flagged once it has
    been below in ``consecutive`` consecutive windows in which it was measured.

    ``margin`` :math:`m` is an addition to the paper's rule (``margin=0`` is the rule as printed): with 3-4
    workers, :math:`S - \sigma` alone flags whichever worker is a lone outlier however small the gap (with
    throughputs :math:`(1, 1, 1 - \epsilon)`, :math:`S - \sigma = 1 - 0.8\epsilon`, so the third worker is
    below for every :math:`\epsilon > 0`), i.e. a worker a few percent slower from noise alone. Requiring also
    :math:`S_k < (1 - m) S` flags only workers that are really slow.

    With 2 measured workers the slower one is exactly :math:`S - \sigma` and the strict test never holds: the
    online policies need at least 3 workers. (The comparison has a relative slack of 1e-9 so that rounding in
    :math:`S - \sigma` does not break this.)

    A throughput of ``None``, NaN or infinity (a window with no measured time) means "not measured this
    window" (e.g. a worker excluded by the elastic policy): it is left out of :math:`S` and :math:`\sigma` and
    its consecutive count is unchanged. A window with fewer than 2 measured workers flags nothing and changes
    no count.
    """

    def __init__(self, world_size: int, consecutive: int = 3, margin: float = 0.2) -> None:
        self.world_size = check_int("world_size", world_size, 1)
        self.consecutive = check_int("consecutive", consecutive, 1)
        self.margin = check_real("margin", margin, 0, 1, high_open=True)
        self.counters = [0] * self.world_size
        self.windows = 0
        self.history: list[dict[str, Any]] = []
        self._flagged: set[int] = set()

    @property
    def flagged(self) -> set[int]:
        """Ranks flagged by the latest :meth:`update`."""
        return set(self._flagged)

    def _measured(self, throughputs: Sequence[float | None]) -> dict[int, float]:
        if hasattr(throughputs, "tolist"):  # a tensor or an array gathered from the ranks
            throughputs = throughputs.tolist()
        if isinstance(throughputs, (str, bytes)) or not isinstance(throughputs, Iterable):
            raise ValueError(f"throughputs must be a sequence of {self.world_size} numbers or None")
        values = list(throughputs)
        if len(values) != self.world_size:
            raise ValueError(
                f"throughputs must have one entry per rank (world_size={self.world_size}), got {len(values)}"
            )
        measured = {}
        for rank, value in enumerate(values):
            if value is None:
                continue
            if not isinstance(value, Real) or isinstance(value, bool) or value < 0:
                raise ValueError(f"throughputs[{rank}] must be a number >= 0, NaN or None, got {value!r}")
            if math.isfinite(value):
                measured[rank] = float(value)
        return measured

    def update(self, throughputs: Sequence[float | None]) -> set[int]:
        """One detection window: each rank's window throughput (``None``/NaN: not measured). Returns the ranks
        currently flagged (below the threshold in ``consecutive`` consecutive measured windows)."""
        measured = self._measured(throughputs)
        record: dict[str, Any] = {"window": self.windows, "mean": None, "std": None, "threshold": None, "below": []}
        self.windows += 1
        if len(measured) < 2:
            self._flagged = set()
            self.history.append(record)
            return set()
        n = len(measured)
        mean = math.fsum(measured.values()) / n
        std = math.sqrt(math.fsum((v - mean) ** 2 for v in measured.values()) / n)
        threshold = min(mean - std, (1.0 - self.margin) * mean)
        cut = threshold - _BELOW_REL_TOL * abs(mean)
        below = sorted(rank for rank, v in measured.items() if v < cut)
        for rank in measured:
            self.counters[rank] = self.counters[rank] + 1 if rank in below else 0
        self._flagged = {rank for rank, count in enumerate(self.counters) if count >= self.consecutive}
        record.update(mean=mean, std=std, threshold=threshold, below=below)
        self.history.append(record)
        return set(self._flagged)

    def state_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "counters": list(self.counters),
            "windows": self.windows,
            "flagged": sorted(self._flagged),
            "history": copy.deepcopy(self.history),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["world_size"] != self.world_size:
            raise ValueError(
                f"checkpointed straggler detector has world_size={state['world_size']}; this run uses "
                f"world_size={self.world_size}"
            )
        self.counters = [int(c) for c in state["counters"]]
        self.windows = int(state["windows"])
        self._flagged = {int(r) for r in state.get("flagged", [])}
        self.history = copy.deepcopy(list(state.get("history", [])))


class _QuotaPolicy:
    """Shared state of the §IV-B2 online policies: the BSP quota and the event log."""

    def __init__(self, bsp_quota: float) -> None:
        self.bsp_quota = check_real("bsp_quota", bsp_quota, 0, 1)
        self.events: list[dict[str, Any]] = []

    def quota_done(self, bsp_progress: float) -> bool:
        """Whether ``bsp_progress`` (fraction of the total workload trained with BSP) has reached the quota."""
        return check_real("bsp_progress", bsp_progress, 0) >= self.bsp_quota - _QUOTA_TOL

    def _event(self, step: int, event: str, ranks: Iterable[int], protocol: str, **extra: Any) -> None:
        self.events.append({"step": step, "event": event, "ranks": sorted(ranks), "protocol": protocol, **extra})

    def state_dict(self) -> dict[str, Any]:
        return {"bsp_quota": self.bsp_quota, "events": copy.deepcopy(self.events)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["bsp_quota"] != self.bsp_quota:
            raise ValueError(
                f"checkpointed policy has bsp_quota={state['bsp_quota']}; this run uses bsp_quota={self.bsp_quota}: "
                "resume with the same schedule"
            )
        self.events = copy.deepcopy(list(state["events"]))


class GreedyPolicy(_QuotaPolicy):
    """Greedy online policy of §IV-B2: "simply switches to ASP (if it is not already using ASP ...) when a
    straggler is detected; once the cluster is free of any stragglers and the aggregate BSP training has not
    been satisfied, it will switch back to training with BSP". Once the BSP quota is done it trains with ASP.

    Events: ``quota_done`` (once, ranks ``[]``), ``straggler_switch_to_asp`` (ranks: the stragglers),
    ``clear_switch_to_bsp`` (ranks ``[]``); none when the protocol does not change.
    """

    def __init__(self, bsp_quota: float) -> None:
        super().__init__(bsp_quota)
        self._quota_reported = False

    def decide(self, step: int, protocol: str, bsp_progress: float, stragglers: set[int]) -> str:
        """The protocol to train with from now on, given the current ``protocol`` and flagged ``stragglers``."""
        step = check_int("step", step, 0)
        protocol = _check_protocol("protocol", protocol)
        if self.quota_done(bsp_progress):
            if not self._quota_reported:
                self._quota_reported = True
                self._event(step, "quota_done", [], "asp")
            return "asp"
        if stragglers:
            if protocol == "bsp":
                self._event(step, "straggler_switch_to_asp", stragglers, "asp")
            return "asp"
        if protocol == "asp":
            self._event(step, "clear_switch_to_bsp", [], "bsp")
        return "bsp"

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "quota_reported": self._quota_reported}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._quota_reported = bool(state["quota_reported"])


class ElasticPolicy(_QuotaPolicy):
    """Elastic online policy of §IV-B2: "removes any detected stragglers from the current cluster so as to
    complete the specified amount of BSP training free of stragglers. Once the designated BSP workload is
    fulfilled, it will then restore the cluster size and train the remaining workload with ASP."

    Before the quota is done the protocol is BSP and each new straggler is excluded while at least
    ``min_participants`` workers remain; excluded workers are not re-admitted before the quota is done,
    except by :meth:`release`. Events: ``exclude`` (the newly excluded ranks), ``exclude_refused`` (once per
    rank until the next release), ``quota_done_restore`` (once, the ranks that were excluded), ``release``
    (with a ``reason``).
    """

    def __init__(self, bsp_quota: float, world_size: int, min_participants: int = 2) -> None:
        super().__init__(bsp_quota)
        self.world_size = check_int("world_size", world_size, 1)
        self.min_participants = check_int("min_participants", min_participants, 1)
        self.excluded: set[int] = set()
        self._refused: set[int] = set()
        self._restored = False

    def decide(self, step: int, bsp_progress: float, stragglers: set[int]) -> tuple[str, frozenset[int]]:
        """``(protocol, excluded ranks)`` to train with from now on, given the flagged ``stragglers``."""
        step = check_int("step", step, 0)
        for rank in stragglers:
            check_int("straggler rank", rank, 0, self.world_size - 1)
        if self.quota_done(bsp_progress):
            if not self._restored:
                self._restored = True
                self._event(step, "quota_done_restore", self.excluded, "asp")
                self.excluded = set()
            return "asp", frozenset()
        newly, refused = [], []
        for rank in sorted(set(stragglers) - self.excluded):
            if self.world_size - len(self.excluded) - 1 >= self.min_participants:
                self.excluded.add(rank)
                newly.append(rank)
            elif rank not in self._refused:
                self._refused.add(rank)
                refused.append(rank)
        if newly:
            self._event(step, "exclude", newly, "bsp")
        if refused:
            self._event(step, "exclude_refused", refused, "bsp")
        return "bsp", frozenset(self.excluded)

    def release(self, step: int, reason: str) -> frozenset[int]:
        """Re-admit every excluded worker now (the strategy must restore the full cluster early); returns them."""
        step = check_int("step", step, 0)
        released = frozenset(self.excluded)
        self.excluded = set()
        self._refused = set()
        self._event(step, "release", released, "asp" if self._restored else "bsp", reason=reason)
        return released

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "world_size": self.world_size,
            "min_participants": self.min_participants,
            "excluded": sorted(self.excluded),
            "refused": sorted(self._refused),
            "restored": self._restored,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["world_size"] != self.world_size:
            raise ValueError(
                f"checkpointed elastic policy has world_size={state['world_size']}; this run uses "
                f"world_size={self.world_size}"
            )
        super().load_state_dict(state)
        self.excluded = {int(r) for r in state["excluded"]}
        self._refused = {int(r) for r in state["refused"]}
        self._restored = bool(state["restored"])
