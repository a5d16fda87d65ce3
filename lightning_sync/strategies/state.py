"""Per-rank state a strategy declares instead of writing out ``strategy_state`` / ``load_strategy_state``.

A class of the strategy hierarchy names its own fields in ``state_fields``: attribute names, or ``{key: names}`` to
save them as one dict under ``key``; the base collects every class's along the MRO, so a subclass adds to its bases'.
Each field is saved under its name without a leading underscore (``_step`` as ``"step"``):

* a value with ``state_dict()`` (a controller, a tracker) is saved as that, ``None`` as ``None``. On restore, a
  factory ``_new_<key>()`` on the strategy, if there is one, builds a fresh object to load it into (the object is
  built lazily, e.g. at train start; a saved ``None`` then restores nothing); otherwise the existing object loads it;
* any other value (a counter, a list) is saved as a copy and restored as a copy.

A field missing from the checkpoint raises: the checkpoint was written by another strategy. A strategy whose restore
does real work (a check against its arguments, state in flight, another device) keeps its own
``strategy_state`` / ``load_strategy_state`` for that part and calls ``super()``.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

__all__ = ["load_declared_state", "save_declared_state"]


def _declarations(strategy: object) -> list[tuple[str | None, tuple[str, ...]]]:
    """``(group, names)`` of every class that declares fields, the base's first (``group``: the dict's key, or None)."""
    declared: list[tuple[str | None, tuple[str, ...]]] = []
    for cls in reversed(type(strategy).__mro__):
        fields = cls.__dict__.get("state_fields")
        if isinstance(fields, dict):
            declared.extend(fields.items())
        elif fields:
            declared.append((None, fields))
    return declared


def _key(name: str) -> str:
    # interned, as a literal key is: a pickle of the state (a restarted replica group's transfer) then refers to a
    # string it already holds instead of writing it again, byte for byte as when each class wrote its keys out
    return sys.intern(name.lstrip("_"))


def save_declared_state(strategy: object) -> dict[str, Any]:
    """The declared fields' values, as they go into the strategy's state dict."""
    state: dict[str, Any] = {}
    for group, names in _declarations(strategy):
        fields = state if group is None else state.setdefault(group, {})
        for name in names:
            value = getattr(strategy, name)
            fields[_key(name)] = value.state_dict() if hasattr(value, "state_dict") else copy.deepcopy(value)
    return state


def load_declared_state(strategy: object, state: dict[str, Any]) -> None:
    """Restore the declared fields from the strategy's state dict (see the module's docstring)."""
    for group, names in _declarations(strategy):
        saved = state if group is None else state.get(group, {})
        for name in names:
            key = _key(name)
            if key not in saved:
                where = key if group is None else f"{group}.{key}"
                raise ValueError(
                    f"the checkpoint holds no {where!r}, which {type(strategy).__name__} saves: it was written by "
                    "another strategy; resume with the strategy (and arguments) that wrote it"
                )
            value = saved[key]
            factory = getattr(strategy, f"_new_{key}", None)
            if factory is not None:
                if value is not None:
                    restored = factory()
                    restored.load_state_dict(value)
                    setattr(strategy, name, restored)
            elif hasattr(current := getattr(strategy, name), "load_state_dict"):
                current.load_state_dict(value)
            else:
                setattr(strategy, name, copy.deepcopy(value))
