"""README's two fresh-machine commands stay what CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_readme_test_command_is_what_ci_runs():
    readme_cmd = _bash_blocks((ROOT / "README.md").read_text())[1]  # the second command at the top: the tests
    ci = (ROOT / ".ci" / "run").read_text()
    install = re.search(r"pip install --quiet (-c .*)", ci).group(1)
    tail = [line for line in ci.splitlines() if line.startswith("python -m ruff")]
    assert readme_cmd.startswith("python3 -m venv .venv && . .venv/bin/activate && ")
    assert f"pip install {install} && {tail[0]}" in readme_cmd, (readme_cmd, install, tail)
    assert "-c .ci/constraints.txt" in install


def test_constraints_pin_the_core_packages():
    pins = dict(
        line.split("==", 1)
        for line in (ROOT / ".ci" / "constraints.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    for name in ("torch", "torchvision", "lightning", "torchmetrics", "jsonargparse"):
        assert name in pins, name
