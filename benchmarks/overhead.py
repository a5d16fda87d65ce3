"""The hot path's cost against its references, measured side by side in one run: BSP's step against Lightning's
DDP step, SelSync's step that does not sync against a local step without a vote; and bytes and epoch time on an
emulated 1 Gbit/s, 1 ms link.

    python benchmarks/overhead.py                     # CPU: 2 processes, gloo (a few minutes on 2 cores)
    python benchmarks/overhead.py --accelerator gpu   # GPU: 2 ranks sharing GPU 0 over gloo; 2 GPUs over NCCL too

Setups (every one is two ranks, started torchrun-style so each process runs many fits):

* ``cpu``: 2 processes on this machine, gloo, ``torch.set_num_threads(1)`` per rank;
* ``gpu-shared`` (``--accelerator gpu``): the torchrun environment of two one-GPU nodes on one machine
  (``NODE_RANK=r``, ``LOCAL_RANK=0``), ``Trainer(accelerator="gpu", devices=1, num_nodes=2)``,
  ``process_group_backend="gloo"``: both ranks train on GPU 0 and gloo carries CUDA tensors. Runs on a one-GPU
  machine;
* ``gpu-nccl`` (``--accelerator gpu`` where there are >= 2 GPUs): one GPU per rank, NCCL.

Part 1 — BSP vs DDP. For each model, blocks of ``--steps`` steps alternate between Lightning's ``DDPStrategy`` and
our ``BSPStrategy`` (same backend, same model, data and seed), in ABBA order over ``--repeats`` repeats so drift of
the machine cancels; a step's time runs from the end of the previous step to the end of this one (on a GPU after
``torch.cuda.synchronize()``, so it is the step's own GPU work), the first ``--warmup`` steps of a block excluded.
Printed: the median step time of each block and BSP/DDP per repeat, the median of those ratios, and the same for the
process's CPU time per step (all its threads; a loaded machine deschedules processes, which wall time charges to
whichever block ran then, CPU time much less). Goal: <= 1.03.

Part 2 — SelSync's step that does not sync vs a local step with no vote. One run alternates, step by step,
SelSync's full per-step work (squared norm, windowed EWMA and Eq. 2 on the device, the 8-byte vote all-reduce read
after the update; ``delta=inf`` so no step syncs) with a plain local step (the same Lightning step with none of
that, but the per-step SIGTERM collective that SelSync folds into its vote). Interleaving puts both kinds under the
same noise; the ratio of median step times is printed per repeat. The two parities of a step differ by themselves
(``--control``, an A/A run with SelSync's steps plain too, on the 2-core machine: the even steps' ratio 1.04, the odd
steps' 0.92, medians per parity), so the runs alternate which parity is SelSync's; with an even ``--repeats`` the
median and geometric mean over runs cancel it, and the median per parity is printed. Goal: <= 1.02.

Part 4 — SelSync's step that does not sync vs a step with no collective at all (issue 51: Part 2's "plain" step
still pays the per-step SIGTERM all-reduce that SelSync folds into its vote, so it hid the vote's round trip). Blocks
of ``--steps`` steps of three strategies, in a rotating order over ``--repeats`` repeats: local SGD with a period
longer than the run (its local step has no collective: the reference), SelSync with ``delta=inf`` (never syncs) in
Alg. 1's vote order (``vote="exact"``: every step waits for its vote's round trip) and in the overlapped order
(``vote="overlapped"``, the default: a vote is read one step later). Each without link emulation and under an
emulated 1 ms latency (``LinkModel("100gbit", "1ms")``: the vote's bytes take no time, its round trip 1 ms). Printed:
median step time per block, each SelSync row over the local-SGD block of the same repeat, and the median over
repeats. Goal: the overlapped step <= 1.03x the collective-free step, on CPU and GPU, with and without latency.

Part 3 (``cpu`` only) — one epoch under ``LinkModel("1gbit", "1ms")``: BSP (25 MiB buckets, 1 MiB buckets, no
overlap) and SelSync(0.3): bytes sent per rank, seconds blocked in communication, epoch wall time, on the demo CNN
(~38k parameters) and on WideMLP (~4.3M parameters, 17 MB: communication-heavy).

Models: ``digits`` (the demo CNN, batch 32), ``widemlp`` (batch 32) and ``resnet18`` (torchvision's ResNet-18,
10 classes, batch 128 of synthetic 32x32 images, the size issue 18 measured). Defaults: ``digits,widemlp`` on the
CPU, ``resnet18`` on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.nn import functional as F

WORLD = 2


# ---------------------------------------------------------------------------------------------------- workloads
class ResNet18(pl.LightningModule):
    """torchvision's ResNet-18 (10 classes) with SGD, momentum 0.9, weight decay 5e-4."""

    def __init__(self) -> None:
        super().__init__()
        import torchvision

        self.net = torchvision.models.resnet18(num_classes=10)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)


