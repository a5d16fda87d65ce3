"""``evaluate="last_sync"``: validation during fit evaluates the global model of the last synchronisation, with no
communication (``lightning_sync.strategies.evaluation``).

In 2 processes started once (torchrun-style): local SGD (period 4, 6 steps an epoch, so every validation comes two
local steps after the last averaging), FedAvg, ADPSGD, SelSync, plain DiLoCo (the outer step's
:math:`\\theta_{global}`) and streaming DiLoCo (2 fragments, delay 1: each fragment's global values as of its last
sync). A probe records the model right after every step that synced and the model validation sees: validation must
see exactly the model of the last synced step (DiLoCo: the outer optimizer's global parameters), the same on both
ranks, with no byte sent under the ``eval`` tag, and training must go on from each rank's own replica. A local SGD
fit interrupted after an epoch and resumed from its checkpoint validates the same models and ends with the same
replicas as the uninterrupted fit (the copy is in every rank's checkpoint part).

The default ``evaluate="average"``: one exact all-reduce of the model per validation (bytes: the analytic count of
gloo's ring), none when no training step ran since a sync of the whole model (FedAvg, whose last averaging of an
epoch is its last step; plain DiLoCo with rounds that end with the epoch): every rank then holds the global model,
which validation takes as it is (checked identical on every rank with ``verify_sync``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import run_suite

WORLD = 2
EPOCHS = 3
BATCHES = 6  # steps per epoch
#: DiLoCo's cases step an outer optimizer with state (SlowMo's: outer_optimizer="auto" over SGD is plain averaging)
SLOWMO = {"name": "sgd", "lr": 1.0, "momentum": 0.5}


def _digest(tensors: Any) -> str:
    import hashlib

    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _suite(rank: int, out_dir: str) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_sync import ADPSGDStrategy, DiLoCoStrategy, FedAvgStrategy, LocalSGDStrategy, SelSyncStrategy
    from lightning_sync.data import DigitsDataModule
    from lightning_sync.launch import quiet_trainer_kwargs
    from lightning_sync.models import DigitsCNN

    out = Path(out_dir)

    class Probe(pl.Callback):
        def __init__(self) -> None:
            self.synced_model: str | None = None  # the model right after the last step that synced
            self.expected: list[str | None] = []  # at each validation: the last synced model
            self.seen: list[str] = []  # the model validation evaluated
            self.outer_match: list[bool] = []  # DiLoCo: the evaluated parameters are the outer's global ones
            self.restored: list[bool] = []
            self._before: str | None = None
            self._syncs = 0
            self.replica: str | None = None
            self.synced_state: dict[str, torch.Tensor] = {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            syncs = trainer.strategy.step_counter.sync_steps
            if syncs != self._syncs:
                self.synced_model = _digest(trainer.strategy.flat.state_tensors())
                self.synced_state = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
            self._syncs = syncs

        def on_validation_start(self, trainer, pl_module):  # callbacks run before the strategy swaps the model in
            if trainer.state.fn == "fit":
                self._before = _digest(trainer.strategy.flat.state_tensors())
                self.expected.append(self.synced_model)

        def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            if batch_idx == 0 and trainer.state.fn == "fit":
                strategy = trainer.strategy
                self.seen.append(_digest(strategy.flat.state_tensors()))
                outer = getattr(strategy, "outer", None)
                if outer is not None:
                    self.outer_match.append(
                        all(
                            torch.equal(g.state[: g.param_numel], outer.global_params[i])
                            for i, g in enumerate(strategy.flat.groups)
                            if g.param_numel
                        )
                    )

        def on_train_end(self, trainer, pl_module):  # before the strategy's final average
            self.replica = _digest(trainer.strategy.flat.state_tensors())
            self.buffers = [(t.numel(), t.element_size()) for t in trainer.strategy.flat.state_tensors()]

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if self._before is not None:
                self.restored.append(self._before == _digest(trainer.strategy.flat.state_tensors()))
                self._before = None

    class SaveMidEpoch(pl.Callback):
        """A checkpoint saved outside validation, two local steps after a sync (global step 10; syncs after steps
        0, 4, 8): its main file must hold the last sync's model, taken without a collective."""

        def __init__(self, probe: Probe) -> None:
            self.probe = probe
            self.expected: dict[str, torch.Tensor] = {}
            self.current: dict[str, torch.Tensor] = {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 10:
                self.expected = dict(self.probe.synced_state)
                self.current = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
                before = trainer.strategy.comm_stats.summary().get("bytes_checkpoint", 0.0)
                trainer.save_checkpoint(str(out / "mid" / "mid.ckpt"))
                self.sent = trainer.strategy.comm_stats.summary().get("bytes_checkpoint", 0.0) - before

    class StopAfter(pl.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            if trainer.current_epoch == 0:
                trainer.should_stop = True

    def fit(name: str, strategy: Any, *extra: Any, ckpt: str | None = None, root: str | None = None) -> dict:
        pl.seed_everything(0, verbose=False)
        probe = Probe()
        checkpoint = ModelCheckpoint(dirpath=str(out / (root or name) / "ckpt"), save_last=True)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=WORLD,
            strategy=strategy,
            max_epochs=EPOCHS,
            limit_train_batches=BATCHES,
            limit_val_batches=2,
            callbacks=[probe, checkpoint, *extra],
            **quiet_trainer_kwargs(enable_checkpointing=True),
        )
        model = DigitsCNN(lr=0.05, momentum=0.9)
        trainer.fit(model, DigitsDataModule(batch_size=16), ckpt_path=ckpt)
        metrics = trainer.strategy.sync_metrics()
        from lightning_sync.comm.cost import allreduce_bytes

        return {  # one all-reduce per flat buffer
            "average_bytes": sum(allreduce_bytes(n, size, WORLD, rank, "gloo") for n, size in probe.buffers),
            "bytes_checkpoint": metrics.get("bytes_checkpoint", 0.0),
            "expected": probe.expected,
            "seen": probe.seen,
            "outer_match": probe.outer_match,
            "restored": probe.restored,
            "bytes_eval": metrics.get("bytes_eval", 0.0),
            "bytes_final": metrics.get("bytes_final", 0.0),
            "replica": probe.replica,
            "model": _digest(v for v in model.state_dict().values() if v.is_floating_point()),
            "last": checkpoint.last_model_path,
            "global_step": trainer.global_step,
        }

    def mid_checkpoint() -> dict[str, Any]:
        pl.seed_everything(0, verbose=False)
        probe = Probe()
        mid = SaveMidEpoch(probe)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=WORLD,
            strategy=LocalSGDStrategy(period=4, evaluate="last_sync"),
            max_steps=12,
            limit_train_batches=BATCHES,
            limit_val_batches=0,
            callbacks=[probe, mid],
            **quiet_trainer_kwargs(),
        )
        trainer.fit(DigitsCNN(lr=0.05, momentum=0.9), DigitsDataModule(batch_size=16))
        saved = torch.load(out / "mid" / "mid.ckpt", map_location="cpu", weights_only=False)["state_dict"]
        floating = [k for k, v in saved.items() if v.is_floating_point()]
        return {
            "holds_last_sync": all(torch.equal(saved[k], mid.expected[k]) for k in floating),
            "holds_replica": all(torch.equal(saved[k], mid.current[k]) for k in floating),
            "sent": mid.sent,
        }

    res: dict[str, Any] = {
        "localsgd": fit("localsgd", LocalSGDStrategy(period=4, evaluate="last_sync")),
        "localsgd_average": fit("localsgd_average", LocalSGDStrategy(period=4)),
        # evaluate="average" right after a sync of the whole model: the epoch's last step syncs
        "fedavg_in_sync": fit("fedavg_in_sync", FedAvgStrategy(syncs_per_epoch=2, verify_sync=True)),
        "diloco_in_sync": fit("diloco_in_sync", DiLoCoStrategy(outer_optimizer=SLOWMO, sync_every=3, verify_sync=True)),
        # offset=period-1: averaging after steps 2, 5, 8, ... — every 6-step epoch ends on one, with no warm-up
        "localsgd_in_sync": fit("localsgd_in_sync", LocalSGDStrategy(period=3, offset=2, verify_sync=True)),
        "fedavg": fit("fedavg", FedAvgStrategy(syncs_per_epoch=2, evaluate="last_sync")),
        "adpsgd": fit("adpsgd", ADPSGDStrategy(warmup_epochs=0, evaluate="last_sync")),
        "selsync": fit("selsync", SelSyncStrategy(evaluate="last_sync")),
        "diloco": fit("diloco", DiLoCoStrategy(outer_optimizer=SLOWMO, sync_every=4, evaluate="last_sync")),
        "streaming": fit(
            "streaming",
            DiLoCoStrategy(outer_optimizer=SLOWMO, sync_every=4, fragments=2, delay=1, evaluate="last_sync"),
        ),
    }
    # resume: the same local SGD fit stopped after its first epoch and resumed from last.ckpt
    interrupted = fit("resume", LocalSGDStrategy(period=4, evaluate="last_sync"), StopAfter())
    res["resumed"] = fit(
        "resume", LocalSGDStrategy(period=4, evaluate="last_sync"), ckpt=interrupted["last"], root="resume"
    )
    res["interrupted"] = interrupted
    res["mid_checkpoint"] = mid_checkpoint()
    (out / f"res_rank{rank}.json").write_text(json.dumps(res))


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return run_suite(_suite, WORLD, tmp_path_factory.mktemp("evaluate"))


