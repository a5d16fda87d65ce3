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

:class:`LocalClipping`, part of every :class:`~lightning_sync.strategies.SyncStrategy`, clips a local gradient at
:math:`c\sqrt N` instead (``local_clipping="scaled"``, the default): the bound of the local norm's excess when noise
dominates, so a local step is clipped about as often as DDP's. :math:`N` counts replicas: with replica groups a
local gradient is already the mean over the :math:`N_r` ranks of its replica, whose excess over the mean of all
:math:`N N_r` ranks is bounded by :math:`\sqrt N`; a fault-tolerant run counts every replica group. A step whose
gradient *is* every rank's average (BSP, Sync-Switch's BSP phase, a SelSync gradient sync) is clipped at :math:`c`,
as DDP. ``"as_given"`` clips every gradient at :math:`c`. Both algorithms are scaled (``"norm"``, and ``"value"``,
whose per-coordinate noise obeys the same argument). Only the clipping Lightning routes through the precision plugin
is concerned (``gradient_clip_val``, and ``LightningModule.clip_gradients`` from ``configure_gradient_clipping``).
"""

from __future__ import annotations

import math
from typing import Any, Literal

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


class LocalClipping:
    """Mixin of :class:`~lightning_sync.strategies.SyncStrategy`. Its ``__init__`` sets ``local_clipping``
    (:func:`check_local_clipping`); ``setup`` calls :meth:`_install_local_clipping` once the precision plugin is final
    and ``teardown`` :meth:`_remove_local_clipping`. A method whose gradient is every rank's average on some or all
    steps overrides :meth:`_gradient_is_local`.

    Uses from the strategy: ``precision_plugin``, ``num_replicas``, ``fault_tolerance``."""

    local_clipping: LocalClippingMode = "scaled"
    _clipping_plugin: Any = None

    @property
    def local_clip_factor(self) -> float:
        r"""What ``gradient_clip_val`` is multiplied by on a local step: :math:`\sqrt N` (``"scaled"``; :math:`N`
        replicas, every replica group's with fault tolerance), else 1."""
        if self.local_clipping != "scaled":
            return 1.0
        replicas = self.num_replicas  # type: ignore[attr-defined]
        ft = getattr(self, "fault_tolerance", None)
        if ft is not None:
            replicas *= ft.replica_groups
        return math.sqrt(replicas)

    def _gradient_is_local(self) -> bool:
        """Whether this step's gradient, about to be clipped, is this rank's own (True) or the ranks' average."""
        return True

    def _install_local_clipping(self) -> None:
        plugin = self.precision_plugin
        self._remove_local_clipping()
        if self.local_clip_factor == 1.0:
            return
        clip = type(plugin).clip_gradients.__get__(plugin)  # the plugin's own method

        def clip_gradients(optimizer: Any, clip_val: float = 0.0, gradient_clip_algorithm: Any = None) -> None:
            if clip_val and self._gradient_is_local():
                clip_val = clip_val * self.local_clip_factor
            if gradient_clip_algorithm is None:
                return clip(optimizer, clip_val)
            return clip(optimizer, clip_val, gradient_clip_algorithm)

        plugin.clip_gradients = clip_gradients  # an instance attribute: shadows the class's method until teardown
        self._clipping_plugin = plugin
        trainer = getattr(self.lightning_module, "trainer", None)
        if trainer is not None and trainer.gradient_clip_val and trainer.state.fn == TrainerFn.FITTING:
            rank_zero_info(
                f"{type(self).__name__}: gradient_clip_val={trainer.gradient_clip_val} clips a local gradient at "
                f"{trainer.gradient_clip_val * self.local_clip_factor:.4g} (x sqrt({self.local_clip_factor**2:.0f}) "
                "replicas, "
                "local_clipping='scaled'); local_clipping='as_given' clips it at gradient_clip_val"
            )

    def _remove_local_clipping(self) -> None:
        plugin, self._clipping_plugin = self._clipping_plugin, None
        if plugin is not None and "clip_gradients" in vars(plugin):
            del plugin.clip_gradients
