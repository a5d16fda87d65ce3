"""The packaged ``compare`` workloads (digits, text, vgg, words) built from their base configs, for tests that train
each one a few steps on a given accelerator and validate it (the GPU test and its CPU twin run the same code)."""

from __future__ import annotations

import importlib
from typing import Any

import yaml


def _instantiate(entry: dict[str, Any], **override: Any) -> Any:
    module, _, name = entry["class_path"].rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    return cls(**{**(entry.get("init_args") or {}), **override})


def fit_and_validate(workload: str, accelerator: str, steps: int = 3) -> dict[str, float]:
    """Train ``workload``'s model ``steps`` steps with local SGD (period 2: a sync inside the run) in this process and
    validate it (two batches), as ``compare`` would run it; return the metrics logged by validation."""
    import lightning.pytorch as pl

    import lightning_sync  # noqa: F401  (registers the names)
    from lightning_sync.compare import packaged_config
    from lightning_sync.launch import quiet_trainer_kwargs
    from lightning_sync.strategies import LocalSGDStrategy

    config = yaml.safe_load(packaged_config(workload).read_text())
    pl.seed_everything(0, verbose=False)
    model, data = _instantiate(config["model"]), _instantiate(config["data"])
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=1,
        strategy=LocalSGDStrategy(period=2),
        max_steps=steps,
        limit_val_batches=2,
        **quiet_trainer_kwargs(),
    )
    trainer.fit(model, data)
    metrics = trainer.validate(model, data, verbose=False)[0]
    return {k: float(v) for k, v in metrics.items()}
