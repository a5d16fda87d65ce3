"""Memory per rank (``lightning_sync.benchmark.memory``), counted on a tiny model in-process: parameters, gradients,
optimizer and outer-optimizer state are the bytes of their distinct storages (a flat buffer that several tensors
view counts once, with its padding); the end record carries them and the compare table shows them in MB. Local
shards under FSDP2 are ``tests/test_sharded.py``'s (4 processes)."""

from __future__ import annotations

import math

import torch
from torch import nn

from lightning_sync.benchmark.memory import MemoryCount, peak_rss_bytes, storage_bytes
from lightning_sync.benchmark.runs import RunResult, Target
from lightning_sync.benchmark.tables import markdown, table_rows
from lightning_sync.benchmark.ttt import outcome
from lightning_sync.core.outer import OuterOptimizer, OuterSGD


def _step(model: nn.Module, opt: torch.optim.Optimizer, count: MemoryCount) -> None:
    model(torch.randn(2, 4)).sum().backward()
    count.observe_grads(model)
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_parameters_gradients_and_optimizer_state_are_their_storages_bytes():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)  # 15 float32 parameters: 60 bytes
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    count = MemoryCount()
    _step(model, opt, count)
    _step(model, opt, count)
    mem = count.record(model, [opt], strategy=None)
    assert mem["params_bytes"] == 60
    assert mem["grads_bytes"] == 60  # seen at the steps; set to None after them
    assert mem["optimizer_bytes"] == 60  # one momentum buffer per parameter
    assert mem["outer_bytes"] == 0
    assert mem["peak_rss_bytes"] == peak_rss_bytes() > 0

    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    adam.step()
    # two moments per parameter, and the step counters (one float32 scalar each)
    assert MemoryCount().record(model, [adam], None)["optimizer_bytes"] == 2 * 60 + 2 * 4


def test_views_of_one_flat_buffer_count_once_with_its_padding_and_the_outer_state_twice_the_model():
    flat = torch.zeros(20)  # 15 elements used, 5 of padding
    weight, bias = flat[:12].view(3, 4), flat[12:15]
    assert storage_bytes([weight, bias, None, 3]) == 80
    outer = OuterOptimizer(OuterSGD(lr=0.7, momentum=0.9, nesterov=True), [flat[:15]])

    class Strategy:
        outer_averaging = type("Outer", (), {"optimizer": outer})()

    mem = MemoryCount().record(nn.Linear(4, 3), [], Strategy())
    assert mem["outer_bytes"] == 2 * 15 * 4  # global parameters and momentum


def test_the_end_records_memory_is_the_runs_outcome_and_a_column_of_the_table(tmp_path):
    memory = {"params_bytes": 4e6, "grads_bytes": 4e6, "optimizer_bytes": 4e6, "outer_bytes": 0, "peak_rss_bytes": 5e8}
    records = [
        {"event": "start", "metric": "val/acc", "target": 0.5, "mode": "max"},
        {"event": "eval", "step": 10, "wall_s": 1.0, "value": 0.6, "comm": {"bytes_sent": 1.0}},
        {"event": "end", "step": 10, "wall_s": 1.5, "comm": {}, "memory": memory},
    ]
    o = outcome(records)
    assert o.state_bytes == 12e6 and o.peak_rss_bytes == 5e8
    result = RunResult("ddp", 0, "none", tmp_path, ok=True, outcome=o)
    rows = table_rows(["ddp"], [result])
    assert rows[0]["state_mb"] == 12.0 and rows[0]["peak_rss_mb"] == 500.0
    table = markdown(rows, Target("val/acc", 0.5, "max"))
    assert "| state MB / rank | peak RSS MB |" in table.splitlines()[0] and "| 12.0 | 500.0 |" in table
    # runs recorded before the memory count: no columns (an older report re-renders as it was)
    old = outcome(records[:2] + [{**records[2], "memory": None}])
    assert math.isnan(old.state_bytes)
    rows = table_rows(["ddp"], [RunResult("ddp", 0, "none", tmp_path, ok=True, outcome=old)])
    assert "state MB" not in markdown(rows, Target("val/acc", 0.5, "max"))
