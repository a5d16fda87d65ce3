r"""DiLoCo's outer optimizer for parameter averaging (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication
Training of Language Models", arXiv 2311.08105, Algorithm 1).

Periodic methods average the replicas and every rank takes the mean. DiLoCo treats the round's change as a
gradient instead: with :math:`\theta^{(t-1)}` the global parameters every replica started the round from and
:math:`\theta_i^{(t)}` replica :math:`i`'s parameters after its inner steps,

.. math::

    \Delta^{(t)} = \theta^{(t-1)} - \frac{1}{N}\sum_{i=1}^N \theta_i^{(t)}
    \qquad \text{(Algorithm 1's outer gradient)}

and an outer optimizer steps :math:`\theta^{(t)} = \mathrm{OuterOpt}(\theta^{(t-1)}, \Delta^{(t)})` (the outer
step), which every replica takes. The paper's outer optimizer is SGD with Nesterov momentum, lr 0.7, momentum
0.9; outer lr 1 without momentum is plain averaging, :math:`\theta^{(t)} = \theta^{(t-1)} - \Delta^{(t)} =
\text{mean}`.

**The outer momentum follows the inner learning rate** (``inner_lr_scaling``, on by default): SlowMo (Wang et al.
2020, "SlowMo: Improving Communication-Efficient Distributed SGD with Slow Momentum", ICLR, Algorithm 1) keeps the
slow momentum in units of the inner learning rate :math:`\gamma_t`,
:math:`u \leftarrow \beta u + \Delta/\gamma_t,\ \theta \leftarrow \theta - \alpha\gamma_t u`. In the
parameter units used here (:math:`b = \gamma_t u`) that is the momentum decay multiplied by
:math:`\gamma_t/\gamma_{t-1}`: :math:`b \leftarrow \mu\,(\gamma_t/\gamma_{t-1})\, b + \Delta`. With a constant
inner learning rate nothing changes; under a schedule that lowers it (OneCycle, cosine, steps), the outer momentum
shrinks with it instead of carrying pseudo-gradients of the high-rate phase into the annealed one. Measured: DiLoCo's
paper optimizer (lr 0.7, Nesterov 0.9) over SGD with momentum and a per-step OneCycle schedule ended at 0.51 / 0.78
validation accuracy (seeds 0, 1) against DDP's 0.97 without the scaling, and at 0.953 / 0.961 with it
(``benchmarks/dropin.py``'s script, 2 ranks, H = 16; docs/strategies/diloco.md, "The outer optimizer on an ordinary
script").

Here the mean comes from the strategies' all-reduce of the flat parameter buffer (one collective, as for plain
averaging); :class:`OuterOptimizer` keeps :math:`\theta^{(t-1)}` and the momentum in persistent flat buffers of the
same layout, so a sync allocates nothing, and steps any contiguous range of them (Streaming DiLoCo's fragments).
No Lightning, no ``torch.distributed``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from lightning_sync.core.validation import check_bool, check_real

__all__ = [
    "ADAPTIVE_OPTIMIZERS",
    "DILOCO_OUTER",
    "SLOWMO_OUTER",
    "OuterOptimizer",
    "OuterSGD",
    "auto_outer_optimizer",
    "parse_outer_optimizer",
]

#: the keys an outer optimizer spec may hold (``name`` and ``lr`` are required)
SPEC_KEYS = ("name", "lr", "momentum", "nesterov", "inner_lr_scaling")


@dataclass(frozen=True)
class OuterSGD:
    r"""Outer SGD as ``torch.optim.SGD`` defines it (no dampening, no weight decay), on the outer gradient
    :math:`\Delta`:

    .. math::

        b \leftarrow \mu b + \Delta, \qquad
        d = \begin{cases} \Delta + \mu b & \text{Nesterov} \\ b & \text{momentum } \mu > 0 \\ \Delta & \mu = 0
            \end{cases}, \qquad
        \theta \leftarrow \theta - \eta\, d

    with :math:`b` starting at 0 (so the first step's :math:`b = \Delta`, as ``torch.optim.SGD`` initialises its
    buffer). With ``inner_lr_scaling`` (default) and momentum, the decay :math:`\mu` is multiplied by
    :math:`\gamma_t/\gamma_{t-1}`, the inner learning rate of this outer step over the previous one's (SlowMo's slow
    momentum, module docstring); with a constant inner rate, or when the caller passes none, it is
    ``torch.optim.SGD``'s arithmetic exactly. Use :func:`parse_outer_optimizer` to build one from a user's spec.
    """

    lr: float
    momentum: float = 0.0
    nesterov: bool = False
    inner_lr_scaling: bool = True

    def spec(self) -> dict[str, Any]:
        """The dict form :func:`parse_outer_optimizer` accepts (and checkpoints record)."""
        return {"name": "sgd", **asdict(self)}


#: DiLoCo's outer optimizer (the paper's: SGD, Nesterov momentum 0.9, lr 0.7; the momentum follows the inner
#: learning rate, ``inner_lr_scaling``), as a spec
DILOCO_OUTER: Mapping[str, Any] = MappingProxyType(
    {"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True, "inner_lr_scaling": True}
)


#: SlowMo's outer step over SGD inner optimizers (Wang et al. 2020, Algorithm 1 with slow lr α = 1 and slow momentum
#: β = 0.5, the defaults of fairscale's ``SlowMoDistributedDataParallel``), as a spec; opt-in (``outer_optimizer=
#: "auto"`` chooses plain averaging over SGD, see :func:`auto_outer_optimizer`)
SLOWMO_OUTER: Mapping[str, Any] = MappingProxyType(
    {"name": "sgd", "lr": 1.0, "momentum": 0.5, "nesterov": False, "inner_lr_scaling": True}
)

#: inner optimizers with per-coordinate adaptive steps (the Adam family and its relatives): DiLoCo's setting
ADAPTIVE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = tuple(
    getattr(torch.optim, name)
    for name in (
        "Adam",
        "AdamW",
        "Adamax",
        "NAdam",
        "RAdam",
        "Adagrad",
        "Adadelta",
        "RMSprop",
        "SparseAdam",
        "Adafactor",
    )
    if hasattr(torch.optim, name)
)


def auto_outer_optimizer(optimizers: Sequence[torch.optim.Optimizer]) -> tuple[OuterSGD | None, str]:
    r"""The outer optimizer for the user's inner optimizer(s), with the reason (``outer_optimizer="auto"``); ``None``
    is plain averaging (:math:`\theta^{(t)} = \text{mean}`, Algorithm 1 with outer lr 1 and no momentum).

    * every inner optimizer adaptive (:data:`ADAPTIVE_OPTIMIZERS`, e.g. AdamW): DiLoCo's, :data:`DILOCO_OUTER`
      (Douillard et al. 2023 train with inner AdamW; outer Nesterov SGD, lr 0.7, momentum 0.9), the setting that
      paper measured over that kind of inner optimizer;
    * otherwise (SGD, with or without momentum, or anything else): plain averaging. An outer momentum over an inner
      SGD with momentum did not hold on an ordinary model (issue 51; ``benchmarks/dropin.py``, docs/strategies/
      diloco.md, "Defaults on an ordinary model"): SlowMo's outer step (lr 1, heavy-ball 0.5, :data:`SLOWMO_OUTER`),
      the previous default here, ended 1.9-3.5 points below DDP over 10 seeds of a ResNet-style CNN with Nesterov
      SGD and a per-step OneCycle schedule where plain averaging ended 1.3-2.7 below (the rest is the local step's
      gradient clipping), cost more the more often it stepped (H = 4: 3.6-4.0 points), and with a constant rate
      it collapsed the model (0.45 validation accuracy against DDP's 0.80 and plain averaging's 0.82); on the
      ``words`` workload it diverged on one seed of three at 100 Mbit/s. DiLoCo's setting diverged on ``words``
      too. A spec such as :data:`SLOWMO_OUTER` chooses an outer step explicitly.

    ``optimizers`` must not be empty (ValueError).
    """
    if not optimizers:
        raise ValueError("outer_optimizer='auto' needs the inner optimizer(s) to choose from, got none")
    names = ", ".join(type(o).__name__ for o in optimizers)
    if all(isinstance(o, ADAPTIVE_OPTIMIZERS) for o in optimizers):
        config = parse_outer_optimizer(DILOCO_OUTER)
        assert config is not None
        return config, f"DiLoCo's (inner {names}: adaptive, as the paper's AdamW)"
    return None, f"plain averaging (inner {names}: not adaptive; an outer momentum over it did not hold, issue 51)"


def parse_outer_optimizer(spec: Any, argument: str = "outer_optimizer") -> OuterSGD | None:
    """``None`` (plain averaging) or an :class:`OuterSGD` from a mapping such as ``{"name": "sgd", "lr": 0.7,
    "momentum": 0.9, "nesterov": True}``.

    ``name`` must be ``"sgd"``, ``lr`` a finite number > 0, ``momentum`` (default 0) in [0, 1), ``nesterov``
    (default False) a bool, and Nesterov needs momentum > 0 (as ``torch.optim.SGD``); ``inner_lr_scaling`` (default
    True: the momentum follows the inner learning rate, :class:`OuterSGD`) a bool. Anything else raises
    ``ValueError`` naming ``argument`` and the key with its allowed range.
    """
    if spec is None:
        return None
    if isinstance(spec, OuterSGD):
        return spec
    example = "{'name': 'sgd', 'lr': 0.7, 'momentum': 0.9, 'nesterov': True}"
    if not isinstance(spec, Mapping):
        raise ValueError(f"{argument} must be None (plain averaging) or a mapping such as {example}, got {spec!r}")
    unknown = [k for k in spec if k not in SPEC_KEYS]
    if unknown:
        raise ValueError(
            f"{argument} has unknown keys {unknown!r}: the allowed keys are {', '.join(SPEC_KEYS)} (e.g. {example})"
        )
    for key in ("name", "lr"):
        if key not in spec:
            raise ValueError(f"{argument} must give {key!r} (e.g. {example}), got {dict(spec)!r}")
    if spec["name"] != "sgd" or not isinstance(spec["name"], str):
        raise ValueError(
            f"{argument}['name'] must be 'sgd' (outer SGD with optional Nesterov momentum, as DiLoCo), "
            f"got {spec['name']!r}"
        )
    lr = check_real(f"{argument}['lr']", spec["lr"], 0.0, math.inf, low_open=True)
    momentum = check_real(f"{argument}['momentum']", spec.get("momentum", 0.0), 0.0, 1.0, high_open=True)
    nesterov = check_bool(f"{argument}['nesterov']", spec.get("nesterov", False))
    if nesterov and momentum == 0.0:
        raise ValueError(
            f"{argument}['nesterov'] = True needs {argument}['momentum'] in (0.0, 1.0), got momentum {momentum!r}"
        )
    scaling = check_bool(f"{argument}['inner_lr_scaling']", spec.get("inner_lr_scaling", True))
    return OuterSGD(lr=lr, momentum=momentum, nesterov=nesterov, inner_lr_scaling=scaling)


class OuterOptimizer:
    r"""The global parameters :math:`\theta^{(t-1)}` and the outer SGD state, over flat parameter buffers.

    Built once from the replicas' (identical) parameters — one flat tensor per buffer group, e.g. the parameter
    regions of :class:`~lightning_sync.comm.FlatState`'s groups — it holds a persistent copy of them and, with
    momentum, one zeroed momentum buffer of the same size: two model-sized buffers, allocated here and never per sync.

    :meth:`step` takes the all-reduced mean of the replicas over a contiguous range of one buffer and turns it, in
    place, into the new global parameters :math:`\theta^{(t)}` (which every replica then takes); ranges let Streaming
    DiLoCo step one fragment at a time. The arithmetic is ``torch.optim.SGD``'s, in its order of operations, so the
    result is bit-identical to ``torch.optim.SGD(foreach=False)`` stepping :math:`\theta^{(t-1)}` with gradient
    :math:`\Delta`. One exception, for exactness: with lr 1 and no momentum the step is
    :math:`\theta^{(t-1)} - (\theta^{(t-1)} - \text{mean}) = \text{mean}`, taken as the mean itself rather than
    through the rounding of :math:`\Delta` (so it reproduces plain averaging bit for bit).
    """

    def __init__(self, config: OuterSGD, params: Sequence[Tensor]) -> None:
        if not isinstance(config, OuterSGD):
            raise ValueError(f"config must be an OuterSGD (see parse_outer_optimizer), got {config!r}")
        self.config = config
        with torch.no_grad():
            #: :math:`\theta^{(t-1)}`: the global parameters the replicas last took, one flat tensor per buffer
            self.global_params: list[Tensor] = [p.detach().reshape(-1).clone() for p in params]
            #: momentum buffers :math:`b` (empty without momentum)
            self.momentum_buffers: list[Tensor] = (
                [torch.zeros_like(g) for g in self.global_params] if config.momentum > 0 else []
            )
        #: outer steps taken (over any range)
        self.steps = 0
        #: the inner learning rate of the last outer step of each range (index, start), for ``inner_lr_scaling``
        self.inner_lrs: dict[tuple[int, int], float] = {}

    @property
    def is_averaging(self) -> bool:
        """Whether the step is plain averaging (lr 1, no momentum)."""
        return self.config.lr == 1.0 and self.config.momentum == 0.0

    def reset(self, params: Sequence[Tensor]) -> None:
        """Take ``params`` as the global parameters and zero the momentum (a fresh start from identical replicas)."""
        with torch.no_grad():
            for g, p in zip(self.global_params, params, strict=True):
                g.copy_(p.reshape(-1))
            for b in self.momentum_buffers:
                b.zero_()
        self.steps = 0
        self.inner_lrs.clear()

    @torch.no_grad()
    def step(self, mean: Tensor, index: int = 0, start: int = 0, inner_lr: float | None = None) -> None:
        r"""One outer step on ``global_params[index][start : start + mean.numel()]``.

        ``mean`` (1-D, contiguous) holds the replicas' mean over that range and receives :math:`\theta^{(t)}`, which
        is also stored as the new global parameters. DiLoCo's Algorithm 1, outer gradient and outer step:
        :math:`\Delta = \theta^{(t-1)} - \text{mean}`, then :class:`OuterSGD`'s update. ``inner_lr``
        (:math:`\gamma_t`, the inner learning rate of the round's last step) scales the momentum's decay by
        :math:`\gamma_t/\gamma_{t-1}` with ``inner_lr_scaling``; ``None`` (or a previous rate of 0) leaves it as is.
        """
        n = mean.numel()
        glob = self.global_params[index]
        if not 0 <= start <= start + n <= glob.numel():
            raise ValueError(f"range [{start}, {start + n}) is outside global_params[{index}] of {glob.numel()}")
        theta = glob[start : start + n]
        self.steps += 1
        if self.is_averaging:
            theta.copy_(mean)
            return
        c = self.config
        decay = c.momentum
        if c.momentum > 0 and c.inner_lr_scaling and inner_lr is not None:
            previous = self.inner_lrs.get((index, start))
            if previous is not None and previous > 0 and inner_lr != previous:
                decay = c.momentum * (float(inner_lr) / previous)  # SlowMo: the momentum in inner-rate units
            self.inner_lrs[(index, start)] = float(inner_lr)
        delta = torch.sub(theta, mean, out=mean)  # Δ = θ_prev − mean, in mean's storage (no allocation)
        if c.momentum > 0:
            buf = self.momentum_buffers[index][start : start + n]
            buf.mul_(decay).add_(delta)
            if c.nesterov:
                delta.add_(buf, alpha=c.momentum)
            else:
                delta.copy_(buf)
        theta.add_(delta, alpha=-c.lr)
        mean.copy_(theta)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Copies (on the CPU) of the global parameters and momentum, with the configuration they belong to."""
        return {
            "config": self.config.spec(),
            "global_params": [g.detach().to("cpu", copy=True) for g in self.global_params],
            "momentum_buffers": [b.detach().to("cpu", copy=True) for b in self.momentum_buffers],
            "steps": self.steps,
            "inner_lrs": [[i, s, lr] for (i, s), lr in sorted(self.inner_lrs.items())],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output into the existing buffers (in place). The configuration must be this
        optimizer's and the buffers the same sizes (ValueError otherwise: resume with the same outer optimizer and
        model)."""
        saved = parse_outer_optimizer(state["config"], "the checkpoint's outer optimizer")
        if saved != self.config:
            raise ValueError(
                f"the checkpoint's outer optimizer is {state['config']}; this run uses {self.config.spec()}: resume "
                "with the same outer_optimizer"
            )
        for name in ("global_params", "momentum_buffers"):
            mine, theirs = getattr(self, name), state[name]
            if [t.numel() for t in mine] != [t.numel() for t in theirs]:
                raise ValueError(
                    f"the checkpoint's outer {name} have sizes {[t.numel() for t in theirs]}, this model's "
                    f"{[t.numel() for t in mine]}: resume with the same model"
                )
            with torch.no_grad():
                for dst, src in zip(mine, theirs):
                    dst.copy_(src.reshape(-1))
        self.steps = int(state["steps"])
        self.inner_lrs = {(int(i), int(s)): float(lr) for i, s, lr in state.get("inner_lrs", [])}
