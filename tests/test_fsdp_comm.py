"""FSDP2's own collectives counted (``lightning_sync.comm.fsdp_comm``): 4 gloo processes, a small MLP sharded with
``fully_shard`` over all 4 ranks (1 x 4) and over the ``"shard"`` dimension of a 2 x 2 mesh (the layout of sharded
replicas), trained a few SGD steps with and without FSDP2's collectives routed through the pack's communicators.

Held: the counted run's parameters are bit-identical to the uncounted run's (the same collectives on the same
tensors), with and without an emulated link; the bytes counted per rank are the analytic ones: per step, every
module's all-gather twice (before its forward, and again before its backward: FSDP2 reshards a non-root module after
its forward) of its padded local shard, :math:`(N-1)` shards sent, and its gradients' reduce-scatter once, which gloo
runs as an all-reduce of the whole padded gradient (``cost.reduce_scatter_bytes``); recorded under an intra level
the tags are ``intra/fsdp_all_gather`` and ``intra/fsdp_reduce_scatter``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch import run_suite

from lightning_sync.comm.cost import allgather_bytes, gloo_ring_allreduce_bytes

WORLD = 4
STEPS = 3
SIZES = (16, 24, 24, 3)  # the last weight [3, 24] and bias [3] are padded to 4 rows over 4 ranks


def _suite(rank: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_sync.comm import CommStats, LinkModel
    from lightning_sync.comm.fsdp import fsdp_params, padded_numel
    from lightning_sync.comm.fsdp_comm import count_fsdp_collectives

    dist.init_process_group("gloo")
    res: dict = {}
    meshes = {
        "1x4": init_device_mesh("cpu", (WORLD,)),
        "2x2": init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")),
    }

    def train(layout: str, counted: str | None) -> tuple[list, dict, list]:
        torch.manual_seed(0)
        layers = [nn.Linear(a, b) for a, b in zip(SIZES, SIZES[1:])]
        model = nn.Sequential(layers[0], nn.Tanh(), layers[1], nn.Tanh(), layers[2])
        mesh = meshes[layout] if layout == "1x4" else meshes[layout]["shard"]
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        stats = CommStats()
        if counted == "plain":
            count_fsdp_collectives(model, stats)
        elif counted == "intra+link":
            count_fsdp_collectives(model, stats.level("intra"), link=LinkModel.parse("10gbit,0.1ms"))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        torch.manual_seed(1 + rank)
        for _ in range(STEPS):
            loss = model(torch.randn(8, SIZES[0])).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        shards = [p.to_local().detach().clone().tolist() for p in model.parameters()]
        padded = [sum(padded_numel(fp) for fp in fsdp_params(layer).values()) for layer in layers]
        return shards, dict(stats.bytes_sent), padded

    for layout in ("1x4", "2x2"):
        plain, _, _ = train(layout, None)
        counted, sent, padded = train(layout, "plain")
        linked, sent_intra, _ = train(layout, "intra+link")
        res[layout] = {
            "identical": plain == counted,
            "identical_with_link": plain == linked,
            "sent": sent,
            "sent_intra": sent_intra,
            "padded": padded,
            "group_size": WORLD if layout == "1x4" else 2,
            "group_rank": rank if layout == "1x4" else rank % 2,
        }
    (Path(out_dir) / f"res_rank{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_suite(_suite, WORLD, tmp_path_factory.mktemp("fsdp_comm"))


@pytest.mark.parametrize("layout", ["1x4", "2x2"])
def test_counting_fsdp2s_collectives_leaves_the_trajectory_bit_identical(results, layout):
    for rank, res in enumerate(results):
        assert res[layout]["identical"], f"rank {rank}: counted FSDP2 differs from FSDP2's own collectives"
        assert res[layout]["identical_with_link"], f"rank {rank}: FSDP2 under link emulation differs"


@pytest.mark.parametrize("layout", ["1x4", "2x2"])
def test_bytes_counted_are_the_analytic_all_gathers_and_reduce_scatters_of_the_shards(results, layout):
    for rank, res in enumerate(results):
        r = res[layout]
        n, me = r["group_size"], r["group_rank"]
        assert len(r["padded"]) == len(SIZES) - 1 and all(p > 0 for p in r["padded"])
        gather = sum(2 * allgather_bytes(4 * p, n) for p in r["padded"]) * STEPS
        scatter = sum(gloo_ring_allreduce_bytes(n * p, 4, n, me) for p in r["padded"]) * STEPS
        assert r["sent"] == {"fsdp_all_gather": gather, "fsdp_reduce_scatter": scatter}, f"rank {rank}"
        assert r["sent_intra"] == {"intra/fsdp_all_gather": gather, "intra/fsdp_reduce_scatter": scatter}


def test_reduce_scatter_bytes_are_gloos_all_reduce_of_the_input_and_the_ring_elsewhere():
    from lightning_sync.comm.cost import reduce_scatter_bytes

    for n, rank in ((2, 0), (4, 3), (3, 1)):
        assert reduce_scatter_bytes(1000, 4, n, rank, "gloo") == gloo_ring_allreduce_bytes(1000, 4, n, rank)
    assert reduce_scatter_bytes(1000, 4, 4, 0, "nccl") == 3000  # (N - 1) / N of the 4000 bytes
    assert reduce_scatter_bytes(1000, 4, 1, 0, "nccl") == reduce_scatter_bytes(1000, 4, 1, 0, "gloo") == 0


def test_the_fsdp2_row_checks_its_arguments_at_construction():
    from lightning_sync.strategies import CountedFSDP2Strategy

    strategy = CountedFSDP2Strategy(link="1gbit,1ms")
    assert strategy.link is not None and strategy._data_parallel_size == "all"
    assert strategy._tensor_parallel_size == 1 and strategy.comm_stats.total_bytes() == 0
    with pytest.raises(ValueError, match="link must be"):
        CountedFSDP2Strategy(link="fast")
    with pytest.raises(ValueError, match="data_parallel_size"):
        CountedFSDP2Strategy(data_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        CountedFSDP2Strategy(tensor_parallel_size=True)
