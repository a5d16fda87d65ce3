"""Test probes for the hot path: which host reads happen between the end of backward and the optimizer update.

:class:`HostReads` records the tensor methods that bring a value to the host (on a GPU each one synchronises with
the device); :class:`ProbedCNN` trains with :class:`ProbeSGD`, which ends the probe's window once the optimizer
closure (backward, the strategy's work after it, Lightning's hooks) has returned — right before the update is
launched; :class:`ReadProbe` (a callback) opens the window at ``on_after_backward``, optionally with
``torch.cuda.set_sync_debug_mode("error")`` on a GPU, so that any synchronising CUDA call in the window raises.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from lightning_sync.models import DigitsCNN


class HostReads(torch.overrides.TorchFunctionMode):
    """Records calls that read a tensor's value on the host."""

    READS = frozenset({"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy", "cpu"})

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.READS or (name == "to" and any(str(a) == "cpu" for a in args[1:])):
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


class ProbeSGD(torch.optim.SGD):
    """SGD that closes its probe's window once the closure has returned, before the update."""

    probe: Any = None

    def step(self, closure=None):  # type: ignore[override]
        loss = closure() if closure is not None else None
        if self.probe is not None:
            self.probe.stop()
        super().step()
        return loss


class ProbedCNN(DigitsCNN):
    def configure_optimizers(self):
        return ProbeSGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)


class ReadProbe(Callback):
    """Per step, the host reads between ``on_after_backward`` and the update (``per_step``)."""

    def __init__(self, cuda_sync_errors: bool = False) -> None:
        self.cuda_sync_errors = cuda_sync_errors
        self.mode: HostReads | None = None
        self.per_step: list[list[str]] = []

    def on_train_start(self, trainer, pl_module):
        trainer.optimizers[0].probe = self

    def on_after_backward(self, trainer, pl_module):
        self.mode = HostReads()
        self.mode.__enter__()
        if self.cuda_sync_errors:
            torch.cuda.set_sync_debug_mode("error")

    def stop(self) -> None:
        if self.cuda_sync_errors:
            torch.cuda.set_sync_debug_mode("default")
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.per_step.append(self.mode.calls)
            self.mode = None
