import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, settings
from hypothesis.configuration import set_hypothesis_home_dir

# Hypothesis: the same examples in every run (a failure reproduces, a pass does not depend on the draw), no example
# database (a fresh clone would replay nothing), no time-based health check on a loaded machine
settings.register_profile(
    "lightning-sync", derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("lightning-sync")


def pytest_configure(config):
    """Hypothesis's storage (its cache of the constants in the code under test, written from collection on) in a
    temporary directory of this session, not ``.hypothesis/`` in the checkout."""
    config._lightning_sync_hypothesis_home = home = tempfile.mkdtemp(prefix="lightning-sync-hypothesis-")
    set_hypothesis_home_dir(home)


def pytest_unconfigure(config):
    home = getattr(config, "_lightning_sync_hypothesis_home", None)
    if home is not None:
        shutil.rmtree(home, ignore_errors=True)


#: OMP_NUM_THREADS: Lightning's launchers set it (cores // processes) in this process, and every later Popen and
#: NamespaceCluster.env would inherit that value
_DIST_ENV = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "PL_GLOBAL_SEED",
    "OMP_NUM_THREADS",
)


@pytest.fixture(autouse=True)
def _restore_distributed_env():
    """Lightning's launchers write MASTER_PORT, OMP_NUM_THREADS etc. into the parent's environment and set torch's
    thread count; in-process world-size-1 runs create a default process group. Restore all of it after every test."""
    saved = {k: os.environ.get(k) for k in _DIST_ENV}
    threads = torch.get_num_threads()
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
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
