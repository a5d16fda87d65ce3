"""Every strategy trains at the learning rate of the user's (DDP's) configuration out of the box (issue 17).

The text workload's packaged configuration (``lightning_sync/configs/compare_text.yaml``: a character Transformer,
SGD lr 0.1, momentum 0.9) diverged under ASP, SSP and Sync-Switch when each push was a worker's full step
(perplexity ``inf``). With the DDP-anchored defaults (pushes scaled by 1/m, ASP's and SSP's workers at the momentum
derived from the user's, Sync-Switch's BSP phase at the user's rate) every asynchronous row must end with a finite
test perplexity within 15% of BSP's. One set of 4 torchrun-style processes runs the five fits (the import is paid
once); the model, data and learning rate are the packaged configuration's, the budget is reduced to ``EPOCHS``
epochs (the config's is a time-to-target budget) with the rate decayed for the last one.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from launch import run_suite

WORLD = 4
STRATEGIES = ("bsp", "asp", "ssp", "aladdin", "sync_switch")
#: How far above BSP's test perplexity a row may end: issue 17's 15%.
MARGIN = 0.15
#: the reduced budget (epochs of the packaged data), the rate x0.1 for its last epoch (the model's step schedule,
#: ``lr_milestones``, as the papers anneal). Measured at this budget with the defaults (``python
#: benchmarks/lr_defaults.py --warmup 0 --milestones 2``: seeds 1-5, 4 processes on 2 cores), the ratio to BSP's of
#: the same seed: ASP 1.06-1.10x, SSP 1.06-1.10x, ALADDIN 1.02-1.03x, Sync-Switch 1.01-1.06x (RESULTS). At a constant
#: rate (``--warmup 0 --momentum``, no ``--milestones``) the means were within 15% but single runs spread to 1.28x
#: (Sync-Switch; ASP 1.07-1.16x): the push order, hence the staleness, follows the OS's scheduling of the 4
#: processes, and the last epoch at a tenth of the rate averages that noise out, as it does for BSP. The papers'
#: literal rates (the defaults before issue 17) diverged (nan/inf) in 8 of 9 runs.
EPOCHS = 3
MILESTONES = [2]


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
        model = CharTransformerLM(**config["model"]["init_args"], lr_milestones=MILESTONES)
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
