import os

import pytest
import torch.distributed as dist

_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "PL_GLOBAL_SEED")


@pytest.fixture(autouse=True)
def _restore_distributed_env():
    """Lightning's launchers write MASTER_PORT etc. into the parent's environment; in-process world-size-1 runs
    create a default process group. Restore both after every test."""
    saved = {k: os.environ.get(k) for k in _DIST_ENV}
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
