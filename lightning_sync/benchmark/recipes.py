"""Per-workload recipes: each method's hyperparameters for one workload, as ``benchmarks/tune.py`` chose them.

A recipe is a YAML file ``<root>/<workload>/<strategy>.yaml`` (``examples/recipes/vgg/selsync.yaml``)::

    strategy: selsync           # the registered name (must match the file name)
    init_args:                  # the strategy's constructor arguments
      delta: 0.05
    lr_scale: 1.0               # optional: the model's learning rate is the base config's times this
    args: []                    # optional: further `lightning-sync fit` arguments, e.g. --trainer.max_epochs=40
    tuned: {...}                # optional: how it was chosen (command, link, seeds, candidates and their times)

``lightning-sync compare --recipes`` adds a row ``<strategy> (tuned)`` per strategy with a recipe for the workload,
next to the default row (``--recipes only``: the tuned rows only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = ["Recipe", "load_recipe", "recipe_path", "write_recipe"]

_KEYS = {"strategy", "init_args", "lr_scale", "args", "tuned"}


def _file_name(strategy: str) -> str:
    return strategy.replace("-", "_")


def recipe_path(root: str | Path, workload: str, strategy: str) -> Path:
    """Where the recipe of ``strategy`` for ``workload`` lives under ``root``."""
    return Path(root) / workload / f"{_file_name(strategy)}.yaml"


@dataclass(frozen=True)
class Recipe:
    """One method's tuned settings for one workload (see the module docstring)."""

    strategy: str
    init_args: dict[str, Any] = field(default_factory=dict)
    lr_scale: float | None = None
    args: tuple[str, ...] = ()
    tuned: dict[str, Any] = field(default_factory=dict)
    source: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.strategy, str) or not self.strategy:
            raise ValueError(
                f"recipe {self.source}: strategy must be a registered strategy name, got {self.strategy!r}"
            )
        if not isinstance(self.init_args, dict) or not all(isinstance(k, str) for k in self.init_args):
            raise ValueError(
                f"recipe {self.source}: init_args must be a mapping of argument names, got {self.init_args!r}"
            )
        if self.lr_scale is not None and (
            isinstance(self.lr_scale, bool)
            or not isinstance(self.lr_scale, (int, float))
            or not math.isfinite(self.lr_scale)
            or self.lr_scale <= 0
        ):
            raise ValueError(f"recipe {self.source}: lr_scale must be a number > 0 or absent, got {self.lr_scale!r}")
        if not all(isinstance(a, str) and a.startswith("--") for a in self.args):
            raise ValueError(f"recipe {self.source}: args must be a list of '--key=value' strings, got {self.args!r}")


def load_recipe(path: str | Path) -> Recipe:
    """Read and check a recipe file (``ValueError`` naming the file and the problem)."""
    p = Path(path)
    data = yaml.safe_load(p.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"recipe {p}: expected a mapping with keys {sorted(_KEYS)}, got {type(data).__name__}")
    unknown = set(data) - _KEYS
    if unknown:
        raise ValueError(f"recipe {p}: unknown keys {sorted(unknown)}; allowed: {sorted(_KEYS)}")
    recipe = Recipe(
        strategy=data.get("strategy", ""),
        init_args=dict(data.get("init_args") or {}),
        lr_scale=data.get("lr_scale"),
        args=tuple(data.get("args") or ()),
        tuned=dict(data.get("tuned") or {}),
        source=str(p),
    )
    if _file_name(recipe.strategy) != p.stem:
        raise ValueError(f"recipe {p}: strategy {recipe.strategy!r} does not match the file name {p.name!r}")
    return recipe


def write_recipe(path: str | Path, recipe: Recipe, header: str = "") -> None:
    """Write ``recipe`` as YAML (``header``: comment lines put first)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {"strategy": recipe.strategy, "init_args": dict(recipe.init_args)}
    if recipe.lr_scale is not None:
        data["lr_scale"] = recipe.lr_scale
    if recipe.args:
        data["args"] = list(recipe.args)
    if recipe.tuned:
        data["tuned"] = recipe.tuned
    comment = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    p.write_text(comment + yaml.safe_dump(data, sort_keys=False, width=120))
