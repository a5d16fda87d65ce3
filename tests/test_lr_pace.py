"""lightning_sync.strategies.lr_pace without processes: the step a global-pace schedule is at, and its wrapper."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_sync import ALADDINStrategy, ASPStrategy, SSPStrategy, SyncSwitchStrategy
from lightning_sync.strategies.lr_pace import GlobalPaceScheduler, paced_steps


def _one_cycle(total: int = 40) -> torch.optim.lr_scheduler.OneCycleLR:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=total)
    opt.step()  # as in training: the optimizer steps before its schedule
    return sched


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_at_equal_pace_the_paced_step_is_each_ranks_own_count(world):
    for k in range(7):  # a rank's k-th batch of the epoch sits at k * world + j for some j in the round
        for j in range(world):
            assert paced_steps(0, k * world + j, world) == k + 1
            assert paced_steps(5 * world * 3, k * world + j, world) == 5 * 3 + k + 1  # after 3 epochs of 5 rounds


def test_the_paced_step_is_ddps_after_the_same_data_with_accumulation():
    # 2 ranks, 2 batches a step: DDP's optimizer steps after b batches are ceil(b / 4); after an epoch of 10, 3
    assert [paced_steps(0, p, 2, accumulation=2) for p in range(10)] == [math.ceil((p + 1) / 4) for p in range(10)]
    assert paced_steps(10, 9, 2, accumulation=2) == 5


def test_the_wrapper_advances_to_the_target_none_ahead_several_behind():
    plain, wrapped = _one_cycle(), _one_cycle()
    target = {"t": None}
    paced = GlobalPaceScheduler(wrapped, lambda: target["t"])
    steps = [3, 3, 2, 7, 8, 8, 20]  # a rank behind (catches up), level, ahead (holds)
    done = 0
    for t in steps:
        target["t"] = t
        paced.step()
        while done < max(t, done):
            plain.step()
            done += 1
        assert paced.last_epoch == done and paced.get_last_lr() == plain.get_last_lr()
        assert paced.optimizer.param_groups[0]["lr"] == plain.optimizer.param_groups[0]["lr"]
    target["t"] = None  # not known: one step, as Lightning's own call
    paced.step()
    plain.step()
    assert paced.last_epoch == plain.last_epoch == 21 and paced.get_last_lr() == plain.get_last_lr()


def test_the_wrapper_saves_and_restores_the_users_scheduler_state_unchanged():
    inner = _one_cycle()
    paced = GlobalPaceScheduler(inner, lambda: 5)
    paced.step()
    assert paced.state_dict() == inner.state_dict() and paced.state_dict()["last_epoch"] == 5
    fresh = _one_cycle()
    GlobalPaceScheduler(fresh, lambda: None).load_state_dict(paced.state_dict())
    assert fresh.last_epoch == 5 and fresh.get_last_lr() == inner.get_last_lr()


def test_a_call_with_arguments_is_passed_through():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
    paced = GlobalPaceScheduler(plateau, lambda: 100)
    paced.step(1.0)
    paced.step(2.0)  # worse: the rate halves, the target is not consulted
    assert opt.param_groups[0]["lr"] == 0.5 and plateau.last_epoch == 2


def test_a_scheduler_without_a_step_count_is_refused_naming_the_alternative():
    class Counterless:
        def step(self) -> None: ...

    with pytest.raises(ValueError, match="lr_pace='local'"):
        GlobalPaceScheduler(Counterless(), lambda: 1)


@pytest.mark.parametrize("cls", [ASPStrategy, SSPStrategy, ALADDINStrategy, SyncSwitchStrategy])
def test_lr_pace_defaults_to_global_and_a_bad_value_names_the_argument(cls):
    assert cls().lr_pace == "global" and cls(lr_pace="local").lr_pace == "local"
    with pytest.raises(ValueError, match="lr_pace must be 'global'.*'local'.*got 'server'"):
        cls(lr_pace="server")
