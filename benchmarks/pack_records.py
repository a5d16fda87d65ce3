"""Pack an experiment's per-run records into one file (issue 48, item 5).

Committed experiments keep their tables and plots as ``compare`` wrote them (``runs.csv``, ``summary.json``, a
``table.md``/``table.csv`` and plots per link); the runs' own records, a folder per run
(``<link>/<method>/seed<N>/`` with ``time_to_target.jsonl``, ``summary.json``, ``overlay.yaml``, ``command.txt``),
are packed into one file per experiment folder, ``records.jsonl.gz``, and the run folders removed:

    python benchmarks/pack_records.py                 # every experiment under docs/benchmarks/time_to_target
    python benchmarks/pack_records.py EXPERIMENT...   # these experiment folders (e.g. a --out before committing it)
    python benchmarks/pack_records.py --check         # list the experiment folders with unpacked records (exit 1)
    python benchmarks/pack_records.py --unpack EXPERIMENT --out DIR   # write the run folders back under DIR

An experiment folder is ``<root>/<workload>/<experiment>`` (``--root``, default ``docs/benchmarks/time_to_target``),
or a folder given on the command line; every run folder below it (a lane's ``<lane>/<link>/<method>/seed<N>/``
too) goes into its one file. Records committed flat as ``<method>_seed<N>_time_to_target.jsonl`` are packed too.

``records.jsonl.gz`` is gzip-compressed JSON lines, readable with the standard library
(:func:`read_packed`: ``gzip.open(path, "rt")``, one ``json.loads`` per line), one object per run, sorted by ``run``::

    {"run": "1gbit-1ms/asp-lr_scale-2.0/seed1",  # the run folder, relative to the experiment folder
     "link": "1gbit-1ms", "method": "asp-lr_scale-2.0", "seed": 1,  # as in the folder names (null: not in them)
     "records": [{"event": "start", ...}, {"event": "eval", ...}, ...],  # its time_to_target.jsonl, line by line
     "summary": {...},  # its summary.json (fit's totals), where it has one
     "files": {"overlay.yaml": "...", "command.txt": "..."}}  # any other text file of the run folder, verbatim

Nothing is lost: the run's own configuration (``overlay.yaml``: its strategy and arguments) and command
(``command.txt``: e.g. a tuned learning rate) are not in the experiment folder, so they are kept, verbatim, in the
run's ``files``. Where a file would not come back byte for byte from its parsed form (a record cut short by a killed
run, say), its text is kept in ``files`` too, and ``--unpack`` writes that. Packing checks that every file comes back
byte for byte before it removes anything; packing again adds new run folders to the file (a run already in it must
be identical) and leaves a packed experiment as it is.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import re
import sys
from pathlib import Path
from typing import Any

from lightning_sync.benchmark.ttt import PACKED, read_packed

RECORDS = "time_to_target.jsonl"
SUMMARY = "summary.json"
ROOT = Path("docs/benchmarks/time_to_target")
_SEED_DIR = re.compile(r"^seed(\d+)$")
_FLAT = re.compile(r"^(?P<method>.+)_seed(?P<seed>\d+)_time_to_target\.jsonl$")


def _records_text(records: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def _summary_text(summary: dict[str, Any]) -> str:
    return json.dumps(summary, indent=2)  # as `lightning-sync fit --summary_json` writes it


def run_files(entry: dict[str, Any]) -> dict[str, str]:
    """The files of one packed run, ``{name relative to the run folder: text}`` (for a flat record, its file name)."""
    files: dict[str, str] = {}
    if entry.get("flat"):
        files[entry["flat"]] = _records_text(entry["records"])
    else:
        files[RECORDS] = _records_text(entry["records"])
        if "summary" in entry:
            files[SUMMARY] = _summary_text(entry["summary"])
    files.update(entry.get("files", {}))  # verbatim text wins over the parsed form
    return files


def _parse_records(text: str) -> list[dict[str, Any]]:
    records = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a last line cut short by a killed run (the text is kept verbatim)
            break
    return records


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not a text file; remove it or keep it outside the run folder") from err


def _pack_run_dir(experiment: Path, run_dir: Path) -> dict[str, Any]:
    rel = run_dir.relative_to(experiment)
    parts = rel.parts
    entry: dict[str, Any] = {
        "run": rel.as_posix(),
        "link": parts[-3] if len(parts) >= 3 else None,
        "method": parts[-2] if len(parts) >= 2 else None,
        "seed": int(_SEED_DIR.match(parts[-1]).group(1)),
    }
    verbatim: dict[str, str] = {}
    for path in sorted(p for p in run_dir.rglob("*") if p.is_file()):
        name = path.relative_to(run_dir).as_posix()
        text = _read_text(path)
        if name == RECORDS:
            entry["records"] = _parse_records(text)
            if _records_text(entry["records"]) != text:
                verbatim[name] = text
        elif name == SUMMARY:
            try:
                entry["summary"] = json.loads(text)
            except json.JSONDecodeError:
                verbatim[name] = text
                continue
            if _summary_text(entry["summary"]) != text:
                verbatim[name] = text
        else:
            verbatim[name] = text
    if verbatim:
        entry["files"] = verbatim
    return entry


def _pack_flat(experiment: Path, path: Path) -> dict[str, Any]:
    m = _FLAT.match(path.name)
    text = _read_text(path)
    entry: dict[str, Any] = {
        "run": path.relative_to(experiment).as_posix(),
        "link": None,  # committed without its link folder
        "method": m.group("method"),
        "seed": int(m.group("seed")),
        "flat": path.name,
        "records": _parse_records(text),
    }
    if _records_text(entry["records"]) != text:
        entry["files"] = {path.name: text}
    return entry


def unpacked(experiment: Path) -> tuple[list[Path], list[Path]]:
    """The run folders (``seed<N>`` with a ``time_to_target.jsonl``) and flat record files not yet packed."""
    run_dirs = sorted(p.parent for p in experiment.rglob(RECORDS) if p.is_file() and _SEED_DIR.match(p.parent.name))
    flat = sorted(p for p in experiment.rglob("*_time_to_target.jsonl") if p.is_file() and _FLAT.match(p.name))
    return run_dirs, flat


def _sort_key(entry: dict[str, Any]) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", entry["run"])]


def write_packed(folder: Path, entries: list[dict[str, Any]]) -> Path:
    """``folder/records.jsonl.gz``, the same bytes for the same runs (no time or name in the gzip header)."""
    path = folder / PACKED
    text = "".join(json.dumps(e, sort_keys=False) + "\n" for e in sorted(entries, key=_sort_key))
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, compresslevel=9, mtime=0) as f:
        f.write(text.encode("utf-8"))
    path.write_bytes(buffer.getvalue())
    return path


def _remove_empty_dirs(top: Path, start: Path) -> None:
    folder = start
    while folder != top and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
        folder = folder.parent


def pack(experiment: str | Path) -> int:
    """Pack ``experiment``'s unpacked runs into its ``records.jsonl.gz`` and remove them; the number packed."""
    experiment = Path(experiment)
    run_dirs, flat = unpacked(experiment)
    if not run_dirs and not flat:
        return 0
    new = [_pack_run_dir(experiment, d) for d in run_dirs] + [_pack_flat(experiment, p) for p in flat]
    old = {e["run"]: e for e in read_packed(experiment)}
    for entry in new:
        if entry["run"] in old and old[entry["run"]] != entry:
            raise ValueError(f"{experiment}: run {entry['run']} is packed already, with other contents")
    entries = {**old, **{e["run"]: e for e in new}}
    write_packed(experiment, list(entries.values()))
    # every file comes back byte for byte before anything is removed
    packed = {e["run"]: e for e in read_packed(experiment)}
    for run_dir in run_dirs:
        files = run_files(packed[run_dir.relative_to(experiment).as_posix()])
        on_disk = {p.relative_to(run_dir).as_posix(): p for p in run_dir.rglob("*") if p.is_file()}
        if set(files) != set(on_disk) or any(files[n].encode("utf-8") != p.read_bytes() for n, p in on_disk.items()):
            raise RuntimeError(f"{experiment / PACKED}: {run_dir} does not come back byte for byte; nothing removed")
    for path in flat:
        if run_files(packed[path.relative_to(experiment).as_posix()])[path.name].encode("utf-8") != path.read_bytes():
            raise RuntimeError(f"{experiment / PACKED}: {path} does not come back byte for byte; nothing removed")
    for run_dir in run_dirs:
        for p in sorted(run_dir.rglob("*"), key=lambda p: len(p.parts), reverse=True):
            if p.is_file():
                p.unlink()
            else:
                p.rmdir()
        run_dir.rmdir()
        _remove_empty_dirs(experiment, run_dir.parent)
    for path in flat:
        path.unlink()
    return len(new)


