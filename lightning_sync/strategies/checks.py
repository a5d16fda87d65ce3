"""Argument and setup checks of :class:`~lightning_sync.strategies.SyncStrategy`: a bad argument raises a
``ValueError`` naming it and its allowed values at construction; a Trainer setting the strategy cannot honour raises at
setup saying why and what to use instead."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Protocol

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_sync.comm import FlatState, LinkModel
from lightning_sync.comm.compression import check_compressible
from lightning_sync.core.validation import check_choice, check_instance


class Checked(Protocol):
    """What :func:`check_supported` reads of a :class:`~lightning_sync.strategies.SyncStrategy`."""

    lightning_module: Any
    precision_plugin: Any
    supports_accumulation: bool
    world_size: int
    topology: Any


START_METHODS = ("popen", "spawn", "fork", "forkserver")


def check_link(link: Any, name: str = "link") -> LinkModel | None:
    if link is None or isinstance(link, LinkModel):
        return link
    allowed = f"{name} must be a LinkModel, a string 'BANDWIDTH[,LATENCY]' such as '1gbit,1ms', or None"
    if not isinstance(link, str):
        raise ValueError(f"{allowed}; got {link!r}")
    try:
        return LinkModel.parse(link)
    except ValueError as err:
        raise ValueError(f"{allowed}; {err}") from None


#: the arguments a strategy passes on to Lightning's ``DDPStrategy`` as they are
DDP_ARGUMENTS = (
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "checkpoint_io",
    "precision_plugin",
    "process_group_backend",
    "timeout",
    "start_method",
)


def ddp_arguments(values: Mapping[str, Any]) -> dict[str, Any]:
    """The :data:`DDP_ARGUMENTS` out of a constructor's ``locals()``, checked (:func:`check_ddp_arguments`): what it
    passes on to ``DDPStrategy.__init__``. The constructor still names each in its signature (LightningCLI reads it)."""
    arguments = {name: values[name] for name in DDP_ARGUMENTS}
    check_ddp_arguments(**arguments)
    return arguments


def check_ddp_arguments(
    accelerator: Any,
    parallel_devices: Any,
    cluster_environment: Any,
    checkpoint_io: Any,
    precision_plugin: Any,
    process_group_backend: Any,
    timeout: Any,
    start_method: Any,
) -> None:
    """Type checks of the arguments passed on to ``DDPStrategy`` (which checks none): a mistake fails here, naming
    the argument, instead of deep inside the Trainer. What the objects hold (an accelerator's name, a backend's
    availability) is Lightning's and torch's to check when the Trainer is built and the process group starts."""
    check_instance(
        "accelerator", accelerator, (pl.accelerators.Accelerator, str), "a lightning Accelerator, a name such as 'cpu'"
    )
    if parallel_devices is not None and (
        not isinstance(parallel_devices, (list, tuple))
        or not all(isinstance(d, torch.device) for d in parallel_devices)
    ):
        raise ValueError(f"parallel_devices must be a list of torch.device or None, got {parallel_devices!r}")
    check_instance("cluster_environment", cluster_environment, ClusterEnvironment, "a lightning ClusterEnvironment")
    check_instance("checkpoint_io", checkpoint_io, CheckpointIO, "a lightning CheckpointIO")
    check_instance("precision_plugin", precision_plugin, Precision, "a lightning.pytorch Precision plugin")
    if process_group_backend is not None and (not isinstance(process_group_backend, str) or not process_group_backend):
        raise ValueError(
            "process_group_backend must be None (Lightning picks gloo or nccl) or a torch.distributed backend name "
            f"such as 'gloo' or 'nccl', got {process_group_backend!r}"
        )
    if timeout is not None and (not isinstance(timeout, timedelta) or timeout <= timedelta(0)):
        raise ValueError(f"timeout must be a datetime.timedelta > 0 or None (torch's default), got {timeout!r}")
    check_choice("start_method", start_method, START_METHODS)


def check_supported(strategy: Checked, trainer: pl.Trainer) -> None:
    """Reject Trainer settings every lightning_sync strategy cannot honour, saying why and what to use instead."""
    name = type(strategy).__name__
    module = strategy.lightning_module
    if module is not None and not module.automatic_optimization:
        raise ValueError(
            f"{name} does not support manual optimization (automatic_optimization=False): it acts inside the "
            "optimizer closure Lightning builds for automatic optimization. Use automatic optimization, or "
            "Lightning's DDPStrategy for manual optimization."
        )
    if trainer.accumulate_grad_batches != 1 and not strategy.supports_accumulation:
        raise ValueError(
            f"{name} does not support accumulate_grad_batches={trainer.accumulate_grad_batches}: its schedule is "
            "counted in batches or measures per-step times. Use a larger batch size, or BSP / SelSync / local SGD, "
            "which act once per optimizer step on the accumulated gradient."
        )
    precision = getattr(strategy.precision_plugin, "precision", None)
    if precision in ("16-mixed", "16"):
        raise ValueError(
            f"{name} does not support precision={precision!r}: float16 AMP hands the strategy gradients that "
            "are still loss-scaled. Use precision='bf16-mixed' or '32-true'."
        )
    if trainer.state.fn == "fit" and (alone := strategy.topology.alone()) is not None:
        rank_zero_warn(name + alone)  # nobody to synchronise with: the topology says why


def check_compressible_state(compression: str, flat: FlatState, name: str) -> None:
    """At setup: every flat buffer a sync sends must be compressible with ``compression`` (floating point, and for
    the casts wider than 2 bytes); otherwise a ``ValueError`` saying which buffer and what to use instead."""
    for group in flat.groups:
        what = f"{name}'s {group.state.numel()} parameters and buffers on {group.state.device}"
        check_compressible(compression, group.state.dtype, what)
