"""The parameter server's wire protocol: message kinds, the header, and which group carries what.

Every message is a ``uint8`` tensor: a :data:`HEADER_BYTES`-byte header — four float64 values: kind, epoch, flag, and
α (NaN for none) — followed, for parameter payloads, by the packed shards (the parameters' dtype, or the compression's
wire format). :class:`~lightning_sync.comm.ps.ParameterServer` uses two gloo groups, one per direction:

=========  ==========================  ===============================================================================
kind       group, direction            meaning and answer
=========  ==========================  ===============================================================================
PUSH       push, worker → server       header (epoch, flag = reply wanted) + the worker's delta for the server's shards;
                                       applied by :meth:`~lightning_sync.core.ps.ShardServer.push`, which decides the
                                       PARAMS replies
DONE       push, worker → server       header (epoch): the worker found the epoch's data consumed
                                       (:meth:`~lightning_sync.core.ps.ShardServer.finish_epoch`)
FLUSH      push, worker → server       header only; answered by ACK once everything the worker sent before is applied
STOP       push, worker → server       header only, at shutdown; answered by CLOSE; a server exits after the last STOP
PARAMS     pull, server → worker       header (α of the mix, or none: replace) + the server's global parameters
ACK        pull, server → worker       header only: the answer to FLUSH
CLOSE      pull, server → worker       header only: the answer to STOP; a mailbox exits after the last CLOSE
=========  ==========================  ===============================================================================

The server thread receives from any source on the push group (tag 0) and the mailbox thread from any source on the
pull group. Besides, every rank's **watch** thread per peer receives one byte from that peer alone on the push group
under :data:`WATCH_TAG`: :data:`BYE_CLOSE` at a clean shutdown, :data:`BYE_STOP` when the peer's run failed.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: bytes of every message's header: kind, epoch, flag and α as four float64
HEADER_BYTES = 32
# worker -> server (push group)
PUSH, FLUSH, DONE, STOP = 1, 2, 3, 4
# server -> worker (pull group)
PARAMS, ACK, CLOSE = 11, 12, 13
#: tag of the watch threads' receives on the push group (the server's any-source receives use tag 0)
WATCH_TAG = 7
#: the goodbyes a watch thread receives: the peer closed cleanly, or its run failed
BYE_CLOSE, BYE_STOP = 1, 2


def write_header(buf: Tensor, kind: int, epoch: int = 0, flag: int = 0, alpha: float | None = None) -> None:
    """Write the header into the first :data:`HEADER_BYTES` of ``buf``."""
    buf[:HEADER_BYTES].view(torch.float64).copy_(
        torch.tensor([kind, epoch, flag, float("nan") if alpha is None else alpha], dtype=torch.float64)
    )


def read_header(buf: Tensor) -> tuple[int, int, int, float | None]:
    """``(kind, epoch, flag, alpha)`` from the first :data:`HEADER_BYTES` of ``buf``."""
    kind, epoch, flag, alpha = buf[:HEADER_BYTES].view(torch.float64).tolist()
    return int(kind), int(epoch), int(flag), (None if alpha != alpha else alpha)