def unpack(experiment: str | Path, out: str | Path) -> int:
    """Write every packed run of ``experiment`` back under ``out`` (its run folder, or its flat file); the count."""
    entries = read_packed(experiment)
    for entry in entries:
        base = Path(out) / entry["run"]
        folder = base.parent if entry.get("flat") else base
        for name, text in run_files(entry).items():
            path = folder / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(text.encode("utf-8"))
    return len(entries)


def experiments(root: Path) -> list[Path]:
    """``<root>/<workload>/<experiment>`` folders."""
    return sorted(e for w in root.iterdir() if w.is_dir() for e in w.iterdir() if e.is_dir())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="*", type=Path, help="experiment folders (default: every one under --root)")
    parser.add_argument("--root", type=Path, default=ROOT, help="<root>/<workload>/<experiment> (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="list the folders with unpacked records; exit 1 if any")
    parser.add_argument("--unpack", type=Path, metavar="EXPERIMENT", help="write its packed runs back under --out")
    parser.add_argument("--out", type=Path, help="with --unpack: where the run folders go")
    args = parser.parse_args(argv)
    if args.unpack is not None:
        if args.out is None:
            parser.error("--unpack needs --out")
        count = unpack(args.unpack, args.out)
        print(f"{args.unpack / PACKED}: {count} run(s) written under {args.out}")
        return 0
    folders = args.folders or experiments(args.root)
    if args.check:
        pending = []
        for folder in folders:
            run_dirs, flat = unpacked(folder)
            if run_dirs or flat:
                pending.append(folder)
                print(f"{folder}: {len(run_dirs) + len(flat)} unpacked run(s)")
        if not pending:
            print(f"every experiment packed ({len(folders)} folder(s))")
        return 1 if pending else 0
    for folder in folders:
        count = pack(folder)
        if count:
            print(f"{folder / PACKED}: {count} run(s) packed ({len(read_packed(folder))} in the file)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
