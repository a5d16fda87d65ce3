"""Validation and checkpoints of the global model when replicas diverge.

Methods with local steps (local SGD, FedAvg, ADPSGD, SelSync, DiLoCo) hold a different replica on every rank.
Validation during fit then evaluates the global model — the replicas' average w = W 1/n, swapped into the module with
one exact all-reduce (tag ``"eval"``) and each rank's own replica put back bit-exactly afterwards — so metrics,
``EarlyStopping`` and ``ModelCheckpoint`` decide on one value on every rank. The main checkpoint file holds the same
global model (each rank's own replica goes to its part, :mod:`~lightning_sync.strategies.checkpoint`), and
validate/test/predict from a checkpoint load it on every rank.

``evaluate="last_sync"`` (an argument of the methods with local steps) evaluates instead the global model as of the
most recent synchronisation — what every rank held right after it (with an outer optimizer,
:math:`\theta_{global}`; with streaming DiLoCo, each fragment's global values as of its last sync) — kept in a
copy on every rank, so validation and the main checkpoint file send nothing. It costs one model-sized copy per
rank (in memory and in each rank's checkpoint part) and a copy per sync; the model validated lags the replicas by
the local steps since that sync. The default, ``"average"``, is exact at the moment of validation and costs one
all-reduce of the model per validation — except when no training step has run since a sync of the whole model
(a local SGD period or FedAvg round that ends with the epoch, DiLoCo's plain sync): every rank then holds that
global model, which is the replicas' average, and validation (or the main checkpoint file) takes it as it is, with
no communication. With ``verify_sync=True`` the replicas are checked to be identical there (one checksum gather).

With replica groups (``replica_size``) the ranks of a replica are identical, so the average is the replicas': one
all-reduce over the replicas' first ranks, then a broadcast inside each replica (the traffic between replicas is
the flat average's with the number of replicas as the world size).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor

from lightning_sync.core.validation import check_choice

#: what validation during fit (and the main checkpoint file) holds for a method with local steps
EVALUATE = ("average", "last_sync")


def check_evaluate(evaluate: Any) -> str:
    """The ``evaluate`` argument: ``"average"`` (the replicas' exact average, one all-reduce per validation) or
    ``"last_sync"`` (the global model of the last synchronisation, kept on every rank: no communication)."""
    return check_choice("evaluate", evaluate, EVALUATE)


class GlobalModelEvaluation:
    """Mixin of :class:`~lightning_sync.strategies.SyncStrategy`, ahead of
    :class:`~lightning_sync.strategies.checkpoint.PerRankCheckpointing` in the MRO: its ``save_checkpoint``,
    ``_main_file_checkpoint`` and ``load_checkpoint`` wrap the per-rank ones.

    Uses from the strategy: ``replicas_diverge`` and ``averages_for_eval`` (whether to average at all; the
    parameter-server strategies swap in the servers' model instead), ``flat`` and ``comm`` (the all-reduce).
    """

    _eval_replica: list[Tensor] | None  # this rank's replica while the global model is swapped in
    _main_state_dict: dict[str, Any] | None  # what the main checkpoint file holds during a save
    #: ``"average"`` or ``"last_sync"`` (set by the strategies that take the argument, :func:`check_evaluate`)
    evaluate: str = "average"
    #: with ``evaluate="last_sync"``: every flat group's state (parameters, then buffers) as of the last sync
    _synced: list[Tensor] | None = None
    #: every rank holds the same parameters and buffers: set by a sync of the whole model (:meth:`_mark_in_sync`),
    #: cleared by every training step (forward: BatchNorm statistics; then the update). Identical on every rank (it
    #: follows the step schedule), so every rank skips the same collectives.
    _in_sync: bool = False

    def _evaluates_average(self) -> bool:
        """Whether this strategy's replicas can differ and validation (and the main checkpoint file) should see their
        average instead of each rank's own."""
        return self.replicas_diverge and self.averages_for_eval and self._flat is not None and self.num_replicas > 1

    def _evaluates_last_sync(self) -> bool:
        """Whether that global model is the last sync's copy (no communication) rather than a fresh average."""
        return self.evaluate == "last_sync" and self._evaluates_average()

    def _mark_in_sync(self) -> None:
        """After a sync that left every rank holding the whole global model (parameters and buffers)."""
        self._in_sync = True

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._in_sync = False  # the forward moves BatchNorm statistics; the update follows
        return super().training_step(*args, **kwargs)

    # ------------------------------------------------------------------ evaluate="last_sync": the copy
    def _init_synced(self) -> None:
        """At setup, replicas identical (after the setup broadcast): the copy starts as them. A resume then loads the
        saved copy (:meth:`_load_synced`)."""
        self._synced = None
        self._in_sync = False  # a fit starts (or resumes) with no sync of its own yet
        if self.evaluate == "last_sync":
            self._synced = [g.state.detach().clone() for g in self.flat.groups]

    def _record_synced(self) -> None:
        """After a sync that left every rank holding the global model (parameters and buffers): copy it."""
        if self._synced is not None:
            with torch.no_grad():
                for saved, g in zip(self._synced, self.flat.groups):
                    saved.copy_(g.state)

    def _record_synced_region(self, group: int, start: int, values: Tensor) -> None:
        """After the sync of one range of a flat group (a DiLoCo fragment): ``values`` are its global values."""
        if self._synced is not None:
            with torch.no_grad():
                self._synced[group][start : start + values.numel()].copy_(values)

    def _synced_state(self) -> list[Tensor] | None:
        """This rank's part of the strategy state under ``"synced"`` (``None`` unless ``evaluate="last_sync"``)."""
        return None if self._synced is None else [t.detach().clone() for t in self._synced]

    def _load_synced(self, saved: list[Tensor] | None) -> None:
        if self.evaluate != "last_sync":
            return  # a copy saved by a last_sync run is not needed to evaluate the average
        if saved is None:
            raise ValueError(
                "evaluate='last_sync' needs the global model of the last sync, and this checkpoint was written with "
                "evaluate='average' (it holds no copy of it): resume with evaluate='average', or start the fit anew"
            )
        if self._synced is None or len(saved) != len(self._synced):
            raise ValueError("the checkpoint's copy of the last sync's global model does not match this model")
        with torch.no_grad():
            for own, value in zip(self._synced, saved):
                if own.shape != value.shape:
                    raise ValueError("the checkpoint's copy of the last sync's global model does not match this model")
                own.copy_(value)

    def on_validation_start(self) -> None:
        super().on_validation_start()
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING and self._evaluates_average():
            # every rank validates the global model (w = W 1/n, or the last sync's), so metrics, EarlyStopping and
            # ModelCheckpoint decide on one value; each rank's own replica waits in a scratch copy and is put back
            # bit-exactly afterwards
            last_sync = self._evaluates_last_sync()
            self._eval_replica = self._swap_in_synced() if last_sync else self._swap_in_average("eval")

    def on_validation_end(self) -> None:
        # after the callbacks' on_validation_end (ModelCheckpoint saves there, with the average swapped in)
        if self._eval_replica is not None:
            self._put_back(self._eval_replica)
            self._eval_replica = None
        super().on_validation_end()

    def _swap_in_average(self, tag: str) -> list[Tensor] | None:
        """Average parameters and buffers into the module (one exact all-reduce per flat buffer, counted under
        ``tag``); return this rank's values from before, for :meth:`_put_back`. ``None`` (nothing sent, nothing to
        put back) when the replicas are in sync (:attr:`_in_sync`): they are their average.

        This is an observation, not a sync: it changes no method state — no outer-optimizer step (with DiLoCo's
        outer optimizer, validation sees the replicas' plain mean, not the next outer step), no compression
        reference or error feedback (the mean is exact, in the data's dtype)."""
        tensors = self.flat.state_tensors()
        if self._in_sync:
            if self.verify_sync:
                what = f"parameters and buffers (in sync since the last sync, at {tag!r})"
                self._verify(tensors, what, self.replicas.across)  # sharded: each shard index's ranks; else all
            return None
        replica = [t.detach().clone() for t in tensors]
        self.topology.mean(tensors, tag)  # with replica groups: over the leaders, broadcast in the replica
        return replica

    def _swap_in_synced(self) -> list[Tensor]:
        """``evaluate="last_sync"``: the last sync's global model into the module, no communication; return this
        rank's values from before, for :meth:`_put_back`."""
        assert self._synced is not None
        tensors = self.flat.state_tensors()
        replica = [t.detach().clone() for t in tensors]
        with torch.no_grad():
            for saved, g in zip(self._synced, self.flat.groups):
                g.state.copy_(saved)
        return replica

    def _put_back(self, replica: list[Tensor] | None) -> None:
        if replica is None:  # nothing was swapped in
            return
        for tensor, saved in zip(self.flat.state_tensors(), replica):
            tensor.copy_(saved)
        self.flat.reshard()  # sharded: the next forward gathers this replica's shards, not validation's

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Each rank's part holds its own replica; the main file the global model (see :meth:`_main_file_checkpoint`).
        A save while validation has the average swapped in (``ModelCheckpoint`` saves in ``on_validation_end``) has
        that average in ``checkpoint``: the main file keeps it — the model whose score was just monitored — and the
        parts are written with each rank's replica put back for the moment."""
        if self._eval_replica is None or self._comm is None:
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        self._main_state_dict = {k: v.detach().clone() for k, v in checkpoint["state_dict"].items()}
        average = [t.detach().clone() for t in self.flat.state_tensors()]
        self._put_back(self._eval_replica)
        try:
            own = {**checkpoint, "state_dict": self.lightning_module_state_dict()}
            super().save_checkpoint(own, filepath, storage_options=storage_options)
        finally:
            self._put_back(average)
            self._main_state_dict = None

    def _main_file_checkpoint(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """The main file holds the global model (the replicas' average; during validation, the one validated), so
        ``trainer.test(ckpt_path="best")`` and any consumer of the file get the same model on every rank. Outside
        validation the average costs one all-reduce, tagged ``"checkpoint"`` (bookkeeping, not training traffic);
        with ``evaluate="last_sync"`` the file holds the last sync's global model, with no communication."""
        if self._main_state_dict is not None:
            return {**checkpoint, "state_dict": self._main_state_dict}
        if not self._evaluates_average():
            return checkpoint
        replica = self._swap_in_synced() if self._evaluates_last_sync() else self._swap_in_average("checkpoint")
        try:
            average = {k: v.detach().clone() for k, v in self.lightning_module_state_dict().items()}
        finally:
            self._put_back(replica)
        return {**checkpoint, "state_dict": average}

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Every rank reads the file rank 0 wrote: ranks whose step counts differ (the asynchronous methods) name
        the same checkpoint differently (``ModelCheckpoint``'s ``{step}``), so ``ckpt_path="best"`` resolves to rank
        0's name on every rank (one broadcast). Validate/test/predict from a checkpoint evaluate the global model in
        the main file on every rank; a resumed fit restores each rank's own part."""
        if self._comm is not None and self.world_size > 1:
            checkpoint_path = self.comm.broadcast_object(checkpoint_path, src=0, tag="checkpoint")
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.state.fn != TrainerFn.FITTING and self.replicas_diverge:
            return self.load_global_model(checkpoint_path, weights_only=weights_only)
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
