"""Multi-node by configuration alone: 2 hosts (network namespaces) x 2 processes train BSP, SelSync, ALADDIN and
local SGD with replica groups (``replica_size="node"``: each host a replica).

Every process gets only the environment a multi-node launcher sets (``MASTER_ADDR`` = host 0's address on the
veth/bridge network, ``NODE_RANK``, ``LOCAL_RANK``, ``RANK``, ``WORLD_SIZE=4``) and builds
``Trainer(accelerator="cpu", num_nodes=2, devices=2, strategy=...)``; see ``multinode_worker.py``. One launch runs
the three fits; each rank writes what it saw and the tests below assert on it. Needs root, Linux and iproute2; the
harness's own guarantees (processes killed and namespaces removed when a rank fails or the test raises) are tested
at the end, and its pure parts without namespaces.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import multinode_worker as worker
import pytest

from lightning_sync.cluster import NamespaceCluster, cluster_available, wait_all
from lightning_sync.comm.cost import gloo_ring_allreduce_bytes
from lightning_sync.launch import free_port

available, why = cluster_available()
needs_cluster = pytest.mark.skipif(not available, reason=f"namespace cluster unavailable: {why}")

HOSTS, PROCS = 2, 2
WORLD = HOSTS * PROCS
WORKER = Path(__file__).resolve().with_name("multinode_worker.py")
JOB_TIMEOUT = 240.0  # seconds; about 40 s on 2 idle cores. A hung job is killed, and its namespaces removed.


def _ns_list() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def _numel() -> int:
    from lightning_sync.models import DigitsCNN

    model = DigitsCNN()
    return sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers() if b.is_floating_point())


# ----------------------------------------------------------------------------------------------- the job
@pytest.fixture(scope="module")
def job(tmp_path_factory):
    if not available:
        pytest.skip(f"namespace cluster unavailable: {why}")
    out = tmp_path_factory.mktemp("multinode")
    cluster = NamespaceCluster(hosts=HOSTS, rate="1gbit", subnet=80)
    start = time.perf_counter()
    with cluster:
        procs = cluster.launch(
            [sys.executable, str(WORKER), str(out)], free_port(), procs_per_host=PROCS, stdin=subprocess.DEVNULL
        )
        codes = wait_all(procs, timeout=JOB_TIMEOUT, grace=15.0)
    seconds = time.perf_counter() - start
    left = cluster.existing()
    if codes != [0] * WORLD:
        details = []
        for r in range(WORLD):
            for name in (f"error_rank{r}.txt", f"log_rank{r}.txt"):
                path = out / name
                if path.exists():
                    details.append(f"--- {name}\n" + "\n".join(path.read_text().splitlines()[-25:]))
                    break
        pytest.fail(f"exit codes {codes} after {seconds:.0f}s (negative: killed)\n" + "\n".join(details))
    res = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return {"res": res, "cluster": cluster, "left": left}


# ----------------------------------------------------------------------------------------------- what it proves
@needs_cluster
def test_four_ranks_on_two_nodes_from_the_environment(job):
    for r, res in enumerate(job["res"]):
        assert res["env"]["RANK"] == str(r) and res["env"]["WORLD_SIZE"] == str(WORLD)
        for name in ("bsp", "selsync", "aladdin"):
            m = res[name]
            assert m["world_size"] == WORLD and m["num_nodes"] == HOSTS
            assert m["global_rank"] == r  # Lightning's rank = NODE_RANK * devices + LOCAL_RANK = RANK
            assert (m["node_rank"], m["local_rank"]) == (r // PROCS, r % PROCS)
            assert str(m["node_rank"]) == res["env"]["NODE_RANK"] and str(m["local_rank"]) == res["env"]["LOCAL_RANK"]
    nodes = {(res["bsp"]["node_rank"], res["bsp"]["local_rank"]) for res in job["res"]}
    assert nodes == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert [res["bsp"]["strategy"] for res in job["res"]] == ["BSPStrategy"] * WORLD
    assert [res["aladdin"]["strategy"] for res in job["res"]] == ["ALADDINStrategy"] * WORLD


@needs_cluster
def test_processes_ran_on_two_hosts_and_traffic_crossed_the_link(job):
    cluster, res = job["cluster"], job["res"]
    master = cluster.address(0)
    assert master.startswith("169.254.") and master != "127.0.0.1"
    for r, rr in enumerate(res):
        host = r // PROCS
        assert rr["env"]["MASTER_ADDR"] == master
        assert rr["namespace"] == cluster.namespace(host)  # `ip netns identify <pid>`
        addresses = " ".join(rr["addresses"])
        assert f"inet {cluster.address(host)}/" in addresses
        assert f"inet {cluster.address(1 - host)}/" not in addresses  # the other host is reachable only over the link
        assert rr["interface"] == cluster.interface(host)
    inodes = [rr["netns_inode"] for rr in res]
    assert inodes[0] == inodes[1] and inodes[2] == inodes[3] and inodes[0] != inodes[2]
    # gloo's ring all-reduce sends to the next rank: 1 -> 2 and 3 -> 0 cross the hosts. What each host's veth link
    # sent during the BSP fit (the kernel's counter) covers at least one rank's accounted gradient bytes.
    for host in range(HOSTS):
        sent = res[host * PROCS]["bsp"]["veth_tx_bytes"]
        assert sent >= min(rr["bsp"]["metrics"]["bytes_grads"] for rr in res)


@needs_cluster
def test_bsp_keeps_all_four_replicas_bit_identical_and_bytes_match_the_accounting(job):
    res = job["res"]
    numel = _numel()
    assert len({rr["bsp"]["checksum"] for rr in res}) == 1  # sha256 of every tensor's bits (verify_sync also ran)
    for r, rr in enumerate(res):
        m = rr["bsp"]["metrics"]
        assert m["sync_steps"] == worker.BSP_STEPS and m["local_steps"] == 0
        assert m["bytes_grads"] == worker.BSP_STEPS * gloo_ring_allreduce_bytes(numel, 4, WORLD, r)
        assert rr["bsp"]["finite"]


@needs_cluster
def test_selsync_decides_alike_on_every_rank_and_replicas_agree_after_each_sync(job):
    res = job["res"]
    numel = _numel()
    steps = worker.SELSYNC_STEPS
    m0 = res[0]["selsync"]["metrics"]
    assert 0 < m0["sync_steps"] < steps and m0["local_steps"] + m0["sync_steps"] == steps  # a mix of both
    probes = [rr["selsync"]["probe"] for rr in res]
    assert len(probes[0]) == steps
    for r, rr in enumerate(res):
        m = rr["selsync"]["metrics"]
        assert (m["sync_steps"], m["local_steps"]) == (m0["sync_steps"], m0["local_steps"])
        assert [s for s, _ in probes[r]] == [s for s, _ in probes[0]]  # the same steps synced everywhere
        assert m["bytes_params"] == m["sync_steps"] * gloo_ring_allreduce_bytes(numel, 4, WORLD, r)
    rows = probes[0]
    assert sum(s for s, _ in rows) == m0["sync_steps"]
    assert all(equal for synced, equal in rows if synced)  # bit-identical parameters and buffers after each sync
    assert not any(equal for synced, equal in rows if not synced)  # local steps really diverge
    final_identical = len({rr["selsync"]["checksum"] for rr in res}) == 1
    assert final_identical == rows[-1][0]  # the final parameters agree exactly when the last step synced


@needs_cluster
def test_aladdin_every_rank_trains_and_pushes_and_the_global_model_is_finite(job):
    from lightning_sync.comm.ps import HEADER_BYTES
    from lightning_sync.core.ps import ShardPlan

    res = job["res"]
    plan = ShardPlan(_numel(), WORLD, 1 << 22)  # ALADDINStrategy's default shard_size
    for r, rr in enumerate(res):
        a = rr["aladdin"]
        assert a["steps"] == worker.ALADDIN_BATCHES  # every rank trained its batches
        assert a["server"]["pushes"] == a["steps"] and a["server"]["global_updates"] > 0
        # each push sends every other rank's server its shards of the delta (this rank's own stay local)
        per_push = sum(HEADER_BYTES + 4 * plan.numel(s) for s in range(WORLD) if s != r)
        assert a["metrics"]["bytes_push"] == a["server"]["pushes"] * per_push
        assert a["finite"]
    assert len({rr["aladdin"]["checksum"] for rr in res}) == 1  # fit hands back the one global model


@needs_cluster
def test_replica_size_node_makes_each_host_a_replica_whose_traffic_stays_off_the_link(job):
    """``replica_size="node"`` on 2 nodes x 2 devices: each host's two ranks are one replica (exact gradient average
    every step over the host's loopback), the hosts' first ranks average between them. What each host's veth link
    sent (the kernel's counter) covers the syncs between hosts and stays below what its ranks sent inside the
    replica: the traffic inside a host never crossed the link."""
    res = job["res"]
    numel = _numel()
    syncs = math.ceil(worker.GROUPED_STEPS / worker.GROUPED_PERIOD)  # after steps 0 and 3, and a final average
    for r, rr in enumerate(res):
        g = rr["grouped"]
        assert g["topology"] == [PROCS, HOSTS, r // PROCS]
        m = g["metrics"]
        assert m["bytes_intra/grads"] == worker.GROUPED_STEPS * gloo_ring_allreduce_bytes(numel, 4, PROCS, r % PROCS)
        between = (syncs + 1) * gloo_ring_allreduce_bytes(numel, 4, HOSTS, r // PROCS) if r % PROCS == 0 else 0
        assert m.get("bytes_params", 0) + m.get("bytes_final", 0) == between  # on the leaders only
        assert len(g["replicas"]) == worker.GROUPED_STEPS and all(all(hosts) for hosts in g["replicas"])
        assert [synced and same for synced, same in g["probe"]] == [step % worker.GROUPED_PERIOD == 0 for step in
                                                                    range(worker.GROUPED_STEPS)]  # fmt: skip
    for host in range(HOSTS):
        leader = res[host * PROCS]["grouped"]
        inside = sum(res[host * PROCS + i]["grouped"]["metrics"]["bytes_intra"] for i in range(PROCS))
        sent = leader["veth_tx_bytes"]
        # measured: host 0 sent 0.8 MB (the syncs, rank 0's setup broadcast, TCP/IP), its ranks 2.3 MB inside;
        # had that crossed the link, the host would have sent over 3 MB
        assert leader["metrics"]["bytes_params"] + leader["metrics"]["bytes_final"] <= sent < inside


@needs_cluster
def test_no_namespace_is_left_after_the_job(job):
    assert job["left"] == []
    cluster = job["cluster"]  # names matched exactly: another process's prefix may start with this one's
    listed = {line.split()[0] for line in _ns_list().splitlines() if line.strip()}
    assert not listed & ({cluster.namespace(i) for i in range(HOSTS)} | {f"{cluster.prefix}sw"}), _ns_list()


# ----------------------------------------------------------------------------------------------- the harness
@needs_cluster
def test_a_failed_rank_gets_the_others_killed_and_the_namespaces_removed():
    cluster = NamespaceCluster(hosts=HOSTS, rate="1gbit", subnet=81)
    with cluster:

        def cmd(host: int, local_rank: int) -> list[str]:
            return ["sh", "-c", "exit 3"] if (host, local_rank) == (1, 1) else ["sleep", "600"]

        procs = cluster.launch(cmd, free_port(), procs_per_host=PROCS)
        codes = wait_all(procs, timeout=120, grace=0.5)
        assert codes == [-9, -9, -9, 3]
    assert cluster.existing() == []


@needs_cluster
def test_leaving_the_cluster_on_an_exception_kills_its_processes():
    cluster = NamespaceCluster(hosts=HOSTS, rate="1gbit", subnet=82)
    with pytest.raises(RuntimeError, match="test failed"):
        with cluster:
            procs = cluster.launch(["sleep", "600"], free_port(), procs_per_host=PROCS)
            raise RuntimeError("test failed")
    assert [p.returncode for p in procs] == [-9] * WORLD
    assert cluster.existing() == []


def test_environment_of_a_host_with_several_processes():
    cluster = NamespaceCluster(hosts=3, prefix="envtest")  # nothing is created before `with`
    env = cluster.env(1, 29500, local_rank=1, procs_per_host=2, extra={"X": "1"})
    assert {k: env[k] for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "NODE_RANK", "LOCAL_RANK")} == {
        "MASTER_ADDR": cluster.address(0),
        "MASTER_PORT": "29500",
        "WORLD_SIZE": "6",
        "RANK": "3",
        "NODE_RANK": "1",
        "LOCAL_RANK": "1",
    }
    assert env["LOCAL_WORLD_SIZE"] == "2" and env["GLOO_SOCKET_IFNAME"] == cluster.interface(1) and env["X"] == "1"
    one = cluster.env(2, 29500)  # the default: one process per host
    assert (one["RANK"], one["WORLD_SIZE"], one["LOCAL_RANK"]) == ("2", "3", "0")
    # the hosts share this machine's cores: each process gets its share, not every core (Lightning's per-node rule)
    cores = len(os.sched_getaffinity(0))
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("OMP_NUM_THREADS", raising=False)
        assert cluster.env(0, 29500, procs_per_host=2)["OMP_NUM_THREADS"] == str(max(1, cores // 6))
        assert cluster.env(0, 29500)["OMP_NUM_THREADS"] == str(max(1, cores // 3))
        mp.setenv("OMP_NUM_THREADS", "5")
        assert cluster.env(0, 29500)["OMP_NUM_THREADS"] == "5"  # a user's setting stands
    with pytest.raises(ValueError, match="local_rank"):
        cluster.env(0, 29500, local_rank=2, procs_per_host=2)
    with pytest.raises(ValueError, match="procs_per_host"):
        cluster.env(0, 29500, procs_per_host=0)
    with pytest.raises(ValueError, match="i must"):
        cluster.env(3, 29500)


def test_wait_all_kills_the_others_once_one_process_fails():
    procs = [
        subprocess.Popen(["sleep", "600"], start_new_session=True),
        subprocess.Popen(["sh", "-c", "exit 3"], start_new_session=True),
    ]
    assert wait_all(procs, timeout=3600, grace=0.2) == [-9, 3]  # not the timeout: pytest-timeout would fail first


def test_wait_all_kills_everything_at_the_timeout_and_returns_codes_of_finished_jobs():
    procs = [subprocess.Popen(["sleep", "600"], start_new_session=True)]
    assert wait_all(procs, timeout=0.2) == [-9]
    procs = [subprocess.Popen(["true"], start_new_session=True) for _ in range(2)]
    assert wait_all(procs, timeout=60) == [0, 0]
    with pytest.raises(ValueError, match="timeout"):
        wait_all(procs, timeout=0)
    with pytest.raises(ValueError, match="grace"):
        wait_all(procs, timeout=1, grace=-1)
