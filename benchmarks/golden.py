"""Golden trajectories: behaviour pinned before the strategy layer is refactored (issue 58, item 1).

Every strategy x {flat, replica groups where accepted, fault-tolerant where accepted} x {fp32 averaging, bf16}
runs a short fixed fit and a fit resumed from its middle (the cases: ``benchmarks/golden_cases.py``); recorded per
rank: the final model's sha256 and statistics, the bytes and collectives per tag, the step counters.

    python benchmarks/golden.py list [--cases PATTERN]
    python benchmarks/golden.py record [--cases PATTERN]      # write tests/golden/golden.json (those cases only)
    python benchmarks/golden.py compare --ref HEAD [--cases PATTERN]
                                                              # bit for bit: the reference commit vs the working tree
    python benchmarks/golden.py check [--cases PATTERN]       # the recorded values, within the CI test's tolerance

``--cases`` takes shell patterns (``fnmatch``), comma-separated, matched against ``<method>/<layout>/<precision>``
names: ``'adpsgd*'``, ``'*/grouped/*'``, ``'*/ft/*,bsp/*'``. Without it: every case (40, six of them
fault-tolerant on torchft).

**Before a refactoring commit lands**: ``compare --ref <the commit before it>`` runs every case on a temporary git
worktree of the reference commit and on the working tree, on this machine, with this harness (only the
``lightning_sync`` package differs), and lists every difference: a parameter sha256, a byte or collective count, a
step counter. A refactoring lands only when there is none. A change of numbers is a behaviour change: its own commit,
its reason in the message, and the goldens re-recorded for the cases it changes.

**Re-recording a subset** (e.g. after ADPSGD's defaults change, a behaviour change of its own): ``record --cases
'adpsgd*'`` replaces those cases' entries in ``tests/golden/golden.json`` and keeps every other; each entry names the
commit it was recorded at. ``tests/test_golden.py`` replays the recorded values (a representative subset in CI, all
with ``LIGHTNING_SYNC_SLOW_TESTS=1``) within a float tolerance that holds on any machine (relative ``RTOL`` on the
parameter statistics), byte and collective counts and step counters exact.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from golden_cases import CASES, WORLD  # noqa: E402

GOLDEN = ROOT / "tests" / "golden" / "golden.json"
#: relative tolerance of the parameter statistics on another machine (another BLAS, another vector width)
RTOL = 1e-5
#: what is compared exactly even across machines (with the statistics' ``n``)
EXACT_KEYS = frozenset({"bytes", "ops", "global_step", "steps", "sync_steps", "n"})
FT_LIMIT_S = 600  # one fault-tolerant case (two fits) on a loaded 2-core machine


def select(patterns: str | None) -> list[str]:
    """The case names matching ``patterns`` (comma-separated ``fnmatch`` patterns; ``None``: every case), in the
    registry's order; a pattern that matches nothing is an error."""
    if patterns is None:
        return list(CASES)
    pats = [p.strip() for p in patterns.split(",") if p.strip()]
    for p in pats:
        if not any(fnmatch.fnmatchcase(n, p) for n in CASES):
            raise SystemExit(f"--cases: {p!r} matches no case (see: python benchmarks/golden.py list)")
    return [n for n in CASES if any(fnmatch.fnmatchcase(n, p) for p in pats)]


# ----------------------------------------------------------------------------------------------- running cases
def _env(lib_root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(lib_root), str(HERE)])
    env.pop("LIGHTNING_SYNC_VERIFY", None)  # verify_sync's traffic would change the byte counts
    return env


