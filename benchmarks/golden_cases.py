"""The golden cases of ``benchmarks/golden.py``: what each one runs, and the processes that run them.

A case is one strategy in one layout at one averaging precision, named ``<method>/<layout>/<precision>``:

* ``flat``: 2 ranks, every rank a replica (the strategy's ordinary behaviour);
* ``grouped``: 4 ranks as 2 replica groups of 2 (``replica_size=2``), for the methods that accept replica groups;
* ``ft``: 2 fault-tolerant replica groups of one process each on torchft (``fault_tolerance=FaultTolerance(...)``,
  ``min_replicas=2``: every quorum holds both groups, so every sync averages over the same members), for the
  methods that accept it, fp32 only (fault tolerance refuses compression at construction). These failed
  intermittently until the replica group's rendezvous store became its own (a torchft membership of a second fit
  in the same process read the first one's stale addresses from the default group's store): recorded since;
* ``single``: 1 rank, for the asynchronous strategies (ASP, SSP, ALADDIN, Sync-Switch's ASP phase): with 2 ranks
  which rank trains which batch, and the interleaving of pushes and pulls, follow the ranks' speed at run time (a
  shared work counter), so neither parameters nor per-rank bytes repeat between two runs. One rank has one order
  (push, then pull, in turn) and is deterministic: it pins the parameter-server machinery (shards, clocks, pushes,
  pulls, checkpoint and resume of the server state) but not the interleaving of several ranks; fp32 only, since
  nothing goes over a wire there (``bf16`` gives bit-identical parameters: compression never applies).
  Sync-Switch also runs ``flat`` with its BSP phase pinned: the parameters at the switch (identical on both ranks)
  and the BSP phase's traffic; what follows the switch is ASP on 2 ranks and is not recorded.

and ``fp32`` (the data's own dtype on the wire) or ``bf16`` (``compression="bf16"``; not where the method refuses
compression at construction: streaming DiLoCo, :data:`UNCOMPRESSED`).

Every case trains :class:`~lightning_sync.models.DigitsCNN` (38k parameters, BatchNorm buffers) on
:class:`~lightning_sync.data.DigitsDataModule` (batch 32) from seed 0 for ``EPOCHS`` epochs of ``BATCHES`` batches,
validating on ``VAL_BATCHES`` batches at every epoch end, with a ``ModelCheckpoint`` in the middle of the run (step
``MID``, in the middle of the second epoch; the asynchronous strategies at the end of the second epoch, the only
place their ranks meet); then a second fit resumes from that checkpoint. Recorded per rank, for both fits: the final
model's digest (:func:`digest`), the strategy's bytes and collectives per tag (``CommStats``), the global step and the
strategy's step counters.

The cases' settings make every method sync within 12 steps (period 3, ``syncs_per_epoch=2``...); where a default
reaches its paper's behaviour within the run it is kept (ADPSGD's ``p_init`` and warm-up, DiLoCo's outer optimizer),
so a change of that default changes the goldens.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

EPOCHS = 3
BATCHES = 4  # training batches per epoch and rank (limit_train_batches)
VAL_BATCHES = 2
MID = 6  # the step the mid-run checkpoint is taken at (the middle of the second epoch)
BATCH = 32
SEED = 0
TIMEOUT_S = 120
#: fixed positions of the flattened state (fractions of its length) whose values are recorded besides the sums
ELEMENTS = (0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)

#: method -> (strategy class name, arguments), the settings of every layout
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "bsp": ("BSPStrategy", {}),
    "selsync": ("SelSyncStrategy", {"delta": 0.05}),
    "localsgd": ("LocalSGDStrategy", {"period": 3}),
    "fedavg": ("FedAvgStrategy", {"fraction": 0.5, "syncs_per_epoch": 2}),
    "adpsgd": ("ADPSGDStrategy", {}),  # its defaults: period 1 in the first epoch, then adapting from p_init
    "diloco": ("DiLoCoStrategy", {"sync_every": 3}),  # outer optimizer "auto" (Nesterov over the inner SGD)
    "diloco_streaming": ("DiLoCoStrategy", {"sync_every": 4, "fragments": 2, "delay": 1, "alpha": 0.5}),
    "osp": ("OSPStrategy", {"bandwidth": "100gbit"}),  # U_max at its cap: no measured time in the schedule
    "asp": ("ASPStrategy", {}),
    "ssp": ("SSPStrategy", {"staleness": 2}),
    "aladdin": ("ALADDINStrategy", {"period": 2}),
    "sync_switch": ("SyncSwitchStrategy", {}),  # SyncSwitch() added: BSP for 25% of the workload, then ASP
}
GROUPED = ("bsp", "selsync", "localsgd", "fedavg", "adpsgd", "diloco", "diloco_streaming")
FAULT_TOLERANT = ("localsgd", "fedavg", "adpsgd", "diloco", "diloco_streaming", "bsp")
ASYNC = ("asp", "ssp", "aladdin", "sync_switch")
#: methods whose settings refuse compression at construction (streaming DiLoCo's fragments are sent uncompressed)
UNCOMPRESSED = ("diloco_streaming",)
WORLD = {"flat": 2, "grouped": 4, "ft": 2, "single": 1}
PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class Case:
    """One golden case: ``method`` in ``layout`` at ``precision`` (see the module docstring)."""

    method: str
    layout: str
    precision: str
    #: what of the run is recorded: "all", or "bsp_phase" (Sync-Switch on 2 ranks: the run up to its switch)
    record: str = "all"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.method}/{self.layout}/{self.precision}"

    @property
    def world(self) -> int:
        return WORLD[self.layout]

    @property
    def epoch_checkpoints(self) -> bool:
        """Checkpoints at epoch ends (the parameter-server family rejects step-based ones)."""
        return self.method in ASYNC

    def strategy(self, fault_tolerance: Any = None) -> Any:
        import lightning_sync.strategies as S

        cls_name, kwargs = METHODS[self.method]
        kwargs = dict(kwargs, timeout=timedelta(seconds=TIMEOUT_S), sync_stats=False)
        if self.precision == "bf16":
            kwargs["compression"] = "bf16"
        if self.layout == "grouped":
            kwargs["replica_size"] = 2
        if fault_tolerance is not None:
            kwargs["fault_tolerance"] = fault_tolerance
        return getattr(S, cls_name)(**kwargs)


def _cases() -> dict[str, Case]:
    cases: list[Case] = []
    for method in METHODS:
        for precision in PRECISIONS if method not in UNCOMPRESSED else ("fp32",):
            if method in ASYNC:
                if precision == "fp32":  # one rank sends nothing: compression never applies (bf16 is identical)
                    cases.append(Case(method, "single", precision))
                if method == "sync_switch":
                    cases.append(Case(method, "flat", precision, record="bsp_phase"))
            else:
                cases.append(Case(method, "flat", precision))
            if method in GROUPED:
                cases.append(Case(method, "grouped", precision))
        if method in FAULT_TOLERANT:
            cases.append(Case(method, "ft", "fp32"))
    return {c.name: c for c in cases}


#: every golden case by name
CASES: dict[str, Case] = _cases()


# ----------------------------------------------------------------------------------------------- what is recorded
def digest(state: dict[str, Any]) -> dict[str, Any]:
    """A model's state in numbers: ``sha256`` of the raw bytes of every tensor of ``state_dict`` in order (the
    bit-identical comparison), and for the floating ones flattened in order, in float64: ``n``, ``sum``,
    ``sum_abs``, ``sum_sq`` and the values at the fixed positions :data:`ELEMENTS` (the comparison within a
    tolerance, on any machine)."""
    import torch

    sha = hashlib.sha256()
    floats = []
    for key, t in state.items():
        t = t.detach().cpu().contiguous()
        sha.update(key.encode())
        sha.update(str(t.dtype).encode())
        sha.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        if t.is_floating_point():
            floats.append(t.reshape(-1).double())
    flat = torch.cat(floats)
    n = flat.numel()
    return {
        "sha256": sha.hexdigest(),
        "n": n,
        "sum": float(flat.sum()),
        "sum_abs": float(flat.abs().sum()),
        "sum_sq": float((flat * flat).sum()),
        "elements": [float(flat[round(f * (n - 1))]) for f in ELEMENTS],
    }


def _comm(strategy: Any, tags: set[str] | None = None) -> dict[str, dict[str, int]]:
    stats = strategy.comm_stats
    keep = (lambda k: True) if tags is None else (lambda k: k in tags)
    return {
        "bytes": {k: int(v) for k, v in sorted(stats.bytes_sent.items()) if keep(k)},
        # not the count of torchft quorums (0 bytes each): at a fit's start a replica group asks again every 0.1 s
        # until its peers joined, so the count follows the processes' timing; the quorums at syncs are pinned by
        # the bytes and steps around them
        "ops": {k: int(v) for k, v in sorted(stats.ops.items()) if keep(k) and k != "quorum"},
    }


# ----------------------------------------------------------------------------------------------- one fit
def _fit(case: Case, root: Path, run: str, ckpt_path: str | None, fault_tolerance: Any = None) -> dict[str, Any]:
    """One fit of ``case`` (checkpoints into ``root/ckpt_<run>``); what it records on this rank."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from lightning_sync.data import DigitsDataModule
    from lightning_sync.launch import quiet_trainer_kwargs
    from lightning_sync.models import DigitsCNN

    pl.seed_everything(SEED, verbose=False)
    strategy = case.strategy(fault_tolerance)
    # the same checkpointing in both fits, into directories of names of the same length (a save broadcasts its path)
    if case.epoch_checkpoints:
        mc = ModelCheckpoint(dirpath=root / f"ckpt_{run}", every_n_epochs=1, save_top_k=-1, filename="{epoch}")
    else:
        mc = ModelCheckpoint(dirpath=root / f"ckpt_{run}", every_n_train_steps=MID, save_top_k=-1, filename="{step}")
    callbacks: list[Any] = [mc]
    at_switch: dict[str, Any] = {}
    if case.method == "sync_switch":

        class AtSwitch(Callback):
            """The replica and the traffic so far at the first batch of the ASP phase (all ranks identical)."""

            def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
                s = trainer.strategy
                if not at_switch and s.protocol == "asp":
                    at_switch["params"] = digest(pl_module.state_dict())
                    at_switch["global_step"] = trainer.global_step
                    at_switch.update(_comm(s))

        callbacks.append(AtSwitch())
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=case.world if case.layout != "ft" else 1,
        strategy=strategy,
        max_epochs=EPOCHS,
        limit_train_batches=BATCHES,
        limit_val_batches=VAL_BATCHES,
        callbacks=callbacks,
        **quiet_trainer_kwargs(enable_checkpointing=True, default_root_dir=str(root)),
    )
    model = DigitsCNN(lr=0.05, momentum=0.9, weight_decay=1e-4)
    trainer.fit(model, DigitsDataModule(batch_size=BATCH), ckpt_path=ckpt_path)
    if case.record == "bsp_phase":
        return {"at_switch": at_switch}
    return {
        "params": digest(model.state_dict()),
        "global_step": int(trainer.global_step),
        "steps": int(strategy.step_counter.steps),
        "sync_steps": int(strategy.step_counter.sync_steps),
        **_comm(strategy),
    }


