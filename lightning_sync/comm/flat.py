"""Parameters, buffers and gradients as views of persistent flat buffers.

A sync is then one collective over a contiguous tensor that already exists: no per-sync concatenation of a
model-sized copy (PyTorch's ``average_parameters`` allocates one with ``torch.cat`` and rebinds every
``p.data`` at every call) and no collective per small tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_sync.comm.fsdp import (
    bind_local_shard,
    fsdp_params,
    is_sharded,
    local_part,
    padded_numel,
    reshard,
    sharded_like,
)


@dataclass
class _Group:
    """All tensors of one (device, dtype): ``state = [params | float buffers]``, ``grads = [grads | scratch]``.

    Gradients live in their own storage so that a checkpoint of the parameters (whose views share ``state``'s
    storage) does not also serialise the gradients. The scratch tail of ``grads`` receives a copy of the buffers
    when buffers travel with a gradient sync, so that is one collective too.
    """

    state: Tensor
    grads: Tensor
    params: list[nn.Parameter]
    param_views: list[Tensor]
    grad_views: list[Tensor]
    trainable: list[bool]
    buffer_numel: int
    param_numel: int
    buffer_slots: list[tuple[nn.Module, str]] = field(default_factory=list)
    #: each parameter's position in ``module.parameters()`` (registration order over all groups)
    param_order: list[int] = field(default_factory=list)
    #: each parameter's first element in ``grads`` (and ``state``)
    param_offsets: list[int] = field(default_factory=list)

    @property
    def buffers(self) -> Tensor:
        return self.state[self.param_numel :]

    @property
    def grad_region(self) -> Tensor:
        return self.grads[: self.param_numel]


class FlatState:
    """Rebinds a module's parameters and floating-point buffers as views of one buffer per (device, dtype).

    * ``p.data`` becomes a view of ``state``; optimizers keep the same ``Parameter`` objects, and
      ``load_state_dict`` copies in place, so views survive checkpoint restore.
    * Floating-point buffers (BatchNorm running statistics) are rebound as views of the tail of ``state``; they
      are updated in place by their modules. Integer buffers (``num_batches_tracked``) are left alone: they count
      steps, which synchronous strategies keep equal on every rank.
    * Gradients of trainable parameters are bound as views of ``grads`` before each backward (see
      :meth:`bind_grads`), so autograd accumulates into the flat buffer in place.

    Frozen parameters are included in ``state`` (they may be unfrozen later, and a sync must keep them equal)
    but never receive a gradient view.

    **A module sharded with FSDP2** (every parameter a ``DTensor`` of ``fully_shard``; :attr:`sharded`): ``state``
    holds each parameter's *local shard* (with FSDP2's padding, :mod:`~lightning_sync.comm.fsdp`), FSDP2's own
    storage a view of it, so a sync averages this rank's shard. The gradients stay FSDP2's (the ``DTensor``
    gradients its reduce-scatter writes inside backward, averaged over the replica's ranks): :meth:`bind_grads` does
    nothing. The flat gradient buffer has the state's layout (each local shard at its parameter's padded offset, the
    padding zero, the buffers' scratch tail after them), and a gradient sync between replicas or the replica's
    gradient norm fills it from FSDP2's gradients first (:meth:`pack_grads`: one copy of the local gradient shards)
    and, after an average, writes it back into them (:meth:`unpack_grads`), so :meth:`grad_tensors` and
    :meth:`grad_sq_norm` read this rank's local gradient shard as one tensor per buffer.
    """

    def __init__(self, module: nn.Module) -> None:
        shards = fsdp_params(module) if any(is_sharded(p) for p in module.parameters()) else None
        #: whether the parameters are FSDP2's local shards (see the class docstring)
        self.sharded = shards is not None
        self._module = module if self.sharded else None
        params: dict[tuple[torch.device, torch.dtype], list[nn.Parameter]] = {}
        order: dict[int, int] = {}
        for i, p in enumerate(module.parameters()):
            if shards is not None and id(p) not in shards:
                raise ValueError(
                    f"parameter {i} of the module is not sharded by fully_shard while others are: shard every "
                    "parameter (fully_shard the root module too) or none"
                )
            if p.is_sparse:
                raise ValueError("sparse parameters are not supported by lightning_sync strategies")
            params.setdefault((p.device, p.dtype), []).append(p)
            order[id(p)] = i
        buffers: dict[tuple[torch.device, torch.dtype], list[tuple[nn.Module, str, Tensor]]] = {}
        seen: set[int] = set()
        for mod in module.modules():
            for name, buf in mod._buffers.items():
                if buf is None or not buf.is_floating_point() or id(buf) in seen:
                    continue
                seen.add(id(buf))
                buffers.setdefault((buf.device, buf.dtype), []).append((mod, name, buf))
        self.groups: list[_Group] = []
        for key in list(params) + [k for k in buffers if k not in params]:
            group = self._build(params.get(key, []), buffers.get(key, []), *key, shards)
            group.param_order = [order[id(p)] for p in group.params]
            self.groups.append(group)

    @staticmethod
    def _build(
        params: list[nn.Parameter],
        buffers: list[tuple[nn.Module, str, Tensor]],
        device: torch.device,
        dtype: torch.dtype,
        shards: dict[int, Any] | None = None,
    ) -> _Group:
        if shards is not None:
            return FlatState._build_sharded(params, buffers, device, dtype, shards)
        p_numel = sum(p.numel() for p in params)
        b_numel = sum(b.numel() for _, _, b in buffers)
        state = torch.empty(p_numel + b_numel, device=device, dtype=dtype)
        grads = torch.zeros(p_numel + b_numel, device=device, dtype=dtype)
        param_views, grad_views, trainable, offsets = [], [], [], []
        offset = 0
        with torch.no_grad():
            for p in params:
                n = p.numel()
                offsets.append(offset)
                view = state[offset : offset + n].view_as(p)
                view.copy_(p.data)
                p.data = view
                param_views.append(view)
                grad_views.append(grads[offset : offset + n].view_as(p))
                trainable.append(p.requires_grad)
                if p.grad is not None:
                    grad_views[-1].copy_(p.grad)
                    p.grad = grad_views[-1]
                offset += n
            slots = FlatState._bind_buffers(buffers, state, offset)
        return _Group(
            state, grads, list(params), param_views, grad_views, trainable, b_numel, p_numel, slots, [], offsets
        )

    @staticmethod
    def _bind_buffers(buffers: list[tuple[nn.Module, str, Tensor]], state: Tensor, offset: int) -> list:
        """The floating buffers rebound as views of ``state`` from ``offset`` on; their slots."""
        slots = []
        with torch.no_grad():
            for mod, name, buf in buffers:
                n = buf.numel()
                view = state[offset : offset + n].view_as(buf)
                view.copy_(buf)
                mod._buffers[name] = view
                slots.append((mod, name))
                offset += n
        return slots

    @staticmethod
    def _build_sharded(
        params: list[nn.Parameter],
        buffers: list[tuple[nn.Module, str, Tensor]],
        device: torch.device,
        dtype: torch.dtype,
        shards: dict[int, Any],
    ) -> _Group:
        """A group of FSDP2 parameters: their padded local shards, FSDP2's storage bound to views of ``state``."""
        sizes = [padded_numel(shards[id(p)]) for p in params]
        p_numel = sum(sizes)
        b_numel = sum(b.numel() for _, _, b in buffers)
        state = torch.empty(p_numel + b_numel, device=device, dtype=dtype)
        param_views, offsets = [], []
        offset = 0
        for p, n in zip(params, sizes):
            offsets.append(offset)
            param_views.append(bind_local_shard(shards[id(p)], state[offset : offset + n]))
            offset += n
        slots = FlatState._bind_buffers(buffers, state, offset)
        trainable = [p.requires_grad for p in params]
        # FSDP2's gradients are DTensors of its own; this buffer (the state's layout) takes a copy of their local
        # shards when a gradient sync or norm needs them (pack_grads)
        grads = torch.zeros(p_numel + b_numel, device=device, dtype=dtype)
        grad_views = [grads[o : o + v.numel()].view_as(v) for o, v in zip(offsets, param_views)]
        return _Group(
            state, grads, list(params), param_views, grad_views, trainable, b_numel, p_numel, slots, [], offsets
        )

    def reshard(self) -> None:
        """Sharded: free FSDP2's unsharded parameters kept after a forward without backward (validation), so the
        next forward gathers the local shards as they are now (after a sync or a swap); nothing otherwise."""
        if self._module is not None:
            reshard(self._module)

    # ------------------------------------------------------------------ views used by the strategies
    def state_tensors(self) -> list[Tensor]:
        """``[params | buffers]`` per group: what a parameter sync or the setup broadcast sends."""
        return [g.state for g in self.groups if g.state.numel()]

    def grad_tensors(self, with_buffers: bool = True) -> list[Tensor]:
        """``[grads | buffer copy]`` per group (call :meth:`stage_buffers` first when ``with_buffers``; sharded:
        :meth:`pack_grads` first)."""
        if with_buffers:
            return [g.grads for g in self.groups if g.grads.numel()]
        return [g.grad_region for g in self.groups if g.param_numel]

    def drop_grads(self) -> None:
        """Set every trainable parameter's ``.grad`` to ``None``: the optimizer's next step leaves those parameters
        and their state (momentum, weight decay, Adam's moments and step) as they are — a step that must not apply,
        e.g. a fault-tolerant gradient average that did not commit. :meth:`bind_grads` binds them again before the
        next backward."""
        for g in self.groups:
            for p, train in zip(g.params, g.trainable):
                if train:
                    p.grad = None

    def stage_buffers(self, group: int | None = None) -> None:
        """Copy the buffers into the gradient buffer's scratch tail (before a gradient sync); of one group when
        ``group`` (an index into :attr:`groups`) is given."""
        for g in self.groups if group is None else [self.groups[group]]:
            if g.buffer_numel:
                g.grads[g.param_numel :].copy_(g.buffers)

    def unstage_buffers(self, group: int | None = None) -> None:
        """Copy the synced buffers back from the scratch tail (after a gradient sync); of one group when given."""
        for g in self.groups if group is None else [self.groups[group]]:
            if g.buffer_numel:
                g.buffers.copy_(g.grads[g.param_numel :])

    @property
    def has_buffers(self) -> bool:
        return any(g.buffer_numel for g in self.groups)

    def numel(self) -> int:
        return sum(g.state.numel() for g in self.groups)

    def nbytes(self) -> int:
        return sum(g.state.numel() * g.state.element_size() for g in self.groups)

    # ------------------------------------------------------------------ gradients
    def bind_grads(self) -> None:
        """Make every trainable parameter's ``.grad`` a view of the flat gradient buffer.

        ``optimizer.zero_grad()`` (``set_to_none=True`` by default) drops the views; this restores them (zeroed)
        before the next backward, so autograd accumulates in place. A gradient that was replaced by another
        tensor is copied into its slot first.
        """
        if self.sharded:
            return  # FSDP2's gradients (see the class docstring)
        for g in self.groups:
            zeroed = False
            for p, view, train in zip(g.params, g.grad_views, g.trainable):
                if not train:
                    continue
                grad = p.grad
                if grad is None:
                    if not zeroed:
                        g.grad_region.zero_()
                        zeroed = True
                    p.grad = view
                elif grad.data_ptr() != view.data_ptr():
                    view.copy_(grad)
                    p.grad = view

    def pack_grads(self) -> None:
        """Sharded: copy every trainable parameter's local gradient shard (FSDP2's ``DTensor`` gradient; zeros where
        it has none) into its view of the flat gradient buffer. Nothing otherwise (the gradients live there)."""
        if not self.sharded:
            return
        with torch.no_grad():
            for g in self.groups:
                for p, view, train in zip(g.params, g.grad_views, g.trainable):
                    if not train:
                        continue
                    if p.grad is None:
                        view.zero_()
                    else:
                        view.copy_(local_part(p.grad))

    def unpack_grads(self) -> None:
        """Sharded: write the flat gradient buffer (after an average) back into every trainable parameter's
        gradient, what the optimizer applies; a parameter that had none gets a ``DTensor`` gradient placed as the
        parameter (another replica's contribution reached it). Nothing otherwise."""
        if not self.sharded:
            return
        with torch.no_grad():
            for g in self.groups:
                for p, view, train in zip(g.params, g.grad_views, g.trainable):
                    if not train:
                        continue
                    if p.grad is None:
                        p.grad = sharded_like(view.clone(), p)
                    else:
                        local_part(p.grad).copy_(view)

    def grads_bound(self) -> bool:
        return all(
            p.grad is not None and p.grad.data_ptr() == v.data_ptr()
            for g in self.groups
            for p, v, t in zip(g.params, g.grad_views, g.trainable)
            if t
        )

    def grad_sq_norm(self) -> Tensor:
        """Squared L2 norm of this rank's whole gradient: one fused dot product per group, no per-tensor loop.

        Only valid while the gradients are bound (:meth:`bind_grads` ran before backward; sharded: after
        :meth:`pack_grads`, this rank's local gradient shard's); parameters that got no gradient contribute zero.
        """
        total: Tensor | None = None
        for g in self.groups:
            if g.param_numel:
                region = g.grad_region
                sq = torch.dot(region, region).double() if region.is_floating_point() else None
                if sq is not None:
                    total = sq if total is None else total + sq.to(total.device)
        if total is None:
            return torch.zeros((), dtype=torch.float64)
        return total

    def checksum(self, tensors: list[Tensor]) -> Tensor:
        """Two int64 fingerprints of the exact bits of ``tensors`` (order-sensitive), for consistency checks."""
        out = torch.zeros(2, dtype=torch.int64)
        for t in tensors:
            if t.numel() == 0:
                continue
            flat = t.detach().reshape(-1)
            if flat.element_size() == 4:
                bits = flat.view(torch.int32).to(torch.int64)
            elif flat.element_size() == 2:
                bits = flat.view(torch.int16).to(torch.int64)
            elif flat.element_size() == 8:
                bits = flat.view(torch.int64)
            else:
                bits = flat.view(torch.uint8).to(torch.int64)
            idx = torch.arange(1, bits.numel() + 1, device=bits.device, dtype=torch.int64)
            out[0] += bits.sum().cpu()
            out[1] += ((bits % 1000003) * (idx % 1000033)).sum().cpu()
        return out
