"""The runnable examples (issue 48): ``examples/train.py`` as a user runs it, and the launch scripts.

* ``python examples/train.py --strategy localsgd ... --devices 2``: Lightning re-runs the script for rank 1 (popen);
  rank 0 prints a ``result: {json}`` line with the validation accuracy and the strategy's LSSR and bytes. The same
  with ``--strategy ddp`` (Lightning's own DDP: no LSSR). A bad strategy argument fails before anything is launched,
  with the strategy's own ``ValueError`` naming the argument.
* Under ``torchrun --standalone`` (2 processes) Lightning detects torchrun's environment and launches nothing; and
  ``examples/torchrun.sh`` run twice on this host is a 2-node rendezvous of one process each.
* ``examples/torchrun.sh`` and ``examples/slurm.sbatch`` parse (``bash -n``).

Every command is a subprocess with its own working directory under pytest's tmp_path (the script writes under
``runs/train`` there) and without the launcher variables of the environment pytest runs in (a SLURM or torchrun job
would otherwise make Lightning think it was launched by that). The commands are started together, once for the
module, and each test waits for its own: a popen launch imports Lightning in rank 0 and then in rank 1, one core at a
time, so side by side they take about half the wall time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from lightning_sync.launch import free_port, kill_session

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TRAIN = EXAMPLES / "train.py"
SHARDED = EXAMPLES / "train_sharded.py"
TIMEOUT = 900  # seconds for every command together (started at once); about 10-30 s each alone on 2 idle cores,
# 115 s together on 2 loaded ones: a hang guard with room for a slower machine
#: what a launcher sets: removed, so that each command starts as if typed in a fresh shell
LAUNCHER_VARIABLES = (
    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE",
    "PL_GLOBAL_SEED", "TORCHELASTIC_RUN_ID",
)  # fmt: skip


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES and not k.startswith("SLURM_")}
    env.update(extra)
    return env


def _train(*args: str) -> list[str]:
    return [sys.executable, str(TRAIN), *args, "--max-steps", "6", "--devices", "2"]


def _torchrun() -> str | None:
    beside = Path(sys.executable).with_name("torchrun")  # installed with torch into the same environment
    return str(beside) if beside.exists() else shutil.which("torchrun")


TORCHRUN = _torchrun()
needs_torchrun = pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not installed beside this Python")


def _commands() -> dict[str, list[tuple[list[str], dict[str, str]]]]:
    """Each test's command(s) and environment; the two-node case is two commands (two torchrun agents)."""
    commands = {
        "localsgd": [(_train("--strategy", "localsgd", "--strategy-arg", "period=2"), {})],
        "ddp": [(_train("--strategy", "ddp"), {})],
        "bad_argument": [(_train("--strategy", "localsgd", "--strategy-arg", "period=0"), {})],
        # a model that needs sharding: 4 processes as 2 replicas x 2 shards, and Lightning's FSDP2 over all 4
        "sharded_diloco": [([sys.executable, str(SHARDED), "--max-steps", "6", "--strategy-arg", "sync_every=3"], {})],
        "sharded_fsdp": [([sys.executable, str(SHARDED), "--max-steps", "6", "--strategy", "fsdp"], {})],
    }
    if TORCHRUN is not None:
        standalone = [TORCHRUN, "--standalone", "--nnodes=1", "--nproc-per-node=2"]
        commands["torchrun"] = [(standalone + _train("--strategy", "localsgd")[1:], {})]
        node = dict(
            RDZV_ENDPOINT=f"127.0.0.1:{free_port()}", NNODES="2", NPROC_PER_NODE="1", RDZV_ID="test-examples",
            ACCELERATOR="cpu", PATH=f"{Path(TORCHRUN).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        )  # fmt: skip
        script = ["bash", str(EXAMPLES / "torchrun.sh"), "--strategy", "selsync", "--max-steps", "6"]
        commands["two_nodes"] = [(script, node), (script, node)]
    return commands


@dataclass
class Done:
    returncodes: list[int]
    stdout: str  # every command's, one after the other
    stderr: str
    cwd: Path


@dataclass
class Started:
    procs: list[subprocess.Popen]
    logs: list[tuple[Path, Path]]
    cwd: Path
    deadline: float

    def wait(self) -> Done:
        for proc in self.procs:
            try:
                proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for p in self.procs:
                    kill_session(p)
                tail = "\n".join(err.read_text()[-3000:] for _, err in self.logs)
                pytest.fail(f"{[p.args for p in self.procs]} ran past {TIMEOUT} s\n{tail}")
        return Done(
            [proc.returncode for proc in self.procs],
            "".join(out.read_text() for out, _ in self.logs),
            "".join(err.read_text() for _, err in self.logs),
            self.cwd,
        )


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Every command of this module, started at once (output to files: a full pipe would stall a rank)."""
    deadline = time.monotonic() + TIMEOUT
    started: dict[str, Started] = {}
    try:
        for name, commands in _commands().items():
            cwd = tmp_path_factory.mktemp(name)
            procs, logs = [], []
            for i, (cmd, env) in enumerate(commands):
                out, err = cwd / f"stdout{i}.log", cwd / f"stderr{i}.log"
                with out.open("w") as fo, err.open("w") as fe:
                    procs.append(
                        subprocess.Popen(cmd, cwd=cwd, env=_env(**env), stdout=fo, stderr=fe, start_new_session=True)
                    )  # start_new_session: a timeout kills the ranks a command started too
                logs.append((out, err))
            started[name] = Started(procs, logs, cwd, deadline)
        yield started
    finally:
        for run in started.values():
            for proc in run.procs:
                kill_session(proc)


def _result(stdout: str) -> dict:
    """The one ``result: {json}`` line rank 0 printed."""
    lines = [line for line in stdout.splitlines() if line.startswith("result: ")]
    assert len(lines) == 1, stdout[-3000:]
    return json.loads(lines[0].removeprefix("result: "))


@pytest.mark.parametrize("strategy", ["localsgd", "ddp"])
def test_train_py_launches_two_processes_and_prints_the_result(launched, strategy):
    done = launched[strategy].wait()
    assert done.returncodes == [0], done.stderr[-4000:]
    result = _result(done.stdout)
    assert result["strategy"] == strategy and result["world_size"] == 2 and result["global_step"] == 6
    assert result["cluster"] == "LightningEnvironment"  # Lightning started rank 1 (the script, run again)
    assert 0.0 <= result["val_acc"] <= 1.0
    if strategy == "localsgd":
        assert result["lssr"] == 0.5 and result["bytes_sent"] > 0  # period 2: every other step averages
    else:
        assert "lssr" not in result  # Lightning's DDPStrategy has no sync_metrics()
    assert (done.cwd / "runs" / "train" / strategy / "version_0" / "metrics.csv").is_file()


@pytest.mark.parametrize("strategy", ["diloco", "fsdp"])
def test_train_sharded_py_shards_the_model_in_each_replica(launched, strategy):
    """examples/train_sharded.py: DiLoCo between 2 replicas of 2 shards (rank 0 holds half the model and sends its
    shard between the replicas), and Lightning's ModelParallelStrategy over all 4 ranks (a quarter of the model)."""
    done = launched[f"sharded_{strategy}"].wait()
    assert done.returncodes == [0], done.stderr[-4000:]
    result = _result(done.stdout)
    assert result["strategy"] == strategy and result["world_size"] == 4 and result["global_step"] == 6
    assert 0.0 <= result["val_acc"] <= 1.0
    shards = 2 if strategy == "diloco" else 4
    # rank 0's shard of each layer: its rows, FSDP2's first (largest) share along dim 0 (the 10-row head: 3 of 10)
    assert result["parameters"] / shards <= result["local_parameters"] < result["parameters"] / shards + 1024
    if strategy == "diloco":
        assert result["lssr"] == pytest.approx(4 / 6) and result["bytes_between_replicas"] > 0  # syncs at 3 and 6
    else:
        assert "lssr" not in result  # Lightning's ModelParallelStrategy has no sync_metrics()


def test_a_bad_strategy_argument_fails_with_the_strategys_message(launched):
    done = launched["bad_argument"].wait()
    assert done.returncodes == [2]  # argparse's error status: nothing was launched
    assert "ValueError: period must be" in done.stderr, done.stderr[-3000:]
    assert not (done.cwd / "runs").exists()


@pytest.mark.parametrize("script", ["torchrun.sh", "slurm.sbatch"])
def test_launch_scripts_parse(script):
    done = subprocess.run(["bash", "-n", str(EXAMPLES / script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@needs_torchrun
def test_train_py_under_torchrun_standalone(launched):
    done = launched["torchrun"].wait()
    assert done.returncodes == [0], done.stderr[-4000:]
    result = _result(done.stdout)
    assert result["cluster"] == "TorchElasticEnvironment"  # torchrun started both processes; Lightning none
    assert result["world_size"] == 2 and result["global_step"] == 6 and result["bytes_sent"] > 0


@needs_torchrun
def test_torchrun_sh_two_nodes_on_one_host(launched):
    """examples/torchrun.sh, as on two nodes: two torchrun agents meet at one c10d rendezvous on this host, one
    process each (``--num-nodes 2 --devices 1``); rank 0 is on whichever agent the rendezvous numbered first."""
    done = launched["two_nodes"].wait()
    assert done.returncodes == [0, 0], done.stderr[-4000:]
    result = _result(done.stdout)
    assert result["cluster"] == "TorchElasticEnvironment" and result["world_size"] == 2
    assert result["strategy"] == "selsync" and result["global_step"] == 6 and 0.0 <= result["lssr"] <= 1.0