def _run_ft(names: list[str], out: Path, lib_root: Path) -> None:
    """The fault-tolerant cases, each in fresh processes: one serving two lighthouses (the full fit's, the resumed
    fit's) and one per replica group."""
    from lightning_sync.launch import free_port, kill_session

    env = _env(lib_root)
    procs: list[subprocess.Popen] = []
    logs: list[Path] = []

    def start(cmd: list[str], log: Path, **extra: str) -> subprocess.Popen:
        logs.append(log)
        with log.open("w") as f:
            p = subprocess.Popen(cmd, env=dict(env, **extra), cwd=out, stdout=f, stderr=subprocess.STDOUT,
                                 start_new_session=True)  # fmt: skip
        procs.append(p)
        return p

    try:
        for name in names:  # fresh processes per case, the lighthouses' included (each case starts as a user's job)
            case_dir = out / name.replace("/", "__")
            case_dir.mkdir(parents=True, exist_ok=True)
            served = case_dir / "lighthouses.json"
            lighthouse = start(
                [sys.executable, str(HERE / "golden_cases.py"), "lighthouses", "2", str(served)],
                case_dir / "lighthouses.log",
            )
            deadline = time.monotonic() + 300
            while not served.exists():
                if lighthouse.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the lighthouses did not start:\n{(case_dir / 'lighthouses.log').read_text()}")
                time.sleep(0.2)
            urls = {name: json.loads(served.read_text())}
            groups = [
                start(
                    [
                        sys.executable,
                        str(HERE / "golden_cases.py"),
                        "ft-group",
                        json.dumps({"group": g, "cases": [name], "out": str(out), "lighthouses": urls}),
                    ],
                    out / f"{name.replace('/', '__')}_group{g}.log",
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(free_port()),
                )  # fmt: skip
                for g in range(WORLD["ft"])
            ]
            deadline = time.monotonic() + FT_LIMIT_S
            for g in groups:
                try:
                    g.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    break
            if any(g.returncode != 0 for g in groups):
                tails = "\n".join(f"--- {log.name}\n{log.read_text()[-4000:]}" for log in logs)
                raise RuntimeError(f"a fault-tolerant replica group failed or hung ({name}):\n{tails}")
            lighthouse.send_signal(signal.SIGTERM)
            lighthouse.wait(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            kill_session(p)


def run_cases(names: list[str], workdir: Path, lib_root: Path = ROOT) -> dict[str, Any]:
    """Run ``names`` with the ``lightning_sync`` package of ``lib_root`` (in a subprocess with that on
    ``PYTHONPATH``, this harness beside it); return each case's record."""
    out = workdir / "results.json"
    cmd = [sys.executable, str(HERE / "golden.py"), "_run", "--json", str(out), "--workdir", str(workdir)]
    if names:
        cmd += ["--cases", ",".join(names)]
    subprocess.run(cmd, env=_env(lib_root), check=True, cwd=workdir)
    return json.loads(out.read_text())


def _run_here(names: list[str], workdir: Path | None = None) -> dict[str, Any]:
    """Every world's cases in one launch (Lightning imported once per process); their files in a fresh
    ``/tmp/golden-XXXXXXXX`` (``workdir`` is not used for them), removed afterwards.

    The path's length is fixed because it is in the byte counts: a checkpoint save broadcasts its file's path (tags
    ``"checkpoint"`` and ``"lightning"``), so a longer directory name sends more bytes. ``/tmp`` rather than the
    system's temporary directory, so that the recorded counts hold wherever ``TMPDIR`` points."""
    with tempfile.TemporaryDirectory(prefix="golden-", dir="/tmp") as tmp:
        return _run_in(names, Path(tmp))


def _run_in(names: list[str], workdir: Path) -> dict[str, Any]:
    from golden_cases import rank_main

    import lightning_sync
    from lightning_sync.launch import launch_local

    print(f"golden: lightning_sync from {Path(lightning_sync.__file__).parent}", flush=True)
    records: dict[str, Any] = {}
    for layout in ("flat", "grouped", "single", "ft"):
        batch = [n for n in names if CASES[n].layout == layout]
        if not batch:
            continue
        out = workdir / layout
        out.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        print(f"golden: {len(batch)} {layout} case(s) on {WORLD[layout]} process(es)...", flush=True)
        if layout == "ft":
            _run_ft(batch, out, Path(lightning_sync.__file__).parent.parent)
        else:
            launch_local(rank_main, WORLD[layout], batch, str(out))
        print(f"golden: {layout} done in {time.monotonic() - start:.0f} s", flush=True)
        for n in batch:
            case_dir = out / n.replace("/", "__")
            records[n] = {"ranks": [json.loads((case_dir / f"rank{r}.json").read_text()) for r in range(WORLD[layout])]}
    return records


# ----------------------------------------------------------------------------------------------- comparing
def differences(expected: Any, actual: Any, rtol: float | None = None, path: str = "") -> list[tuple[str, Any, Any]]:
    """Where ``actual`` differs from ``expected``: ``(path, expected, actual)`` triples.

    ``rtol=None``: bit for bit (every value equal, sha256 included). Otherwise the cross-machine comparison: sha256
    skipped, :data:`EXACT_KEYS` exact, a parameter statistic within ``rtol`` of its scale (``sum`` and ``sum_abs``:
    ``sum_abs``; ``sum_sq``: itself; an element: the larger of its magnitude and the state's root mean square)."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        diffs: list[tuple[str, Any, Any]] = []
        if rtol is not None and {"sha256", "sum", "sum_abs", "sum_sq", "elements"} <= expected.keys():
            return _param_differences(expected, actual, rtol, path)
        for key in sorted(expected.keys() | actual.keys()):
            sub = f"{path}.{key}" if path else key
            if key not in expected or key not in actual:
                diffs.append((sub, expected.get(key, "(absent)"), actual.get(key, "(absent)")))
            else:
                diffs += differences(expected[key], actual[key], rtol, sub)
        return diffs
    if isinstance(expected, list) and isinstance(actual, list) and len(expected) == len(actual):
        return [d for i, (e, a) in enumerate(zip(expected, actual)) for d in differences(e, a, rtol, f"{path}[{i}]")]
    return [] if expected == actual else [(path, expected, actual)]


def _param_differences(e: dict[str, Any], a: dict[str, Any], rtol: float, path: str) -> list[tuple[str, Any, Any]]:
    diffs = [] if e["n"] == a.get("n") else [(f"{path}.n", e["n"], a.get("n"))]
    if diffs:
        return diffs
    rms = math.sqrt(e["sum_sq"] / e["n"])
    scales = {"sum": e["sum_abs"], "sum_abs": e["sum_abs"], "sum_sq": e["sum_sq"]}
    for key, scale in scales.items():
        if not abs(a[key] - e[key]) <= rtol * scale:
            diffs.append((f"{path}.{key}", e[key], a[key]))
    for i, (x, y) in enumerate(zip(e["elements"], a["elements"])):
        if not abs(y - x) <= rtol * max(abs(x), rms):
            diffs.append((f"{path}.elements[{i}]", x, y))
    return diffs


def table(rows: list[tuple[str, str, Any, Any]], left: str, right: str) -> str:
    """Differences as a text table: case, where, ``left``'s value, ``right``'s."""
    head = ("case", "where", left, right)
    cells = [head] + [(c, w, _short(x), _short(y)) for c, w, x, y in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(4)]
    return "\n".join("  ".join(s.ljust(w) for s, w in zip(r, widths)).rstrip() for r in cells)


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 40 else text[:37] + "..."


# ----------------------------------------------------------------------------------------------- commands
def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def _provenance() -> dict[str, Any]:
    import lightning
    import torch

    return {
        "commit": _git("rev-parse", "HEAD"),
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
    }


def cmd_record(names: list[str], path: Path) -> None:
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="golden-") as tmp:
        records = run_cases(names, Path(tmp))
    store(records, path)
    print(f"golden: recorded {len(names)} case(s) into {path} in {time.monotonic() - start:.0f} s")


def store(records: dict[str, Any], path: Path) -> None:
    """Write ``records`` into the golden file ``path``, replacing those cases' entries and keeping the others."""
    names = list(records)
    golden = json.loads(path.read_text()) if path.exists() else {"cases": {}}
    provenance = _provenance()
    for name in names:
        golden["cases"][name] = {"recorded_at": provenance, **records[name]}
    golden["cases"] = {n: golden["cases"][n] for n in sorted(golden["cases"], key=_order)}
    golden["about"] = "recorded by python benchmarks/golden.py record; replayed by tests/test_golden.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(golden, indent=1) + "\n")


def _order(name: str) -> int:
    return list(CASES).index(name) if name in CASES else len(CASES)


def cmd_compare(names: list[str], ref: str) -> int:
    """Run ``names`` on a temporary worktree of ``ref`` and on the working tree; report every difference."""
    commit = _git("rev-parse", "--verify", f"{ref}^{{commit}}")
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="golden-compare-") as tmp:
        tree = Path(tmp) / "ref"
        _git("worktree", "add", "--detach", str(tree), commit)
        try:
            (Path(tmp) / "a").mkdir()
            (Path(tmp) / "b").mkdir()
            print(f"golden: reference {ref} ({commit[:10]}) ...", flush=True)
            theirs = run_cases(names, Path(tmp) / "a", tree)
            print("golden: working tree ...", flush=True)
            ours = run_cases(names, Path(tmp) / "b", ROOT)
        finally:
            _git("worktree", "remove", "--force", str(tree))
    rows = [(n, where, x, y) for n in names for where, x, y in differences(theirs[n], ours[n])]
    elapsed = time.monotonic() - start
    if rows:
        print(table(rows, f"ref {ref}", "working tree"))
        changed = sorted({r[0] for r in rows}, key=_order)
        print(f"golden: {len(changed)} of {len(names)} case(s) differ: {', '.join(changed)} ({elapsed:.0f} s)")
        return 1
    print(f"golden: all {len(names)} case(s) bit-identical to {ref} ({commit[:10]}) ({elapsed:.0f} s)")
    return 0


