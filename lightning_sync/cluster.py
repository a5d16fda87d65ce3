"""A multi-host cluster on one Linux machine: network namespaces joined through a bridge by veth links, each link
rate-limited in the kernel with a ``tbf`` qdisc (both directions), addresses from the link-local 169.254.0.0/16.

Processes started with :meth:`NamespaceCluster.popen` run "on" a host: gloo traffic between hosts crosses the
rate-limited links for real, so a benchmark sees what a cluster of that bandwidth would (latency cannot be added:
``netem`` is not available on these machines; use :class:`~lightning_sync.comm.LinkModel` for that, without the
cluster: its latency on top of a kernel-limited link would hide behind the real transfer of an asynchronous
collective, which completes at the later of the two, but not of a blocking one). A host can run
several processes (:meth:`NamespaceCluster.launch` with ``procs_per_host``): each gets the environment a multi-node
launcher such as torchrun gives it (``MASTER_ADDR`` = host 0's address, ``NODE_RANK``, ``LOCAL_RANK``, ``RANK``,
``WORLD_SIZE``), so a ``Trainer(num_nodes=hosts, devices=procs_per_host)`` goes multi-node by configuration alone.
Needs root and iproute2 (``ip``, ``tc``). The namespaces are removed, and every process this cluster started that is
still running is killed first, on every exit path: leaving the ``with`` block (also on an exception), ``atexit``,
and SIGTERM/SIGINT while it is active.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from lightning_sync.comm.link import parse_bandwidth
from lightning_sync.core.validation import check_int, check_real
from lightning_sync.launch import kill_session


def cluster_available() -> tuple[bool, str]:
    """Whether namespaces can be made here, and if not why."""
    if not sys.platform.startswith("linux"):
        return False, "network namespaces need Linux"
    if os.geteuid() != 0:
        return False, "creating network namespaces needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) is not installed"
    return True, ""


def _run(*args: str) -> None:
    subprocess.run(list(args), check=True, capture_output=True, text=True)


def wait_all(procs: Sequence[subprocess.Popen], timeout: float, grace: float = 10.0) -> list[int]:
    """Wait for every process of a job and return their exit codes (negative: killed by that signal).

    A job whose rank failed cannot finish (the others block in a collective until their own timeout), so once any
    process exits non-zero the others get ``grace`` seconds, then are killed; all are killed at ``timeout`` seconds.
    Every process has exited when this returns.
    """
    timeout = check_real("timeout", timeout, 0.0, low_open=True)
    grace = check_real("grace", grace, 0.0)
    deadline = time.monotonic() + timeout
    try:
        while True:
            codes = [p.poll() for p in procs]  # every process, every round (``any`` would stop at the first)
            if all(code is not None for code in codes):
                break
            now = time.monotonic()
            if any(code not in (None, 0) for code in codes):
                deadline = min(deadline, now + grace)
            if now >= deadline:
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            kill_session(p)
    return [int(p.returncode) for p in procs]


class NamespaceCluster:
    """``hosts`` namespaces ``<prefix>h<i>`` with address ``169.254.<subnet>.<i+1>``, each joined to a bridge in
    ``<prefix>sw`` by a veth link limited to ``rate`` in each direction (tbf with a burst of 10 ms of traffic)."""

    def __init__(self, hosts: int, rate: str | float = "1gbit", subnet: int = 77, prefix: str | None = None) -> None:
        self.hosts = check_int("hosts", hosts, 2, 250)
        self.bits_per_second = parse_bandwidth(rate)
        self.subnet = check_int("subnet", subnet, 0, 255)
        self.prefix = prefix or f"ls{os.getpid() % 100000}"
        if len(self.prefix) > 8:
            raise ValueError(f"prefix must be at most 8 characters (interface names are limited), got {self.prefix!r}")
        self._created: list[str] = []
        self._previous_handlers: dict[int, Any] = {}
        self._procs: list[subprocess.Popen] = []

    # ------------------------------------------------------------------ names
    def namespace(self, i: int) -> str:
        return f"{self.prefix}h{i}"

    def interface(self, i: int) -> str:
        return f"{self.prefix}v{i}"

    def address(self, i: int) -> str:
        return f"169.254.{self.subnet}.{i + 1}"

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> NamespaceCluster:
        ok, why = cluster_available()
        if not ok:
            raise RuntimeError(f"cannot build a namespace cluster: {why}")
        atexit.register(self.destroy)
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous_handlers[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)
        try:
            self._create()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.destroy()

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.destroy()
        previous = self._previous_handlers.get(signum)
        if callable(previous):
            previous(signum, frame)
        else:
            raise SystemExit(128 + signum)

    def _create(self) -> None:
        switch = f"{self.prefix}sw"
        _run("ip", "netns", "add", switch)
        self._created.append(switch)
        _run("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", switch, "link", "set", "br0", "up")
        rate = f"{int(self.bits_per_second)}bit"
        burst = f"{max(32_000, int(self.bits_per_second / 8 / 100))}b"
        for i in range(self.hosts):
            ns, host_if, switch_if = self.namespace(i), self.interface(i), f"{self.prefix}p{i}"
            _run("ip", "netns", "add", ns)
            self._created.append(ns)
            _run("ip", "link", "add", host_if, "type", "veth", "peer", "name", switch_if)
            _run("ip", "link", "set", host_if, "netns", ns)
            _run("ip", "link", "set", switch_if, "netns", switch)
            _run("ip", "-n", switch, "link", "set", switch_if, "master", "br0")
            _run("ip", "-n", switch, "link", "set", switch_if, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", host_if)
            _run("ip", "-n", ns, "link", "set", host_if, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            for where, dev in ((ns, host_if), (switch, switch_if)):  # host -> switch and switch -> host
                _run("tc", "-n", where, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", burst,
                     "latency", "100ms")  # fmt: skip

    def destroy(self) -> None:
        """Kill every process this cluster started that still runs, then delete every namespace it made (their veth
        links go with them; a namespace with a process left in it would outlive its name). Idempotent."""
        while self._procs:
            kill_session(self._procs.pop())
        while self._created:
            ns = self._created.pop()
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers.clear()

    def existing(self) -> list[str]:
        """This cluster's namespaces (its hosts' and its switch's) that exist right now. Matched by exact name:
        another cluster's prefix may start with this one's (``ls123`` and ``ls1234``, from another process id)."""
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        mine = {self.namespace(i) for i in range(self.hosts)} | {f"{self.prefix}sw"}
        return [name for name in (line.split()[0] for line in out.splitlines() if line.strip()) if name in mine]

    # ------------------------------------------------------------------ processes
    def env(
        self,
        i: int,
        master_port: int,
        extra: dict[str, str] | None = None,
        local_rank: int = 0,
        procs_per_host: int = 1,
    ) -> dict[str, str]:
        """The environment of process ``local_rank`` of ``procs_per_host`` on host ``i``, as torchrun would set it
        for a multi-node job (Lightning launches nothing; ``Trainer(num_nodes=hosts, devices=procs_per_host)``).

        The hosts share this machine's cores: ``OMP_NUM_THREADS`` (unless already set) is the cores over every
        process of the cluster, at least 1 — what Lightning's own launchers give the same processes on one host.
        Lightning sets it from the processes of one node only, so each host's process would take every core (4
        hosts on 2 cores: 8 compute threads, twice the CPU time of the emulated run for the same steps)."""
        procs_per_host = check_int("procs_per_host", procs_per_host, 1)
        local_rank = check_int("local_rank", local_rank, 0, procs_per_host - 1)
        check_int("i", i, 0, self.hosts - 1)
        env = dict(os.environ)
        env.update(
            MASTER_ADDR=self.address(0),
            MASTER_PORT=str(master_port),
            WORLD_SIZE=str(self.hosts * procs_per_host),
            RANK=str(i * procs_per_host + local_rank),
            NODE_RANK=str(i),
            LOCAL_RANK=str(local_rank),
            LOCAL_WORLD_SIZE=str(procs_per_host),
            GLOO_SOCKET_IFNAME=self.interface(i),
        )
        if "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // (self.hosts * procs_per_host)))
        env.update(extra or {})
        return env

    def popen(self, i: int, cmd: Sequence[str], env: dict[str, str], **kwargs: Any) -> subprocess.Popen:
        """Start ``cmd`` inside host ``i``'s namespace, in a session of its own; :meth:`destroy` kills it if it is
        still running."""
        kwargs.setdefault("start_new_session", True)
        self._procs = [p for p in self._procs if p.poll() is None]
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespace(i), *cmd], env=env, **kwargs)
        self._procs.append(proc)
        return proc

    def launch(
        self,
        cmd: Sequence[str] | Callable[[int, int], Sequence[str]],
        master_port: int,
        procs_per_host: int = 1,
        extra: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> list[subprocess.Popen]:
        """Start a multi-node job: ``procs_per_host`` processes on every host, each with :meth:`env`. ``cmd`` is
        one command for all, or ``cmd(host, local_rank)``. Returns the processes in global rank order; wait for them
        with :func:`wait_all`. If a start fails, the processes already started are killed."""
        procs: list[subprocess.Popen] = []
        try:
            for i in range(self.hosts):
                for local_rank in range(procs_per_host):
                    argv = cmd(i, local_rank) if callable(cmd) else cmd
                    env = self.env(i, master_port, extra, local_rank=local_rank, procs_per_host=procs_per_host)
                    procs.append(self.popen(i, argv, env, **kwargs))
        except BaseException:
            for p in procs:
                kill_session(p)
            raise
        return procs
