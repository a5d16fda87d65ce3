"""What an installed lightning-sync carries: a wheel built from the project's own files holds its data files."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_ships_the_configs_the_help_text_snapshot_and_its_license(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "lightning_sync", src / "lightning_sync", ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path / "dist"
    build = "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))"
    done = subprocess.run(
        [sys.executable, "-c", build, str(dist)], cwd=src, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    wheel = dist / done.stdout.strip().splitlines()[-1]
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        "lightning_sync/py.typed",
        "lightning_sync/data/python_help_topics.txt.gz",
        "lightning_sync/data/PYTHON_LICENSE.txt",
    }
    expected |= {f"lightning_sync/configs/{p.name}" for p in (ROOT / "lightning_sync" / "configs").glob("*.yaml")}
    assert len(expected) > 4 and expected <= names, sorted(expected - names)
    assert not any(n.split("/")[0] in {"tests", "callbacks", "examples", "benchmarks"} for n in names)
