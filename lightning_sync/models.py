"""Small LightningModules for the embedded demo and the benchmarks: on scikit-learn's digits (1x8x8, 10 classes) a
compute-bound CNN, a wide MLP and a VGG-11-shaped model whose head holds the bytes; on Python's own help text a
character Transformer and a word-level Transformer whose embedding and output layers hold the bytes."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torchmetrics.classification import MulticlassAccuracy


def _check_step_decay(lr_milestones: list[int] | None, lr_gamma: float) -> None:
    if lr_milestones is not None and (
        any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in lr_milestones)
        or list(lr_milestones) != sorted(lr_milestones)
    ):
        raise ValueError(f"lr_milestones must be increasing epoch numbers >= 1, got {lr_milestones!r}")
    if not 0 < lr_gamma <= 1:
        raise ValueError(f"lr_gamma must be in (0, 1], got {lr_gamma!r}")


def _with_step_decay(opt: torch.optim.Optimizer, hp: Any) -> Any:
    """``opt``, or ``opt`` with a step schedule: the rate multiplied by ``lr_gamma`` at each epoch in
    ``lr_milestones`` (stepped per epoch, as the ADPSGD and SelSync papers anneal and Sync-Switch's policy switches
    after the first decay)."""
    if not hp.get("lr_milestones"):
        return opt
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=list(hp.lr_milestones), gamma=hp.lr_gamma)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}


class _Classifier(pl.LightningModule):
    """Cross-entropy classifier with SGD (momentum, weight decay), an optional step LR schedule (multiply by
    ``lr_gamma`` at each epoch in ``lr_milestones``, as the ADPSGD and SelSync papers anneal), torchmetrics accuracy."""

    def __init__(
        self,
        lr: float,
        momentum: float,
        weight_decay: float,
        num_classes: int,
        lr_milestones: list[int] | None = None,
        lr_gamma: float = 0.1,
    ) -> None:
        super().__init__()
        _check_step_decay(lr_milestones, lr_gamma)
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr!r}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
        self.val_acc = MulticlassAccuracy(num_classes=num_classes)
        self.test_acc = MulticlassAccuracy(num_classes=num_classes)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val/loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val/acc", self.val_acc, prog_bar=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.test_acc(self(x), y)
        self.log("test/acc", self.test_acc)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        opt = torch.optim.SGD(self.parameters(), lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay)
        return _with_step_decay(opt, hp)


class DigitsCNN(_Classifier):
    """The demo CNN: two 3x3 conv layers with BatchNorm (so buffer averaging is exercised), then two linear.

    About 38k parameters; a step on a batch of 32 8x8 images takes a few milliseconds on one CPU core.
    """

    def __init__(
        self,
        lr: float = 0.05,
        momentum: float = 0.9,
        weight_decay: float = 1e-4,
        channels: int = 16,
        hidden: int = 64,
        num_classes: int = 10,
        lr_milestones: list[int] | None = None,
        lr_gamma: float = 0.1,
    ) -> None:
        super().__init__(lr, momentum, weight_decay, num_classes, lr_milestones, lr_gamma)
        self.save_hyperparameters()
        c = channels
        self.features = nn.Sequential(
            nn.Conv2d(1, c, 3, padding=1),
            nn.BatchNorm2d(c),
            nn.ReLU(),
            nn.Conv2d(c, 2 * c, 3, padding=1),
            nn.BatchNorm2d(2 * c),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(2 * c * 16, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 2:
            x = x.view(-1, 1, 8, 8)
        return self.head(self.features(x))


class WideMLP(_Classifier):
    """A communication-heavy model: wide fully connected layers (``hidden=2048``, ``depth=2``: ~4.3M parameters,
    17 MB of float32) on the same 64-pixel inputs, so syncs cost far more than the compute of a step."""

    def __init__(
        self,
        lr: float = 0.05,
        momentum: float = 0.9,
        weight_decay: float = 1e-4,
        hidden: int = 2048,
        depth: int = 2,
        num_classes: int = 10,
        lr_milestones: list[int] | None = None,
        lr_gamma: float = 0.1,
    ) -> None:
        super().__init__(lr, momentum, weight_decay, num_classes, lr_milestones, lr_gamma)
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth!r}")
        self.save_hyperparameters()
        layers: list[nn.Module] = [nn.Flatten()]
        width = 64
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class _LanguageModel(pl.LightningModule):
    """Evaluation of the language models: ``<stage>/loss`` (mean token cross-entropy) and ``<stage>/ppl``, the
    perplexity of the whole evaluation: exp of the mean token loss over every batch of every rank. (Logging each
    batch's ``exp(loss)`` and averaging those, as ``self.log(..., sync_dist=True)`` would, gives a larger number by
    Jensen's inequality — with 8 x 32-token batches 38 where the perplexity is 16.) The sums are reduced once per
    evaluation through the strategy (``strategy.reduce``, the path ``sync_dist`` takes).

    Both models share the training arguments (``optimizer``, ``lr``, the step schedule: :meth:`_check_training`,
    :meth:`configure_optimizers`) and the causal Transformer core over ``dim``-wide positions
    (:meth:`_build_core`)."""

    @staticmethod
    def _check_training(optimizer: str, lr: float, lr_milestones: list[int] | None, lr_gamma: float) -> None:
        if optimizer not in ("sgd", "adamw"):
            raise ValueError(f"optimizer must be 'sgd' or 'adamw', got {optimizer!r}")
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr!r}")
        _check_step_decay(lr_milestones, lr_gamma)

    def _build_core(self, vocab_size: int, seq_len: int, dim: int, heads: int, layers: int, dropout: float) -> None:
        """The learned positions (``pos``), ``layers`` causal encoder layers of width ``dim`` (``encoder``) and the
        untied output layer over the vocabulary (``head``), created in that order."""
        self.pos = nn.Parameter(torch.zeros(seq_len, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab_size)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        if hp.optimizer == "adamw":
            return _with_step_decay(torch.optim.AdamW(self.parameters(), lr=hp.lr), hp)
        return _with_step_decay(torch.optim.SGD(self.parameters(), lr=hp.lr, momentum=hp.momentum), hp)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def _evaluation_step(self, stage: str, batch: tuple[Tensor, Tensor]) -> None:
        loss = self._loss(batch)
        self.log(f"{stage}/loss", loss, sync_dist=True)
        tokens = batch[1].numel()
        sums = getattr(self, "_ppl_sums", None) or {}
        total = sums.get(stage)
        # on the loss's device: a CPU tensor stacked with a CUDA loss fails on a GPU (issue 51)
        count = torch.tensor(float(tokens), dtype=torch.float64, device=loss.device)
        step = torch.stack([loss.detach().double() * tokens, count])
        sums[stage] = step if total is None else total + step.to(total.device)
        self._ppl_sums = sums

    def _log_perplexity(self, stage: str) -> None:
        sums = getattr(self, "_ppl_sums", None) or {}
        total = sums.pop(stage, None)
        if total is None:  # no batch evaluated on this rank (every rank evaluates in the packaged setups)
            return
        total = self.trainer.strategy.reduce(total, reduce_op="sum")
        self.log(f"{stage}/ppl", torch.exp(total[0] / total[1]).float(), prog_bar=stage == "val")

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluation_step("val", batch)

    def on_validation_epoch_end(self) -> None:
        self._log_perplexity("val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluation_step("test", batch)

    def on_test_epoch_end(self) -> None:
        self._log_perplexity("test")


class CharTransformerLM(_LanguageModel):
    """A small causal Transformer language model over characters (the SelSync paper's Transformer workload, scaled
    down: ``layers`` encoder layers of width ``dim`` with ``heads`` heads). Logs ``train/loss``, ``val/loss``,
    ``val/ppl`` and ``test/ppl`` (perplexity: exp of the mean token loss of the whole evaluation); optimizer SGD with
    momentum (default, so OSP's correction is exact and ADPSGD sees a learning rate) or AdamW, with an optional step
    schedule (the rate times ``lr_gamma`` at each epoch in ``lr_milestones``)."""

    def __init__(
        self,
        vocab_size: int = 128,
        seq_len: int = 64,
        dim: int = 64,
        heads: int = 2,
        layers: int = 2,
        dropout: float = 0.0,
        lr: float = 0.1,
        momentum: float = 0.9,
        optimizer: str = "sgd",
        lr_milestones: list[int] | None = None,
        lr_gamma: float = 0.1,
    ) -> None:
        super().__init__()
        self._check_training(optimizer, lr, lr_milestones, lr_gamma)
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab_size, dim)
        self._build_core(vocab_size, seq_len, dim, heads, layers, dropout)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        t = x.shape[1]
        h = self.embed(x) + self.pos[:t]
        return self.head(self.encoder(h, mask=self.mask[:t, :t], is_causal=True))


#: VGG-11 (Simonyan & Zisserman 2015, Table 1, configuration "A"): conv widths as multiples of the first, "M" a
#: 2x2 max-pool. The original pools five times (224 -> 7); on 8x8 digits the first three pools take the map to 1x1.
VGG11_LAYERS = (1, "M", 2, "M", 4, 4, "M", 8, 8, 8, 8)


class DigitsVGG11(_Classifier):
    """A communication-bound image model: VGG-11's shape on the 8x8 digits — eight 3x3 convolutions (configuration
    A's widths 64-128-256-256-512-512-512-512 divided by ``64 / channels``, max-pooling to 1x1) and VGG's three fully
    connected layers (``features -> fc -> fc -> classes``, ReLU, optional dropout).

    As in VGG, the fully connected head holds most of the bytes: with the defaults (``channels=8``, ``fc=3072``) about
    9.8M parameters (39 MB of float32), 98% of them in the head, while a step's compute is small (the convolutions
    run on 8x8 to 1x1 maps). No BatchNorm by default (VGG-11 has none; ``batch_norm=True`` adds it after each
    convolution).
    """

    def __init__(
        self,
        lr: float = 0.02,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        channels: int = 8,
        fc: int = 3072,
        dropout: float = 0.0,
        batch_norm: bool = False,
        num_classes: int = 10,
        lr_milestones: list[int] | None = None,
        lr_gamma: float = 0.1,
    ) -> None:
        super().__init__(lr, momentum, weight_decay, num_classes, lr_milestones, lr_gamma)
        for name, value in (("channels", channels), ("fc", fc)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not 0 <= dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.save_hyperparameters()
        layers: list[nn.Module] = []
        width = 1
        for item in VGG11_LAYERS:
            if item == "M":
                layers.append(nn.MaxPool2d(2))
                continue
            out = int(item) * channels
            layers.append(nn.Conv2d(width, out, 3, padding=1))
            if batch_norm:
                layers.append(nn.BatchNorm2d(out))
            layers.append(nn.ReLU(inplace=True))
            width = out
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(width, fc),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(fc, fc),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(fc, num_classes),
        )
        for module in self.modules():  # torchvision's VGG initialisation (plain VGG does not train from the default)
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0, 0.01)
                nn.init.zeros_(module.bias)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 2:
            x = x.view(-1, 1, 8, 8)
        return self.head(self.features(x))


class WordTransformerLM(_LanguageModel):
    """A communication-bound language model over words: a wide word embedding (``vocab_size x embed_dim``), projected
    to a small causal Transformer (``layers`` layers of width ``dim``), and an untied output layer
    (``dim x vocab_size``).

    The embedding and output layers hold most of the bytes (with the defaults, 4096 x 2048 + 128 x 4096 of 9.4M
    parameters, 95%; 38 MB of float32) while the compute per token is that of the small core: a wide embedding stands
    in for the large vocabularies whose tables dominate word-level language models (this text has only ~4k distinct
    tokens). The embedding's gradient is dense under data-parallel all-reduce (every row travels, whatever words the
    batch held). No buffers: the causal mask is built per forward. Logs ``train/loss``, ``val/loss``, ``val/ppl``
    and ``test/ppl`` (perplexity: exp of the mean token loss of the whole evaluation); SGD with momentum (default) or
    AdamW, with an optional step schedule (the rate times ``lr_gamma`` at each epoch in ``lr_milestones``).
    """

    def __init__(
        self,
        vocab_size: int = 4096,
        seq_len: int = 32,
        embed_dim: int = 2048,
        dim: int = 128,
        heads: int = 4,
        layers: int = 1,
        dropout: float = 0.0,
        lr: float = 0.1,
        momentum: float = 0.9,
        optimizer: str = "sgd",
        lr_milestones: list[int] | None = None,
        lr_gamma: float = 0.1,
    ) -> None:
        super().__init__()
        for name, value in (
            ("vocab_size", vocab_size),
            ("seq_len", seq_len),
            ("embed_dim", embed_dim),
            ("dim", dim),
            ("heads", heads),
            ("layers", layers),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if dim % heads:
            raise ValueError(f"dim must be divisible by heads, got dim={dim}, heads={heads}")
        self._check_training(optimizer, lr, lr_milestones, lr_gamma)
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        if not 0 <= dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab_size, embed_dim)
        self.proj = nn.Linear(embed_dim, dim)
        self._build_core(vocab_size, seq_len, dim, heads, layers, dropout)

    def configure_model(self) -> None:
        """Shard with FSDP2 when the strategy gives a device mesh: ``fully_shard`` over ``device_mesh["shard"]``
        (the pack's sharded replicas, ``sharded=True``) or ``device_mesh["data_parallel"]`` (Lightning's
        ``ModelParallelStrategy``, ``compare``'s ``fsdp2`` row): the embedding, the projection, each encoder layer and
        the output layer, then the module itself (the positions). Without a mesh (DDP, every other strategy) it does
        nothing; a module sharded at an earlier setup (an evaluation after fit) is left as it is."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        mesh = self._device_mesh
        if mesh is None or isinstance(self, FSDPModule):
            return
        names = mesh.mesh_dim_names or ()
        if "shard" in names:
            mesh = mesh["shard"]
        elif "data_parallel" in names:
            if "tensor_parallel" in names and mesh["tensor_parallel"].size() > 1:
                raise ValueError(
                    "WordTransformerLM shards with FSDP2 only: use ModelParallelStrategy with tensor_parallel_size=1"
                )
            mesh = mesh["data_parallel"]
        for block in (self.embed, self.proj, *self.encoder.layers, self.head):
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def forward(self, x: Tensor) -> Tensor:
        t = x.shape[1]
        h = self.proj(self.embed(x)) + self.pos[:t]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=x.device)
        return self.head(self.encoder(h, mask=mask, is_causal=True))
