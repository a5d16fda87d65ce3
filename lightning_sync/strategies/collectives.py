"""Lightning's own collectives (``reduce`` for ``self.log(..., sync_dist=True)``, ``barrier``, ``broadcast``,
``all_gather``) routed through the strategy's :class:`~lightning_sync.comm.Communicator`: counted under the tag
``"lightning"`` (``"checkpoint"`` for the barriers around saving and restoring) and link-emulated like the method's
own traffic."""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.types import ReduceOp
from torch import Tensor

#: names of Lightning's own barriers that belong to saving or restoring a checkpoint
CHECKPOINT_BARRIERS = frozenset({"Trainer.save_checkpoint", "_CheckpointConnector.resume_end"})
_REDUCE_OPS = {"mean": "avg", "avg": "avg", "sum": "sum", "max": "max", "min": "min"}


class CountedCollectives:
    """Mixin of :class:`~lightning_sync.strategies.SyncStrategy`: before setup (no communicator yet) and for
    another process group, Lightning's own implementation runs."""

    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        if not isinstance(tensor, Tensor) or self._comm is None or group is not None:
            return super().reduce(tensor, group=group, reduce_op=reduce_op)
        if isinstance(reduce_op, str):
            op = _REDUCE_OPS.get(reduce_op.lower())
        elif reduce_op is None:
            op = "sum"
        else:
            op = {ReduceOp.SUM: "sum", ReduceOp.MAX: "max", ReduceOp.MIN: "min"}.get(reduce_op)
        if op is None:
            return super().reduce(tensor, group=group, reduce_op=reduce_op)
        if op == "avg" and not tensor.is_floating_point():
            self.comm.all_reduce(tensor, op="sum", tag="lightning")
            return tensor.copy_(tensor / self.world_size)
        self.comm.all_reduce(tensor, op=op, tag="lightning")
        return tensor

    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        if self._comm is None:
            return super().barrier(name, *args, **kwargs)
        # Lightning's barriers around saving and restoring a checkpoint are checkpoint bookkeeping, not training
        # traffic (the one after a save is counted ahead in the checkpoint part: checkpoint.SAVE_BARRIERS)
        self.comm.barrier(tag="checkpoint" if name in CHECKPOINT_BARRIERS else "lightning")

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self._comm is None:
            return super().broadcast(obj, src)
        return self.comm.broadcast_object(obj, src=src, tag="lightning")

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        if self._comm is None or group is not None:
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)
        if sync_grads:
            return self.comm.all_gather_differentiable(tensor, tag="lightning")
        return self.comm.all_gather(tensor, tag="lightning")
