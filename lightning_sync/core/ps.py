"""Parameter-server math: memory-wise sharding, the servers' update rules (ASP, SSP, ALADDIN) and the workers'
mixing. Torch only; the transport that moves these tensors lives in :mod:`lightning_sync.comm.ps`.

References: ALADDIN (``aladdin.md``) Alg. 1 (worker), Alg. 2 (server), §3.2 (α = 1 − 1/√(nπ)), §3.3
(memory-wise sharding); ASP (Hogwild) and SSP as described in Sync-Switch §II-B and SelSync §II-C.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_sync.core.validation import check_int, check_real

#: Server update rules.
MODES = ("asp", "ssp", "aladdin")


def aladdin_alpha(num_workers: int, period: int) -> float:
    """α = 1 − 1/√(nπ) (ALADDIN §3.2): the weight of the global parameters in a worker's PS-triggered update."""
    num_workers = check_int("num_workers", num_workers, 1)
    period = check_int("period", period, 1)
    return 1.0 - 1.0 / math.sqrt(num_workers * period)


def per_push_alpha(pushes_since_update: int) -> float:
    """α_i = 1 − 1/√c̃ (ALADDIN Alg. 2 line 9), c̃ = pushes the server accumulated since its last global update."""
    pushes_since_update = check_int("pushes_since_update", pushes_since_update, 1)
    return 1.0 - 1.0 / math.sqrt(pushes_since_update)


def update_scale_for(update_scale: float | str, pushers: int) -> float:
    r"""The factor a worker's update is multiplied by before it is pushed (ASP, SSP, Sync-Switch's ASP phase).

    The learning rate in the user's optimizer is DDP's: the rate for the average gradient of the global batch of
    ``m`` workers. One DDP step moves the model by :math:`-\eta \frac1m \sum_i g_i`; under ASP each of the ``m``
    workers pushes its own step :math:`-\eta g_i` and the servers add every push, so ``m`` pushes move the model
    ``m`` times as far — the per-sample step is ``m`` times DDP's (and stale), which diverges at DDP's rate. Scaling
    each push by :math:`1/m` (``"auto"``) makes ``m`` pushes move the global model as one DDP step does, in
    expectation: per-sample step equivalence, the linear scaling rule of Sync-Switch §IV-C (BSP's rate = ``m`` ×
    ASP's) with DDP's rate as the anchor. A number is used as given (``1.0``: the papers' literal ASP).
    """
    pushers = check_int("pushers", pushers, 1)
    if isinstance(update_scale, str):
        if update_scale != "auto":
            raise ValueError(f"update_scale must be 'auto' (1/m) or a number in (0.0, inf), got {update_scale!r}")
        return 1.0 / pushers
    try:
        return check_real("update_scale", update_scale, 0.0, low_open=True)
    except ValueError:
        raise ValueError(f"update_scale must be 'auto' (1/m) or a number in (0.0, inf), got {update_scale!r}") from None


def worker_momentum_for(worker_momentum: float | str | None, user_momentum: float, pushers: int) -> float:
    r"""The momentum a worker's own optimizer steps with under asynchronous pushes (ASP, SSP; opt-in for
    Sync-Switch's ASP phase), from the user's (DDP's) momentum :math:`\mu` and the number of ranks pushing :math:`m`.

    Asynchrony begets momentum (Mitliagkas et al., 2016, Thm. 3): with :math:`m` workers pushing in turn, the
    expected update of the global model carries an implicit momentum :math:`1 - 1/m` on top of the workers' own.
    The momentum DDP trains well with is then too much: stale updates overshoot. ``"auto"`` lowers the workers'
    momentum by widening its gap to 1 linearly in :math:`m`, as the time constant of the implicit momentum,
    :math:`1/(1 - (1 - 1/m)) = m`, grows:

    .. math:: 1 - \mu_w = \min\bigl(1, (1 - \mu)\,\tfrac{m + 1}{2}\bigr)

    so one worker (:math:`m = 1`) keeps :math:`\mu`, and :math:`\mu = 0.9` becomes 0.75 for 4 workers, 0.45 for
    10 and 0 from 19 on. The slope 1/2 is calibrated, not derived: ``benchmarks/lr_defaults.py`` measured it on
    the text workload (docs/guide.md, "Learning rates"). ``None`` keeps the user's momentum (the behaviour before); a
    number in ``[0, 1)`` is used as given.
    """
    pushers = check_int("pushers", pushers, 1)
    user_momentum = check_real("user_momentum", user_momentum, 0.0, 1.0, high_open=True)
    if worker_momentum is None:
        return user_momentum
    if isinstance(worker_momentum, str):
        if worker_momentum != "auto":
            raise ValueError(f"worker_momentum must be 'auto', None or a number in [0.0, 1.0), got {worker_momentum!r}")
        return 1.0 - min(1.0, (1.0 - user_momentum) * (pushers + 1) / 2)
    try:
        return check_real("worker_momentum", worker_momentum, 0.0, 1.0, high_open=True)
    except ValueError:
        raise ValueError(
            f"worker_momentum must be 'auto', None or a number in [0.0, 1.0), got {worker_momentum!r}"
        ) from None


