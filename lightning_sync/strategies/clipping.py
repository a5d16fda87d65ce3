r"""Gradient clipping on a local step, on the strategy's side.

With ``Trainer(gradient_clip_val=c)`` Lightning's DDP clips the ranks' *averaged* gradient
:math:`\bar g = \frac1N\sum_i g_i`. A method's local step has only its own rank's :math:`g_i`, and clipping that at
the same :math:`c` clips a different, larger vector: with rank gradients that are independent estimates of the same
mean, :math:`E\|g_i\|^2 = \|\mu\|^2 + \sigma^2` against :math:`E\|\bar g\|^2 = \|\mu\|^2 + \sigma^2/N`, up to
:math:`N` times larger when the sampling noise :math:`\sigma^2` dominates. So a local step is clipped more often
and harder than the DDP step it stands for, and the replicas' mean moves less than DDP's model: measured on
``benchmarks/dropin.py``'s script (2 ranks, ``gradient_clip_val=1.0``), the local gradient's norm was 1.2-1.3x
the averaged one's and was clipped on 75-90% of the steps against DDP's 35%, and every local-step method ended 2-3
points below DDP (issue 51; docs/guide.md, "Gradient clipping on local steps").

:class:`LocalClipping`, a component every :class:`~lightning_sync.strategies.SyncStrategy` owns
(``strategy.clipping``), clips a local gradient at
:math:`c\sqrt N` instead (``local_clipping="scaled"``, the default): the bound of the local norm's excess when noise
dominates, so a local step is clipped about as often as DDP's. :math:`N` counts replicas: with replica groups a
local gradient is already the mean over the :math:`N_r` ranks of its replica, whose excess over the mean of all
:math:`N N_r` ranks is bounded by :math:`\sqrt N`; a fault-tolerant run counts every replica group. A step whose
gradient *is* every rank's average (BSP, Sync-Switch's BSP phase, a SelSync gradient sync) is clipped at :math:`c`,
as DDP: the method says so in its ``_gradient_is_local`` hook. ``"as_given"`` clips every gradient at :math:`c`. Both
algorithms are scaled (``"norm"``, and ``"value"``, whose per-coordinate noise obeys the same argument). Only the
clipping Lightning routes through the precision plugin is concerned (``gradient_clip_val``, and
``LightningModule.clip_gradients`` from ``configure_gradient_clipping``).
"""

from __future__ import annotations

import math
from typing import Any, Literal, Protocol

from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info

LocalClippingMode = Literal["scaled", "as_given"]
LOCAL_CLIPPING_MODES = ("scaled", "as_given")


def check_local_clipping(value: Any) -> LocalClippingMode:
    if value not in LOCAL_CLIPPING_MODES:
        raise ValueError(
            f"local_clipping must be 'scaled' (a local gradient clipped at gradient_clip_val * sqrt(world size)) or "
            f"'as_given' (every gradient at gradient_clip_val), got {value!r}"
        )
    return value  # type: ignore[no-any-return]


class ClippingHost(Protocol):
    """What :class:`LocalClipping` uses of the strategy that owns it."""

    local_clipping: LocalClippingMode
    topology: Any
    precision_plugin: Any
    lightning_module: Any

    def _gradient_is_local(self) -> bool: ...


class LocalClipping:
    """Scales ``gradient_clip_val`` on a local step (see the module docstring). The strategy's ``setup`` calls
    :meth:`install` once the precision plugin is final, ``teardown`` :meth:`remove`; at each clip the strategy's
    ``_gradient_is_local()`` says whether this step's gradient is the rank's own (a method whose gradient is every
    rank's average on some or all steps overrides it)."""

    def __init__(self, strategy: ClippingHost) -> None:
        self.strategy = strategy
        self._plugin: Any = None  # the precision plugin whose clip_gradients is wrapped, until remove()

    @property
    def factor(self) -> float:
        r"""What ``gradient_clip_val`` is multiplied by on a local step: :math:`\sqrt N` (``"scaled"``; :math:`N`
        replicas in the run, :attr:`~lightning_sync.strategies.topology.Topology.replicas_in_run`: every replica
        group's with fault tolerance), else 1."""
        s = self.strategy
        return math.sqrt(s.topology.replicas_in_run) if s.local_clipping == "scaled" else 1.0

    def install(self) -> None:
        """Wrap the strategy's precision plugin's ``clip_gradients`` (an instance attribute, until :meth:`remove`)."""
        s = self.strategy
        plugin = s.precision_plugin
        self.remove()
        factor = self.factor
        if factor == 1.0:
            return
        clip = type(plugin).clip_gradients.__get__(plugin)  # the plugin's own method

        def clip_gradients(optimizer: Any, clip_val: float = 0.0, gradient_clip_algorithm: Any = None) -> None:
            if clip_val and s._gradient_is_local():
                clip_val = clip_val * self.factor
            if gradient_clip_algorithm is None:
                return clip(optimizer, clip_val)
            return clip(optimizer, clip_val, gradient_clip_algorithm)

        plugin.clip_gradients = clip_gradients  # an instance attribute: shadows the class's method until teardown
        self._plugin = plugin
        trainer = getattr(s.lightning_module, "trainer", None)
        if trainer is not None and trainer.gradient_clip_val and trainer.state.fn == TrainerFn.FITTING:
            rank_zero_info(
                f"{type(s).__name__}: gradient_clip_val={trainer.gradient_clip_val} clips a local gradient at "
                f"{trainer.gradient_clip_val * factor:.4g} (x sqrt({factor**2:.0f}) replicas, "
                "local_clipping='scaled'); local_clipping='as_given' clips it at gradient_clip_val"
            )

    def remove(self) -> None:
        plugin, self._plugin = self._plugin, None
        if plugin is not None and "clip_gradients" in vars(plugin):
            del plugin.clip_gradients
