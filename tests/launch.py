"""Test-side names for :mod:`lightning_sync.launch` (torchrun-like local processes)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_sync.launch import free_port, launch_local

run_external = launch_local


def run_suite(fn: Callable[..., Any], world: int, out: Path) -> list[dict[str, Any]]:
    """Run ``fn(rank, str(out))`` on ``world`` processes; return what each rank wrote to ``out/res_rank<r>.json``."""
    run_external(fn, world, str(out))
    return [json.loads((out / f"res_rank{r}.json").read_text()) for r in range(world)]


__all__ = ["free_port", "run_external", "run_suite"]
