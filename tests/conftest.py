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


@pytest.fixture(autouse=True)
def _no_popen_launch_from_pytest(monkeypatch):
    """``strategy="<name>"`` launches as Lightning's ``ddp``: it runs ``sys.argv`` again for every other rank, which
    here is pytest. Fail such a test at once, saying what to use instead."""
    from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

    call_children = _SubprocessScriptLauncher._call_children_scripts

    def refuse(self):
        if self.num_processes > 1:
            raise RuntimeError(
                "a test launched processes with start_method='popen' (strategy='<name>'), which would run pytest "
                "again: use strategy='<name>_spawn' or start_method='spawn', or lightning_sync.launch.launch_local"
            )
        call_children(self)  # one process: nothing is started, training runs here

    monkeypatch.setattr(_SubprocessScriptLauncher, "_call_children_scripts", refuse)


@pytest.fixture
def single_process(monkeypatch):
    """A torchrun-like environment of one process: Lightning launches nothing and trains in this process."""
    from launch import free_port

    for key, value in dict(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", NODE_RANK="0"
    ).items():
        monkeypatch.setenv(key, value)
