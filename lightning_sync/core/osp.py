"""OSP's math (Overlapped Synchronization Parallel, §4): gradient importance (PGP, Eq. 3-4), the ICS size bound
(Eq. 5) and its per-epoch schedule (Algorithm 1), layer selection for the GIB, and the LGP correction (Eq. 6-7)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_sync.core.validation import check_int, check_real


def layer_importance(grad: Tensor, param: Tensor, sizes: list[int], scratch: Tensor | None = None) -> Tensor:
    r"""Eq. 4, :math:`I^l = \sum_{j \in l} |g_j P_j|`, for every layer of the flat buffers at once (``sizes``: the
    layers' element counts, in order): one product pass into ``scratch`` (allocated when not given), then one sum
    per layer. Returned in float64."""
    prod = torch.mul(grad, param, out=scratch) if scratch is not None else grad * param
    prod.abs_()
    return torch.stack([part.sum() for part in prod.split(sizes)]).to(torch.float64)


def u_max(bandwidth_bytes_per_s: float, compute_seconds: float, world_size: int, loss_rate: float = 0.0) -> float:
    """Eq. 5: :math:`S(G^u) \\le b(1 + lr) T_c / N` — the bytes of unimportant gradients whose all-reduce fits
    behind one step's computation :math:`T_c` on a link of bandwidth :math:`b` (loss rate :math:`lr`)."""
    check_real("bandwidth", bandwidth_bytes_per_s, 0.0)
    check_real("compute_seconds", compute_seconds, 0.0)
    check_int("world_size", world_size, 1)
    return bandwidth_bytes_per_s * (1.0 + loss_rate) * compute_seconds / world_size


class ICSSchedule:
    """Algorithm 1: :math:`S(G^u)_1 = 0` and :math:`L = loss_1`; for epoch :math:`i > 1`,
    :math:`S(G^u)_i = (1 - loss_i / L) \\cdot U_{max}` with :math:`U_{max} \\le` ``max_fraction`` of the model.

    ``loss_i`` is the mean training loss of the epoch that just ended (the loss known when epoch ``i`` starts).
    The share is clamped to ``[0, U_max]`` (a loss above ``L`` gives 0). Sizes are in elements.
    """

    def __init__(self, model_numel: int, max_fraction: float = 0.8) -> None:
        self.model_numel = check_int("model_numel", model_numel, 1)
        self.max_fraction = check_real("max_unimportant_fraction", max_fraction, 0.0, 1.0)
        self.reference_loss: float | None = None
        self.u_max = 0.0
        self.share = 0.0  # S(G^u) of the current epoch, elements

    def start_epoch(self, epoch: int, previous_loss: float | None, u_max_elements: float) -> float:
        """Set and return :math:`S(G^u)` for ``epoch`` (0-based), given the previous epoch's mean loss."""
        self.u_max = min(max(0.0, u_max_elements), self.max_fraction * self.model_numel)
        if epoch == 0 or previous_loss is None or not math.isfinite(previous_loss):
            self.share = 0.0
        else:
            if self.reference_loss is None:  # loss_1, measured over the first epoch
                self.reference_loss = previous_loss
            ratio = previous_loss / self.reference_loss if self.reference_loss > 0 else 1.0
            self.share = min(self.u_max, max(0.0, (1.0 - ratio) * self.u_max))
        return self.share

    def state_dict(self) -> dict[str, float | None]:
        return {"reference_loss": self.reference_loss, "u_max": self.u_max, "share": self.share}

    def load_state_dict(self, state: dict[str, float | None]) -> None:
        self.reference_loss = state["reference_loss"]
        self.u_max = float(state["u_max"] or 0.0)
        self.share = float(state["share"] or 0.0)


def select_unimportant(importance: Tensor, sizes: list[int], budget: float) -> list[int]:
    """The GIB's unimportant layers: layers in ascending importance, each taken if it still fits in ``budget``
    elements (a layer too large is skipped and smaller ones are still tried). Ties break by layer index, so every
    rank holding the same importance vector selects the same layers. Returned sorted by layer index."""
    if budget <= 0:
        return []
    order = sorted(range(len(sizes)), key=lambda i: (float(importance[i]), i))
    chosen, used = [], 0
    for i in order:
        if used + sizes[i] <= budget:
            chosen.append(i)
            used += sizes[i]
    return sorted(chosen)


def sgd_step(
    param: Tensor,
    grad: Tensor,
    momentum_buffer: Tensor | None,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
) -> Tensor | None:
    r"""One ``torch.optim.SGD`` update of ``param`` in place, as PyTorch's single-tensor path computes it:
    :math:`d = g + \lambda w`; :math:`m = d` on the buffer's first step, else :math:`m = \mu m + (1 - \tau) d`;
    :math:`d = d + \mu m` with Nesterov, else :math:`d = m`; :math:`w \mathrel{-}= \eta d`. Returns the new momentum
    buffer (updated in place when one is given), or ``None`` without momentum.

    OSP's LGP correction (Eq. 7) for SGD re-applies the step from the parameters and momentum buffer saved before the
    local update, with the global gradient instead of the local one: that is exactly the update BSP would have
    made, and — every input being identical on every rank — bit-identical across ranks (subtracting the local
    gradient's contribution instead would leave rank-dependent rounding).
    """
    d = grad.add(param, alpha=weight_decay) if weight_decay else grad
    buf = momentum_buffer
    if momentum:
        if buf is None:
            buf = d.clone()
        else:
            buf.mul_(momentum).add_(d, alpha=1.0 - dampening)
        d = d.add(buf, alpha=momentum) if nesterov else buf
    param.add_(d, alpha=-lr)
    return buf
