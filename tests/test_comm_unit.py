"""In-process tests of the comm layer's pure parts: wire-byte formulas, link model, flat buffers."""

import math

import pytest
import torch
from torch import nn

from lightning_sync.comm import CommStats, FlatState, LinkModel
from lightning_sync.comm.cost import (
    allgather_bytes,
    allreduce_bytes,
    broadcast_bytes,
    gloo_ring_allreduce_bytes,
    ring_allreduce_bytes,
)


@pytest.mark.parametrize("numel", [1, 2, 3, 7, 100, 1001, 24_000, 123_457])
def test_gloo_ring_two_ranks_sends_exactly_the_buffer(numel):
    for rank in (0, 1):
        assert gloo_ring_allreduce_bytes(numel, 4, 2, rank) == 4 * numel


@pytest.mark.parametrize("n", [3, 4, 5, 8])
def test_gloo_ring_matches_textbook_formula_when_divisible(n):
    numel = 2 * n * 1000
    for rank in range(n):
        assert gloo_ring_allreduce_bytes(numel, 4, n, rank) == 2 * (n - 1) * numel * 4 // n
        assert ring_allreduce_bytes(numel, 4, n) == 2 * (n - 1) * numel * 4 // n


@pytest.mark.parametrize("n,numel", [(3, 10), (4, 1001), (5, 7), (8, 3), (6, 99_999)])
def test_gloo_ring_total_is_each_chunk_forwarded_n_minus_1_times_per_phase(n, numel):
    total = sum(gloo_ring_allreduce_bytes(numel, 4, n, r) for r in range(n))
    assert total == 2 * (n - 1) * numel * 4


def test_single_rank_sends_nothing():
    assert allreduce_bytes(1000, 4, 1, 0, "gloo") == 0
    assert allreduce_bytes(1000, 4, 1, 0, "nccl") == 0
    assert broadcast_bytes(1000, 1, 0, 0) == 0
    assert allgather_bytes(1000, 1) == 0


@pytest.mark.parametrize("n", [2, 3, 4, 5, 7, 8])
@pytest.mark.parametrize("src", [0, 1])
def test_binomial_broadcast_sends_every_rank_one_copy(n, src):
    per_rank = [broadcast_bytes(100, n, r, src) for r in range(n)]
    assert sum(per_rank) == (n - 1) * 100
    assert per_rank[src] == 100 * math.ceil(math.log2(n))


def test_link_clock_shares_the_link_between_concurrent_transfers():
    from lightning_sync.comm import LinkClock

    link = LinkModel("1gbit", "1ms")
    mb10 = 1_250_000  # 10 Mbit: 10 ms alone at 1 Gbit/s
    # a lone transfer costs exactly the link model's delay
    clock = LinkClock(link)
    a = clock.start(mb10, now=5.0)
    assert clock.completion(a, now=5.0) == pytest.approx(5.0 + link.delay(mb10))
    # two launched together share the bandwidth: both complete after 20 ms (+ latency), not 10
    clock = LinkClock(link)
    a, b = clock.start(mb10, now=100.0), clock.start(mb10, now=100.0)
    assert clock.completion(a, now=100.0) == pytest.approx(100.021)
    assert clock.completion(b, now=100.0) == pytest.approx(100.021)
    # a second one starting halfway through the first: the first's projection is pushed back, exactly
    clock = LinkClock(link)
    a = clock.start(mb10, now=0.0)
    assert clock.completion(a, now=0.0) == pytest.approx(0.011)
    b = clock.start(mb10, now=0.005)  # a has 5 Mbit left; both at 0.5 Gbit/s: a done at 0.015, b alone after
    assert clock.completion(a, now=0.005) == pytest.approx(0.015 + 0.001)
    assert clock.completion(b, now=0.005) == pytest.approx(0.020 + 0.001)
    assert clock.completion(a, now=0.5) == pytest.approx(0.016)  # exact once done
    # a tiny flag during a long transfer is not stuck behind it
    clock = LinkClock(link)
    big = clock.start(125_000_000, now=0.0)  # 1 s alone
    flag = clock.start(4, now=0.1)
    assert clock.completion(flag, now=0.1) < 0.1 + 0.0011
    assert clock.completion(big, now=0.1) == pytest.approx(1.001, abs=1e-6)
    # nothing to send: latency only
    assert clock.completion(clock.start(0, now=2.0), now=2.0) == pytest.approx(2.001)


def test_link_model_parsing_and_delay():
    link = LinkModel(bandwidth="1gbit", latency="1ms")
    assert link.bits_per_second == 1e9
    assert link.latency_seconds == pytest.approx(1e-3)
    assert link.delay(125_000_000) == pytest.approx(1.001)  # 1 Gbit of payload + 1 ms
    assert LinkModel("10Gbps", "250us").delay(0) == pytest.approx(250e-6)
    assert LinkModel("125MB").bits_per_second == 1e9
    assert LinkModel.parse("100mbit,2ms") == LinkModel("100mbit", "2ms")
    for bad in ["fast", "-1gbit", "0mbit", "1 gbitz"]:
        with pytest.raises(ValueError, match="bandwidth"):
            LinkModel(bandwidth=bad)
    with pytest.raises(ValueError, match="latency"):
        LinkModel(latency="-1ms")
    with pytest.raises(ValueError, match="link"):
        LinkModel.parse("1gbit,1ms,extra")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 6 * 6, 3)
        self.frozen = nn.Parameter(torch.ones(5), requires_grad=False)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1)) + self.frozen.sum()