@pytest.mark.parametrize("name", ("localsgd", "fedavg", "adpsgd", "selsync", "diloco"))
def test_validation_sees_the_model_of_the_last_sync_without_communicating(suite, name):
    a, b = suite[0][name], suite[1][name]
    assert len(a["seen"]) == EPOCHS
    assert a["seen"] == b["seen"], "ranks validated different models"
    assert a["seen"] == a["expected"] == b["expected"], "validation did not see the last synced model"
    assert all(a["restored"]) and all(b["restored"]) and len(a["restored"]) == EPOCHS - 1  # training went on
    assert a["bytes_eval"] == 0.0 and b["bytes_eval"] == 0.0  # nothing sent to validate
    if name == "diloco":
        assert a["outer_match"] == [True] * EPOCHS  # the outer step's global parameters


def test_local_sgd_validates_two_local_steps_behind_its_replicas(suite):
    """6 steps an epoch, period 4 (averaging after steps 0, 4, 8, ...): at each validation the replicas are 1-3
    local steps past the last averaging, so the last sync's model is not the replicas' average — which is what
    ``evaluate="average"`` validates (one all-reduce each time)."""
    last_sync, average = suite[0]["localsgd"], suite[0]["localsgd_average"]
    assert last_sync["seen"] != average["seen"]
    for r in suite:  # one exact all-reduce of parameters and buffers per validation
        assert r["localsgd_average"]["bytes_eval"] == EPOCHS * r["localsgd_average"]["average_bytes"] > 0
        # and one more at the end (average_at_end): the last step (17) is 1 local step past the averaging after 16
        assert r["localsgd_average"]["bytes_final"] == r["localsgd_average"]["average_bytes"]


