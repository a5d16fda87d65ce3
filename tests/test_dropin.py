"""A drop-in for ``strategy="ddp"`` (issue 20): an ordinary user script, with only ``strategy=`` changed.

The script is ``benchmarks/dropin.py``'s: a small ResNet-style CNN with BatchNorm on the embedded digits, torchmetrics
accuracy, SGD with Nesterov momentum and a per-step OneCycleLR, gradient clipping, bf16-mixed, ``ModelCheckpoint`` on
``val_acc`` with ``save_last``, ``EarlyStopping``, ``LearningRateMonitor``, ``CSVLogger``, ``val_check_interval=0.5``,
``self.log("train_loss", loss, sync_dist=True)``; the fit (6 epochs) is interrupted after epoch 3 and resumed from
``last.ckpt``, then validate / test (also from the best checkpoint) / predict.

* **Every strategy, in processes started once** (torchrun-style, ``launch_local``; 2 ranks): it trains or is refused
  at setup with the reason (OSP: clipping; the parameter-server strategies: mid-epoch validation — each then runs with
  the change its message names); validation accuracy at defaults within 3 points of Lightning's ``ddp``; predict
  returns predictions; the resume starts at the checkpoint's epoch and step; during validation every rank evaluates
  the same model and afterwards each rank's own replica is back bit-exactly (where the strategy took a training
  sync at validation's start, SelSync's overlapped vote, training continues from the synced model validation saw);
  a per-step ``sync_dist`` log under the asynchronous strategies warns once and does not stop the run.
  SelSync(``delta="auto"``) resumed from a checkpoint taken with the global model swapped in ends bit-identical to the
  uninterrupted run.
* **An ordinary model, over seeds** (issue 51): the same script for 3 epochs, every strategy at its defaults over 5
  seeds, without clipping in fp32 and with ``gradient_clip_val=1.0`` + bf16-mixed: the mean validation accuracy
  within 3 points of ``ddp``'s over the same seeds, and no run more than 10 points below ``ddp``'s run on the same
  seed; and a slice of the second ordinary script (issue 57: ``benchmarks/dropin_text.py``'s Transformer with AdamW
  and a linear warm-up), ADPSGD against ``ddp`` on two seeds under the same rule (the whole grid, both scripts, 10
  seeds, every strategy, is ``benchmarks/dropin_grid.py``).
* **Launched by Lightning**, once each: ``"selsync"`` re-runs the script (popen, a subprocess here: a popen launch
  from pytest would run pytest again), and the launching process is rank 0; ``"aladdin_spawn"`` from pytest, and the
  launching process reads what rank 0 had after fit (steps, epochs, callback state, the strategy's metrics).
"""

from __future__ import annotations

import json
import subprocess
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))  # spawned workers inherit sys.path, so they import it too

import dropin  # noqa: E402  (benchmarks/dropin.py: the user script)
import dropin_grid  # noqa: E402  (benchmarks/dropin_grid.py: the wide check's rule)
from launch import run_suite  # noqa: E402

WORLD = 2
#: the benchmark's length (benchmarks/dropin.py), on which the drop-in table is measured. Measured with
#: ``python benchmarks/dropin.py --world 2 --epochs E --seeds 0 1 2 3 4 5 6 7 8 9 --strategies
#: ddp,asp,ssp,aladdin,sync_switch`` (2026-11-23): at E = 4 the asynchronous rows ended 0.9-1.3 points below ddp on
#: average, with single-seed gaps up to 3.1 (validation) and 4.1 (test) points, so a one-run check against 3 points
#: failed about one CI run in ten (SSP, 3.1 points, in CI); at E = 6 their mean gap is 0.0-0.3 points and the
#: largest single-seed gap 1.1 points (validation and test).
EPOCHS = 6
INTERRUPT_AT = 3
#: validation accuracy at defaults must be within this of ddp's (the issue's "Done when"; 360 images: 1 = 0.28 pt)
MARGIN = 0.03
PARAMETER_SERVER = ("asp", "ssp", "aladdin", "sync_switch")
REFUSED = {"osp": "gradient clipping", **{n: "val_check_interval" for n in PARAMETER_SERVER}}
#: what may differ between an uninterrupted run and a resumed one: wall-clock time only. Every byte count must match,
#: the checkpoint's own messages and verify_sync's checks included (a checkpoint part counts its save's messages).
NOT_TRAJECTORY = ("blocked_s",)


