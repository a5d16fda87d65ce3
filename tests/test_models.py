"""The packaged models' optional step schedule (``lr_milestones``, ``lr_gamma``): one rule for the classifiers and
the language models, checked at construction and applied per epoch."""

from __future__ import annotations

import pytest
import torch

from lightning_sync.models import CharTransformerLM, DigitsCNN, DigitsVGG11, WordTransformerLM

SMALL = {
    DigitsCNN: {"channels": 2, "hidden": 4},
    DigitsVGG11: {"channels": 1, "fc": 8},
    CharTransformerLM: {"dim": 8, "heads": 2, "layers": 1},
    WordTransformerLM: {"vocab_size": 16, "embed_dim": 8, "dim": 8, "heads": 2, "layers": 1},
}


@pytest.mark.parametrize("cls", list(SMALL), ids=lambda c: c.__name__)
def test_constant_rate_by_default(cls):
    assert isinstance(cls(**SMALL[cls]).configure_optimizers(), torch.optim.Optimizer)


@pytest.mark.parametrize("cls", list(SMALL), ids=lambda c: c.__name__)
def test_step_decay_multiplies_the_rate_at_each_milestone(cls):
    model = cls(**SMALL[cls], lr=0.1, lr_milestones=[1, 3], lr_gamma=0.5)
    conf = model.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]
    assert sched["interval"] == "epoch"
    rates = []
    for _ in range(4):  # Lightning steps an epoch-interval scheduler at the end of each epoch
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched["scheduler"].step()
    assert rates == pytest.approx([0.1, 0.05, 0.05, 0.025])


@pytest.mark.parametrize("cls", list(SMALL), ids=lambda c: c.__name__)
@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"lr_milestones": [0]}, "lr_milestones"),
        ({"lr_milestones": [3, 2]}, "lr_milestones"),
        ({"lr_milestones": [1.5]}, "lr_milestones"),
        ({"lr_milestones": [True]}, "lr_milestones"),
        ({"lr_gamma": 0.0}, "lr_gamma"),
        ({"lr_gamma": 1.5}, "lr_gamma"),
    ],
)
def test_bad_schedule_arguments(cls, kwargs, name):
    with pytest.raises(ValueError, match=rf"{name} must be .*got"):
        cls(**SMALL[cls], **kwargs)


@pytest.mark.parametrize("workload", ["digits", "text", "vgg", "words"])
def test_every_packaged_workload_trains_and_validates_on_the_cpu(workload, single_process):
    """The CPU twin of tests/test_gpu.py's per-workload test (same code, ``accelerator="cpu"``)."""
    from workloads import fit_and_validate

    metrics = fit_and_validate(workload, "cpu")
    name = "val/ppl" if workload in ("text", "words") else "val/acc"
    assert name in metrics and torch.isfinite(torch.tensor(metrics[name]))
