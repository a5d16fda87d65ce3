"""Lightning strategies: thin glue composing ``lightning_sync.core`` and ``lightning_sync.comm``.

Importing this package registers every strategy name in Lightning's ``StrategyRegistry``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_sync.strategies.adpsgd import ADPSGDStrategy
from lightning_sync.strategies.aladdin import ALADDINStrategy
from lightning_sync.strategies.asp import ASPStrategy
from lightning_sync.strategies.base import SyncStrategy
from lightning_sync.strategies.bsp import BSPStrategy
from lightning_sync.strategies.ddp import CountedDDPStrategy
from lightning_sync.strategies.diloco import DiLoCoStrategy
from lightning_sync.strategies.fault_tolerance import FaultTolerance
from lightning_sync.strategies.fedavg import FedAvgStrategy
from lightning_sync.strategies.fsdp2 import CountedFSDP2Strategy
from lightning_sync.strategies.localsgd import LocalSGDStrategy
from lightning_sync.strategies.osp import OSPStrategy
from lightning_sync.strategies.ps import ParameterServerStrategy
from lightning_sync.strategies.selsync import SelSyncStrategy
from lightning_sync.strategies.ssp import SSPStrategy
from lightning_sync.strategies.sync_switch import SyncSwitchStrategy

STRATEGIES: tuple[type[SyncStrategy], ...] = (
    BSPStrategy,
    SelSyncStrategy,
    LocalSGDStrategy,
    FedAvgStrategy,
    ADPSGDStrategy,
    OSPStrategy,
    ASPStrategy,
    SSPStrategy,
    ALADDINStrategy,
    SyncSwitchStrategy,
    DiLoCoStrategy,
)

for _cls in STRATEGIES:
    _cls.register_strategies(StrategyRegistry)
# Lightning's DDP with the pack's accounting: the reference row of `compare` (not a SyncStrategy, so not in STRATEGIES)
CountedDDPStrategy.register_strategies(StrategyRegistry)
# and Lightning's ModelParallelStrategy (FSDP2 over all ranks) with it: compare's fsdp2 row
CountedFSDP2Strategy.register_strategies(StrategyRegistry)

__all__ = [
    "ADPSGDStrategy",
    "ALADDINStrategy",
    "ASPStrategy",
    "BSPStrategy",
    "CountedDDPStrategy",
    "CountedFSDP2Strategy",
    "DiLoCoStrategy",
    "FaultTolerance",
    "FedAvgStrategy",
    "LocalSGDStrategy",
    "OSPStrategy",
    "ParameterServerStrategy",
    "SSPStrategy",
    "STRATEGIES",
    "SelSyncStrategy",
    "SyncStrategy",
    "SyncSwitchStrategy",
]
