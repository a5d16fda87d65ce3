"""lightning-sync: communication-efficient data-parallel strategies for PyTorch Lightning.

``Trainer(strategy="selsync")`` or ``strategy=SelSyncStrategy(delta=0.3)``; importing the package registers the
strategy names with Lightning.
"""

from lightning_sync import callbacks  # noqa: F401  (registers SyncSwitch as Sync-Switch's default controller)
from lightning_sync.comm import CommStats, LinkModel
from lightning_sync.strategies import (
    ADPSGDStrategy,
    ALADDINStrategy,
    ASPStrategy,
    BSPStrategy,
    DiLoCoStrategy,
    FaultTolerance,
    FedAvgStrategy,
    LocalSGDStrategy,
    OSPStrategy,
    SelSyncStrategy,
    SSPStrategy,
    SyncStrategy,
    SyncSwitchStrategy,
)

__version__ = "0.1.0"

__all__ = [
    "ADPSGDStrategy",
    "ALADDINStrategy",
    "ASPStrategy",
    "BSPStrategy",
    "CommStats",
    "DiLoCoStrategy",
    "FaultTolerance",
    "FedAvgStrategy",
    "LinkModel",
    "LocalSGDStrategy",
    "OSPStrategy",
    "SelSyncStrategy",
    "SSPStrategy",
    "SyncStrategy",
    "SyncSwitchStrategy",
    "__version__",
]
