"""Per-rank checkpoint parts: every rank's own state is written beside the checkpoint and restored on resume.

Lightning saves rank 0's model and optimizer state only. Methods whose replicas differ between ranks (local steps,
asynchronous pushes) and every method's per-rank counters need each rank's own: :class:`PerRankCheckpointing`
writes ``<file>.rank<r>`` from every rank (atomically), then rank 0 the main file with a checkpoint id every part
repeats, and on load checks strategy, world size and id before handing each rank its part.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Mapping
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_sync.comm.dcp import model_refs, read_shards, split_shards, write_shards
from lightning_sync.strategies.checkpoint_dir import (
    META_FILE,
    check_target,
    is_checkpoint_dir,
    part_file,
    swap_in,
    temporary_dir,
)

#: the key of the main checkpoint file under which the strategy records what the parts must match
CKPT_KEY = "lightning_sync"
#: the launches that end a save after its part is written, counted in the part ahead of time ``(tag, bytes,
#: blocking)``: the barrier before rank 0 writes the main file, and Lightning's ``Trainer.save_checkpoint`` barrier
SAVE_BARRIERS = (("checkpoint", 0, True), ("checkpoint", 0, True))


def save_atomically(io: CheckpointIO, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
    """Save ``checkpoint`` to ``path`` through ``io``; with the default :class:`TorchCheckpointIO` on a local path,
    write a temporary file beside ``path`` and rename it over ``path`` (atomic on POSIX, so readers and a resume
    after a crash see the old file or the new one, never a truncated one).

    Lightning's own local write goes through a temporary file in the system temp directory and ``shutil.move``,
    which is a copy (not atomic) when that directory is on another filesystem. Other ``CheckpointIO`` plugins
    (remote, asynchronous, custom formats) and ``storage_options`` are passed through unchanged. No ``fsync``: the
    guarantee is against the process dying, not the machine.
    """
    if type(io) is not TorchCheckpointIO or storage_options is not None or not _is_local_file_protocol(path):
        io.save_checkpoint(checkpoint, path, storage_options=storage_options)
        return
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for a plain open()
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(checkpoint, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


class PerRankCheckpointing:
    """Mixin of :class:`~lightning_sync.strategies.SyncStrategy`: the checkpoint overrides of Lightning's strategy.

    Uses from the strategy: ``strategy_state()`` / ``load_strategy_state()`` (what each rank saves),
    ``replicas_diverge`` (whether each rank's model and optimizer state are saved too; sharded replicas always save
    them, ``topology.parts_hold_model``), ``comm`` (one broadcast and
    one barrier per save), ``_main_file_checkpoint`` (what rank 0 writes to the main file; parameter-server
    methods put the global model there), and ``topology`` (the model's form in the parts and the main file: sharded
    replicas save each rank's local shards in its part and the whole tensors in the main file).
    """

    _part_names: dict[str, str]  # this rank's checkpoint path -> rank 0's, for its part's name
    _topology: Any  # the strategy's topology (None before setup_environment): the model's form in the files
    _restored_state: dict[str, Any] | None
    _restored_per_rank: bool
    #: a checkpoint is a directory in torch.distributed.checkpoint's format (sharded replicas; checkpoint_dir.py)
    save_distributed_checkpoint: bool = False

    @staticmethod
    def rank_file(filepath: Any, rank: int) -> str:
        """Where ``rank``'s part of the checkpoint ``filepath`` lives (written beside it)."""
        return f"{filepath}.rank{rank}"

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write this rank's part beside the checkpoint, then (after every rank has) rank 0 writes the file.

        Each rank's part holds its :meth:`strategy_state` and, when :attr:`replicas_diverge`, its own model and
        optimizer state (local steps make replicas and momentum buffers differ; Lightning saves rank 0's only).
        The main file is written last, so it exists only if every part does, and it records the world size and a
        fresh checkpoint id that every part repeats (a part left over from another save of the same name, e.g. an
        interrupted overwrite of ``last.ckpt``, is refused on load). Local files are written atomically (a temporary
        file renamed over the real name): a crash mid-write leaves the previous file, never a truncated one.
        """
        if self._comm is None:
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        distributed = self.save_distributed_checkpoint  # a directory in DCP's format (sharded replicas)
        if distributed:
            check_target(filepath, storage_options)
        part: dict[str, Any] = {"strategy_state": self.strategy_state()}
        per_rank_model = self.topology.parts_hold_model(self.replicas_diverge)  # sharded: always (its own shards)
        # Name every part after rank 0's file: a file name with {step} differs between ranks whose step counts differ
        # (asynchronous methods), and resume looks for <rank 0's file>.rank<r>. Removal maps back without a collective.
        # Rank 0's fresh id for this save travels in the same broadcast.
        shared, ckpt_id = (str(filepath), uuid.uuid4().hex)
        if self.world_size > 1:
            shared, ckpt_id = self.comm.broadcast_object((shared, ckpt_id), tag="checkpoint")
        self._part_names[str(filepath)] = shared
        part["checkpoint_id"] = ckpt_id
        shards: dict[str, Any] = {}
        if distributed:  # each DTensor a reference into the DCP files; one copy when the replicas never diverge
            replica = self.replica_index if self.replicas_diverge else ""
            own = {"state_dict": checkpoint.get("state_dict"), "optimizer_states": checkpoint.get("optimizer_states")}
            own, shards = split_shards(own, f"replica{replica}.")
            part.update(own)
        elif per_rank_model:
            part["state_dict"] = self.topology.checkpoint_part(checkpoint.get("state_dict"))
            part["optimizer_states"] = self.topology.checkpoint_part(checkpoint.get("optimizer_states"))
        # What the main file holds may cost a collective (the replicas' average, or with verify_sync the check that
        # they are in sync): issue it before the part is written, so the part's totals include every message of
        # this save and a run resumed from it continues from the totals the uninterrupted run had after the save.
        # The two barriers that end the save are counted ahead (0 bytes, one blocking op each): ours below, after
        # which rank 0 writes the main file, and the one Lightning's Trainer.save_checkpoint issues after this method
        # returns (Trainer.save_checkpoint is the only caller Lightning has; ModelCheckpoint saves through it).
        checkpoint = self._main_file_checkpoint(checkpoint)
        record = {
            "strategy": type(self).__name__,
            "world_size": self.world_size,
            "per_rank_model": per_rank_model,
            "checkpoint_id": ckpt_id,
            "ranks_per_replica": self.ranks_per_replica,
        }
        if distributed:  # the global model's DTensors go to DCP's "state_dict" too; meta.pt holds references
            checkpoint = dict(checkpoint)
            checkpoint.pop("optimizer_states", None)  # each rank's is in its part
            record["model"], average = model_refs(checkpoint.pop("state_dict"), write_plain=self.is_global_zero)
            target = temporary_dir(shared, ckpt_id)
            write_shards({**shards, **average}, target, self.comm)  # DCP's plans and metadata: counted collectives
            part_path = part_file(target, self.global_rank)
        else:
            checkpoint = self.topology.checkpoint_main(checkpoint)
            part_path = self.rank_file(shared, self.global_rank)
        part["strategy_state"]["comm"] = self.comm_stats.state_dict(pending=SAVE_BARRIERS)
        save_atomically(self.checkpoint_io, part, part_path)
        self.comm.barrier(tag="checkpoint")
        checkpoint[CKPT_KEY] = record
        if not self.is_global_zero:
            return
        if distributed:
            torch.save(checkpoint, os.path.join(target, META_FILE))
            swap_in(target, shared)  # every rank's files are in: the directory replaces any previous one
        else:
            save_atomically(self.checkpoint_io, checkpoint, filepath, storage_options)

    def _main_file_checkpoint(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """What rank 0 writes to the main file (parameter-server methods put the global model there)."""
        return checkpoint

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        directory = is_checkpoint_dir(checkpoint_path)  # save_distributed_checkpoint=True wrote it
        if directory:
            meta = os.path.join(os.fspath(checkpoint_path), META_FILE)
            checkpoint = self.checkpoint_io.load_checkpoint(meta, weights_only=weights_only)
        else:
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        saved = checkpoint.get(CKPT_KEY)
        if saved is None:
            rank_zero_warn(
                f"{checkpoint_path} holds no lightning_sync strategy state: {type(self).__name__} starts its "
                "counters, accounting and method state fresh, and every rank loads rank 0's weights."
            )
            return checkpoint
        self._check_saved(saved, checkpoint_path, directory)
        if directory:
            part_path = part_file(checkpoint_path, self.global_rank)
        else:
            part_path = self.rank_file(checkpoint_path, self.global_rank)
        try:
            part = self.checkpoint_io.load_checkpoint(part_path, weights_only=weights_only)
        except FileNotFoundError as err:
            beside = "in the directory" if directory else "beside the file; copy the .rankN files along with it"
            raise FileNotFoundError(
                f"checkpoint {checkpoint_path} is incomplete: rank {self.global_rank}'s part {part_path} is missing "
                f"(each rank's state is written {beside})"
            ) from err
        expected = saved.get("checkpoint_id")  # absent in checkpoints written before ids were recorded
        if expected is not None and part.get("checkpoint_id") != expected:
            raise ValueError(
                f"checkpoint {checkpoint_path} is inconsistent: rank {self.global_rank}'s part {part_path} belongs to "
                f"another save (checkpoint id {part.get('checkpoint_id')}, the file's is {expected}). A save of the "
                "same name was interrupted, or files of different saves were mixed; resume from another checkpoint."
            )
        if directory:  # this rank's shards, read from the DCP files (no collective)
            own = {"state_dict": part["state_dict"], "optimizer_states": part["optimizer_states"]}
            part.update(read_shards(own, self.lightning_module, os.fspath(checkpoint_path)))
        self._restored_per_rank = bool(saved.get("per_rank_model"))
        if self._restored_per_rank:
            checkpoint["state_dict"] = part["state_dict"]
            checkpoint["optimizer_states"] = part["optimizer_states"]
        self._restored_state = part["strategy_state"]
        if self._flat is not None:  # restoring after setup (restore_checkpoint_after_setup)
            self.load_strategy_state(self._restored_state)
            self._restored_state = None
        return checkpoint

    def load_global_model(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint as validate, test and predict read it: the main file's global model (a distributed
        checkpoint's ``state_dict`` entries, each rank reading its own shards of them)."""
        if not is_checkpoint_dir(checkpoint_path):
            return DDPStrategy.load_checkpoint(self, checkpoint_path, weights_only=weights_only)
        directory = os.fspath(checkpoint_path)
        checkpoint = self.checkpoint_io.load_checkpoint(os.path.join(directory, META_FILE), weights_only=weights_only)
        saved = checkpoint.get(CKPT_KEY, {})
        self._check_saved(saved, checkpoint_path, True)
        checkpoint["state_dict"] = read_shards(saved["model"], self.lightning_module, directory)
        return checkpoint

    def _check_saved(self, saved: dict[str, Any], checkpoint_path: Any, directory: bool) -> None:
        """The checkpoint's record matches this run: strategy, world size, ranks per replica (and sharding, for a
        distributed checkpoint)."""
        if saved.get("strategy") != type(self).__name__:
            raise ValueError(
                f"checkpoint {checkpoint_path} was written by {saved.get('strategy')}; resume it with that strategy "
                f"(this run uses {type(self).__name__})"
            )
        if saved["world_size"] != self.world_size:
            raise ValueError(
                f"checkpoint {checkpoint_path} holds per-rank state for world size {saved['world_size']}; this run "
                f"has world size {self.world_size}. Resume with the same number of processes."
            )
        grouping = saved.get("ranks_per_replica", 1)  # absent in checkpoints written before replica groups
        if grouping != self.ranks_per_replica:
            raise ValueError(
                f"checkpoint {checkpoint_path} was written with {grouping} rank(s) per replica; this run has "
                f"{self.ranks_per_replica} (replica_size={self.replica_size!r}). Resume with the replica_size the "
                "checkpoint was written with: each rank's part holds its replica's state."
            )
        if directory and not self.sharded:
            raise ValueError(
                f"checkpoint {checkpoint_path} is a distributed checkpoint of sharded replicas (a directory in "
                f"torch.distributed.checkpoint's format); load it with {type(self).__name__}(sharded=True), or "
                "consolidate it into one file first: python -m lightning.fabric.utilities.consolidate_checkpoint DIR"
            )

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Lightning's, with the state dict in the form the topology loads (sharded replicas: the part's local
        shards made ``DTensor`` objects again; as read otherwise)."""
        if self._topology is not None:
            state_dict = self._topology.restore_model(checkpoint["state_dict"], self.lightning_module)
            checkpoint = {**checkpoint, "state_dict": state_dict}
        super().load_model_state_dict(checkpoint, strict=strict)  # type: ignore[misc]

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Lightning's, with each optimizer's state in the form the topology loads."""
        if self._topology is not None:
            states = [
                self._topology.restore_optimizer(state, optimizer)
                for state, optimizer in zip(checkpoint["optimizer_states"], self.optimizers)
            ]
            checkpoint = {**checkpoint, "optimizer_states": states}
        super().load_optimizer_state_dict(checkpoint)  # type: ignore[misc]

    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        part = self.rank_file(self._part_names.pop(str(filepath), str(filepath)), self.global_rank)
        try:
            self.checkpoint_io.remove_checkpoint(part)
        except FileNotFoundError:
            pass