class SyntheticImages(pl.LightningDataModule):
    """Fixed random 3x32x32 images and labels (seeded): no download, the same data on every rank and run."""

    def __init__(self, batch_size: int = 128, batches: int = 64) -> None:
        super().__init__()
        self.batch_size, self.batches = batch_size, batches

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(0)
        n = self.batch_size * self.batches * WORLD
        self.data = torch.utils.data.TensorDataset(
            torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)
        )

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(self.data, batch_size=self.batch_size, drop_last=True)


def _workload(name: str) -> tuple[Any, Any]:
    from lightning_sync.data import DigitsDataModule
    from lightning_sync.models import DigitsCNN, WideMLP

    if name == "digits":
        return DigitsCNN(), DigitsDataModule(batch_size=32)
    if name == "widemlp":
        return WideMLP(), DigitsDataModule(batch_size=32)
    if name == "resnet18":
        return ResNet18(), SyntheticImages()
    raise ValueError(f"model must be digits, widemlp or resnet18, got {name!r}")


# ---------------------------------------------------------------------------------------------------- setups
def _placement(setup: str) -> dict[str, Any]:
    """Trainer arguments and the process-group backend of a setup."""
    if setup == "cpu":
        return {"accelerator": "cpu", "devices": WORLD, "num_nodes": 1, "backend": "gloo"}
    if setup == "gpu-shared":
        return {"accelerator": "gpu", "devices": 1, "num_nodes": WORLD, "backend": "gloo"}
    if setup == "gpu-nccl":
        return {"accelerator": "gpu", "devices": WORLD, "num_nodes": 1, "backend": "nccl"}
    raise ValueError(setup)


def _trainer(strategy: Any, setup: str, callbacks: Any = (), **kw: Any) -> pl.Trainer:
    from lightning_sync.launch import quiet_trainer_kwargs

    place = _placement(setup)
    return pl.Trainer(
        accelerator=place["accelerator"],
        devices=place["devices"],
        num_nodes=place["num_nodes"],
        strategy=strategy,
        limit_val_batches=0,
        callbacks=list(callbacks),
        **quiet_trainer_kwargs(**kw),
    )


def _make_toggle_strategy() -> type:
    from torch.optim import Optimizer

    from lightning_sync import SelSyncStrategy

    class ToggleSelSync(SelSyncStrategy):
        """Steps alternate: SelSync's full per-step logic, then a plain local step, i.e. what Lightning does on
        its own in a multi-process step: no norm, no EWMA, no vote, but Lightning's per-step SIGTERM collective
        (which SelSync folds into its vote). ``selsync_on_odd`` puts SelSync's steps on the odd steps instead of
        the even ones: the runs alternate it, because the two parities differ by themselves (``--control``)."""

        plain = False
        _count = 0
        host_s: dict[str, list[float]]
        selsync_on_odd = False
        control = False  # --control: "SelSync's" steps are plain too (an A/A run: what the parities differ by alone)

        def on_train_batch_start(self, batch, batch_idx):  # type: ignore[override]
            self.plain = (self._count % 2 == 1) != self.selsync_on_odd
            self._count += 1
            return super().on_train_batch_start(batch, batch_idx)

        def _after_backward(self, optimizer: Optimizer) -> None:
            if not (self.plain or self.control):
                t0 = time.perf_counter()
                super()._after_backward(optimizer)
                self._host("selsync: norm, tracker, vote, launch", t0)

        def _after_update(self, optimizer: Optimizer) -> None:
            t0 = time.perf_counter()
            if self.plain or self.control:
                self.step_counter.record(False)
                self.sigterm.check()
                self._host("plain: SIGTERM all-reduce", t0)
            else:
                super()._after_update(optimizer)
                self._host("selsync: wait for the vote, read it", t0)

        def _host(self, what: str, t0: float) -> None:
            """Host time of the strategy's own calls in a step (the time split of what a step adds)."""
            self.host_s.setdefault(what, []).append(time.perf_counter() - t0)

    return ToggleSelSync


