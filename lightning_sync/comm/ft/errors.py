"""The error a fault-tolerant replica group stops with, and the short form of a torchft or gloo error in a log."""

from __future__ import annotations

__all__ = ["FaultToleranceError"]


class FaultToleranceError(RuntimeError):
    """A replica group cannot go on: the lighthouse is unreachable, a quorum failed, its state could not be received,
    or its configuration differs from its peers'. The message names the cause and what to do."""


def _short(err: BaseException, limit: int = 300) -> str:
    text = " ".join(str(err).split())
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(err).__name__}: {text}"