def check(names: list[str], recorded: dict[str, Any], results: dict[str, Any]) -> list[tuple[str, str, Any, Any]]:
    """Differences between recorded cases and fresh results beyond the cross-machine tolerance."""
    rows = []
    for n in names:
        if n not in recorded["cases"]:
            rows.append((n, "(not recorded)", None, "run: python benchmarks/golden.py record --cases " + n))
            continue
        expected = {"ranks": recorded["cases"][n]["ranks"]}
        rows += [(n, w, x, y) for w, x, y in differences(expected, results[n], RTOL)]
    return rows


def cmd_check(names: list[str], path: Path) -> int:
    recorded = json.loads(path.read_text())
    with tempfile.TemporaryDirectory(prefix="golden-check-") as tmp:
        results = run_cases(names, Path(tmp))
    rows = check(names, recorded, results)
    if rows:
        print(table(rows, "recorded", "now"))
        return 1
    print(f"golden: all {len(names)} case(s) within the tolerance of {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["list", "record", "compare", "check", "_run"])
    parser.add_argument("--cases", default=None, help="comma-separated fnmatch patterns of case names (default: all)")
    parser.add_argument("--ref", default=None, help="compare: the reference commit (e.g. HEAD)")
    parser.add_argument("--golden", type=Path, default=GOLDEN, help=f"the recorded values (default {GOLDEN})")
    parser.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    names = select(args.cases)
    if args.command == "list":
        for n in names:
            print(n)
        return 0
    if args.command == "_run":  # the subprocess of run_cases
        args.json.write_text(json.dumps(_run_here(names, args.workdir)))
        return 0
    if args.command == "record":
        cmd_record(names, args.golden)
        return 0
    if args.command == "check":
        return cmd_check(names, args.golden)
    if args.ref is None:
        parser.error("compare needs --ref <commit>")
    return cmd_compare(names, args.ref)


if __name__ == "__main__":
    sys.exit(main())
