r"""FSDP2 (``torch.distributed.fsdp.fully_shard``) as sharded replicas use it: the replicas x shards device mesh, the
check that a module is sharded over the mesh's ``"shard"`` dimension, and each parameter's local shard bound to a
view of a flat buffer (:class:`~lightning_sync.comm.flat.FlatState` packs the local shards).

**The mesh** (:func:`replica_mesh`): a 2-D ``DeviceMesh`` of ``(replicas, shards)`` with the dimension names
``("replicate", "shard")`` — PyTorch's names for the same layout in HSDP (``fully_shard`` over a 2-D mesh,
torchtitan's ``dp_replicate`` / ``dp_shard``). Replica ``r`` is the consecutive global ranks ``r*S .. r*S+S-1``, as
with replica groups; ``mesh["shard"]`` is this rank's replica, ``mesh["replicate"]`` the ranks that hold the same
shard index in every replica. A LightningModule shards over ``mesh["shard"]`` only: ``fully_shard`` over the whole
2-D mesh is HSDP, which all-reduces the gradients over the replicas every step (data parallelism over all ranks),
and is refused.

**Checkpoints** hold each rank's local shards (:func:`local_tree`, a per-rank part as every strategy of the pack
writes) and, in the main file, the whole tensors (:func:`full_tree`, all-gathered: a consolidated state dict for
inference); a resume wraps the local shards back into ``DTensor`` objects shaped like the live ones
(:func:`model_from_local`, :func:`optimizer_from_local`).

**The local shards as views.** FSDP2 keeps each parameter's shard padded to the first rank's size along dim 0
(``FSDPParam._sharded_param_data``; the ``DTensor``'s local tensor is its first rows) and all-gathers from it. The
flat state allocates that padded size in its buffer, copies the shard in, and makes FSDP2's storage a view of it
(:func:`bind_local_shard`): the optimizer's in-place update, FSDP2's all-gather and a sync all see the same memory,
so a sync is one collective per flat buffer as without sharding. The padding (zeros on the ranks of a short last
shard, identical on every rank of that shard index) stays zero through every average and outer step. This uses
FSDP2's private ``FSDPParam`` fields (torch 2.14); :func:`bind_local_shard` checks what it relies on and raises
when it does not hold, rather than train on a copy.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._pytree import tree_map

#: the mesh's dimension names: across replicas (same shard index), inside a replica (its shards)
REPLICATE, SHARD = "replicate", "shard"

__all__ = [
    "REPLICATE",
    "SHARD",
    "bind_local_shard",
    "fsdp_params",
    "full_tree",
    "is_sharded",
    "local_part",
    "local_shards",
    "local_tree",
    "model_from_local",
    "optimizer_from_local",
    "padded_numel",
    "replica_mesh",
    "reshard",
    "sharded_like",
    "sharding_problem",
    "skip_in_module_sync",
]


def replica_mesh(device_type: str, replicas: int, shards: int) -> DeviceMesh:
    """The ``(replicas, shards)`` device mesh named ``("replicate", "shard")`` over the default group's ranks
    (collective: every rank calls it at the same point)."""
    return init_device_mesh(device_type, (replicas, shards), mesh_dim_names=(REPLICATE, SHARD))


def is_sharded(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (a parameter FSDP2 sharded)."""
    return isinstance(tensor, DTensor)


def fsdp_params(module: nn.Module) -> dict[int, Any]:
    """``id(parameter) -> FSDPParam`` for every parameter of ``module`` that ``fully_shard`` manages."""
    from torch.distributed.fsdp import FSDPModule

    found: dict[int, Any] = {}
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            group = sub._get_fsdp_state()._fsdp_param_group
            if group is not None:
                for fp in group.fsdp_params:
                    found[id(fp.sharded_param)] = fp
    return found


def sharding_problem(module: nn.Module, mesh: DeviceMesh) -> str | None:
    """``None`` when every parameter of ``module`` is sharded by ``fully_shard`` over ``mesh["shard"]`` along dim 0;
    otherwise what is wrong, in a sentence."""
    shard_ranks = mesh[SHARD].mesh.tolist()
    managed = fsdp_params(module)
    names = [name for name, _ in module.named_parameters()]
    if not names:
        return "the module has no parameters"
    for name, p in module.named_parameters():
        if not isinstance(p, DTensor) or id(p) not in managed:
            return f"parameter {name!r} is not sharded by fully_shard (a plain tensor)"
        dims = p.device_mesh.mesh_dim_names
        if dims != (SHARD,) or p.device_mesh.mesh.tolist() != shard_ranks:
            hsdp = " (fully_shard over the 2-D mesh is HSDP: gradients all-reduced over the replicas every step)"
            return f"parameter {name!r} is sharded over the mesh dimensions {dims}, not ('shard',)" + (
                hsdp if dims is not None and REPLICATE in dims else ""
            )
        if managed[id(p)].fsdp_placement.dim != 0:
            return f"parameter {name!r} is sharded along dim {managed[id(p)].fsdp_placement.dim}, not 0"
    return None


def padded_numel(fsdp_param: Any) -> int:
    """Elements of the parameter's local shard with FSDP2's padding: what the flat buffer holds for it."""
    return int(fsdp_param.padded_sharded_param_size.numel())


