"""Data injection glue (SelSync §III-E): shrink the local batch to b' (Eq. 3) and append, every step, the samples
the sharing ranks send through one fixed-size all-gather. Used by every :class:`SyncStrategy` through its
``injection=(alpha, beta)`` argument."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_sync.comm import Communicator
from lightning_sync.core.injection import check_injection, local_batch_size, shared_count, sharing_ranks


def _leaves(batch: Any) -> list[Tensor]:
    if isinstance(batch, Tensor):
        return [batch]
    if isinstance(batch, (list, tuple)):
        return [t for item in batch for t in _leaves(item)]
    if isinstance(batch, dict):
        return [t for key in sorted(batch) for t in _leaves(batch[key])]
    raise ValueError(f"data injection needs batches of tensors (tuple, list or dict), got {type(batch).__name__}")


def _rebuild(batch: Any, leaves: list[Tensor]) -> Any:
    it = iter(leaves)

    def walk(node: Any) -> Any:
        if isinstance(node, Tensor):
            return next(it)
        if isinstance(node, (list, tuple)):
            out = [walk(item) for item in node]
            return type(node)(out) if isinstance(node, list) else tuple(out)
        return {key: walk(node[key]) for key in sorted(node)}

    return walk(batch)


class DataInjector:
    """Per step, :math:`\\lceil \\alpha N \\rceil` ranks drawn from a shared seed put the first :math:`\\beta b'`
    samples of their local batch in a fixed-size slot; the other ranks' slots are zeros. One all-gather of the
    slots (all batch tensors packed as bytes, tag ``"inject"``) gives every rank every sharer's samples, which it
    appends to its own :math:`b'`: every rank trains on :math:`b' + \\lceil\\alpha N\\rceil \\cdot \\beta b'
    \\approx b` samples (a sharing rank sees its own shared samples twice — that keeps every rank's batch equal).

    Bytes: the ring all-gather sends :math:`(N-1)` slots per rank per step, of which the injected payload is
    :math:`\\lceil\\alpha N\\rceil \\cdot \\beta b' \\cdot` sample size (the paper's figure); the zero slots are the
    price of a fixed-size collective whose message sizes do not tell who shared. All ranks do know who shared (the
    draw is seeded identically on every rank so they can agree without a message); nothing identifying the sharers
    is logged or checkpointed, only counts — the paper's K-anonymity holds towards the job's outputs, not among
    its ranks.
    """

    def __init__(self, alpha: float, beta: float, seed: int = 0) -> None:
        self.alpha, self.beta = check_injection(alpha, beta)
        self.seed = seed
        self.step = 0
        self.local_batch: int | None = None
        self.target_batch: int | None = None
        self.injected_samples = 0
        self.payload_bytes = 0

    def rebuild_loader(self, dataloader: Any, world_size: int) -> Any:
        """Re-create the training loader with batch size :math:`b'` (Eq. 3); its batch size is taken as b."""
        from lightning.pytorch.utilities.data import _get_dataloader_init_args_and_kwargs, _reinstantiate_wrapped_cls

        if not isinstance(dataloader, DataLoader) or dataloader.batch_size is None:
            raise ValueError(
                "data injection resizes the training batch (Eq. 3), so it needs a torch DataLoader built with "
                "batch_size=b (not a custom batch_sampler)"
            )
        b = int(dataloader.batch_size)
        self.target_batch = b
        self.local_batch = local_batch_size(b, self.alpha, self.beta, world_size)
        args, kwargs = _get_dataloader_init_args_and_kwargs(dataloader, dataloader.sampler)
        kwargs["batch_size"] = self.local_batch
        kwargs.pop("batch_sampler", None)
        return _reinstantiate_wrapped_cls(dataloader, *args, **kwargs)

    def inject(self, batch: Any, comm: Communicator, device: torch.device) -> Any:
        """This step's batch with the sharing ranks' samples appended (one all-gather)."""
        leaves = _leaves(batch)
        rows = int(leaves[0].shape[0])
        if any(int(t.shape[0]) != rows for t in leaves):
            raise ValueError("data injection needs every tensor of a batch to have the batch size as first dimension")
        m = min(shared_count(self.local_batch or rows, self.beta), rows)
        sharers = sharing_ranks(comm.world_size, self.alpha, self.seed, self.step)
        self.step += 1
        parts = [t[:m].contiguous().reshape(m, -1) for t in leaves]
        widths = [p.shape[1] * p.element_size() for p in parts]
        slot = torch.cat([p.view(torch.uint8).reshape(m, -1).to(device) for p in parts], dim=1)
        if comm.rank not in sharers:
            slot.zero_()
        gathered = comm.all_gather(slot, tag="inject")  # [N, m, bytes per sample]
        received = gathered[sharers].reshape(len(sharers) * m, -1).to(leaves[0].device)
        self.injected_samples += len(sharers) * m
        self.payload_bytes += len(sharers) * m * sum(widths)
        out, col = [], 0
        for t, w in zip(leaves, widths):
            chunk = received[:, col : col + w].contiguous().view(t.dtype).reshape(len(sharers) * m, *t.shape[1:])
            out.append(torch.cat([t, chunk.to(t.device)], dim=0))
            col += w
        return _rebuild(batch, out)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "injected_samples": self.injected_samples, "payload_bytes": self.payload_bytes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.injected_samples = int(state["injected_samples"])
        self.payload_bytes = int(state["payload_bytes"])
