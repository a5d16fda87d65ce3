"""Memory per rank, counted: the bytes of the training state a rank holds, and its peak resident set size.

What :class:`MemoryCount` counts on a rank, each as the bytes of the storages behind the tensors (a storage shared
by several tensors once: the pack's flat buffers, of which every parameter is a view, count as the whole buffer, its
padding included):

* ``params_bytes``: the model's parameters as the rank holds them between steps: under FSDP2 (``fully_shard``) each
  parameter's local shard (FSDP2's padded shard storage), otherwise the whole tensor;
* ``grads_bytes``: the gradients the optimizer steps with (each parameter's ``.grad``, its local shard under FSDP2),
  seen at the optimizer steps (the largest over the run: gradients set to ``None`` after a step count nothing);
* ``optimizer_bytes``: every tensor in the optimizers' state (momentum buffers, Adam's moments; local shards
  under FSDP2), at the end of training;
* ``outer_bytes``: the outer optimizer's state of the pack's strategies (DiLoCo's global parameters and outer
  momentum, ``strategy.outer_averaging.optimizer``); 0 without one;
* ``peak_rss_bytes``: the process's peak resident set size (``resource.getrusage(RUSAGE_SELF).ru_maxrss``, in KiB
  on Linux): everything above, plus what is not counted in them — communication buffers (DDP's gradient buckets,
  FSDP2's all-gather and reduce-scatter buffers and the unsharded parameters of a module during its forward and
  backward, the pack's flat gradient copy of sharded replicas, a codec's reference and residuals), activations, the
  data, Python and the libraries.

Only torch and the standard library; read by :class:`~lightning_sync.benchmark.TimeToTarget`, which writes rank 0's
count into its ``end`` record (``"memory"``).
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from lightning_sync.comm.fsdp import fsdp_params

__all__ = ["MemoryCount", "peak_rss_bytes", "storage_bytes"]


def _local(tensor: Tensor) -> Tensor:
    """A ``DTensor``'s local tensor (FSDP2's shard); any other tensor as it is."""
    local = getattr(tensor, "_local_tensor", None)
    return local if isinstance(local, Tensor) else tensor


def storage_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (local shards of ``DTensor`` objects; ``None`` and
    non-tensors skipped)."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        if not isinstance(t, Tensor):
            continue
        storage = _local(t).untyped_storage()
        key = (str(_local(t).device), storage.data_ptr())
        if storage.nbytes() and key not in seen:
            seen[key] = storage.nbytes()
    return sum(seen.values())


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _parameters(module: torch.nn.Module) -> list[Tensor]:
    """The module's parameters as held between steps: FSDP2's sharded parameter (``DTensor``) of each parameter it
    manages, whatever its state now (a module left unsharded by a forward without backward, e.g. FSDP2's root after
    validation, registers its unsharded tensors), and every other parameter as it is."""
    managed = fsdp_params(module).values()
    replaced = {id(getattr(fp, "_unsharded_param", None)) for fp in managed} | {id(fp.sharded_param) for fp in managed}
    return [fp.sharded_param for fp in managed] + [p for p in module.parameters() if id(p) not in replaced]


def _optimizer_tensors(optimizers: Iterable[Any]) -> list[Tensor]:
    found: list[Tensor] = []
    for opt in optimizers:
        opt = getattr(opt, "_optimizer", opt)  # a LightningOptimizer
        for state in opt.state.values():
            found += [v for v in state.values() if isinstance(v, Tensor)]
    return found


def _outer_tensors(strategy: Any) -> list[Tensor]:
    outer = getattr(getattr(strategy, "outer_averaging", None), "optimizer", None)
    if outer is None:
        return []
    return [*outer.global_params, *outer.momentum_buffers]


class MemoryCount:
    """A rank's training-state bytes (see the module docstring): call :meth:`observe_grads` at optimizer steps (the
    gradients exist then) and :meth:`record` at the end."""

    def __init__(self) -> None:
        self.grads_bytes = 0

    def observe_grads(self, module: torch.nn.Module) -> None:
        self.grads_bytes = max(self.grads_bytes, storage_bytes(p.grad for p in _parameters(module)))

    def record(self, module: torch.nn.Module, optimizers: Iterable[Any], strategy: Any) -> dict[str, int]:
        """The counts now, with the gradients' largest seen."""
        return {
            "params_bytes": storage_bytes(_parameters(module)),
            "grads_bytes": self.grads_bytes,
            "optimizer_bytes": storage_bytes(_optimizer_tensors(optimizers)),
            "outer_bytes": storage_bytes(_outer_tensors(strategy)),
            "peak_rss_bytes": peak_rss_bytes(),
        }
