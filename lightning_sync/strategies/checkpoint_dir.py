"""Distributed checkpoints of sharded replicas (``save_distributed_checkpoint=True``): a checkpoint is a directory in
``torch.distributed.checkpoint``'s format (DCP), as Lightning's ``ModelParallelStrategy`` writes it, and no rank ever
holds the whole model.

The directory holds:

* DCP's files (``.metadata``, one ``__<rank>_<i>.distcp`` per rank), with every ``DTensor``: each replica's own model
  and optimizer state under ``replica<r>.<path>`` (``replica.<path>`` for a method whose replicas never diverge: DCP
  writes the one copy once), and the global model under ``state_dict`` (the replicas' average, what the main file of
  the other format holds), so ``python -m lightning.fabric.utilities.consolidate_checkpoint <dir>`` gives a file whose
  ``["state_dict"]`` is the whole global model;
* ``meta.pt`` (rank 0): the rest of Lightning's checkpoint (loops, callbacks, ...) and the ``lightning_sync`` record
  the parts must match, with references to the ``state_dict`` entries;
* ``rank<r>.pt`` (each rank): its strategy state and its model and optimizer trees, each ``DTensor`` replaced by a
  reference to its DCP key (:func:`~lightning_sync.comm.dcp.split_shards`).

Every rank writes into a temporary directory beside the target; after every rank has written, rank 0 writes
``meta.pt`` and swaps the directory in (a previous checkpoint of the same name is renamed aside, then removed), so a
crash mid-save leaves the previous checkpoint whole. A resumed fit reads each rank's part and its own shards; validate,
test and predict read the global model.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import Any

from lightning.fabric.utilities.cloud_io import _is_local_file_protocol

from lightning_sync.core.validation import check_bool

#: rank 0's file in the directory (the name Lightning's ``ModelParallelStrategy`` and consolidation use)
META_FILE = "meta.pt"


def check_distributed_checkpoint(value: Any, sharded: Any, fault_tolerance: Any) -> bool:
    """The ``save_distributed_checkpoint`` argument: a bool; ``True`` needs ``sharded=True`` (replicas that are not
    sharded hold the whole model on every rank: their checkpoint is one file and a part per rank) and is not built
    with ``fault_tolerance`` (whose checkpoints are each replica group's own)."""
    check_bool("save_distributed_checkpoint", value)
    if value and sharded is not True:
        raise ValueError(
            "save_distributed_checkpoint=True needs sharded=True: the directory holds each rank's shards of a sharded "
            "replica. Without sharding every rank holds the whole model; use save_distributed_checkpoint=False."
        )
    if value and fault_tolerance is not None:
        raise ValueError(
            "save_distributed_checkpoint=True is not supported with fault_tolerance yet (a replica group's "
            "checkpoint is its own, written while other groups train on); use save_distributed_checkpoint=False."
        )
    return bool(value)


def part_file(directory: Any, rank: int) -> str:
    return os.path.join(os.fspath(directory), f"rank{rank}.pt")


def is_checkpoint_dir(path: Any) -> bool:
    """Whether ``path`` is a distributed checkpoint directory (a local directory with ``meta.pt``)."""
    return _is_local_file_protocol(path) and os.path.isfile(os.path.join(os.fspath(path), META_FILE))


def check_target(filepath: Any, storage_options: Any) -> None:
    """A distributed checkpoint is written by every rank straight to a local filesystem, as Lightning's: no
    ``CheckpointIO`` plugin, no ``storage_options``, no remote path."""
    if storage_options is not None:
        raise TypeError(
            "save_checkpoint(..., storage_options=...) is not supported with save_distributed_checkpoint=True: every "
            "rank writes its shards itself, not through the CheckpointIO plugin"
        )
    if not _is_local_file_protocol(filepath):
        raise ValueError(
            f"save_distributed_checkpoint=True writes to a local (or shared, mounted) filesystem; {filepath} is not "
            "one. Save to a local path, or use save_distributed_checkpoint=False (one file per rank, through the "
            "CheckpointIO plugin)."
        )


def temporary_dir(filepath: str, checkpoint_id: str) -> str:
    """Where every rank writes a save before rank 0 swaps it in (beside the target, hidden; the same on every rank)."""
    head, tail = os.path.split(os.path.abspath(filepath))
    return os.path.join(head, f".{tail}.{checkpoint_id[:12]}.tmp")


def swap_in(tmp: str, filepath: str) -> None:
    """Rank 0, after every rank has written into ``tmp``: make it ``filepath`` (a previous file or directory of that
    name is renamed aside first, then removed)."""
    old = f"{tmp}.old"
    if os.path.lexists(filepath):
        os.replace(filepath, old)
    os.replace(tmp, filepath)
    if os.path.isdir(old) and not os.path.islink(old):
        shutil.rmtree(old, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(old)
