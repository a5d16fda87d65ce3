"""Periodic parameter averaging: constant period (CPSGD), adaptive period (ADPSGD) and FedAvg's schedule.

* Jiang & Agrawal et al., "Adaptive Periodic Averaging: A Practical Approach to Reducing Communication in
  Distributed Learning": Algorithm 1 (CPSGD, Eq. 4), Algorithm 2 (ADPSGD, Eq. 16) and the warm-up of §IV-B
  ("we use averaging period of 1 for the first epoch for warmup, and then apply Algorithm 2").
* Tyagi & Swany, "Accelerating Distributed ML Training via Selective Synchronization", §II-B: FedAvg "collects
  updates from fraction C of N workers x times in every epoch, such that synchronization factor E = 1/x".

Step indices are 0-based optimizer steps (the ``k`` of both algorithms); "averaging after step k" means after
the local update of step k (Alg. 1 lines 4-6, Alg. 2 lines 7-12).
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any

import torch

from lightning_sync.core.validation import check_int

__all__ = [
    "ADPSGDController",
    "ConstantPeriod",
    "fedavg_participants",
    "fedavg_sync_positions",
    "mean_squared_deviation",
]


class ConstantPeriod:
    r"""CPSGD (Alg. 1): average after the local update of step :math:`k` when :math:`k \bmod p = 0` (line 5),
    i.e. Eq. 4 applies :math:`A_n` at :math:`k = 0, p, 2p, \dots`; plus a warm-up and an offset.

    Warm-up: steps :math:`0, \dots, w-1` always average (period 1, as ADPSGD's first epoch in §IV-B and
    post-local SGD). Afterwards Alg. 1 restarts its count at the end of the warm-up: step :math:`k \ge w`
    averages when :math:`(k - w) \bmod p = o`, with the offset :math:`o \in [0, p-1]`. With ``warmup_steps=0``
    and ``offset=0`` this is exactly Alg. 1, whose first averaging is after step 0; ``offset=period - 1``
    averages after every :math:`p` local steps (steps :math:`p-1, 2p-1, \dots`: torchft's ``LocalSGD`` and
    DiLoCo's ``sync_every``), so when :math:`p` divides an epoch's steps every epoch ends on an averaging; with
    ``period=1`` every step averages (fully synchronous SGD, FULLSGD).

    Stateless: the decision depends only on the step index, so there is nothing to checkpoint.
    """

    def __init__(self, period: int, warmup_steps: int = 0, offset: int = 0) -> None:
        self.period = check_int("period", period, 1)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        self.offset = check_int("offset", offset, 0, self.period - 1)

    def should_average(self, step: int) -> bool:
        """Whether to average after the local update of the 0-based optimizer step ``step``."""
        step = check_int("step", step, 0)
        if step < self.warmup_steps:
            return True
        return (step - self.warmup_steps) % self.period == self.offset

    @staticmethod
    def count(num_steps: int, period: int, warmup_steps: int = 0, offset: int = 0) -> int:
        r"""Number of averagings over steps :math:`0, \dots, K-1`:
        :math:`\min(K, w) + \lceil \max(0, K - w - o) / p \rceil`."""
        num_steps = check_int("num_steps", num_steps, 0)
        period = check_int("period", period, 1)
        warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        offset = check_int("offset", offset, 0, period - 1)
        after = max(0, num_steps - warmup_steps - offset)
        return min(num_steps, warmup_steps) + (after + period - 1) // period


class ADPSGDController:
    r"""ADPSGD (Alg. 2) averaging-period controller, with the paper's warm-up (period 1 for the first epoch,
    §IV-B).

    Per optimizer step :math:`k` (0-based), after the local update (lines 4-7), :meth:`step` increments
    :math:`k` and ``cnt`` (line 5) and says whether to average:

    * **warm-up** (:math:`k <` ``warmup_steps``): average every step (period 1); Alg. 2 is not applied, no
      :math:`S_k` is needed (:meth:`needs_statistic` is False) and ``cnt`` restarts at 0 after each step, so
      Alg. 2 starts with a fresh counter and :math:`p = p_{init}` (lines 1-3) at the first step after it.
    * otherwise average when ``cnt == p`` (line 8), then ``cnt = 0`` (line 9). After that averaging the caller
      computes :math:`S_k` (line 11, see :func:`mean_squared_deviation`) and calls :meth:`observe` with the
      learning rate :math:`\gamma_k`:

      - **sampling** (:math:`k < K_s` = ``sample_steps``, line 13):
        :math:`C_2 \leftarrow \mathrm{RunningAverage}(C_2, S_k/\gamma_k)` (line 14), :math:`p` stays
        :math:`p_{init}`;
      - **adaptive** (lines 16-19): :math:`p \mathrel{+}= 1` if :math:`S_k < \text{low}\cdot\gamma_k C_2`,
        :math:`p \mathrel{-}= 1` if :math:`S_k > \text{high}\cdot\gamma_k C_2` (the paper's 0.7 and 1.3),
        clamped to :math:`[1, \text{max\_period}]` (the paper's :math:`p` is unbounded below and above;
        :math:`p = 0` would never average again, and the upper bound caps the staleness).

    ``sample_steps`` is compared with the global step index, as :math:`k` in line 13 (§IV-B: :math:`K_s = 0.25K`
    with :math:`K` all training iterations; the strategy places it after the warm-up, see
    :class:`~lightning_sync.strategies.ADPSGDStrategy`). Deviation from the letter of Alg. 2: the sampling phase
    lasts until :math:`k \ge K_s` *and* ``min_samples`` values of :math:`S_k/\gamma_k` have been averaged into
    :math:`C_2` (the paper's "first few synchronization steps"; at least 1, so the adaptive comparison never runs
    against the initial :math:`C_2 = 0` of line 3, which would only ever decrease :math:`p`). With
    ``min_samples=1`` and :math:`K_s` beyond the warm-up this is Alg. 2 exactly. (A sampled :math:`C_2 = 0`, e.g.
    one rank, or ranks that never diverge, leaves :math:`p` unchanged while :math:`S_k = 0`.)
    """

    def __init__(
        self,
        p_init: int = 4,
        warmup_steps: int = 0,
        sample_steps: int = 0,
        low: float = 0.7,
        high: float = 1.3,
        max_period: int = 64,
        min_samples: int = 1,
    ) -> None:
        self.max_period = check_int("max_period", max_period, 1)
        self.min_samples = check_int("min_samples", min_samples, 1)
        self.p_init = check_int("p_init", p_init, 1)
        if self.p_init > self.max_period:
            raise ValueError(
                f"p_init must be an integer in [1, max_period] = [1, {self.max_period}], got p_init={p_init!r} with "
                f"max_period={max_period!r}"
            )
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        self.sample_steps = check_int("sample_steps", sample_steps, 0)
        for name, value in (("low", low), ("high", high)):
            if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if not low < high:
            raise ValueError(f"low must be < high, got low={low!r}, high={high!r}")
        self.low = float(low)
        self.high = float(high)
        self._p = self.p_init  # Alg. 2 line 2
        self.c2 = 0.0  # line 3
        self.samples = 0
        self.steps = 0  # k: optimizer steps seen
        self.since_sync = 0  # cnt, line 1
        self.last_s: float | None = None

    @property
    def _k(self) -> int:
        """0-based index of the last step (the next one, before any step)."""
        return max(self.steps - 1, 0)

    @property
    def phase(self) -> str:
        """``"warmup"``, ``"sampling"`` or ``"adaptive"`` for step :math:`k` (the last :meth:`step`)."""
        k = self._k
        if k < self.warmup_steps:
            return "warmup"
        if k < self.sample_steps or self.samples < self.min_samples:
            return "sampling"
        return "adaptive"

    @property
    def period(self) -> int:
        """Current averaging period :math:`p` (1 during warm-up)."""
        return 1 if self._k < self.warmup_steps else self._p

    def step(self) -> bool:
        """Count one optimizer step (Alg. 2 line 5); True when this step must average (lines 8-9)."""
        index = self.steps
        self.steps += 1
        self.since_sync += 1
        if index < self.warmup_steps or self.since_sync >= self._p:
            self.since_sync = 0
            return True
        return False

    def averages_next(self) -> bool:
        """Whether the next :meth:`step` will return True (without counting it): a fault-tolerant run asks for the
        quorum of that averaging a step ahead."""
        return self.steps < self.warmup_steps or self.since_sync + 1 >= self._p

    def needs_statistic(self) -> bool:
        """Whether the averaging just decided needs :math:`S_k` (False during warm-up)."""
        return self.phase != "warmup"

    def observe(self, s_k: float, lr: float) -> None:
        r"""Feed :math:`S_k` (Alg. 2 line 11) and :math:`\gamma_k` after an averaging (lines 13-19).

        A no-op during warm-up (Alg. 2 is not applied there; :meth:`needs_statistic` is False).
        """
        if isinstance(s_k, bool) or not isinstance(s_k, Real) or not math.isfinite(s_k) or s_k < 0:
            raise ValueError(f"s_k must be a finite number >= 0, got {s_k!r}")
        if isinstance(lr, bool) or not isinstance(lr, Real) or not math.isfinite(lr) or lr <= 0:
            raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
        phase = self.phase
        if phase == "warmup":
            return
        s_k = float(s_k)
        lr = float(lr)
        self.last_s = s_k
        if phase == "sampling":
            self.samples += 1
            self.c2 += (s_k / lr - self.c2) / self.samples  # line 14: running average
            return
        target = lr * self.c2
        if s_k < self.low * target:  # lines 16-17
            self._p = min(self._p + 1, self.max_period)
        elif s_k > self.high * target:  # lines 18-19
            self._p = max(self._p - 1, 1)

    def _config(self) -> dict[str, Any]:
        return {
            "p_init": self.p_init,
            "low": self.low,
            "high": self.high,
            "max_period": self.max_period,
            "min_samples": self.min_samples,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            **self._config(),
            "warmup_steps": self.warmup_steps,
            "sample_steps": self.sample_steps,
            "period": self._p,
            "c2": self.c2,
            "samples": self.samples,
            "steps": self.steps,
            "since_sync": self.since_sync,
            "last_s": self.last_s,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpointed controller.

        ``warmup_steps`` and ``sample_steps`` are taken from the checkpoint: they are step positions fixed when
        the run first started (from its length), and a resumed run continues that schedule, so the restoring
        controller may be built with their defaults. ``p_init``, ``low``, ``high``, ``max_period`` and
        ``min_samples`` must match this controller's (ValueError otherwise).
        """
        config = self._config()
        # a checkpoint from before min_samples existed sampled until its first sample: min_samples=1
        saved = {name: state.get(name, 1) if name == "min_samples" else state[name] for name in config}
        if saved != config:
            raise ValueError(
                f"checkpointed ADPSGD controller has {saved}; this run uses {config}: resume with the same "
                f"ADPSGD arguments"
            )
        self.warmup_steps = check_int("warmup_steps", state["warmup_steps"], 0)
        self.sample_steps = check_int("sample_steps", state["sample_steps"], 0)
        self._p = check_int("period", state["period"], 1, self.max_period)
        self.c2 = float(state["c2"])
        self.samples = check_int("samples", state["samples"], 0)
        self.steps = check_int("steps", state["steps"], 0)
        self.since_sync = check_int("since_sync", state["since_sync"], 0)
        self.last_s = None if state["last_s"] is None else float(state["last_s"])


def mean_squared_deviation(sum_sq_dev: float, world_size: int) -> float:
    r""":math:`S_k` of Eq. 16 / Alg. 2 line 11 from the all-reduced :math:`\sum_i \|w_i - \bar w\|^2`.

    .. math:: S_k = \mathrm{Var}[W] = \frac{1}{n} \sum_{i=1}^n \|w_i - \bar w\|^2, \quad
              \bar w = \frac{1}{n}\sum_{j=1}^n w_j

    (Eq. 7's :math:`\mathrm{Var}[W_k]`, evaluated right before the averaging), where :math:`w_i` is rank
    :math:`i`'s whole parameter vector. Each rank computes its own :math:`\|w_i - \bar w\|^2` against the
    freshly averaged parameters (line 10) and one scalar all-reduce (sum) gives ``sum_sq_dev``.
    """
    world_size = check_int("world_size", world_size, 1)
    if isinstance(sum_sq_dev, bool) or not isinstance(sum_sq_dev, Real) or sum_sq_dev < 0:
        raise ValueError(f"sum_sq_dev must be a number >= 0, got {sum_sq_dev!r}")
    return float(sum_sq_dev) / world_size


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def fedavg_participants(world_size: int, fraction: float, seed: int, round_index: int) -> list[int]:
    r"""Ranks whose parameters are averaged in FedAvg round ``round_index`` (SelSync §II-B: "fraction C of N").

    :math:`\lceil C N \rceil` distinct ranks (at least 1), drawn with a CPU :class:`torch.Generator` seeded from
    ``(seed, round_index)`` through SplitMix64, so every rank computes the same set without communication;
    returned sorted. ``fraction == 1`` gives all ranks. :math:`CN` is rounded to 9 decimals before the ceiling
    so that binary floating point does not add a rank (``0.1 * 10`` gives 1 rank, not 2).
    """
    world_size = check_int("world_size", world_size, 1)
    if (
        isinstance(fraction, bool)
        or not isinstance(fraction, Real)
        or not math.isfinite(fraction)
        or not 0.0 < fraction <= 1.0
    ):
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    if isinstance(seed, bool) or not isinstance(seed, Integral):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    round_index = check_int("round_index", round_index, 0)
    k = min(world_size, max(1, math.ceil(round(float(fraction) * world_size, 9))))
    if k == world_size:
        return list(range(world_size))
    mixed = _splitmix64((_splitmix64(int(seed) & _MASK64) + round_index) & _MASK64)
    generator = torch.Generator(device="cpu")
    generator.manual_seed(mixed)
    chosen = torch.randperm(world_size, generator=generator)[:k]
    return sorted(int(r) for r in chosen.tolist())


def fedavg_sync_positions(steps_per_epoch: int, syncs_per_epoch: int) -> list[int]:
    r"""1-based batch positions within an epoch after which FedAvg syncs ("x times in every epoch, uniformly
    spaced", SelSync §II-B, :math:`E = 1/x`).

    Position :math:`j = 1..x` is :math:`\mathrm{round}(j \cdot S / x)` with :math:`S` = ``steps_per_epoch``,
    rounded half up in exact integer arithmetic (not Python's banker's :func:`round`); the positions are
    strictly increasing because :math:`S/x \ge 1`, and the last is :math:`S`. When :math:`x` divides :math:`S`
    this is local SGD with period :math:`S/x`.
    """
    steps_per_epoch = check_int("steps_per_epoch", steps_per_epoch, 1)
    x = check_int("syncs_per_epoch", syncs_per_epoch, 1, steps_per_epoch)
    return [(2 * j * steps_per_epoch + x) // (2 * x) for j in range(1, x + 1)]