def warmup_factor(step: int, warmup_steps: int) -> float:
    """Linear warm-up from 0: ``(step + 1) / warmup_steps`` for the 0-based ``step < warmup_steps``, then 1."""
    step = check_int("step", step, 0)
    warmup_steps = check_int("warmup_steps", warmup_steps, 0)
    return 1.0 if step >= warmup_steps else (step + 1) / warmup_steps


def mix_(local: Tensor, global_: Tensor, alpha: float) -> Tensor:
    """x ← (1 − α)·x + α·x̃ in place (ALADDIN Eq. 3, Alg. 1 line 6: the PS-triggered local update)."""
    return local.mul_(1.0 - alpha).add_(global_, alpha=alpha)


@dataclass(frozen=True)
class ShardPlan:
    """Memory-wise sharding (ALADDIN §3.3) of a flat parameter vector of ``total`` elements.

    The vector is cut into contiguous shards of at most ``max_shard`` elements — a layer larger than that spans
    several shards — and no larger than needed to give every rank a share; shard ``i`` is served by rank
    ``i % world_size``. Each rank's shards, concatenated in order, are its server's state.
    """

    total: int
    world_size: int
    max_shard: int
    shards: tuple[tuple[int, int], ...] = field(init=False)

    def __post_init__(self) -> None:
        check_int("total", self.total, 1)
        check_int("world_size", self.world_size, 1)
        check_int("max_shard", self.max_shard, 1)
        size = min(self.max_shard, math.ceil(self.total / self.world_size))
        shards = tuple((start, min(start + size, self.total)) for start in range(0, self.total, size))
        object.__setattr__(self, "shards", shards)

    def owner(self, shard: int) -> int:
        return shard % self.world_size

    def owned(self, rank: int) -> list[tuple[int, int]]:
        """``(start, end)`` of the shards ``rank`` serves, in order."""
        return [s for i, s in enumerate(self.shards) if self.owner(i) == rank]

    def numel(self, rank: int) -> int:
        return sum(end - start for start, end in self.owned(rank))

    def servers(self) -> list[int]:
        """Ranks that serve at least one shard (every rank unless the vector is smaller than the world)."""
        return sorted({self.owner(i) for i in range(len(self.shards))})

    def gather(self, flat: Tensor, rank: int, out: Tensor | None = None) -> Tensor:
        """``rank``'s shards of ``flat``, concatenated (into ``out`` when given)."""
        parts = [flat[start:end] for start, end in self.owned(rank)]
        if out is None:
            return torch.cat(parts) if len(parts) != 1 else parts[0].clone()
        torch.cat(parts, out=out)
        return out

    def scatter(self, packed: Tensor, rank: int, flat: Tensor) -> None:
        """Write ``rank``'s packed shards back into their places in ``flat``."""
        offset = 0
        for start, end in self.owned(rank):
            flat[start:end].copy_(packed[offset : offset + end - start])
            offset += end - start


