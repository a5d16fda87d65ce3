"""Communication: the only layer that touches ``torch.distributed``; one accounting path for every method."""

from lightning_sync.comm.accounting import CommStats
from lightning_sync.comm.communicator import CommHandle, Communicator, destroy_default_group
from lightning_sync.comm.fault import PeerFailure, destroy_groups_at_exit, report_failure
from lightning_sync.comm.flat import FlatState
from lightning_sync.comm.link import LinkClock, LinkModel

__all__ = [
    "CommHandle",
    "CommStats",
    "Communicator",
    "FlatState",
    "LinkClock",
    "LinkModel",
    "PeerFailure",
    "destroy_default_group",
    "destroy_groups_at_exit",
    "report_failure",
]
