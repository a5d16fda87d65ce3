"""Checkpoint files that are complete or absent: a crash mid-write never leaves a truncated file under the real name."""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol


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