class StepTimer(pl.Callback):
    """Step time = from the end of the previous step to the end of this one (after a device synchronisation on
    a GPU), so everything a step costs — Lightning's per-step collectives, the wait for the slower rank — is
    charged to it; beside it the process's CPU time over the same interval (all its threads: less sensitive to a
    loaded machine, which deschedules processes, than wall time). ``kind(trainer)`` sorts the steps (Part 2:
    SelSync's or plain)."""

    def __init__(self, warmup: int, kind: Any = None) -> None:
        self.warmup = warmup
        self.kind = kind or (lambda trainer: "all")
        self.last: tuple[float, float] | None = None
        self.times: dict[str, list[float]] = {}
        self.cpu: dict[str, list[float]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if torch.cuda.is_available() and trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        now = (time.perf_counter(), time.process_time())
        if self.last is not None and trainer.global_step > self.warmup:
            kind = self.kind(trainer)
            self.times.setdefault(kind, []).append(now[0] - self.last[0])
            self.cpu.setdefault(kind, []).append(now[1] - self.last[1])
        self.last = now


# ---------------------------------------------------------------------------------------------------- worker
def _worker(
    rank: int,
    out_dir: str,
    setup: str,
    models: list[str],
    steps: int,
    warmup: int,
    repeats: int,
    parts: list[int],
    control: bool = False,
) -> None:
    if setup == "gpu-shared":
        os.environ.update(NODE_RANK=str(rank), LOCAL_RANK="0")  # two one-GPU "nodes" on this machine
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_sync import BSPStrategy, LinkModel, SelSyncStrategy

    backend = _placement(setup)["backend"]
    res: dict[str, Any] = {"setup": setup, "models": models, "parts": parts, "steps_total": warmup + steps + 1}
    if torch.cuda.is_available() and setup != "cpu":
        res["device"] = torch.cuda.get_device_name(0)

    def run(strategy: Any, model_name: str, timer: StepTimer | None, **kw: Any) -> pl.Trainer:
        pl.seed_everything(0)
        model, data = _workload(model_name)
        trainer = _trainer(strategy, setup, [timer] if timer else [], **kw)
        trainer.fit(model, data)
        return trainer

    # Part 1: BSP vs DDP, blocks in ABBA order
    for model_name in models if 1 in parts else ():
        rows = []
        for r in range(repeats):
            order = ("ddp", "bsp") if r % 2 == 0 else ("bsp", "ddp")
            row: dict[str, Any] = {}
            for kind in order:
                strategy = (
                    DDPStrategy(process_group_backend=backend)
                    if kind == "ddp"
                    else BSPStrategy(process_group_backend=backend)
                )
                timer = StepTimer(warmup)
                run(strategy, model_name, timer, max_steps=warmup + steps + 1, max_epochs=-1)
                row[kind] = statistics.median(timer.times["all"])
                row[f"{kind}_cpu"] = statistics.median(timer.cpu["all"])
                row[f"{kind}_n"] = len(timer.times["all"])
            rows.append(row)
        res[f"bsp_vs_ddp/{model_name}"] = rows

    # Part 2: SelSync's non-sync step vs a plain local step, interleaved step by step
    toggle = _make_toggle_strategy()
    for model_name in models if 2 in parts else ():
        blocks = []
        for r in range(repeats):
            strategy = toggle(delta=float("inf"), vote="exact", process_group_backend=backend)  # as measured before
            strategy.host_s = {}
            strategy.selsync_on_odd = r % 2 == 1  # cancels the parities' own difference over pairs of runs
            strategy.control = control
            timer = StepTimer(warmup, kind=lambda trainer: "plain" if trainer.strategy.plain else "selsync")
            run(strategy, model_name, timer, max_steps=warmup + 2 * steps + 1, max_epochs=-1)
            blocks.append(
                {
                    "selsync": statistics.median(timer.times["selsync"]),
                    "plain": statistics.median(timer.times["plain"]),
                    "selsync_cpu": statistics.median(timer.cpu["selsync"]),
                    "plain_cpu": statistics.median(timer.cpu["plain"]),
                    "n": [len(timer.times["selsync"]), len(timer.times["plain"])],
                    "sync_steps": strategy.step_counter.sync_steps,
                    "vote_blocked_s": strategy.comm_stats.blocked_seconds["vote"],
                    "vote_ops": strategy.comm_stats.ops["vote"],
                    "selsync_on": "odd" if strategy.selsync_on_odd else "even",
                    "host_us": {k: statistics.median(v[warmup:] or v) * 1e6 for k, v in strategy.host_s.items()},
                }
            )
        res[f"selsync_local/{model_name}"] = blocks

    # Part 4: SelSync's non-sync step (exact and overlapped vote) vs local SGD's step, which has no collective
    from lightning_sync import LocalSGDStrategy

    kinds = {
        "local": lambda link: LocalSGDStrategy(period=10**9, process_group_backend=backend, link=link),
        "exact": lambda link: SelSyncStrategy(
            delta=float("inf"), vote="exact", process_group_backend=backend, link=link
        ),
        "overlapped": lambda link: SelSyncStrategy(
            delta=float("inf"), vote="overlapped", process_group_backend=backend, link=link
        ),
    }
    for model_name in models if 4 in parts else ():
        for link_name, link in (("none", None), ("1ms", LinkModel("100gbit", "1ms"))):
            rows = []
            for r in range(repeats):
                order = list(kinds)[r % 3 :] + list(kinds)[: r % 3]  # every kind first, second and third in turn
                row: dict[str, Any] = {"order": order}
                for kind in order:
                    strategy = kinds[kind](link)
                    timer = StepTimer(warmup)
                    run(strategy, model_name, timer, max_steps=warmup + steps + 1, max_epochs=-1)
                    row[kind] = statistics.median(timer.times["all"])
                    row[f"{kind}_cpu"] = statistics.median(timer.cpu["all"])
                    row[f"{kind}_syncs"] = strategy.step_counter.sync_steps
                    row[f"{kind}_vote_blocked_s"] = strategy.comm_stats.blocked_seconds.get("vote", 0.0)
                rows.append(row)
            res[f"selsync_free/{model_name}/{link_name}"] = rows

    # Part 3 (CPU): one epoch on an emulated 1 Gbit/s, 1 ms link
    if setup == "cpu" and 3 in parts:

        class EpochTimer(pl.Callback):
            def on_train_epoch_start(self, trainer, pl_module):
                self.t0 = time.perf_counter()

            def on_train_epoch_end(self, trainer, pl_module):
                self.seconds = time.perf_counter() - self.t0

        link = LinkModel("1gbit", "1ms")
        for model_name in ("digits", "widemlp"):
            for name, make in (
                ("BSP", lambda: BSPStrategy(link=link)),
                ("BSP(1 MiB buckets)", lambda: BSPStrategy(bucket_cap_mb=1, link=link)),
                ("BSP(no overlap)", lambda: BSPStrategy(bucket_cap_mb=None, link=link)),
                ("SelSync(0.3)", lambda: SelSyncStrategy(delta=0.3, link=link)),
            ):
                pl.seed_everything(0)
                epoch = EpochTimer()
                strategy = make()
                model, data = _workload(model_name)
                trainer = _trainer(strategy, setup, [epoch], max_epochs=1)
                trainer.fit(model, data)
                stats = strategy.comm_stats
                res[f"link/{model_name}/{name}"] = {
                    "steps": strategy.step_counter.steps,
                    "lssr": strategy.step_counter.lssr,
                    "bytes_sent": stats.total_bytes(),
                    "blocked_s": stats.total_blocked_seconds(),
                    "epoch_s": epoch.seconds,
                    "params": sum(p.numel() for p in trainer.lightning_module.parameters()),
                }
    Path(out_dir, f"{setup}_rank{rank}.json").write_text(json.dumps(res))


# ---------------------------------------------------------------------------------------------------- report
def _report(r0: dict[str, Any]) -> None:
    setup = r0["setup"]
    where = f"{setup}" + (f", {r0['device']}" if "device" in r0 else "")
    parts = r0["parts"]
    for model_name in r0["models"] if 1 in parts else ():
        rows = r0[f"bsp_vs_ddp/{model_name}"]
        print(f"\n## Part 1: BSP step vs Lightning DDP step ({model_name}, 2 ranks, {where})")
        print(
            "| repeat | order | steps | median DDP ms | median BSP ms | BSP / DDP | DDP CPU ms | BSP CPU ms "
            "| BSP / DDP (CPU) |"
        )
        print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        ratios, cpu_ratios = [], []
        for i, row in enumerate(rows):
            ratio, cpu_ratio = row["bsp"] / row["ddp"], row["bsp_cpu"] / row["ddp_cpu"]
            ratios.append(ratio)
            cpu_ratios.append(cpu_ratio)
            order = "DDP, BSP" if i % 2 == 0 else "BSP, DDP"
            print(
                f"| {i + 1} | {order} | {row['ddp_n']}, {row['bsp_n']} | {row['ddp'] * 1e3:.3f} "
                f"| {row['bsp'] * 1e3:.3f} | {ratio:.3f} | {row['ddp_cpu'] * 1e3:.3f} | {row['bsp_cpu'] * 1e3:.3f} "
                f"| {cpu_ratio:.3f} |"
            )
        pooled = statistics.median(row["bsp"] for row in rows) / statistics.median(row["ddp"] for row in rows)
        print(
            f"median BSP / DDP over repeats ({model_name}, {setup}): {statistics.median(ratios):.3f}; "
            f"ratio of the medians over blocks: {pooled:.3f}; CPU time: {statistics.median(cpu_ratios):.3f}   "
            "(goal <= 1.03)"
        )
    for model_name in r0["models"] if 2 in parts else ():
        blocks = r0[f"selsync_local/{model_name}"]
        print(f"\n## Part 2: SelSync step that does not sync vs a local step without a vote ({model_name}, {where})")
        print(
            "| run | SelSync on | SelSync steps | plain steps | syncs | median SelSync ms | median plain ms | ratio "
            "| SelSync CPU ms | plain CPU ms | ratio (CPU) | vote blocked us |"
        )
        print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        ratios, cpu_ratios = [], []
        for i, o in enumerate(blocks):
            ratio, cpu_ratio = o["selsync"] / o["plain"], o["selsync_cpu"] / o["plain_cpu"]
            ratios.append(ratio)
            cpu_ratios.append(cpu_ratio)
            vote_us = o["vote_blocked_s"] / max(1, o["vote_ops"]) * 1e6
            print(
                f"| {i + 1} | {o.get('selsync_on', 'even')} | {o['n'][0]} | {o['n'][1]} | {o['sync_steps']} "
                f"| {o['selsync'] * 1e3:.3f} "
                f"| {o['plain'] * 1e3:.3f} | {ratio:.3f} | {o['selsync_cpu'] * 1e3:.3f} | {o['plain_cpu'] * 1e3:.3f} "
                f"| {cpu_ratio:.3f} | {vote_us:.0f} |"
            )
        print(
            f"median SelSync / plain over runs ({model_name}, {setup}): {statistics.median(ratios):.3f}; "
            f"geometric mean: {statistics.geometric_mean(ratios):.3f}; CPU time: {statistics.median(cpu_ratios):.3f}"
            "   (goal <= 1.02; an even number of runs, so SelSync's steps are even and odd equally often)"
        )
        by_parity = {
            p: statistics.median(x for x, o in zip(ratios, blocks) if o.get("selsync_on", "even") == p)
            for p in ("even", "odd")
            if any(o.get("selsync_on", "even") == p for o in blocks)
        }
        print("median ratio by SelSync's parity: " + ", ".join(f"{p} {v:.3f}" for p, v in by_parity.items()))
        hosts = [o["host_us"] for o in blocks if "host_us" in o]
        if hosts:
            print(
                "host time of the strategy's own calls per step, median over runs of the per-run medians: "
                + "; ".join(f"{k} {statistics.median(h[k] for h in hosts):.0f} us" for k in sorted(hosts[0]))
            )
    for model_name in r0["models"] if 4 in parts else ():
        for link_name in ("none", "1ms"):
            rows = r0[f"selsync_free/{model_name}/{link_name}"]
            latency = "no link emulation" if link_name == "none" else "an emulated 1 ms latency"
            print(
                f"\n## Part 4: SelSync step that does not sync vs a step with no collective (local SGD), "
                f"{model_name}, {where}, {latency}"
            )
            print(
                "| repeat | order | local SGD ms | SelSync exact ms | exact / local | SelSync overlapped ms "
                "| overlapped / local | vote blocked per step, exact / overlapped (us) |"
            )
            print("|---:|---|---:|---:|---:|---:|---:|---:|")
            exact, overlapped = [], []
            for i, row in enumerate(rows):
                exact.append(row["exact"] / row["local"])
                overlapped.append(row["overlapped"] / row["local"])
                print(
                    f"| {i + 1} | {', '.join(row['order'])} | {row['local'] * 1e3:.3f} | {row['exact'] * 1e3:.3f} "
                    f"| {exact[-1]:.3f} | {row['overlapped'] * 1e3:.3f} | {overlapped[-1]:.3f} "
                    f"| {row['exact_vote_blocked_s'] * 1e6 / r0['steps_total']:.0f} / "
                    f"{row['overlapped_vote_blocked_s'] * 1e6 / r0['steps_total']:.0f} |"
                )
            print(
                f"median over repeats ({model_name}, {setup}, {link_name}): exact / local "
                f"{statistics.median(exact):.3f}, overlapped / local {statistics.median(overlapped):.3f}   "
                "(goal for overlapped: <= 1.03; vote blocked time: per step of the run, warm-up included)"
            )
    if setup == "cpu" and 3 in parts:
        print("\n## Part 3: one epoch at an emulated 1 Gbit/s, 1 ms link (rank 0; DistributedSampler)")
        print("| model | params | strategy | steps | LSSR | bytes sent / rank | blocked s | epoch s |")
        print("|---|---:|---|---:|---:|---:|---:|---:|")
        names = ("BSP", "BSP(1 MiB buckets)", "BSP(no overlap)", "SelSync(0.3)")
        for model_name in ("digits", "widemlp"):
            for name in names:
                c = r0[f"link/{model_name}/{name}"]
                print(
                    f"| {model_name} | {c['params']:,} | {name} | {c['steps']} | {c['lssr']:.3f} "
                    f"| {c['bytes_sent']:,} | {c['blocked_s']:.3f} | {c['epoch_s']:.3f} |"
                )
        for model_name in ("digits", "widemlp"):
            b, s = r0[f"link/{model_name}/BSP"], r0[f"link/{model_name}/SelSync(0.3)"]
            print(
                f"{model_name}: BSP/SelSync bytes = {b['bytes_sent'] / max(1, s['bytes_sent']):.1f}x, "
                f"epoch time = {b['epoch_s'] / s['epoch_s']:.2f}x"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--models", default=None, help="comma-separated: digits, widemlp, resnet18")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per block (part 2: of each kind)")
    parser.add_argument("--warmup", type=int, default=20, help="steps not measured at the start of each block")
    parser.add_argument("--repeats", type=int, default=6, help="blocks per strategy (part 1), runs (part 2)")
    parser.add_argument("--parts", default="1,2,3,4", help="which parts to run, e.g. 1 or 1,2")
    parser.add_argument(
        "--control", action="store_true", help="part 2 as an A/A run: SelSync's steps plain too (the parities' bias)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write rank 0's raw numbers here")
    args = parser.parse_args()
    parts = [int(p) for p in args.parts.split(",")]

    from lightning_sync.launch import launch_local

    if args.accelerator == "gpu":
        if not torch.cuda.is_available():
            raise SystemExit("--accelerator gpu: no CUDA device on this machine")
        setups = ["gpu-shared"] + (["gpu-nccl"] if torch.cuda.device_count() >= 2 else [])
        models = (args.models or "resnet18").split(",")
        steps = args.steps or 100
    else:
        setups = ["cpu"]
        models = (args.models or "digits,widemlp").split(",")
        steps = args.steps or 100
    out: dict[str, Any] = {}
    for setup in setups:
        with tempfile.TemporaryDirectory() as tmp:
            # cpu: one thread per rank (more ranks than cores on the 2-core machine); gpu-shared: each rank its
            # share of the cores, as Lightning gives the processes of one node (with two one-GPU "nodes" it would
            # give each process every core: 2x oversubscribed, which made repeated runs differ by +-10%)
            threads = 1 if setup == "cpu" else max(1, (os.cpu_count() or WORLD) // WORLD)
            launch_local(
                _worker,
                WORLD,
                tmp,
                setup,
                models,
                steps,
                args.warmup,
                args.repeats,
                parts,
                args.control,
                threads=threads,
            )
            out[setup] = [json.loads(Path(tmp, f"{setup}_rank{r}.json").read_text()) for r in range(WORLD)]
        _report(out[setup][0])
    if args.accelerator == "gpu" and torch.cuda.device_count() < 2:
        print("\n(one GPU: the two-GPU NCCL setup was not run)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