def _digest(module: torch.nn.Module) -> str:
    """Bit-exact fingerprint of the floating-point parameters and buffers."""
    import hashlib

    h = hashlib.sha256()
    for value in module.state_dict().values():
        if value.is_floating_point():
            h.update(value.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------- worker side
def _sync_steps(trainer: Any) -> int | None:
    """The strategy's count of synchronised steps, where it keeps one (``None`` elsewhere)."""
    counter = getattr(trainer.strategy, "step_counter", None)
    return None if counter is None else counter.sync_steps


def _probe_class() -> Any:
    import lightning.pytorch as pl

    class EvalProbe(pl.Callback):
        """What validation ran on, and whether training continued from the replica it had before."""

        def __init__(self) -> None:
            self.during: list[str] = []
            self.restored: list[bool] = []
            self._before: str | None = None
            self._syncs: int | None = None
            self.claimed_epochs: list[int] | None = None

        def on_validation_start(self, trainer, pl_module):  # callbacks run before the strategy swaps the model in
            if trainer.state.fn == "fit":
                self._before = _digest(pl_module)
                self._syncs = _sync_steps(trainer)

        def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            if batch_idx == 0 and trainer.state.fn == "fit":
                self.during.append(_digest(pl_module))
                if self._syncs is not None and _sync_steps(trainer) != self._syncs:
                    # the strategy took a training sync at validation's start (SelSync's overlapped vote read there):
                    # validation saw the synced model, and training must continue from exactly that model
                    self._before = self.during[-1]

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if self._before is not None:
                self.restored.append(self._before == _digest(pl_module))
                self._before = None

        def on_train_end(self, trainer, pl_module):
            work = getattr(trainer.strategy, "_work", None)  # parameter-server strategies: the epochs claimed from
            self.claimed_epochs = sorted(work.claims) if work is not None else None

    return EvalProbe


def _suite(rank: int, out_dir: str) -> None:
    import lightning_sync  # noqa: F401  (registers the names)

    out = Path(out_dir)
    probe = _probe_class()
    results: dict[str, Any] = {}
    for name in ("ddp", *dropin.STRATEGIES):
        probes: list[Any] = []

        def make(probes: list[Any] = probes) -> list[Any]:
            probes.append(probe())
            return [probes[-1]]

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                res = dropin.run_user_script(
                    name, out / name, WORLD, epochs=EPOCHS, interrupt_at=INTERRUPT_AT, callbacks=make
                )
            except BaseException:  # the launcher reports the first rank to fail; say what failed on every rank
                traceback.print_exc()
                raise
        res["local_log_warnings"] = [str(w.message) for w in caught if "inside a training batch" in str(w.message)]
        res["during"] = [d for p in probes for d in p.during]
        res["restored"] = [r for p in probes for r in p.restored]
        res["claimed_epochs"] = [p.claimed_epochs for p in probes]
        results[name] = res
    results["exact_resume"] = _exact_resume(out / "exact", rank)
    (out / f"res_rank{rank}.json").write_text(json.dumps(results, default=str))


def _exact_resume(root: Path, rank: int) -> dict[str, Any]:
    """SelSync(delta="auto") with validation twice per epoch (the global model swapped in, checkpoints saved while it
    is): 3 epochs straight vs interrupted after 2 and resumed from last.ckpt."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_sync import SelSyncStrategy

    class AtEnd(pl.Callback):
        def on_train_end(self, trainer, pl_module):  # before the strategy's final average
            self.replica = _digest(pl_module)
            self.metrics = trainer.strategy.sync_metrics()
            self.calibrator = trainer.strategy.calibrator.state_dict()

    def fit(run: str, *extra: Any, ckpt_path: str | None = None) -> dict[str, Any]:
        pl.seed_everything(0, verbose=False)
        end = AtEnd()
        checkpoint = ModelCheckpoint(dirpath=str(root / run / "ckpt"), save_last=True)  # saves at every validation
        trainer = dropin.user_trainer(
            SelSyncStrategy(verify_sync=True), root / run, WORLD, 3, callbacks=[checkpoint, end, *extra]
        )
        model = dropin.ResNetish()
        trainer.fit(model, dropin.DigitsImages(), ckpt_path=ckpt_path)
        return {
            "replica": getattr(end, "replica", None),
            "model": _digest(model),
            "metrics": getattr(end, "metrics", None),
            "calibrator": getattr(end, "calibrator", None),
            "last": checkpoint.last_model_path,
            "global_step": trainer.global_step,
        }

    # directory names of equal length: Lightning broadcasts the checkpoint directory (counted bytes) at setup
    straight = fit("run_a")
    interrupted = fit("run_b", dropin._StopAfter(2))
    resumed = fit("run_b", ckpt_path=interrupted["last"])
    return {"straight": straight, "interrupted": interrupted, "resumed": resumed}


# ----------------------------------------------------------------------------------------------- tests: part 1
@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return run_suite(_suite, WORLD, tmp_path_factory.mktemp("dropin"))


def test_the_script_is_run_with_every_strategy_of_the_pack():
    from lightning_sync.strategies import STRATEGIES

    assert sorted(dropin.STRATEGIES) == sorted(cls.strategy_name for cls in STRATEGIES)


@pytest.mark.parametrize("name", dropin.STRATEGIES)
def test_trains_or_is_refused_at_setup_with_the_reason(suite, name):
    for r in suite:
        res = r[name]
        if name in REFUSED:
            assert res["refused"] is not None and REFUSED[name] in res["refused"], res["refused"]
            assert res["changed"], "the run was repeated with the change the message names"
        else:
            assert res["refused"] is None and not res["changed"]
        assert res["global_step"] > 0


@pytest.mark.parametrize("name", dropin.STRATEGIES)
def test_validation_accuracy_at_defaults_within_three_points_of_ddp(suite, name):
    ddp = suite[0]["ddp"]
    for r in suite:
        res = r[name]
        assert res["val_acc"] >= ddp["val_acc"] - MARGIN, (name, res["val_acc"], ddp["val_acc"])
        assert res["test_acc"] >= ddp["test_acc"] - MARGIN, (name, res["test_acc"], ddp["test_acc"])
    assert suite[0][name]["val_acc"] == suite[1][name]["val_acc"]  # one value on every rank


@pytest.mark.parametrize("name", ("ddp", *dropin.STRATEGIES))
def test_predict_returns_this_ranks_predictions_and_checkpoints_hold_the_validated_model(suite, name):
    for r in suite:
        res = r[name]
        assert res["predictions"] == 180  # the 360 test images split over 2 ranks, as with ddp
        # validate() and test() after fit see the model fit handed back; "best" is the model whose val_acc was best
        assert res["validate_acc"] == pytest.approx(res["val_acc"], abs=1e-6)
        assert res["best_validate_acc"] == pytest.approx(res["best_val_acc"], abs=1e-6)


@pytest.mark.parametrize("name", ("ddp", *dropin.STRATEGIES))
def test_resume_from_last_ckpt_continues_at_its_epoch_and_step(suite, name):
    for r in suite:
        res = r[name]
        saved, start = res["resumed_from"], res["resume_start"]
        assert start["global_step"] == saved["global_step"]
        if saved["epoch_complete"]:
            assert (start["epoch"], start["batch_idx"]) == (saved["epoch"] + 1, 0)
        else:
            assert (start["epoch"], start["batch_idx"]) == (saved["epoch"], saved["batches_done_in_epoch"])
        assert res["global_step"] > saved["global_step"] and res["epoch"] <= EPOCHS  # and it trained on from there
        if name in PARAMETER_SERVER:
            # the dynamic loader trains the resumed epoch's data: its shuffle and counter, not epoch 0's (SSP hung)
            # (Sync-Switch's BSP phase assigns positions without the counter, so only its ASP epochs appear)
            interrupted, resumed = res["claimed_epochs"][-2:]
            assert interrupted and set(interrupted) <= set(range(INTERRUPT_AT))
            assert resumed and set(resumed) <= set(range(start["epoch"], EPOCHS))


@pytest.mark.parametrize("name", dropin.STRATEGIES)
def test_validation_evaluates_one_model_on_every_rank_and_puts_each_replica_back(suite, name):
    a, b = suite[0][name], suite[1][name]
    assert a["during"] and a["during"] == b["during"], "ranks validated different models"
    if name != "osp":  # OSP applies its in-flight gradients when validation starts (its replicas never differ)
        assert a["restored"] and all(a["restored"]) and all(b["restored"]), "validation changed a rank's replica"
    if name in ("selsync", "localsgd", "fedavg", "adpsgd"):
        assert a["metrics"]["bytes_eval"] > 0  # the average for evaluation is counted under its own tag


@pytest.mark.parametrize("name", PARAMETER_SERVER)
def test_per_step_sync_dist_logs_under_asynchronous_strategies_warn_once(suite, name):
    warned = suite[0][name]["local_log_warnings"]  # rank_zero_warn: rank 0 only
    assert len([w for w in warned if "'train_loss'" in w]) == 2  # once per fit: the interrupted one and the resumed one
    assert "on_epoch=True" in warned[0]
    assert not suite[0]["selsync"]["local_log_warnings"]


def test_selsync_auto_resume_with_the_global_model_swapped_in_is_bit_identical(suite):
    for r in suite:
        exact = r["exact_resume"]
        straight, resumed = exact["straight"], exact["resumed"]
        assert resumed["global_step"] == straight["global_step"]
        assert resumed["replica"] == straight["replica"] and resumed["model"] == straight["model"]
        assert resumed["calibrator"] == straight["calibrator"]
        trajectory = {k: v for k, v in straight["metrics"].items() if k not in NOT_TRAJECTORY}
        assert {k: resumed["metrics"][k] for k in trajectory} == trajectory
        assert straight["metrics"]["bytes_eval"] > 0 and 0 < straight["metrics"]["lssr"] < 1


# ----------------------------------------------------------------------------------------------- tests: part 3
#: the ordinary-model check (issue 51): the user script's length where DiLoCo's and SelSync's defaults fell behind
ORDINARY_EPOCHS = 3
ORDINARY_SEEDS = (0, 1, 2, 3, 4)
#: no clipping in fp32, and the script's own gradient_clip_val=1.0 + bf16-mixed (benchmarks/dropin.py CONFIGS)
ORDINARY_CONFIGS = ("fp32", "clip+bf16")
#: the mean over the seeds within this of ddp's mean (the issue's goal). The seeds are fixed, but another machine's
#: arithmetic amounts to new seeds, and the asynchronous rows also follow how the OS paces the ranks (push and claim
#: order): CI's run of 2026-12-03 had ALADDIN at 0.75 on seed 0 against ddp's 0.93, as a fast rank's own-count
#: OneCycle running ahead of the data did here (benchmarks/dropin.py --straggler 4: 7.4-15.0 points below ddp's mean);
#: the per-step schedule has followed the data since (lr_pace="global"). Measured over seeds 0-9 (benchmarks/dropin.py
#: --world 2 --seeds 0 ... 9 --epochs 3 --config fp32 clip+bf16 --fit-only, then --analyse, 2026-12-03): none of the
#: 252 five-seed subsets fails any of the 22 checks, the worst is 2.68 points below (DiLoCo, clip+bf16), and a normal
#: estimate from the per-seed spread gives 1.2% for any check failing on a new draw of seeds; see
#: docs/results/other.md, "Defaults on an ordinary model"
ORDINARY_MARGIN = 0.03
#: the strategies this check runs in CI: all but BSP and OSP, the synchronous ones (every rank applies every step's
#: gradients; within 0.6 points of ddp's mean in every script and configuration measured over 10 seeds). Leaving them
#: out (20 fits) pays for the Transformer slice below (4 fits of twice the steps, bf16 on the CPU); the grid of
#: benchmarks/dropin_grid.py keeps every strategy
ORDINARY_STRATEGIES = tuple(n for n in dropin.STRATEGIES if n not in ("bsp", "osp"))
#: no run more than this below ddp's run on the same seed (issue 57's rule; a collapse: SelSync ended at 0.28-0.37 in
#: issue 51, ADPSGD 18 points below ddp on one seed in issue 57)
COLLAPSE_MARGIN = 0.10
#: the second ordinary script's slice (issue 57): benchmarks/dropin_text.py's Transformer (AdamW + linear warm-up),
#: the grid's length (benchmarks/dropin_grid.py: 3 epochs of 32 steps per rank), ADPSGD against ddp on two seeds in
#: TEXT_CONFIG. The whole grid (both scripts, both configurations, 10 seeds, every strategy) is the benchmark's:
#: docs/results/other.md, "Two scripts, ten seeds"
TEXT_SEEDS = (0, 1)
TEXT_CONFIG = "clip+bf16"
TEXT_STRATEGIES = ("ddp", "adpsgd")
#: OSP under AdamW on the Transformer script, fp32: at this seed its ranks picked different layers (the approximate
#: correction leaves the replicas' parameters, hence |g w|, different) and gloo aborted on mismatched all-reduces
#: before the importance was averaged over ranks (issue 57's grid). On this machine's arithmetic; elsewhere the run
#: may not reach a disagreement, and then it only trains
OSP_ADAMW_SEED = 4
#: the changes REFUSED's refusals name (benchmarks/dropin.py ADAPTATIONS), made up front: no refused setup to pay
UP_FRONT = {"osp": {"gradient_clip_val": None}, **{n: {"val_check_interval": 1.0} for n in PARAMETER_SERVER}}


def _ordinary(rank: int, out_dir: str) -> None:
    """Every strategy on the ordinary model, seeds x configurations, fit only (val_acc of the last validation)."""
    import lightning_sync  # noqa: F401  (registers the names)

    warnings.filterwarnings("ignore")
    out = Path(out_dir)
    results: dict[str, dict[str, list[float]]] = {}
    for config in ORDINARY_CONFIGS:
        results[config] = {}
        for seed in ORDINARY_SEEDS:
            for name in ("ddp", *ORDINARY_STRATEGIES):
                # what the strategy's refusal at setup asks for (tested in part 1), applied up front
                overrides = {**dropin.CONFIGS[config], **UP_FRONT.get(name, {})}
                res = dropin.run_user_script(
                    name,
                    out / config / f"{name}_s{seed}",
                    WORLD,
                    epochs=ORDINARY_EPOCHS,
                    seed=seed,
                    trainer_overrides=overrides,
                    evaluate=False,
                )
                results[config].setdefault(name, []).append(res["val_acc"])
    results["text"] = {}
    for seed in TEXT_SEEDS:
        for name in TEXT_STRATEGIES:
            res = dropin.run_user_script(
                name,
                out / "text" / f"{name}_s{seed}",
                WORLD,
                epochs=dropin_grid.EPOCHS,
                seed=seed,
                trainer_overrides={**dropin.CONFIGS[TEXT_CONFIG], **UP_FRONT.get(name, {})},
                batch_size=dropin_grid.BATCH,
                evaluate=False,
                script="transformer",
            )
            results["text"].setdefault(name, []).append(res["val_acc"])
    res = dropin.run_user_script(
        "osp",
        out / "text" / "osp_adamw",
        WORLD,
        epochs=dropin_grid.EPOCHS,
        seed=OSP_ADAMW_SEED,
        trainer_overrides=dropin.CONFIGS["fp32"],
        batch_size=dropin_grid.BATCH,
        evaluate=False,
        script="transformer",
    )
    results["osp_adamw"] = {"val_acc": res["val_acc"], "global_step": res["global_step"]}
    (out / f"res_rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def ordinary(tmp_path_factory):
    return run_suite(_ordinary, WORLD, tmp_path_factory.mktemp("ordinary"))


@pytest.mark.parametrize("config", ORDINARY_CONFIGS)
@pytest.mark.parametrize("name", ORDINARY_STRATEGIES)
def test_on_an_ordinary_model_the_mean_over_seeds_is_within_three_points_of_ddp(ordinary, name, config):
    results = ordinary[0][config]
    ddp, mine = results["ddp"], results[name]
    assert len(mine) == len(ddp) == len(ORDINARY_SEEDS)
    gap = sum(mine) / len(mine) - sum(ddp) / len(ddp)
    assert gap >= -ORDINARY_MARGIN, (name, config, [round(v, 4) for v in mine], [round(v, 4) for v in ddp])
    assert ordinary[1][config][name] == mine  # one value on every rank


@pytest.mark.parametrize("config", ORDINARY_CONFIGS)
@pytest.mark.parametrize("name", ORDINARY_STRATEGIES)
def test_on_an_ordinary_model_no_seed_falls_ten_points_below_ddps_same_seed(ordinary, name, config):
    results = ordinary[0][config]
    gaps = [mine - ddp for mine, ddp in zip(results[name], results["ddp"])]
    assert min(gaps) >= -COLLAPSE_MARGIN, (name, config, [round(v, 4) for v in results[name]], results["ddp"])


@pytest.mark.parametrize(
    "gaps,passes",
    [
        ((-0.029, -0.029), True),  # mean 2.9 points below
        ((-0.031, -0.031), False),  # mean 3.1 points below
        ((0.079, -0.099), True),  # one seed 9.9 points below, the mean 1 point below
        ((0.081, -0.101), False),  # one seed 10.1 points below, the mean 1 point below
    ],
)
def test_the_wide_checks_rule_fails_on_the_mean_or_on_one_seed(gaps, passes):
    rows = [{"script": "s", "config": "c", "strategy": "ddp", "seed": seed, "val_acc": 0.8} for seed in (0, 1)]
    rows += [{"script": "s", "config": "c", "strategy": "x", "seed": s, "val_acc": 0.8 + g} for s, g in enumerate(gaps)]
    (verdict,) = dropin_grid.verdicts(rows)
    assert verdict["passes"] is passes and verdict["seeds"] == 2


def test_osp_under_adamw_trains_on_layers_every_rank_agrees_on(ordinary):
    for r in ordinary:
        assert r["osp_adamw"]["global_step"] == 96 and r["osp_adamw"]["val_acc"] > 0.2


def test_on_a_small_transformer_adpsgd_keeps_ddps_accuracy(ordinary):
    """The rule of benchmarks/dropin_grid.py on the Transformer script's slice: the mean within 3 points of ddp's,
    no seed more than 10 points below ddp's same seed."""
    results = ordinary[0]["text"]
    ddp, mine = results["ddp"], results["adpsgd"]
    assert len(mine) == len(ddp) == len(TEXT_SEEDS) and 0.2 < min(ddp)  # the script learns (chance: 1/103)
    verdict = dropin_grid.verdicts(
        [
            {"script": "transformer", "config": TEXT_CONFIG, "strategy": name, "seed": seed, "val_acc": acc}
            for name in TEXT_STRATEGIES
            for seed, acc in zip(TEXT_SEEDS, results[name])
        ]
    )
    assert [v["passes"] for v in verdict] == [True], (verdict, mine, ddp)
    assert ordinary[1]["text"]["adpsgd"] == mine  # one value on every rank


# ----------------------------------------------------------------------------------------------- tests: part 2
def test_popen_launch_runs_the_script_again_and_the_launching_process_is_rank_0(tmp_path):
    log = tmp_path / "script.log"
    with log.open("w") as f:
        code = subprocess.run(
            [sys.executable, str(BENCHMARKS / "dropin.py"), "script", "--strategy", "selsync", "--out", str(tmp_path)],
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=400,
        ).returncode
    assert code == 0, log.read_text()[-3000:]
    outside = json.loads((tmp_path / "launcher.json").read_text())
    inside = [json.loads((tmp_path / f"inside_rank{r}.json").read_text()) for r in range(WORLD)]
    assert outside["pid"] == inside[0]["pid"] != inside[1]["pid"]
    assert {k: v for k, v in outside.items() if k != "predictions"} == inside[0]
    assert outside["predictions"] == 180 and outside["global_step"] > 0 and outside["best_model_score"] is not None


def test_spawn_launch_ships_rank_0s_results_to_the_launching_process(tmp_path):
    trainer = dropin.user_trainer("aladdin_spawn", tmp_path, WORLD, 2, val_check_interval=1.0)
    trainer.callbacks.append(dropin.RecordInside(str(tmp_path)))
    model, data = dropin.ResNetish(), dropin.DigitsImages()
    trainer.fit(model, data)  # the model logs train_loss with sync_dist=True every step: a warning, not an error
    inside = json.loads((tmp_path / "inside_rank0.json").read_text())
    outside = dropin.launcher_view(trainer)
    assert outside["pid"] != inside["pid"]
    assert {k: v for k, v in outside.items() if k != "pid"} == {k: v for k, v in inside.items() if k != "pid"}
    assert outside["global_step"] > 0 and outside["current_epoch"] == 2 and outside["best_model_score"] is not None
    assert outside["server_summary"]["pushes"] > 0 and outside["sync_metrics"]["bytes_push"] > 0
    with pytest.raises(RuntimeError, match="not available in the launching process after a spawn launch"):
        _ = trainer.strategy.comm


def test_spawn_predict_says_that_predictions_do_not_come_back(monkeypatch):
    from types import SimpleNamespace

    from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
    from lightning.pytorch.trainer.states import TrainerFn

    from lightning_sync.strategies.launcher import SyncLauncher

    monkeypatch.setattr(_MultiProcessingLauncher, "launch", lambda self, *a, **kw: None)
    launcher = SyncLauncher.__new__(SyncLauncher)
    launcher._start_method = "spawn"
    trainer = SimpleNamespace(state=SimpleNamespace(fn=TrainerFn.PREDICTING))
    with pytest.warns(UserWarning, match="trainer.predict returns None with start_method='spawn'"):
        assert launcher.launch(lambda: None, trainer=trainer) is None
