"""The bucketed, overlapped gradient all-reduce (``lightning_sync.comm.buckets``) in-process: the bucket plan, the
bytes it sends, and the launch logic driven by real autograd hooks with a recording launcher (no processes).

The two-process behaviour — equal to Lightning's DDP, the first bucket in flight before backward ends, unused
parameters, accounting — is in ``tests/test_overlap.py``.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch import nn

from lightning_sync.comm import CommHandle, CommStats, FlatState
from lightning_sync.comm.buckets import GradBuckets, bucket_bytes, check_bucket_cap_mb, plan_buckets
from lightning_sync.comm.cost import gloo_ring_allreduce_bytes
from lightning_sync.models import DigitsCNN

MIB = 1024 * 1024


def _numels(model: nn.Module) -> list[int]:
    return [p.numel() for p in model.parameters()]


def test_one_bucket_per_parameter_in_reverse_registration_order():
    model = DigitsCNN()
    flat = FlatState(model)
    buckets = plan_buckets(flat, 1e-9)  # every parameter is over the cap: a bucket of its own
    n = len(_numels(model))
    assert [b.params for b in buckets] == [(i,) for i in reversed(range(n))]
    g = flat.groups[0]
    # contiguous slices that tile the whole buffer; the first (the last-registered parameter) carries the buffers
    assert buckets[0].stop == g.grads.numel() == g.param_numel + g.buffer_numel and g.buffer_numel > 0
    assert [b.carries_buffers for b in buckets] == [True] + [False] * (n - 1)
    for later, earlier in zip(buckets, buckets[1:]):
        assert earlier.stop == later.start
    assert buckets[-1].start == 0
    assert [b.numel for b in buckets[1:]] == list(reversed(_numels(model)))[1:]


def test_one_bucket_for_the_whole_model():
    model = DigitsCNN()
    flat = FlatState(model)
    (bucket,) = plan_buckets(flat, 25.0)
    assert (bucket.start, bucket.stop) == (0, flat.numel()) and bucket.carries_buffers
    assert bucket.params == tuple(reversed(range(len(_numels(model)))))


@pytest.mark.parametrize("cap_mb", [0.001, 0.01, 0.05, 0.1])
def test_ddp_rule_whole_parameters_until_the_cap_is_reached(cap_mb):
    model = DigitsCNN()
    flat = FlatState(model)
    sizes = [4 * n for n in _numels(model)]
    buckets = plan_buckets(flat, cap_mb)
    cap = cap_mb * MIB
    for b in buckets:
        held = [sizes[i] for i in b.params]
        assert list(b.params) == sorted(b.params, reverse=True)
        assert sum(held[:-1]) < cap  # not closed before its last parameter ...
        assert sum(held) >= cap or b.params[-1] == 0  # ... which reached the cap (or the model's first)
    assert sorted(i for b in buckets for i in b.params) == list(range(len(sizes)))


class _Mixed(nn.Module):
    """Parameters of two dtypes, registered interleaved: two flat groups."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4).double()
        self.c = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4).double()


def test_buckets_over_groups_follow_reverse_registration_order():
    model = _Mixed()
    flat = FlatState(model)
    assert len(flat.groups) == 2
    buckets = plan_buckets(flat, 1e-9)
    order = [b.params[0] for b in buckets]
    assert order == sorted(order, reverse=True) == list(reversed(range(8)))
    # each group's buffer tail rides with that group's last-registered parameter
    carriers = [(b.group, b.params) for b in buckets if b.carries_buffers]
    assert carriers == [(1, (7,))]  # bn.bias (float64 group, which also holds bn's running statistics)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_bytes_per_bucket_and_in_total(world):
    """Each bucket sends gloo's ring count for its own size; together that is one all-reduce of the whole buffer,
    exactly on 2 ranks and within gloo's segment rounding otherwise (every all-reduce's count is within 2(N-1)
    elements of 2(N-1)B/N, so k buckets differ from one all-reduce by at most 2(N-1)(k+1) elements)."""
    model = DigitsCNN()
    flat = FlatState(model)
    rng = random.Random(world)
    for cap in (1e-9, 0.01, 0.05, 25.0, rng.uniform(0.001, 0.2)):
        buckets = plan_buckets(flat, cap)
        for rank in range(world):
            per_bucket = bucket_bytes(flat, buckets, world, rank, "gloo")
            assert per_bucket == [gloo_ring_allreduce_bytes(b.numel, 4, world, rank) for b in buckets]
            whole = gloo_ring_allreduce_bytes(flat.numel(), 4, world, rank)
            if world == 2:
                assert per_bucket == [4 * b.numel for b in buckets] and sum(per_bucket) == whole == 4 * flat.numel()
            else:
                for b, sent in zip(buckets, per_bucket):
                    assert abs(sent - 2 * (world - 1) / world * 4 * b.numel) <= 2 * (world - 1) * 4
                assert abs(sum(per_bucket) - whole) <= 2 * (world - 1) * 4 * (len(buckets) + 1)


def test_bucket_cap_mb_validation():
    assert check_bucket_cap_mb(None) is None
    assert check_bucket_cap_mb(25) == 25.0
    for bad in (0, -1.0, math.nan, math.inf, True, "25"):
        with pytest.raises(ValueError, match=r"bucket_cap_mb must be a number in \(0.0, inf\)"):
            check_bucket_cap_mb(bad)


