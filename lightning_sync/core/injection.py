"""SelSync's randomized data injection for non-IID data (Tyagi & Swany §III-E, Eq. 3)."""

from __future__ import annotations

import math

from lightning_sync.core.periodic import fedavg_participants
from lightning_sync.core.validation import check_int, check_real


def check_injection(alpha: float, beta: float) -> tuple[float, float]:
    """(α, β): the fraction of ranks that share and the fraction of their local batch they share, both in (0, 1]."""
    return (
        check_real("injection alpha", alpha, 0.0, 1.0, low_open=True),
        check_real("injection beta", beta, 0.0, 1.0, low_open=True),
    )


def local_batch_size(batch_size: int, alpha: float, beta: float, world_size: int) -> int:
    r"""Eq. 3: :math:`b' = b / (1 + \alpha\beta N)`, rounded to the nearest integer, so that the local samples plus
    the :math:`\alpha N \cdot \beta b'` injected ones make about :math:`b` (the paper: b=32 on 8 workers gives
    b'=11 for (0.5, 0.5) and 6 for (0.75, 0.75)). Raises when :math:`b/(1+\alpha\beta N) < 1`, naming the batch size
    that is needed."""
    check_int("batch_size", batch_size, 1)
    check_int("world_size", world_size, 1)
    alpha, beta = check_injection(alpha, beta)
    exact = batch_size / (1.0 + alpha * beta * world_size)
    if exact < 1.0:
        needed = math.ceil(1.0 + alpha * beta * world_size)
        raise ValueError(
            f"data injection (alpha={alpha}, beta={beta}) on {world_size} ranks leaves b' = {batch_size}/"
            f"(1 + alpha*beta*N) = {exact:.2f} < 1 local samples per step (Eq. 3): use a batch_size >= {needed}"
        )
    return max(1, round(exact))


def shared_count(local_batch: int, beta: float) -> int:
    """Samples each sharing rank contributes per step: :math:`\\beta b'` rounded, at least 1."""
    return max(1, round(beta * local_batch))


def sharing_ranks(world_size: int, alpha: float, seed: int, step: int) -> list[int]:
    """The :math:`\\lceil \\alpha N \\rceil` ranks that share at ``step``: a seeded draw (the same one FedAvg uses
    for its participants), identical on every rank without communication."""
    return fedavg_participants(world_size, alpha, seed, step)