def test_flat_state_views_and_grads():
    torch.manual_seed(0)
    net = Net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    flat = FlatState(net)
    (group,) = flat.groups
    # values preserved, parameters and float buffers are views of one buffer
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k
    n_params = sum(p.numel() for p in net.parameters())
    n_buffers = net.bn.running_mean.numel() + net.bn.running_var.numel()
    assert group.state.numel() == n_params + n_buffers
    assert all(p.data_ptr() >= group.state.data_ptr() for p in net.parameters())
    assert net.bn.running_mean.data_ptr() == group.state[n_params:].data_ptr()
    # BatchNorm updates its running stats in place: the flat buffer sees it
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        flat.bind_grads()
        net(torch.randn(8, 1, 8, 8)).pow(2).mean().backward()
        assert flat.grads_bound()
        expected = sum(p.grad.pow(2).sum() for p in net.parameters() if p.grad is not None)
        assert float(flat.grad_sq_norm()) == pytest.approx(float(expected), rel=1e-5)
        opt.step()
    assert torch.equal(group.state[n_params : n_params + 4], net.bn.running_mean)
    assert net.frozen.grad is None  # frozen parameters never receive a gradient view
    # an optimizer step writes through the views
    w = net.conv.weight
    offset = (w.data_ptr() - group.state.data_ptr()) // w.element_size()
    assert torch.equal(group.state[offset : offset + w.numel()], w.detach().reshape(-1))


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_dropped_gradients_make_the_next_optimizer_step_leave_parameters_and_state_as_they_were(optimizer):
    """What a fault-tolerant BSP step that did not commit does (``FaultTolerantTopology.average_grads``): the
    optimizer's step changes nothing — parameters, momentum, weight decay, Adam's moments and step count — and the next
    backward binds the gradients to the flat buffer again."""
    torch.manual_seed(0)
    net = Net()
    flat = FlatState(net)
    make = {
        "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-2),
        "adamw": lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=1e-2),
    }[optimizer]
    opt = make(net.parameters())

    def step() -> None:
        opt.zero_grad()
        flat.bind_grads()
        net(torch.randn(8, 1, 8, 8)).pow(2).mean().backward()

    step()
    opt.step()  # state exists (momentum buffers, moments)
    params = [p.detach().clone() for p in net.parameters()]
    state = [{k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()} for p in net.parameters()]
    step()
    flat.drop_grads()
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, net.parameters()))
    for before, p in zip(state, net.parameters()):
        assert before.keys() == opt.state[p].keys()
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(opt.state[p][k])) for k, v in before.items())
    step()  # bound again: the gradients land in the flat buffer
    assert flat.grads_bound() and float(flat.grad_sq_norm()) > 0


def test_stage_buffers_roundtrip_and_checksum():
    net = Net()
    flat = FlatState(net)
    flat.stage_buffers()
    (group,) = flat.groups
    assert torch.equal(group.grads[group.param_numel :], group.buffers)
    group.grads[group.param_numel :].fill_(3.0)
    flat.unstage_buffers()
    assert bool((net.bn.running_var == 3.0).all())
    a = flat.checksum(flat.state_tensors())
    net.fc.bias.data[0] = torch.nextafter(net.fc.bias.data[0], torch.tensor(10.0))  # one ulp
    assert not torch.equal(a, flat.checksum(flat.state_tensors()))


def test_checkpoint_of_parameters_does_not_carry_gradients(tmp_path):
    net = nn.Linear(1000, 100)
    flat = FlatState(net)
    flat.bind_grads()
    path = tmp_path / "w.pt"
    torch.save(net.state_dict(), path)
    assert path.stat().st_size < 1.2 * flat.nbytes()


def test_comm_stats_totals_exclude_bookkeeping():
    s = CommStats()
    s.record_launch("params", 100, blocking=True)
    s.record_launch("vote", 4, blocking=False)
    s.record_launch("setup", 1000, blocking=True)
    s.record_blocked("params", 0.5)
    assert s.total_bytes() == 104
    assert s.total_bytes(include_bookkeeping=True) == 1104
    assert (s.total_ops(), s.total_blocking()) == (2, 1)
    summary = s.summary()
    assert summary["bytes_params"] == 100 and summary["blocked_s"] == 0.5
    t = CommStats()
    t.load_state_dict(s.state_dict())
    assert t.summary() == summary


def test_comm_stats_snapshot_counts_pending_launches_as_if_they_had_happened():
    """A checkpoint part counts the barriers that end its save ahead: the snapshot equals the live totals after
    those launches, and taking it changes nothing live."""
    s = CommStats()
    s.record_launch("checkpoint", 120, blocking=True)
    snapshot = s.state_dict(pending=(("checkpoint", 0, True), ("verify", 16, False)))
    assert s.ops["checkpoint"] == 1 and "verify" not in s.ops  # live totals untouched
    s.record_launch("checkpoint", 0, blocking=True)
    s.record_launch("verify", 16, blocking=False)
    assert snapshot == s.state_dict()