@pytest.mark.parametrize("name", ("fedavg_in_sync", "diloco_in_sync", "localsgd_in_sync"))
def test_the_average_right_after_a_sync_of_the_whole_model_sends_nothing(suite, name):
    """Every validation comes right after an averaging: the replicas are identical (``verify_sync`` gathers their
    checksums there and would raise otherwise), so validation and ModelCheckpoint's main file take the model as it
    is — the synced model, the same on both ranks — and training goes on from it."""
    a, b = suite[0][name], suite[1][name]
    assert len(a["seen"]) == EPOCHS and a["seen"] == b["seen"]
    assert a["seen"] == a["expected"] == b["expected"], "validation did not see the synced model"
    assert all(a["restored"]) and all(b["restored"]) and len(a["restored"]) == EPOCHS - 1
    for r in (a, b):
        assert r["bytes_eval"] == 0.0
        assert r["bytes_checkpoint"] < 10_000  # no model-sized all-reduce for the main checkpoint file either
        assert r["bytes_final"] == 0.0  # the last step synced: average_at_end has nothing to average
    if name == "diloco_in_sync":
        assert a["outer_match"] == [True] * EPOCHS  # the outer step's global parameters


def test_streaming_diloco_validates_each_fragments_global_values(suite):
    a, b = suite[0]["streaming"], suite[1]["streaming"]
    assert a["seen"] == b["seen"] and len(a["seen"]) == EPOCHS
    assert a["outer_match"] == [True] * EPOCHS and b["outer_match"] == [True] * EPOCHS
    assert a["bytes_eval"] == 0.0


def test_resume_validates_the_same_models_and_ends_with_the_same_replicas(suite):
    for r in suite:
        straight, interrupted, resumed = r["localsgd"], r["interrupted"], r["resumed"]
        assert interrupted["global_step"] == BATCHES and resumed["global_step"] == straight["global_step"]
        assert interrupted["seen"] + resumed["seen"] == straight["seen"]
        assert resumed["replica"] is not None and resumed["replica"] == straight["replica"]
        assert resumed["model"] == straight["model"]


def test_a_checkpoint_outside_validation_holds_the_last_syncs_model_without_an_all_reduce(suite):
    for r in suite:
        mid = r["mid_checkpoint"]
        assert mid["holds_last_sync"] and not mid["holds_replica"]  # two local steps after the sync
    # rank 0's file name is broadcast (a few bytes, tag "checkpoint"); no model-sized all-reduce
    assert all(r["mid_checkpoint"]["sent"] < 10_000 for r in suite)


def test_the_argument_is_checked_at_construction():
    from lightning_sync import LocalSGDStrategy, SelSyncStrategy

    with pytest.raises(ValueError, match=r"evaluate must be one of 'average', 'last_sync'"):
        LocalSGDStrategy(evaluate="last")
    with pytest.raises(ValueError, match=r"evaluate='last_sync' needs aggregation='parameters'"):
        SelSyncStrategy(aggregation="gradients", evaluate="last_sync")
    assert SelSyncStrategy(aggregation="gradients").evaluate == "average"


def test_a_checkpoint_without_the_copy_is_refused_with_the_reason():
    from lightning_sync import LocalSGDStrategy

    strategy = LocalSGDStrategy(evaluate="last_sync")
    strategy._synced = [torch.zeros(3)]
    with pytest.raises(ValueError, match="written with evaluate='average'"):
        strategy._load_synced(None)
    with pytest.raises(ValueError, match="does not match this model"):
        strategy._load_synced([torch.zeros(4)])
    strategy._load_synced([torch.ones(3)])
    assert torch.equal(strategy._synced[0], torch.ones(3))
    LocalSGDStrategy()._load_synced(None)  # evaluate="average" needs no copy