# ------------------------------------------------------------------------------------ launch logic, real autograd
class _Recorder:
    """A launch function that records what it was given and returns a completed handle."""

    def __init__(self) -> None:
        self.launched: list[tuple[int, int]] = []  # (first element offset, numel) of each launched slice
        self.events: list[str] = []

    def __call__(self, tensor: torch.Tensor) -> CommHandle:
        base = tensor._base if tensor._base is not None else tensor
        self.launched.append((tensor.storage_offset() - base.storage_offset(), tensor.numel()))
        self.events.append(f"launch{len(self.launched) - 1}")
        return CommHandle(None, CommStats(), "grads")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(3, 5)
        self.l2 = nn.Linear(5, 5)
        self.l3 = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor, skip_l2: bool = False) -> torch.Tensor:
        h = torch.relu(self.l1(x))
        if not skip_l2:
            h = torch.relu(self.l2(h))
        return self.l3(h)


def _backward(net: nn.Module, flat: FlatState, **kw) -> None:
    flat.bind_grads()
    net(torch.randn(4, 3), **kw).sum().backward()


def test_buckets_launch_during_backward_in_plan_order():
    torch.manual_seed(0)
    net = _Net()
    flat = FlatState(net)
    gb = GradBuckets(flat, 1e-9)  # one bucket per parameter
    rec = _Recorder()
    for i, p in enumerate(net.parameters()):
        p.register_post_accumulate_grad_hook(lambda _, i=i: rec.events.append(f"grad{i}"))
    gb.arm(rec)
    _backward(net, flat)
    assert gb.launched_during_backward == len(gb.buckets) == 6
    # bucket k is launched right when its parameter's gradient is ready (our hook was registered first)
    assert [(b.start, b.numel) for b in gb.buckets] == rec.launched
    # each parameter's bucket goes out from its hook, in the middle of backward (ours runs before the test's)
    assert rec.events == [e for k in range(6) for e in (f"launch{k}", f"grad{5 - k}")]
    gb.finish()
    assert not gb.armed


def test_unused_parameter_launches_its_bucket_after_backward_without_hanging():
    torch.manual_seed(0)
    net = _Net()
    flat = FlatState(net)
    gb = GradBuckets(flat, 1e-9)
    rec = _Recorder()
    gb.arm(rec)
    _backward(net, flat, skip_l2=True)
    # l3 (params 5, 4) went out during backward; l2 (3, 2) got no gradient, so neither it nor anything after it
    # in the fixed order (l1: 1, 0) may go before it: same order on every rank
    assert gb.launched_during_backward == 2
    out = gb.finish()
    assert len(rec.launched) == 6 and gb.used == set()
    assert torch.equal(net.l2.weight.grad, torch.zeros_like(net.l2.weight))  # zeros were sent for it
    assert out[0].data_ptr() == flat.groups[0].grads.data_ptr()


def test_accumulation_only_the_armed_backward_launches():
    torch.manual_seed(0)
    net = _Net()
    flat = FlatState(net)
    gb = GradBuckets(flat, 1e-9)
    rec = _Recorder()
    _backward(net, flat)  # a micro-batch that does not step: hooks only record use
    assert rec.launched == [] and gb.used == set(range(6))
    gb.arm(rec)
    net(torch.randn(4, 3)).sum().backward()  # the stepping micro-batch: accumulates, then launches
    assert gb.launched_during_backward == 6
    gb.finish()


def test_second_gradient_after_launch_is_an_error_naming_the_parameter():
    torch.manual_seed(0)
    net = _Net()
    flat = FlatState(net)
    names = {i: n for i, (n, _) in enumerate(net.named_parameters())}
    gb = GradBuckets(flat, 1e-9, names)
    gb.arm(_Recorder())
    flat.bind_grads()
    loss = net(torch.randn(4, 3)).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"'l3.bias' \(parameter 5\) received a second gradient"):
        loss.backward()
    gb.abandon()
    assert not gb.armed


def test_arm_twice_without_finish_is_an_error():
    net = _Net()
    gb = GradBuckets(FlatState(net), 25.0)
    gb.arm(_Recorder())
    with pytest.raises(RuntimeError, match="neither finished nor abandoned"):
        gb.arm(_Recorder())
    gb.remove()


def test_buffers_travel_in_the_bucket_that_ends_the_buffer():
    torch.manual_seed(0)
    model = DigitsCNN()
    model.train()
    flat = FlatState(model)
    gb = GradBuckets(flat, 1e-9)
    g = flat.groups[0]
    seen: list[torch.Tensor] = []

    def launch(tensor: torch.Tensor) -> CommHandle:
        if tensor.numel() and tensor.data_ptr() + tensor.numel() * 4 == g.grads.data_ptr() + g.grads.numel() * 4:
            seen.append(tensor[-g.buffer_numel :].clone())  # what the bucket carries of the buffers at launch
            tensor[-g.buffer_numel :].mul_(0.5)  # stand-in for the average: must come back to the buffers
        return CommHandle(None, CommStats(), "grads")

    gb.arm(launch)
    flat.bind_grads()
    model(torch.randn(8, 1, 8, 8)).sum().backward()
    staged = g.buffers.clone()
    gb.finish()
    assert len(seen) == 1 and torch.equal(seen[0], staged)  # staged after the forward updated them
    assert torch.equal(g.buffers, staged * 0.5)