def bind_local_shard(fsdp_param: Any, storage: Tensor) -> Tensor:
    """Copy the parameter's padded local shard into ``storage`` (1-D, :func:`padded_numel` elements) and make FSDP2
    keep it there: its all-gather source and the ``DTensor``'s local tensor become views of ``storage``. Returns the
    local tensor (the shard without padding)."""
    param = fsdp_param.sharded_param
    if getattr(fsdp_param, "offload_to_cpu", False) or getattr(fsdp_param, "pin_memory", False):
        raise ValueError(
            f"{fsdp_param} is offloaded to CPU memory (fully_shard's offload_policy): FSDP2 would move its shard out "
            "of the flat buffer the averages run on. Use fully_shard without offload_policy for sharded replicas."
        )
    source = fsdp_param._sharded_param_data
    if source.numel() != storage.numel() or type(source) is not torch.Tensor:
        raise RuntimeError(
            f"FSDP2's sharded storage of {fsdp_param} is not the padded shard this version of lightning_sync binds "
            f"({source.numel()} elements, expected {storage.numel()}): unsupported torch version or FSDP2 option"
        )
    local = param._local_tensor
    length = local.size(0) if local.numel() > 0 else 0
    with torch.no_grad():
        storage.copy_(source)
    view = storage.view(fsdp_param.padded_sharded_param_size).narrow(0, 0, length)
    fsdp_param._sharded_param_data = storage
    param._local_tensor = view
    return view


def reshard(module: nn.Module) -> None:
    """Free every FSDP2 module's unsharded parameters (kept after a forward without backward, e.g. the root's after
    validation), so the next forward all-gathers the local shards as they are now."""
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


def local_tree(tree: Any) -> Any:
    """``tree`` (dicts, lists, tuples) with every ``DTensor`` replaced by a copy of this rank's local shard."""
    return tree_map(lambda t: t.to_local().detach().clone() if isinstance(t, DTensor) else t, tree)


def full_tree(tree: Any, keep: bool = True) -> Any:
    """``tree`` with every ``DTensor`` replaced by the whole tensor, all-gathered over its mesh (collective: every
    rank of the mesh calls it with the same tree, one tensor at a time). ``keep=False`` (a rank that does not write
    the result): each whole tensor is dropped as soon as it is gathered and the local shard stands in its place, so
    such a rank never holds more than one whole tensor."""

    def whole(t: Any) -> Any:
        if not isinstance(t, DTensor):
            return t
        gathered = t.full_tensor().detach()
        return gathered.clone() if keep else t.to_local().detach()

    return tree_map(whole, tree)


def _like(value: Any, live: Any) -> Any:
    """``value`` (a local shard) as a ``DTensor`` placed as ``live``, when ``live`` is one and ``value`` its local
    shape; otherwise ``value``."""
    if not isinstance(live, DTensor) or not isinstance(value, Tensor) or isinstance(value, DTensor):
        return value
    if value.shape == live.to_local().shape:  # a rank's part (when both shapes agree, the shard is the whole)
        local = value.to(device=live.device)
        return DTensor.from_local(local, live.device_mesh, live.placements, shape=live.shape, stride=live.stride())
    if value.shape == live.shape:  # the main file's whole tensor: this rank takes its shard, no communication
        return distribute_tensor(value.to(device=live.device), live.device_mesh, live.placements, src_data_rank=None)
    return value


def model_from_local(state_dict: dict[str, Any], module: nn.Module) -> dict[str, Any]:
    """A state dict of local shards (:func:`local_tree`) or whole tensors (:func:`full_tree`) with each entry that is
    a ``DTensor`` in ``module`` made one again, for ``module.load_state_dict``."""
    live = module.state_dict()
    return {name: _like(value, live.get(name)) for name, value in state_dict.items()}


def optimizer_from_local(state: dict[str, Any], optimizer: Any) -> dict[str, Any]:
    """An optimizer state dict of local shards with each per-parameter tensor of the local shard's shape made a
    ``DTensor`` placed as its parameter (momentum buffers, Adam's moments), for ``optimizer.load_state_dict``."""
    ids = [i for group in state["param_groups"] for i in group["params"]]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    by_id = dict(zip(ids, params))
    per_param = {
        i: {key: _like(value, by_id.get(i)) for key, value in entry.items()} for i, entry in state["state"].items()
    }
    return {**state, "state": per_param}


def local_part(tensor: Tensor) -> Tensor:
    """A ``DTensor``'s local tensor (the memory itself: an in-place change is the ``DTensor``'s); any other tensor as
    it is."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def sharded_like(local: Tensor, param: Tensor) -> Tensor:
    """``local`` (this rank's shard, shaped as ``param``'s) as a ``DTensor`` placed as the sharded ``param`` (a
    gradient FSDP2 did not write); ``local`` itself when ``param`` is not sharded."""
    return _like(local, param)


def local_shards(module: nn.Module) -> list[Tensor]:
    """Every sharded parameter's local tensor (the memory itself, not a copy), in ``module.parameters()`` order."""
    with torch.no_grad():
        return [p.to_local() for p in module.parameters() if isinstance(p, DTensor)]


def skip_in_module_sync(module: nn.Module) -> None:
    """Name ``module``'s sharded parameters in ``_ddp_params_and_buffers_to_ignore`` (DDP's list, which Lightning's
    broadcast of rank 0's module before an evaluation honours): every rank holds its own shards, which no broadcast
    over all ranks may overwrite."""
    ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", []))
    ignored.update(name for name, p in module.named_parameters() if isinstance(p, DTensor))
    module._ddp_params_and_buffers_to_ignore = sorted(ignored)  # type: ignore[assignment]
