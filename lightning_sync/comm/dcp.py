r"""Sharded checkpoints in ``torch.distributed.checkpoint``'s format (DCP), as Lightning's ``ModelParallelStrategy``
writes them, for sharded replicas (``save_distributed_checkpoint=True``).

A checkpoint is a directory: DCP's files (``.metadata`` and one ``__<rank>_<i>.distcp`` per rank) hold every
``DTensor`` — each rank writes its own shards, no rank ever holds the whole model — and beside them rank 0's
``meta.pt`` holds the rest of Lightning's checkpoint, each rank's ``rank<r>.pt`` its per-rank state, in which every
``DTensor`` of the model and optimizer state stands as a reference to its key in the DCP files (:func:`split_shards`).
Lightning's own consolidation (``python -m lightning.fabric.utilities.consolidate_checkpoint <dir>``) turns the
directory into one file that ``torch.load`` reads.

**Counted.** A save is DCP's protocol (``torch.distributed.checkpoint.state_dict_saver``: local plans, the
coordinator's global plan, each rank's writes, the coordinator's metadata) run with DCP's public planner and
storage writer, its two gathers and one broadcast of plans going through the :class:`~lightning_sync.comm
.Communicator` under the tag ``"checkpoint"`` (bookkeeping: counted, kept out of the training totals), so they are
counted as every other message. A load reads each rank's own chunks with no collective (``no_dist``: DCP's load plan
is a rank's own).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_unflatten

from lightning_sync.comm.communicator import Communicator

__all__ = ["SHARD_REF", "model_refs", "read_shards", "shard_refs", "split_shards", "write_shards"]

#: the key that marks a reference to a ``DTensor`` kept in the DCP files (a plain dict: ``weights_only`` loads it)
SHARD_REF = "__lightning_sync_dcp_shard__"


def _ref(key: str, tensor: torch.Tensor) -> dict[str, Any]:
    sharded = isinstance(tensor, DTensor)
    return {
        SHARD_REF: key,
        "shape": tuple(tensor.shape),
        "stride": tuple(tensor.stride()),
        "local_shape": tuple(tensor.to_local().shape) if sharded else None,  # None: a plain tensor
        "dtype": tensor.dtype,
    }


def split_shards(tree: Any, prefix: str) -> tuple[Any, dict[str, DTensor]]:
    """``tree`` with every ``DTensor`` replaced by a reference (a small dict naming its DCP key ``prefix + path``,
    its global shape and stride, its local shape and dtype), and the ``DTensor`` objects by key (a flat dict: DCP
    keeps its keys as they are)."""
    leaves, spec = tree_flatten_with_path(tree)
    shards: dict[str, DTensor] = {}
    out: list[Any] = []
    for path, leaf in leaves:
        if isinstance(leaf, DTensor):
            key = prefix + keystr(path)
            shards[key] = leaf.detach()
            leaf = _ref(key, leaf)
        out.append(leaf)
    return tree_unflatten(out, spec), shards


def model_refs(state_dict: dict[str, Any], write_plain: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """A model's state dict as DCP holds it under ``"state_dict"`` (what Lightning's consolidation turns into the
    whole model): the references of every tensor entry (keys ``"state_dict.<name>"``), and the nested
    ``{"state_dict": {name: tensor}}`` to write — its ``DTensor`` entries on every rank, its plain tensors (buffers,
    which may differ between ranks) only where ``write_plain`` (one rank)."""
    refs = {name: _ref(f"state_dict.{name}", t) for name, t in state_dict.items() if isinstance(t, torch.Tensor)}
    tensors = {
        name: t.detach()
        for name, t in state_dict.items()
        if isinstance(t, DTensor) or (write_plain and isinstance(t, torch.Tensor))
    }
    return refs, {"state_dict": tensors}


def _is_ref(value: Any) -> bool:
    return isinstance(value, dict) and SHARD_REF in value


def shard_refs(tree: Any) -> list[dict[str, Any]]:
    """The references :func:`split_shards` left in ``tree``."""
    found: list[dict[str, Any]] = []

    def visit(value: Any) -> None:
        if _is_ref(value):
            found.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)

    visit(tree)
    return found


def _replace_refs(tree: Any, loaded: dict[str, torch.Tensor]) -> Any:
    if _is_ref(tree):
        return loaded[tree[SHARD_REF]]
    if isinstance(tree, dict):
        return {k: _replace_refs(v, loaded) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_replace_refs(v, loaded) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_replace_refs(v, loaded) for v in tree)
    return tree


def write_shards(state: dict[str, Any], directory: str, comm: Communicator) -> None:
    """Write ``state`` (nested dicts of ``DTensor`` objects and tensors) as a DCP checkpoint into ``directory``
    (collective over ``comm``'s ranks, every rank the same point; its rank 0 is DCP's coordinator and writes
    ``.metadata``). A tensor key that several ranks hold is written once (DCP's deduplication): a ``DTensor``'s
    shard by one rank of those that hold it, a plain tensor by one rank — so a plain tensor whose value differs
    between ranks belongs to one rank's ``state`` only."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    coordinator = comm.rank == 0
    planner = DefaultSavePlanner()
    writer = FileSystemWriter(directory)
    planner.set_up_planner(state_dict=state, storage_meta=writer.storage_meta(), is_coordinator=coordinator)
    writer.set_up_storage_writer(coordinator, rank=comm.rank, use_collectives=True)
    local = writer.prepare_local_plan(planner.create_local_plan())
    plans = comm.all_gather_object(local, tag="checkpoint")
    metadata = None
    central: Any = None
    if coordinator:
        plans, metadata = planner.create_global_plan(plans)
        central = writer.prepare_global_plan(plans)
    central = comm.broadcast_object(central, src=0, tag="checkpoint")
    writes = writer.write_data(planner.finish_plan(central[comm.rank]), planner)
    writes.wait()
    results = comm.all_gather_object(writes.value(), tag="checkpoint")
    if coordinator:
        writer.finish(metadata=metadata, results=results)


def read_shards(tree: Any, module: nn.Module, directory: str) -> Any:
    """``tree`` with each reference of :func:`split_shards` replaced by this rank's local shard (a plain tensor) of
    that ``DTensor``, read from the DCP checkpoint in ``directory`` (no collective: each rank reads its own
    chunks). The shards are placed as ``module``'s sharded parameters (the same mesh and placements: sharded
    replicas shard every parameter along dim 0 over the replica's ranks)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    refs = shard_refs(tree)
    if not refs:
        return tree
    like = next((p for p in module.parameters() if isinstance(p, DTensor)), None)
    if like is None:
        raise RuntimeError("a distributed checkpoint's shards load into a sharded module: configure_model has not run")

    def template(ref: dict[str, Any]) -> torch.Tensor:
        if ref["local_shape"] is None:  # a plain tensor, read whole
            return torch.empty(ref["shape"], dtype=ref["dtype"], device=like.device)
        local = torch.empty(ref["local_shape"], dtype=ref["dtype"], device=like.device)
        shape, stride = torch.Size(ref["shape"]), tuple(ref["stride"])
        return DTensor.from_local(local, like.device_mesh, like.placements, shape=shape, stride=stride)

    templates = {ref[SHARD_REF]: template(ref) for ref in refs}
    dcp_load(templates, storage_reader=FileSystemReader(directory), no_dist=True)
    local = {key: t.to_local() if isinstance(t, DTensor) else t for key, t in templates.items()}
    return _replace_refs(tree, local)
