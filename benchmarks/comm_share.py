"""How communication-bound each `compare` workload is: the share of Lightning's DDP step that communication costs.

For each workload (its packaged `compare` config: model, data, per-rank batch size), `--devices` ranks run, in the
same processes (started once, torchrun-style), alternating `--repeats` times:

* **local**: every rank trains on its own, no communication at all (local SGD with an infinite period): the step
  time of the same computation with the same CPU contention (every rank computes at once, as under DDP);
* **ddp**: Lightning's DDP (``CountedDDPStrategy``) without link emulation (gloo over loopback);
* **ddp + link**: the same under `--link` (default 1gbit,1ms).

A step time is rank 0's time between the starts of consecutive training steps (data, forward, backward with DDP's
overlapped bucket all-reduces, the wait for them, the optimizer); the median over the steps after `--warmup`.

**Communication share** of DDP's step under the link (the issue's goal: >= 0.70 with 4 ranks at 1gbit,1ms):

    share = 1 - (local step time) / (DDP step time under the link)

the part of DDP's step that goes away when nothing is communicated, i.e. what a method that skips communication
can save at most (a speedup of at most 1 / (1 - share) per step). Also printed: the link's own part,
``1 - (DDP step, no link) / (DDP step, link)``; and the hook-measured share, the seconds from each step's first
bucket launch to its last bucket's completion (DDP's communication, overlapped with backward or blocked) over the
step time. Bytes sent per rank per step and blocked seconds per step come from the accounting (link runs).

    python benchmarks/comm_share.py --workload vgg --workload words --workload digits --devices 4

Other arguments pass to the workloads' configs (e.g. `--data.batch_size=16`).

The compute part is CPU time shared by the ranks: numbers depend on the machine's load; measure on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def _worker(
    rank: int,
    out: str,
    workloads: list[str],
    link: str,
    steps: int,
    warmup: int,
    repeats: int,
    devices: int,
    extra: list[str],
) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback

    from lightning_sync.cli import cli_main
    from lightning_sync.compare import packaged_config
    from lightning_sync.launch import quiet_trainer_kwargs
    from lightning_sync.strategies import CountedDDPStrategy, LocalSGDStrategy

    class StepClock(Callback):
        """Rank 0's time (and DDP's communication span so far) at the start of every training step."""

        def __init__(self) -> None:
            self.starts: list[tuple[float, float]] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001
            state = getattr(trainer.strategy, "ddp_hook_state", None)
            self.starts.append((time.perf_counter(), state.comm_seconds if state is not None else 0.0))

    results: dict[str, dict[str, list[float]]] = {}
    for workload in workloads:
        args = ["--config", str(packaged_config(workload)), "--trainer.logger=false", f"--trainer.devices={devices}"]
        args += extra
        cli = cli_main(args, run=False)
        r = results[workload] = {"local": [], "none": [], "link": [], "span": [], "bytes": [], "blocked": []}
        for _ in range(repeats):
            for kind in ("local", "none", "link"):
                pl.seed_everything(0)
                model = type(cli.model)(**{k: v for k, v in cli.model.hparams.items() if not k.startswith("_")})
                clock = StepClock()
                if kind == "local":
                    strategy = LocalSGDStrategy(period=10**9, average_at_end=False)
                else:
                    strategy = CountedDDPStrategy(link=link if kind == "link" else None)
                trainer = pl.Trainer(
                    accelerator="cpu",
                    devices=devices,
                    strategy=strategy,
                    max_steps=steps + 1,
                    limit_val_batches=0,
                    callbacks=[clock],
                    **quiet_trainer_kwargs(),
                )
                trainer.fit(model, cli.datamodule)
                pairs = list(zip(clock.starts, clock.starts[1:]))[warmup:]
                r[kind] += [b[0] - a[0] for a, b in pairs]
                if kind == "link":
                    r["span"] += [(b[1] - a[1]) / (b[0] - a[0]) for a, b in pairs]
                    m = strategy.sync_metrics()
                    r["bytes"].append(m["bytes_sent"] / (steps + 1))
                    r["blocked"].append(m["blocked_s"] / (steps + 1))
    if rank == 0:
        Path(out, "comm_share.json").write_text(json.dumps(results))


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", action="append", default=[], help="vgg, words, digits, text (repeatable)")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--link", default="1gbit,1ms")
    parser.add_argument("--steps", type=int, default=30, help="steps per fit")
    parser.add_argument("--warmup", type=int, default=5, help="steps of each fit not timed")
    parser.add_argument("--repeats", type=int, default=2, help="local / ddp / ddp + link fits, alternating")
    parser.add_argument("--out", default="runs/comm_share")
    args, extra = parser.parse_known_args(argv)
    workloads = args.workload or ["vgg", "words"]
    if args.warmup >= args.steps:
        parser.error("--warmup must be smaller than --steps")
    from lightning_sync.launch import launch_local

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    launch_local(
        _worker,
        args.devices,
        str(out),
        workloads,
        args.link,
        args.steps,
        args.warmup,
        args.repeats,
        args.devices,
        extra,
    )
    raw = json.loads((out / "comm_share.json").read_text())
    print(
        f"\nLightning's DDP, {args.devices} ranks, link {args.link}: median step times over {args.repeats} x "
        f"{args.steps - args.warmup} steps ({time.perf_counter() - start:.0f} s in all)\n"
    )
    print(
        "| workload | step s: local | DDP | DDP + link | comm share | link's part | hook span share | "
        "MB sent / rank / step | blocked s / step |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    table: dict[str, dict[str, float]] = {}
    for workload, r in raw.items():
        local, none, link = (statistics.median(r[k]) for k in ("local", "none", "link"))
        row = {
            "step_s_local": local,
            "step_s_ddp": none,
            "step_s_ddp_link": link,
            "share": 1 - local / link,
            "link_part": 1 - none / link,
            "span_share": statistics.median(r["span"]),
            "mb_per_step": statistics.mean(r["bytes"]) / 1e6,
            "blocked_per_step": statistics.mean(r["blocked"]),
        }
        table[workload] = row
        print(
            f"| {workload} | {local:.3f} | {none:.3f} | {link:.3f} | **{row['share']:.2f}** | {row['link_part']:.2f} "
            f"| {row['span_share']:.2f} | {row['mb_per_step']:.1f} | {row['blocked_per_step']:.3f} |"
        )
    (out / "comm_share_table.json").write_text(json.dumps(table, indent=2))
    return table


if __name__ == "__main__":
    main()