@dataclass
class Reply:
    """A server's answer to a worker: its current shards (the global parameters) and, for ALADDIN, the α the
    worker mixes them with (``None``: replace, as in ASP/SSP)."""

    worker: int
    alpha: float | None = None


class ShardServer:
    """One rank's server: the global parameters of its shards and the rules that update them. No threads, no I/O.

    * ``"asp"`` (Hogwild): every pushed delta is added to the global parameters as it arrives; a push that asks
      for a reply gets the fresh global parameters at once.
    * ``"ssp"``: as ASP, but a worker whose clock (pushes received from it) is more than ``staleness`` ahead of the
      slowest *training* worker gets its reply only once that worker has caught up. A worker that reported its
      epoch's data consumed (:meth:`finish_epoch`) does not hold others back for the rest of that epoch.
    * ``"aladdin"`` (Alg. 2): deltas are accumulated (line 6) and applied lazily (line 8) when a worker's
      ``period``-th push since its last global update arrives; that worker then gets the global parameters
      (line 10) with α_i = 1 − 1/√c̃ (line 9). The pushing worker's own delta is accumulated before the test
      (the listing omits it on the triggering push; dropping a worker's update every π steps is surely not meant).
      The accumulated deltas enter the global model with weight 1/n: x̃ ← x̃ + (1/n)·Σ delta. Line 8 as printed
      adds the plain sum, but the analysis rests on x̃ being the average of the workers' models (Lemma 1, Eq. 5;
      the mixing matrix of Eq. 6), which every worker's full local update keeps true only with weight 1/n.
      ``aggregate="sum"`` applies the listing literally (``benchmarks/stragglers.py`` runs both).

    Deltas are what the worker's own optimizer changed (``x_after − x_before``), so for SGD a delta is −η·g and ASP's
    x̃ ← x̃ + delta is Hogwild's x̃ ← x̃ − η·g, whatever optimizer each worker runs.
    """

    def __init__(
        self,
        params: Tensor,
        num_workers: int,
        mode: str = "asp",
        staleness: int = 0,
        period: int = 1,
        record: bool = True,
        aggregate: str = "mean",
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.num_workers = check_int("num_workers", num_workers, 1)
        self.staleness = check_int("staleness", staleness, 0)
        self.period = check_int("period", period, 1)
        if aggregate not in ("mean", "sum"):
            raise ValueError(f"aggregate must be 'mean' or 'sum', got {aggregate!r}")
        self.aggregate = aggregate
        #: weight of an accumulated (ALADDIN) delta in the global model: 1/n ("mean"), 1 ("sum", Alg. 2 as printed)
        self.weight = 1.0 / self.num_workers if aggregate == "mean" else 1.0
        self.params = params
        self.acc = torch.zeros_like(params) if mode == "aladdin" else None
        self.pushes_since_update = 0  # c̃
        self.worker_counts = [0] * num_workers  # c_i
        self.clocks = [0] * num_workers  # pushes received per worker
        self.done_epoch = [-1] * num_workers
        self.epochs = [0] * num_workers
        self.global_updates = 0
        self.replies = [0] * num_workers
        self._waiting: dict[int, int] = {}  # SSP: worker -> clock it asked at
        self.record = record
        #: SSP: (worker, its clock, slowest training worker's clock) at every reply.
        self.pull_log: list[tuple[int, int, int]] = []

    # ------------------------------------------------------------------ events
    def push(self, worker: int, delta: Tensor, epoch: int, want_reply: bool) -> list[Reply]:
        """Apply (or accumulate) ``worker``'s delta; return the replies to send now."""
        self.clocks[worker] += 1
        self.epochs[worker] = epoch
        if self.mode == "aladdin":
            return self._aladdin_push(worker, delta)
        self.params.add_(delta)
        if not want_reply:
            return self._release()
        if self.mode == "asp":
            return [self._reply(worker)]
        self._waiting[worker] = self.clocks[worker]
        return self._release()

    def finish_epoch(self, worker: int, epoch: int) -> list[Reply]:
        """``worker`` found epoch ``epoch``'s data consumed; it stops gating SSP for that epoch."""
        self.done_epoch[worker] = max(self.done_epoch[worker], epoch)
        return self._release()

    def _aladdin_push(self, worker: int, delta: Tensor) -> list[Reply]:
        assert self.acc is not None
        self.acc.add_(delta)  # line 6
        self.pushes_since_update += 1  # line 4
        self.worker_counts[worker] += 1
        if self.worker_counts[worker] < self.period:  # line 5
            return []
        alpha = per_push_alpha(self.pushes_since_update)  # line 9
        self.params.add_(self.acc, alpha=self.weight)  # line 8: lazy global update (x̃ = average, Eq. 5)
        self.acc.zero_()  # line 11
        self.pushes_since_update = 0
        self.worker_counts[worker] = 0
        self.global_updates += 1
        return [self._reply(worker, alpha)]  # line 10

    # ------------------------------------------------------------------ SSP
    def slowest(self, worker: int) -> int:
        """The smallest clock among workers still training in ``worker``'s epoch (``worker`` included)."""
        epoch = self.epochs[worker]
        return min(
            c for w, c in enumerate(self.clocks) if w == worker or self.done_epoch[w] < epoch or self.epochs[w] > epoch
        )

    def may_reply(self, worker: int) -> bool:
        return self.clocks[worker] - self.slowest(worker) <= self.staleness

    def _release(self) -> list[Reply]:
        ready = [w for w in sorted(self._waiting) if self.may_reply(w)]
        for w in ready:
            del self._waiting[w]
        return [self._reply(w) for w in ready]

    @property
    def waiting(self) -> list[int]:
        return sorted(self._waiting)

    def _reply(self, worker: int, alpha: float | None = None) -> Reply:
        self.replies[worker] += 1
        if self.record and self.mode == "ssp":
            self.pull_log.append((worker, self.clocks[worker], self.slowest(worker)))
        return Reply(worker, alpha)

    # ------------------------------------------------------------------ reading
    def view(self, out: Tensor | None = None) -> Tensor:
        """The global parameters including what ALADDIN accumulated but has not applied yet."""
        if out is None:
            out = self.params.clone()
        else:
            out.copy_(self.params)
        if self.acc is not None:
            out.add_(self.acc, alpha=self.weight)
        return out

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "aggregate": self.aggregate,
            "params": self.params.clone(),
            "acc": None if self.acc is None else self.acc.clone(),
            "pushes_since_update": self.pushes_since_update,
            "worker_counts": list(self.worker_counts),
            "clocks": list(self.clocks),
            "done_epoch": list(self.done_epoch),
            "epochs": list(self.epochs),
            "global_updates": self.global_updates,
            "replies": list(self.replies),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (
            state["mode"] != self.mode
            or len(state["clocks"]) != self.num_workers
            or state.get("aggregate", "mean") != self.aggregate
        ):
            raise ValueError(
                f"server state is for mode {state['mode']!r} with {len(state['clocks'])} workers; this server runs "
                f"{self.mode!r} with {self.num_workers}"
            )
        if state["params"].shape != self.params.shape:
            raise ValueError(f"server state holds {state['params'].numel()} elements, this shard {self.params.numel()}")
        self.params.copy_(state["params"])
        if self.acc is not None:
            self.acc.copy_(state["acc"])
        self.pushes_since_update = state["pushes_since_update"]
        self.worker_counts = list(state["worker_counts"])
        self.clocks = list(state["clocks"])
        self.done_epoch = list(state["done_epoch"])
        self.epochs = list(state["epochs"])
        self.global_updates = state["global_updates"]
        self.replies = list(state["replies"])
        self._waiting.clear()


def check_alpha(alpha: float | str | None) -> float | str | None:
    """ALADDIN's ``alpha``: ``None`` (1 − 1/√(nπ)), ``"per_push"`` (Alg. 2 line 9) or a number in (0, 1]."""
    if alpha is None or alpha == "per_push":
        return alpha
    if isinstance(alpha, str):
        raise ValueError(f"alpha must be a number in (0, 1], 'per_push' or None; got {alpha!r}")
    return check_real("alpha", alpha, 0.0, 1.0, low_open=True)
