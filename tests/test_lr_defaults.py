"""Every strategy trains at the learning rate of the user's (DDP's) configuration out of the box (issue 17).

The text workload's packaged configuration (``lightning_sync/configs/compare_text.yaml``: a character Transformer,
SGD lr 0.1, momentum 0.9) diverged under ASP, SSP and Sync-Switch when each push was a worker's full step
(perplexity ``inf``). With the DDP-anchored defaults (pushes scaled by 1/m, ASP's and SSP's workers at the momentum
derived from the user's, Sync-Switch's BSP phase at the user's rate) every asynchronous row must end with a finite
test perplexity close to BSP's. One set of 4 torchrun-style processes runs the five fits (the import is paid
once); the model, data and learning rate are the packaged configuration's, the budget is reduced to ``EPOCHS``
epochs (the config's is a time-to-target budget).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from launch import run_suite

WORLD = 4
STRATEGIES = ("bsp", "asp", "ssp", "aladdin", "sync_switch")
#: How far above BSP's test perplexity one run may end. Measured at this budget with the defaults
#: (``python benchmarks/lr_defaults.py --warmup 0 --momentum``: seeds 1-5, 4 processes on 2 cores), the ratio to
#: BSP's of the same seed: ASP 1.07-1.16x (mean 1.12x), SSP 1.06-1.15x (1.10x), ALADDIN 1.01-1.04x (1.02x),
#: Sync-Switch 1.04-1.28x (1.13x) — the push order, hence the staleness, follows the OS's scheduling of the 4
#: processes, so single runs spread. Issue 17's 15% holds for the means; one run is allowed 30% (the largest single
#: run measured is 1.28x). The papers' literal rates (the defaults before issue 17) diverged (nan/inf) in 8 of 9 runs.
MARGIN = 0.3
#: the reduced budget (epochs of the packaged data)
EPOCHS = 3


def _suite(rank: int, out_dir: str) -> None:
    import json

    import lightning.pytorch as pl
    import yaml

    import lightning_sync  # noqa: F401  (registers the names)
    from lightning_sync.compare import packaged_config
    from lightning_sync.data.text import PythonTextDataModule
    from lightning_sync.launch import quiet_trainer_kwargs
    from lightning_sync.models import CharTransformerLM

    config = yaml.safe_load(packaged_config("text").read_text())
    res = {}
    for name in STRATEGIES:
        pl.seed_everything(config["seed_everything"])
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=WORLD,
            strategy=name,
            max_epochs=EPOCHS,
            limit_val_batches=config["trainer"]["limit_val_batches"],
            **quiet_trainer_kwargs(),
        )
        model = CharTransformerLM(**config["model"]["init_args"])
        data = PythonTextDataModule(**config["data"]["init_args"])
        trainer.fit(model, data)
        res[name] = {
            "test_ppl": float(trainer.test(model, data, verbose=False)[0]["test/ppl"]),
            "lr": float(model.hparams.lr),
        }
    Path(out_dir, f"res_rank{rank}.json").write_text(json.dumps(res))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_suite(_suite, WORLD, tmp_path_factory.mktemp("lr_defaults"))[0]


@pytest.mark.parametrize("name", STRATEGIES[1:])
def test_asynchronous_rows_train_at_ddps_rate_near_bsp(results, name):
    bsp, row = results["bsp"]["test_ppl"], results[name]["test_ppl"]
    assert results[name]["lr"] == 0.1  # the packaged (DDP-tuned) rate, unchanged
    assert math.isfinite(row), f"{name} diverged at the packaged learning rate"
    assert row <= (1 + MARGIN) * bsp, f"{name}: test perplexity {row:.2f} vs BSP's {bsp:.2f}"
