"""Each paper's math as small classes: no Lightning, no ``torch.distributed``.

Everything here is unit-tested in-process; the strategies compose these with ``lightning_sync.comm``.
"""

from lightning_sync.core.gradient_change import DeviceGradientChangeTracker, GradientChangeTracker, wants_sync
from lightning_sync.core.steps import StepCounter

__all__ = ["DeviceGradientChangeTracker", "GradientChangeTracker", "StepCounter", "wants_sync"]