def _mid_checkpoint(case: Case, root: Path) -> str:
    name = f"epoch={EPOCHS // 2}.ckpt" if case.epoch_checkpoints else f"step={MID}.ckpt"
    return str(root / "ckpt_a" / name)


def run_case_on_rank(
    case: Case, root: Path, fault_tolerance: tuple[Any, Any] | None = None, before_fit: Any = None
) -> dict[str, Any]:
    """The full fit and the fit resumed from its middle, on this rank (``fault_tolerance``: the two fits'
    ``FaultTolerance``; ``before_fit(run)``: called before each)."""
    ft_full, ft_resumed = fault_tolerance if fault_tolerance is not None else (None, None)
    if before_fit is not None:
        before_fit("a")
    full = _fit(case, root, "a", None, ft_full)
    if case.record == "bsp_phase":
        return {"full": full}
    if before_fit is not None:
        before_fit("b")
    resumed = _fit(case, root, "b", _mid_checkpoint(case, root), ft_resumed)
    return {"full": full, "resumed": resumed}


# ----------------------------------------------------------------------------------------------- processes
def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def rank_main(rank: int, names: list[str], out_dir: str) -> None:
    """One rank of a launch (``lightning_sync.launch.launch_local``): every case of ``names`` in turn, each rank's
    record written to ``out_dir/<case>/rank<r>.json``."""
    for name in names:
        case = CASES[name]
        root = Path(out_dir) / name.replace("/", "__")
        root.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        result = run_case_on_rank(case, root)
        (root / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
        if rank == 0:
            print(f"golden: {name} in {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)


def ft_group_main(cfg: dict[str, Any]) -> None:
    """One fault-tolerant replica group (its own process and Lightning world of one): every case of
    ``cfg["cases"]`` in turn, with the lighthouses ``cfg["lighthouses"][case] = [full fit's, resumed fit's]``."""
    import torch

    from lightning_sync import FaultTolerance

    torch.set_num_threads(1)
    group = cfg["group"]
    for name in cfg["cases"]:
        case = CASES[name]
        root = Path(cfg["out"]) / name.replace("/", "__") / f"group{group}"
        root.mkdir(parents=True, exist_ok=True)
        fts = tuple(
            FaultTolerance(
                lighthouse=url,
                replica_group=group,
                replica_groups=WORLD["ft"],
                min_replicas=WORLD["ft"],
                timeout=timedelta(seconds=TIMEOUT_S),
                quorum_timeout=timedelta(seconds=TIMEOUT_S),
                connect_timeout=timedelta(seconds=30),
                join_timeout=timedelta(seconds=TIMEOUT_S),
            )
            for url in cfg["lighthouses"][name]
        )

        def together(run: str, case_dir: Path = root.parent) -> None:
            """Wait until every group is here: a group starting its next fit while its peer still tears the last one
            down fails to connect to it (and torchft's retry of the join then fails too)."""
            (case_dir / f"ready_{run}_g{group}").touch()
            deadline = time.monotonic() + TIMEOUT_S
            while not all((case_dir / f"ready_{run}_g{g}").exists() for g in range(WORLD["ft"])):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"golden: the other replica group never reached {case_dir.name} fit {run}")
                time.sleep(0.1)

        result = run_case_on_rank(case, root, fts, together)  # type: ignore[arg-type]
        (root.parent / f"rank{group}.json").write_text(json.dumps(result, indent=1))


def lighthouses_main(count: int, path: str) -> None:
    """Serve ``count`` torchft lighthouses on free ports (every quorum needs both replica groups), write their URLs
    to ``path`` as a JSON list, and serve until SIGTERM."""
    import signal
    import threading

    from lightning_sync.comm.ft import serve_lighthouse

    servers = [serve_lighthouse(bind="127.0.0.1:0", min_replicas=WORLD["ft"]) for _ in range(count)]
    urls = [f"http://127.0.0.1:{s.address().rsplit(':', 1)[1]}" for s in servers]
    Path(path + ".tmp").write_text(json.dumps(urls))
    Path(path + ".tmp").rename(path)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            pass
    finally:
        for server in servers:
            server.shutdown()


if __name__ == "__main__":  # started by golden.py
    if len(sys.argv) == 3 and sys.argv[1] == "ft-group":
        ft_group_main(json.loads(sys.argv[2]))
    elif len(sys.argv) == 4 and sys.argv[1] == "lighthouses":
        lighthouses_main(int(sys.argv[2]), sys.argv[3])
    else:
        raise SystemExit("usage: python benchmarks/golden_cases.py ft-group|lighthouses '<json>' (golden.py's)")
