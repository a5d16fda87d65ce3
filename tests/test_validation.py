"""Input validation of every public constructor, and the Trainer-settings matrix.

**Part 1: constructor arguments.** :data:`SPECS` holds one :class:`Arg` per (class, argument) of every exported
strategy and callback: the allowed range, a hypothesis strategy of valid values, one of invalid values (wrong type,
out of range, NaN/inf where not allowed, bools where numbers are expected, ...) and the boundary cases. Every
invalid value must raise ``ValueError`` at construction with a message naming the argument and stating the allowed
range; every valid value must construct. :func:`test_every_constructor_argument_has_a_spec` walks the signatures,
so an argument added later without a spec fails the suite. The abstract/base classes ``SyncStrategy`` and
``ParameterServerStrategy`` are covered through their subclasses (every subclass inherits their arguments).

**Part 2: Trainer settings.** :data:`MATRIX` says, for each strategy and each Trainer setting, whether it is
supported (a short in-process fit at world size 1 shows it runs and does what the setting says) or rejected at
setup with an error saying why and what to use instead. ``python tests/test_validation.py`` prints the table as
Markdown (:func:`render_matrix_markdown`).
"""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision, Precision

import lightning_sync
import lightning_sync.callbacks as callbacks_module
from lightning_sync import (
    ADPSGDStrategy,
    ALADDINStrategy,
    ASPStrategy,
    BSPStrategy,
    DiLoCoStrategy,
    FedAvgStrategy,
    LocalSGDStrategy,
    OSPStrategy,
    SelSyncStrategy,
    SSPStrategy,
    SyncStrategy,
    SyncSwitchStrategy,
)
from lightning_sync.callbacks import EpochPrinter, SelDP, StragglerInjection, SyncStats, SyncSwitch
from lightning_sync.comm import LinkModel
from lightning_sync.core.outer import DILOCO_OUTER
from lightning_sync.core.switch import SwitchSchedule
from lightning_sync.core.validation import MAX_INT64
from lightning_sync.data import DigitsDataModule
from lightning_sync.launch import quiet_trainer_kwargs
from lightning_sync.models import DigitsCNN
from lightning_sync.strategies import STRATEGIES
from lightning_sync.strategies.base import START_METHODS
from lightning_sync.strategies.diloco import DEFAULT_SYNC_EVERY

HYPOTHESIS = settings(
    max_examples=25,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
INF = math.inf

# ============================================================================================ part 1: the spec table
# Values no argument here accepts (each spec adds what else is invalid for it).
_JUNK = st.sampled_from([object(), {}, {"a": 1}, set(), b"x", 1j, ("a", 1), Ellipsis])
# Strings without digits, dots or capitals: never a number, a quantity with a unit, a choice, or a file in the repo.
_TEXT = st.text(alphabet="xyz _-:;!", max_size=8)
_ANY_FLOAT = st.floats(allow_nan=True, allow_infinity=True)


@dataclass(frozen=True)
class Arg:
    """The contract of one constructor argument."""

    allowed: str  #: the allowed values, as the docs and the error message state them
    valid: Any  #: hypothesis strategy of values that construct
    invalid: Any  #: hypothesis strategy of values that raise ValueError at construction
    message: str  #: regex the ValueError's message must contain (the argument's name and the allowed range)
    edges_valid: tuple = ()  #: boundary values that construct
    edges_invalid: tuple = ()  #: boundary values that raise
    note: str = ""  #: who checks what, where it is not all checked here at construction


def int_arg(
    name: str, lo: int, hi: int | None = None, none_ok: bool = False, message: str | None = None, note: str = ""
) -> Arg:
    """An integer (not a bool, not a float such as 2.0) in [lo, hi], optionally None."""
    valid = st.integers(lo, hi if hi is not None else lo + 10**12)
    invalid = [st.integers(max_value=lo - 1), _ANY_FLOAT, st.booleans(), _TEXT, _JUNK]
    if hi is not None:
        invalid.append(st.integers(min_value=hi + 1))
    if none_ok:
        valid = valid | st.none()
    else:
        invalid.append(st.none())
    rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
    return Arg(
        allowed=f"integer {rng}" + (" or None" if none_ok else ""),
        valid=valid,
        invalid=st.one_of(invalid),
        message=message or re.escape(f"{name} must be an integer {rng}"),
        edges_valid=(lo,) + ((hi,) if hi is not None else ()) + ((None,) if none_ok else ()),
        edges_invalid=(lo - 1, float(lo), True, str(lo)) + ((hi + 1,) if hi is not None else ()),
        note=note,
    )


def real_arg(
    name: str,
    lo: float,
    hi: float = INF,
    low_open: bool = False,
    high_open: bool = False,
    allow_inf: bool = False,
    none_ok: bool = False,
    note: str = "",
) -> Arg:
    """A real number (int or float, not a bool, not NaN) in the interval, as ``check_real`` words it."""

    def inside(v: float) -> bool:
        if math.isnan(v) or (math.isinf(v) and not allow_inf):
            return False
        return (v > lo if low_open else v >= lo) and (v < hi if high_open else v <= hi)

    floats = st.floats(
        min_value=lo,
        max_value=None if hi == INF else hi,
        exclude_min=low_open,
        exclude_max=high_open and hi != INF,
        allow_nan=False,
        allow_infinity=allow_inf,
    ).filter(inside)
    ints = st.integers(max(math.ceil(lo), -(10**6)), min(math.floor(hi), 10**6) if hi != INF else 10**6)
    valid = floats | ints.filter(inside)
    invalid = [
        st.floats(max_value=lo, allow_nan=False).filter(lambda v: not inside(v)),
        st.just(math.nan),
        st.booleans(),
        _TEXT,
        _JUNK,
    ]
    if hi != INF:
        invalid.append(st.floats(min_value=hi, allow_nan=False).filter(lambda v: not inside(v)))
    if not allow_inf:
        invalid.append(st.sampled_from([INF, -INF]))
    if none_ok:
        valid = valid | st.none()
    else:
        invalid.append(st.none())
    left = "(" if low_open or (lo == -INF and not allow_inf) else "["
    right = ")" if high_open or (hi == INF and not allow_inf) else "]"
    rng = f"{left}{lo}, {hi}{right}"
    near = (math.nextafter(lo, INF), math.nextafter(hi, -INF), 1e300)  # just inside an open bound, and large
    edges_valid = tuple(dict.fromkeys(v for v in (lo, hi, INF, *near) if inside(v))) + ((None,) if none_ok else ())
    edges_invalid = tuple(v for v in (lo, hi, math.nan, INF, -INF) if not inside(v)) + (True, str(lo))
    return Arg(
        allowed=f"number in {rng}" + (" or None" if none_ok else ""),
        valid=valid,
        invalid=st.one_of(invalid),
        message=re.escape(f"{name} must be a number in {rng}"),
        edges_valid=edges_valid,
        edges_invalid=edges_invalid,
        note=note,
    )


def bool_arg(name: str) -> Arg:
    return Arg(
        allowed="bool",
        valid=st.booleans(),
        invalid=st.one_of(st.integers(), _ANY_FLOAT, _TEXT, _JUNK, st.none()),
        message=re.escape(f"{name} must be a bool"),
        edges_valid=(True, False),
        edges_invalid=(0, 1, "True", None),
    )


def choice_arg(name: str, choices: tuple, message: str, note: str = "") -> Arg:
    invalid = [st.text(max_size=12).filter(lambda s: s not in choices), st.integers(), _ANY_FLOAT, st.booleans(), _JUNK]
    if None not in choices:
        invalid.append(st.none())
    strings = [c for c in choices if isinstance(c, str)]
    return Arg(
        allowed="one of " + ", ".join(repr(c) for c in choices),
        valid=st.sampled_from(choices),
        invalid=st.one_of(invalid),
        message=message,
        edges_valid=choices,
        edges_invalid=tuple(s.upper() for s in strings) + (" " + strings[0], ""),
        note=note,
    )


# ------------------------------------------------------------------------------------- argument-specific values
_DENSE = choice_arg(
    "compression",
    (None, "bf16", "fp16", "int8", "int4", "int2"),
    r"compression must be None, 'bf16', 'fp16', 'int8', 'int4' or 'int2', or 'topk:<fraction>' with 0 < fraction < 1",
    note="what the tensors can take (floating point; a cast narrower than the data; sparse: changes only) is checked "
    "at setup",
)
#: the dense formats, and the sparse "topk:<fraction>" for any fraction in (0, 1), with fp32 or narrow values
_FRACTIONS = st.floats(0.0, 1.0, exclude_min=True, exclude_max=True)
_COMPRESSION = replace(
    _DENSE,
    allowed=_DENSE.allowed + ", or 'topk:<fraction>' with 0 < fraction < 1, optionally '+int8', '+int4' or '+int2'",
    valid=_DENSE.valid
    | _FRACTIONS.map(lambda f: f"topk:{f!r}")
    | st.builds("topk:{!r}+{}".format, _FRACTIONS, st.sampled_from(["int8", "int4", "int2"])),
    invalid=_DENSE.invalid
    | st.sampled_from(["topk:0", "topk:1", "topk:2", "topk:-0.5", "topk:nan", "topk:", "topk:x", "TOPK:0.1"])
    | st.sampled_from(["topk:0.01+", "topk:0.01+bf16", "topk:0.01+int3", "topk:0.01+INT2", "topk:1+int2"]),
    edges_valid=(*_DENSE.edges_valid, "topk:0.01", "topk:1e-300", "topk:0.9999999", "topk:0.01+int2"),
    edges_invalid=(*_DENSE.edges_invalid, "topk:0", "topk:1", "topk:inf", "topk:0.01+int2+int2"),
)
_UNIT = st.floats(0.0, 1.0, exclude_min=True, allow_nan=False)
_BAD_UNIT = st.one_of(
    st.floats(max_value=0.0, allow_nan=False),
    st.floats(min_value=1.0, exclude_min=True),
    st.just(math.nan),
    st.booleans(),
    _TEXT,
)
_RATE_TEXT = st.builds(
    "{}{}".format, st.integers(1, 10**6), st.sampled_from(["", "bit", "kbit", "mbit", "gbit", "gbps", "kb", "mb"])
)
_DURATION_TEXT = st.builds("{}{}".format, st.integers(0, 10**4), st.sampled_from(["", "s", "ms", "us", "ns"]))
_BAD_QUANTITIES = st.sampled_from(["0gbit", "-1gbit", "1parsec", "gbit", "1 gbit/s/s", "1e", ".", "inf", "nan"])
_DEVICES = st.sampled_from([torch.device("cpu"), torch.device("cpu", 1), torch.device("cuda", 0)])


def _schedules() -> Any:
    """Valid SyncSwitch schedules in every accepted form (pairs, dicts, compact string, SwitchSchedule)."""
    ends = st.lists(st.integers(1, 99), max_size=3, unique=True).map(lambda xs: [x / 100 for x in sorted(xs)] + [1.0])

    def forms(ends: list[float]) -> Any:
        protocols = st.lists(st.sampled_from(["bsp", "asp", "BSP", " asp "]), min_size=len(ends), max_size=len(ends))
        pairs = protocols.map(lambda ps: list(zip(ps, ends)))
        return st.one_of(
            pairs,
            pairs.map(lambda p: [{"protocol": a, "until": b} for a, b in p]),
            pairs.map(lambda p: ",".join(f"{a.strip()}:{b}" for a, b in p)),
            pairs.map(SwitchSchedule),
        )

    return ends.flatmap(forms)


_BAD_SCHEDULES = st.one_of(
    st.sampled_from(
        [
            [],
            [("bsp", 0.5)],  # does not reach 1.0
            [("ssp", 1.0)],  # unknown protocol
            [("bsp", 1.5)],
            [("bsp", 0.0), ("asp", 1.0)],
            [("bsp", math.nan), ("asp", 1.0)],
            [("bsp", 0.5), ("asp", 0.5), ("bsp", 1.0)],  # not strictly increasing
            [("bsp", 0.5, 1)],
            [{"protocol": "bsp"}],
            [{"protocol": "bsp", "until": 1.0, "extra": 1}],
            "bsp:0.5,asp",
            "bsp=1.0",
        ]
    ),
    st.lists(st.tuples(st.sampled_from(["bsp", "asp"]), st.floats(0.01, 0.99)), min_size=1, max_size=3),
    st.tuples(_TEXT, st.just(1.0)).map(lambda pair: [pair]),
    st.integers(),
    _ANY_FLOAT,
    st.booleans(),
    st.none(),
    _TEXT,
    _JUNK,
)


def _outer_specs() -> Any:
    """Valid outer optimizer specs: SGD with lr > 0, momentum in [0, 1), Nesterov only with momentum."""
    lr = st.floats(0.0, 1e6, exclude_min=True, allow_nan=False) | st.integers(1, 10**6)
    momentum = st.floats(0.0, 1.0, exclude_max=True, allow_nan=False)

    def spec(lr: float, momentum: float, nesterov: bool, keys: int, scaling: bool) -> dict:
        out: dict[str, Any] = {"name": "sgd", "lr": lr}
        if keys >= 1 or momentum > 0:
            out["momentum"] = momentum
        if keys >= 2 or nesterov:
            out["nesterov"] = nesterov and momentum > 0
        if keys >= 3:
            out["inner_lr_scaling"] = scaling
        return out

    return st.builds(spec, lr, momentum, st.booleans(), st.integers(0, 3), st.booleans())


_OUTER = Arg(
    allowed="None (plain averaging) or a mapping {'name': 'sgd', 'lr': > 0, 'momentum': [0, 1) (0), 'nesterov': bool "
    "(False; needs momentum > 0), 'inner_lr_scaling': bool (True)}",
    valid=st.none() | _outer_specs(),
    invalid=st.one_of(
        st.integers(),
        _ANY_FLOAT,
        st.booleans(),
        _TEXT,
        _JUNK,
        st.builds(lambda lr: {"name": "sgd", "lr": lr}, st.floats(max_value=0.0) | st.sampled_from([INF, True, "1"])),
        st.builds(
            lambda m: {"name": "sgd", "lr": 0.7, "momentum": m},
            st.floats(min_value=1.0) | st.floats(max_value=0.0, exclude_max=True) | st.just(math.nan),
        ),
        st.builds(lambda n: {"name": n, "lr": 0.7}, _TEXT | st.sampled_from(["SGD", "adam", "nesterov", None, 1])),
        st.builds(lambda k: {"name": "sgd", "lr": 0.7, k: 0.1}, st.sampled_from(["dampening", "weight_decay", "mu"])),
        st.sampled_from([{"name": "sgd"}, {"lr": 0.7}, {"name": "sgd", "lr": 0.7, "nesterov": True}]),
        st.builds(lambda v: {"name": "sgd", "lr": 0.7, "inner_lr_scaling": v}, st.sampled_from([1, 0, "yes", None])),
    ),
    message=r"outer_optimizer(\['\w+'\])? (must|has unknown keys|= True needs)",
    edges_valid=(None, {"name": "sgd", "lr": 1e-300}, {"name": "sgd", "lr": 1, "momentum": 0.0}, DILOCO_OUTER),
    edges_invalid=(
        {"name": "sgd", "lr": 0.0},
        {"name": "sgd", "lr": 0.7, "momentum": 1.0},
        {"name": "sgd", "lr": 0.7, "nesterov": True},
        {"name": "SGD", "lr": 0.7},
        {},
        "sgd",
    ),
)
#: DiLoCo also takes "auto" (the outer optimizer chosen from the inner one at setup), its default
_DILOCO_OUTER = replace(
    _OUTER,
    allowed="'auto' (default), " + _OUTER.allowed,
    valid=_OUTER.valid | st.just("auto"),
    invalid=st.one_of(_OUTER.invalid, st.sampled_from(["Auto", "AUTO", "auto ", "slowmo"])),
    edges_valid=(*_OUTER.edges_valid, "auto"),
)
_DIVISORS = tuple(d for d in range(1, DEFAULT_SYNC_EVERY + 1) if DEFAULT_SYNC_EVERY % d == 0)


def _ranks_with_a_bad_entry() -> Any:
    return st.tuples(st.lists(st.integers(0, 8), max_size=3), st.sampled_from([-1, True, 1.5, "0", None])).map(
        lambda t: t[0] + [t[1]]
    )


# --------------------------------------------------------------------------------------------- SyncStrategy's
_NOT_AN_OBJECT = st.one_of(st.integers(), _ANY_FLOAT, st.booleans(), _TEXT, _JUNK)


def _link_arg(name: str) -> Arg:
    """A link to emulate: None, a LinkModel or 'BANDWIDTH[,LATENCY]'."""
    return Arg(
        allowed="None, a LinkModel, or 'BANDWIDTH[,LATENCY]' such as '1gbit,1ms'",
        valid=st.one_of(
            st.none(),
            _RATE_TEXT,
            st.builds("{},{}".format, _RATE_TEXT, _DURATION_TEXT),
            st.builds(LinkModel, _RATE_TEXT, _DURATION_TEXT),
        ),
        invalid=st.one_of(
            _TEXT,
            _BAD_QUANTITIES,
            st.builds("{},{}".format, _RATE_TEXT, _BAD_QUANTITIES),
            st.builds("{},{},{}".format, _RATE_TEXT, _DURATION_TEXT, _DURATION_TEXT),
            st.integers(),
            _ANY_FLOAT,
            st.booleans(),
            _JUNK,
        ),
        message=rf"{name} must be a LinkModel, a string 'BANDWIDTH\[,LATENCY\]'",
        edges_valid=(None, "1gbit", "1gbit,0ms", LinkModel("10mbit", "5ms")),
        edges_invalid=("", ",", "1gbit,", "0gbit,1ms", "1gbit,-1ms", 1e9, True),
    )


_REPLICA_SIZE = Arg(
    allowed="None (every rank a replica), 'node' (the ranks of one node) or an integer >= 1",
    valid=st.one_of(st.none(), st.just("node"), st.integers(1, 10**6)),
    invalid=st.one_of(
        st.integers(max_value=0),
        _ANY_FLOAT,
        st.booleans(),
        _TEXT,
        st.sampled_from(["Node", "NODE", "nodes", "2", ""]),
        _JUNK,
    ),
    message=r"replica_size must be None \(every rank a replica\), 'node' .* or an integer >= 1",
    edges_valid=(None, "node", 1, 10**6),
    edges_invalid=(0, -1, 2.0, True, "2", "Node", " node"),
    note="it must divide the world size: checked at setup (needs the Trainer's topology)",
)


def _refused(name: str, spec: Arg) -> Arg:
    """An argument only ``None`` is accepted for: the method refuses replica groups, saying why."""
    return Arg(
        allowed="None only (the method cannot run with replica groups: its docs say why)",
        valid=st.none(),
        invalid=spec.valid.filter(lambda v: v is not None),
        message=rf"{name} must be None for \w+Strategy: .*Use {name}=None",
        edges_valid=(None,),
        edges_invalid=tuple(v for v in spec.edges_valid if v is not None),
    )


def base_specs(parameter_server: bool = False, replica_groups: bool = True) -> dict[str, Arg]:
    """The arguments every strategy inherits from :class:`SyncStrategy` (and passes on to ``DDPStrategy``);
    ``replica_groups=False``: a method that refuses ``replica_size`` and ``intra_link``."""
    if parameter_server:
        injection = Arg(
            allowed="None only (dynamic work assignment has no per-rank partition to inject into)",
            valid=st.none(),
            invalid=st.one_of(st.tuples(_UNIT, _UNIT), st.tuples(_BAD_UNIT, _UNIT), _TEXT, _JUNK, st.integers()),
            message=r"injection must be None for \w+Strategy: .*Use injection with",
            edges_valid=(None,),
            edges_invalid=((0.5, 0.5), (1.0, 1.0)),
        )
    else:
        injection = Arg(
            allowed="None or (alpha, beta), both in (0, 1] (tuple or list)",
            valid=st.one_of(st.none(), st.tuples(_UNIT, _UNIT), st.lists(_UNIT, min_size=2, max_size=2)),
            invalid=st.one_of(
                st.tuples(_BAD_UNIT, _UNIT),
                st.tuples(_UNIT, _BAD_UNIT),
                st.lists(_UNIT, max_size=4).filter(lambda xs: len(xs) != 2),
                st.integers(),
                _ANY_FLOAT,
                st.booleans(),
                _TEXT,
                _JUNK,
            ),
            message=r"injection.*\(0(\.0)?, 1(\.0)?\]",
            edges_valid=(None, (1.0, 1.0), (1, 1), [0.5, 1.0]),
            edges_invalid=((0.0, 0.5), (0.5, 0.0), (1.0, 1.0 + 1e-9), (0.5,), (0.5, 0.5, 0.5), (), "ab"),
        )
    intra_link = _link_arg("intra_link")
    if replica_groups:
        intra_link = replace(intra_link, note="needs replica groups (replica_size resolving to > 1): checked at setup")
    return {
        "link": _link_arg("link"),
        "replica_size": _REPLICA_SIZE if replica_groups else _refused("replica_size", _REPLICA_SIZE),
        "intra_link": intra_link if replica_groups else _refused("intra_link", intra_link),
        "sharded": replace(
            bool_arg("sharded"),
            allowed="a bool; True needs replica_size and a method that runs sharded (BSP, SelSync, local SGD, "
            "FedAvg, ADPSGD, DiLoCo)",
            valid=st.just(False),
            edges_valid=(False,),
            note="True alone raises for a missing replica_size, and the parameter-server family, OSP and Sync-Switch "
            "refuse it, saying why: tests/test_sharded.py, tests/test_sharded_methods.py",
        ),
        "save_distributed_checkpoint": replace(
            bool_arg("save_distributed_checkpoint"),
            allowed="a bool; True needs sharded=True and no fault_tolerance",
            valid=st.just(False),
            edges_valid=(False,),
            note="True without sharded=True, or with fault_tolerance, raises saying why: "
            "tests/test_sharded.py::test_save_distributed_checkpoint_needs_sharded_replicas_without_fault_tolerance",
        ),
        "verify_sync": bool_arg("verify_sync"),
        "compression": _COMPRESSION,
        "sync_stats": bool_arg("sync_stats"),
        "fault_tolerance": _fault_tolerance_arg(supported=False),
        "local_clipping": choice_arg(
            "local_clipping",
            ("scaled", "as_given"),
            r"local_clipping must be 'scaled' \(.*\) or 'as_given' \(.*\), got",
        ),
        "injection": injection,
        "injection_seed": int_arg("injection_seed", 0, note="any size: mixed into 64 bits by SplitMix64"),
        "accelerator": Arg(
            allowed="None, a lightning Accelerator, or a name such as 'cpu'",
            valid=st.one_of(st.none(), st.just(CPUAccelerator()), st.text(max_size=8)),
            invalid=st.one_of(st.integers(), _ANY_FLOAT, st.booleans(), _JUNK, st.just(torch.device("cpu"))),
            message=r"accelerator must be a lightning Accelerator, a name such as 'cpu' or None",
            edges_valid=(None, "cpu", CPUAccelerator()),
            edges_invalid=(torch.device("cpu"), 0, CPUAccelerator),
            note="type-checked here; passed on to DDPStrategy as is. A name is resolved (an unknown one rejected) by "
            "the Trainer, which also replaces it with its own Accelerator object",
        ),
        "parallel_devices": Arg(
            allowed="None or a list (or tuple) of torch.device",
            valid=st.one_of(st.none(), st.lists(_DEVICES, max_size=3), st.lists(_DEVICES, max_size=3).map(tuple)),
            invalid=st.one_of(
                st.lists(st.sampled_from(["cpu", 0, None, "cuda:0"]), min_size=1, max_size=3),
                st.just(torch.device("cpu")),
                st.integers(),
                _ANY_FLOAT,
                st.booleans(),
                _TEXT,
                _JUNK,
            ),
            message=r"parallel_devices must be a list of torch.device or None",
            edges_valid=(None, [], [torch.device("cpu")], (torch.device("cpu"), torch.device("cpu"))),
            edges_invalid=(torch.device("cpu"), ["cpu"], "cpu", 2),
            note="type-checked here; passed on as is (the Trainer fills it in when None or empty)",
        ),
        "cluster_environment": Arg(
            allowed="None or a lightning ClusterEnvironment",
            valid=st.one_of(st.none(), st.just(LightningEnvironment())),
            invalid=st.one_of(_NOT_AN_OBJECT, st.none().map(lambda _: LightningEnvironment)),
            message=r"cluster_environment must be a lightning ClusterEnvironment or None",
            edges_valid=(None, LightningEnvironment()),
            edges_invalid=("slurm", LightningEnvironment),
            note="type-checked here; passed on as is (Lightning's object; its settings are Lightning's to check)",
        ),
        "checkpoint_io": Arg(
            allowed="None or a lightning CheckpointIO",
            valid=st.one_of(st.none(), st.just(TorchCheckpointIO())),
            invalid=_NOT_AN_OBJECT,
            message=r"checkpoint_io must be a lightning CheckpointIO or None",
            edges_valid=(None, TorchCheckpointIO()),
            edges_invalid=("torch", TorchCheckpointIO),
            note="type-checked here; passed on as is (Lightning's object)",
        ),
        "precision_plugin": Arg(
            allowed="None or a lightning.pytorch Precision plugin",
            valid=st.one_of(st.none(), st.just(Precision()), st.just(MixedPrecision("bf16-mixed", "cpu"))),
            invalid=st.one_of(_NOT_AN_OBJECT, st.sampled_from(["16-mixed", "bf16-mixed", 16, 32])),
            message=r"precision_plugin must be a lightning.pytorch Precision plugin or None",
            edges_valid=(None, Precision(), MixedPrecision("16-mixed", "cpu")),
            edges_invalid=("16-mixed", 32),
            note="type-checked here; passed on as is. Which precision a strategy supports is checked at setup "
            "(fp16 AMP is rejected: see the Trainer-settings matrix)",
        ),
        "process_group_backend": Arg(
            allowed="None (Lightning's choice) or a non-empty backend name",
            valid=st.one_of(st.none(), st.sampled_from(["gloo", "nccl", "mpi", "ucc"]), st.text(min_size=1)),
            invalid=st.one_of(st.just(""), st.integers(), _ANY_FLOAT, st.booleans(), _JUNK),
            message=r"process_group_backend must be None \(Lightning picks gloo or nccl\) or a torch.distributed",
            edges_valid=(None, "gloo"),
            edges_invalid=("", 0, True),
            note="type-checked here; whether the backend exists is torch's to check when the process group starts",
        ),
        "timeout": Arg(
            allowed="None (torch's default) or a datetime.timedelta > 0",
            valid=st.one_of(st.none(), st.timedeltas(min_value=timedelta(microseconds=1))),
            invalid=st.one_of(
                st.timedeltas(max_value=timedelta(0)), st.integers(), _ANY_FLOAT, st.booleans(), _TEXT, _JUNK
            ),
            message=r"timeout must be a datetime.timedelta > 0 or None",
            edges_valid=(None, timedelta(microseconds=1), timedelta(days=365)),
            edges_invalid=(timedelta(0), timedelta(seconds=-1), 60, 60.0, "0:01:00"),
            note="checked here (LightningCLI turns '0:01:00' into a timedelta before construction)",
        ),
        "start_method": choice_arg(
            "start_method",
            START_METHODS,
            r"start_method must be one of 'popen', 'spawn', 'fork', 'forkserver'",
            note="checked here; ignored when the processes are started externally (torchrun, SLURM)",
        ),
    }


def _with(base: dict[str, Arg], **own: Arg) -> dict[str, Arg]:
    return {**base, **own}


def _auto_or(number: Arg, message: str) -> Arg:
    """``"auto"`` or what ``number`` allows (SelSync's ``delta``)."""
    return Arg(
        allowed=f"'auto' or {number.allowed}",
        valid=number.valid | st.just("auto"),
        invalid=number.invalid,
        message=message,
        edges_valid=(*number.edges_valid, "auto"),
        edges_invalid=(*number.edges_invalid, "AUTO", "", " auto"),
    )


_SHARD = int_arg("shard_size", 1)
_LR_PACE = choice_arg("lr_pace", ("global", "local"), r"lr_pace must be 'global' \(.*\) or 'local'")
_PUSH_SCALE = {
    "update_scale": Arg(
        allowed="'auto' (1/m) or a number in (0, inf)",
        valid=st.one_of(st.just("auto"), st.floats(0.0, 1e6, exclude_min=True, allow_nan=False), st.integers(1, 10)),
        invalid=st.one_of(
            st.floats(max_value=0.0, allow_nan=False),
            st.sampled_from([math.nan, INF, -INF, "AUTO", "", "1/m", True, False, None]),
            _JUNK,
        ),
        message=re.escape("update_scale must be 'auto' (1/m) or a number in (0.0, inf)"),
        edges_valid=("auto", 1e-300, 1.0, 1),
        edges_invalid=(0.0, 0, -1.0, INF, math.nan, "Auto", True),
    ),
    "warmup_steps": int_arg("warmup_steps", 0),
    "worker_momentum": Arg(
        allowed="'auto', None or a number in [0, 1)",
        valid=st.one_of(st.just("auto"), st.none(), st.floats(0.0, 1.0, exclude_max=True), st.just(0)),
        invalid=st.one_of(
            st.floats(max_value=0.0, exclude_max=True, allow_nan=False),
            st.floats(min_value=1.0, allow_nan=False),
            st.sampled_from([math.nan, INF, -INF, "AUTO", "", "0.5", True, False, 1]),
            _JUNK,
        ),
        message=re.escape("worker_momentum must be 'auto', None or a number in [0.0, 1.0)"),
        edges_valid=("auto", None, 0.0, 0, 0.999999),
        edges_invalid=(1.0, -1e-300, INF, math.nan, "Auto", True),
    ),
}
_BUCKET_CAP = real_arg(
    "bucket_cap_mb",
    0.0,
    low_open=True,
    none_ok=True,
    note="None: one all-reduce after backward, no overlap (BSPStrategy: with find_unused_parameters=True, None is "
    "rejected: the unused parameters are found by the bucketed all-reduce's hooks)",
)


def _fault_tolerance_arg(supported: bool) -> Arg:
    """``fault_tolerance``: a :class:`~lightning_sync.FaultTolerance` or None where the method supports it (with torchft
    installed: the ``ft`` extra), None only where it does not (the refusal says why)."""
    import importlib.util

    ft = lightning_sync.FaultTolerance(lighthouse="http://127.0.0.1:29510", replica_group=0, replica_groups=2)
    junk = st.one_of(_TEXT, st.integers(), _ANY_FLOAT, st.booleans(), _JUNK, st.just({"lighthouse": "http://h:1"}))
    if supported:
        with_torchft = importlib.util.find_spec("torchft") is not None
        return Arg(
            allowed="None or a lightning_sync.FaultTolerance",
            valid=st.one_of(st.none(), st.just(ft)) if with_torchft else st.none(),
            invalid=junk,
            message=r"fault_tolerance must be a lightning_sync\.FaultTolerance\(\.\.\.\) or None",
            edges_valid=(None, ft) if with_torchft else (None,),
            edges_invalid=({"lighthouse": "http://h:1"}, "http://h:1", True),
            note="the FaultTolerance itself is validated at its construction; torchft's presence here (ImportError "
            "naming the ft extra); the Trainer settings (accumulate_grad_batches, one process per group) at setup",
        )
    return Arg(
        allowed="None only (the method cannot run fault-tolerant: the error says why)",
        valid=st.none(),
        invalid=st.one_of(st.just(ft), junk),
        message=r"fault_tolerance must be (None for \w+Strategy, which cannot run fault-tolerant|a lightning_sync)",
        edges_valid=(None,),
        edges_invalid=(ft, "http://h:1"),
    )


#: the methods with local steps: what validation evaluates
_EVALUATE = choice_arg("evaluate", ("average", "last_sync"), r"evaluate must be one of 'average', 'last_sync'")

SPECS: dict[type, dict[str, Arg]] = {
    BSPStrategy: _with(
        base_specs(),
        fault_tolerance=_fault_tolerance_arg(supported=True),
        bucket_cap_mb=_BUCKET_CAP,
        find_unused_parameters=bool_arg("find_unused_parameters"),
    ),
    SelSyncStrategy: _with(
        base_specs(),
        delta=_auto_or(real_arg("delta", 0.0, allow_inf=True), r"delta must be 'auto' or a number in \[0\.0, inf\]"),
        sync_fraction=real_arg(
            "sync_fraction", 0.0, 1.0, low_open=True, none_ok=True, note="with a fixed delta it must be None (checked)"
        ),
        calibration_warmup=int_arg(
            "calibration_warmup", 0, MAX_INT64, none_ok=True, note="with a fixed delta it must be None (checked)"
        ),
        average_at_end=bool_arg("average_at_end"),
        evaluate=Arg(**{**_EVALUATE.__dict__, "note": "with aggregation='gradients' only 'average': refused there"}),
        window=int_arg("window", 1, MAX_INT64, note="upper bound: a deque's maxlen"),
        smoothing=real_arg("smoothing", 0.0, 1.0, low_open=True, none_ok=True),
        aggregation=choice_arg(
            "aggregation", ("parameters", "gradients"), r"aggregation must be 'parameters' or 'gradients'"
        ),
        outer_optimizer=Arg(
            **{**_OUTER.__dict__, "note": "with aggregation='gradients' (not the default) only None: refused there"}
        ),
        vote=choice_arg(
            "vote",
            ("exact", "overlapped", None),
            r"vote must be 'exact', 'overlapped' or None",
            note="'overlapped' with aggregation='gradients' is refused (checked)",
        ),
    ),
    LocalSGDStrategy: _with(
        base_specs(),
        fault_tolerance=_fault_tolerance_arg(supported=True),
        period=int_arg("period", 1),
        warmup_steps=int_arg("warmup_steps", 0),
        offset=int_arg("offset", 0, 7, note="in [0, period - 1]: [0, 7] with the default period 8"),
        average_at_end=bool_arg("average_at_end"),
        evaluate=_EVALUATE,
        outer_optimizer=_OUTER,
    ),
    FedAvgStrategy: _with(
        base_specs(),
        fault_tolerance=_fault_tolerance_arg(supported=True),
        fraction=real_arg("fraction", 0.0, 1.0, low_open=True),
        syncs_per_epoch=int_arg(
            "syncs_per_epoch", 1, note="<= the training batches per epoch: checked at train start (needs the data)"
        ),
        seed=int_arg("seed", 0, note="any size: mixed into 64 bits by SplitMix64"),
        average_at_end=bool_arg("average_at_end"),
        evaluate=_EVALUATE,
        outer_optimizer=_OUTER,
    ),
    ADPSGDStrategy: _with(
        base_specs(),
        fault_tolerance=_fault_tolerance_arg(supported=True),
        p_init=int_arg(
            "p_init",
            1,
            64,
            message=r"p_init must be an integer (>= 1|in \[1, max_period\] = \[1, 64\])",
            note="upper bound: max_period (default 64)",
        ),
        warmup_epochs=int_arg("warmup_epochs", 0),
        sample_fraction=real_arg("sample_fraction", 0.0, 1.0, high_open=True),
        min_samples=int_arg("min_samples", 1),
        low=Arg(
            allowed="finite number, 0 < low < high (default high 1.3)",
            valid=st.floats(0.0, 1.3, exclude_min=True, exclude_max=True),
            invalid=st.one_of(
                st.floats(max_value=0.0, allow_nan=False),
                st.floats(min_value=1.3, allow_nan=False),
                st.just(math.nan),
                st.booleans(),
                _TEXT,
                _JUNK,
                st.none(),
            ),
            message=r"low must be (a finite number > 0|< high)",
            edges_valid=(1e-300, 1.2999999),
            edges_invalid=(0.0, 1.3, math.nan, INF, True),
        ),
        high=Arg(
            allowed="finite number > low (default low 0.7)",
            valid=st.floats(min_value=0.7, exclude_min=True, allow_nan=False, allow_infinity=False),
            invalid=st.one_of(
                st.floats(max_value=0.7, allow_nan=False), st.sampled_from([INF, math.nan]), st.booleans(), _TEXT, _JUNK
            ),
            message=r"(high must be a finite number > 0|low must be < high)",
            edges_valid=(0.7000001, 1e300),
            edges_invalid=(0.7, 0.0, INF, math.nan, True),
        ),
        max_period=Arg(
            allowed="integer >= max(1, p_init) (default p_init 4)",
            valid=st.integers(4, 10**12),
            invalid=st.one_of(st.integers(max_value=3), _ANY_FLOAT, st.booleans(), _TEXT, _JUNK, st.none()),
            message=r"max_period must be an integer >= 1|in \[1, max_period\]",
            edges_valid=(4, 10**6),
            edges_invalid=(3, 0, 4.0, True),
        ),
        average_at_end=bool_arg("average_at_end"),
        evaluate=_EVALUATE,
        outer_optimizer=_OUTER,
    ),
    DiLoCoStrategy: _with(
        base_specs(),  # compression as every strategy's (plain DiLoCo; streaming with it: test_diloco.py)
        fault_tolerance=_fault_tolerance_arg(supported=True),
        sync_every=int_arg("sync_every", 1),
        outer_optimizer=_DILOCO_OUTER,
        fragments=Arg(
            allowed=f"integer in [1, sync_every] dividing sync_every (default sync_every {DEFAULT_SYNC_EVERY})",
            valid=st.sampled_from(_DIVISORS),
            invalid=st.one_of(
                st.integers().filter(lambda k: k not in _DIVISORS), _ANY_FLOAT, st.booleans(), _TEXT, _JUNK, st.none()
            ),
            message=rf"fragments must (be an integer in \[1, {DEFAULT_SYNC_EVERY}\]|divide sync_every)",
            edges_valid=(1, DEFAULT_SYNC_EVERY),
            edges_invalid=(0, DEFAULT_SYNC_EVERY + 1, 3, 2.0, True),
            note="upper bound and divisibility: sync_every's",
        ),
        delay=int_arg(
            "delay", 0, DEFAULT_SYNC_EVERY - 1, note="upper bound: sync_every // fragments - 1 (default fragments 1)"
        ),
        alpha=real_arg("alpha", 0.0, 1.0),
        average_at_end=bool_arg("average_at_end"),
        evaluate=_EVALUATE,
    ),
    OSPStrategy: _with(
        base_specs(replica_groups=False),
        bandwidth=Arg(
            allowed="None (measured), a positive finite number of bits/s, or a rate such as '1gbit'",
            valid=st.one_of(
                st.none(),
                _RATE_TEXT,
                st.integers(1, 10**12),
                st.floats(min_value=0.0, exclude_min=True, allow_nan=False, allow_infinity=False),
            ),
            invalid=st.one_of(
                st.floats(max_value=0.0, allow_nan=False),
                st.sampled_from([INF, math.nan]),
                st.integers(max_value=0),
                _BAD_QUANTITIES,
                _TEXT,
                st.booleans(),
                _JUNK,
            ),
            message=r"bandwidth must (look like|be a positive finite rate)",
            edges_valid=(None, "1gbit", 1, 1e-300),
            edges_invalid=(0, 0.0, "0mbit", INF, math.nan, True),
        ),
        max_unimportant_fraction=real_arg("max_unimportant_fraction", 0.0, 1.0, high_open=True),
        loss_rate=real_arg("loss_rate", 0.0, 1.0),
        fixed_share=real_arg("fixed_share", 0.0, 1.0, high_open=True, none_ok=True),
        bucket_cap_mb=_BUCKET_CAP,
    ),
    ASPStrategy: _with(
        base_specs(parameter_server=True, replica_groups=False), shard_size=_SHARD, lr_pace=_LR_PACE, **_PUSH_SCALE
    ),
    SSPStrategy: _with(
        base_specs(parameter_server=True, replica_groups=False),
        shard_size=_SHARD,
        lr_pace=_LR_PACE,
        staleness=int_arg("staleness", 0),
        **_PUSH_SCALE,
    ),
    ALADDINStrategy: _with(
        base_specs(parameter_server=True, replica_groups=False),
        shard_size=_SHARD,
        lr_pace=_LR_PACE,
        period=int_arg("period", 1),
        alpha=Arg(
            allowed="None (1 - 1/sqrt(n*period)), 'per_push', or a number in (0, 1]",
            valid=st.one_of(st.none(), st.just("per_push"), _UNIT, st.just(1)),
            invalid=st.one_of(_BAD_UNIT, st.sampled_from(["PER_PUSH", "per-push", ""]), _JUNK, st.just(INF)),
            message=r"alpha must be a number in \(0(\.0)?, 1(\.0)?\]",
            edges_valid=(None, "per_push", 1.0, 1e-300),
            edges_invalid=(0.0, 1.0000001, "per push", math.nan, True),
        ),
        aggregate=choice_arg("aggregate", ("mean", "sum"), r"aggregate must be 'mean' \(weight 1/n\) or 'sum'"),
    ),
    SyncSwitchStrategy: _with(
        base_specs(parameter_server=True, replica_groups=False),
        shard_size=_SHARD,
        lr_pace=_LR_PACE,
        bsp_lr_scale=real_arg("bsp_lr_scale", 0.0, low_open=True, none_ok=True),
        asp_lr_scale=real_arg("asp_lr_scale", 0.0, low_open=True),
        **_PUSH_SCALE,
        bucket_cap_mb=_BUCKET_CAP,
    ),
    # ------------------------------------------------------------------------------------------------ callbacks
    SyncStats: {
        "prefix": Arg(
            allowed="string (may be empty)",
            valid=st.text(max_size=12),
            invalid=st.one_of(st.integers(), _ANY_FLOAT, st.booleans(), st.none(), _JUNK),
            message=r"prefix must be a string",
            edges_valid=("", "sync/"),
            edges_invalid=(None, b"sync/"),
        ),
        "log_every_n_steps": int_arg("log_every_n_steps", 1, none_ok=True),
        "prog_bar": bool_arg("prog_bar"),
    },
    SelDP: {
        "seed": int_arg(
            "seed",
            0,
            MAX_INT64,
            none_ok=True,
            note="upper bound: the sampler seeds torch.Generator with seed + epoch (at most 2**64 - 1)",
        ),
    },
    EpochPrinter: {},
    StragglerInjection: {
        "ranks": Arg(
            allowed="integer >= 0, or a non-empty sequence (list, tuple) of integers >= 0",
            valid=st.one_of(
                st.integers(0, 10**6),
                st.lists(st.integers(0, 64), min_size=1, max_size=4),
                st.lists(st.integers(0, 64), min_size=1, max_size=4).map(tuple),
            ),
            invalid=st.one_of(
                st.integers(max_value=-1),
                _ranks_with_a_bad_entry(),
                st.sampled_from([[], (), "0", "01"]),
                _ANY_FLOAT,
                st.booleans(),
                st.none(),
                _TEXT,
                _JUNK,
            ),
            message=r"ranks must be an integer >= 0 or a non-empty sequence of integers >= 0",
            edges_valid=(0, [0], (0, 0), range(2)),
            edges_invalid=(-1, [], [-1], [0, True], "0", 0.0),
        ),
        "slowdown": real_arg("slowdown", 1.0),
        "start": int_arg("start", 0),
        "duration": int_arg("duration", 1, none_ok=True),
    },
    SyncSwitch: {
        "schedule": Arg(
            allowed="(protocol, end) pairs, {'protocol', 'until'} dicts, 'bsp:0.25,asp:1.0', a YAML file path or a "
            "SwitchSchedule; protocols bsp/asp, ends strictly increasing in (0, 1], the last 1.0",
            valid=_schedules(),
            invalid=_BAD_SCHEDULES,
            message=r"schedule.*(must|neither)",
            edges_valid=([("bsp", 1.0)], [("asp", 1.0)], "bsp:0.25,asp:1.0", SwitchSchedule.switch_at(0.5)),
            edges_invalid=([("bsp", 0.999999)], [("bsp", 1.0), ("asp", 1.0)], "", "bsp:1.5"),
        ),
        "policy": choice_arg("policy", (None, "greedy", "elastic"), r"policy must be one of \(None, 'greedy'"),
        "window": int_arg("window", 1, MAX_INT64, note="upper bound: a deque's maxlen"),
        "consecutive": int_arg("consecutive", 1),
        "margin": real_arg("margin", 0.0, 1.0, high_open=True),
        "min_participants": int_arg("min_participants", 1),
    },
}

#: The DDPStrategy arguments SyncStrategy passes on (validated by type here; see each spec's note).
PASS_THROUGH = (
    "process_group_backend",
    "timeout",
    "start_method",
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "checkpoint_io",
    "precision_plugin",
)
CASES = [pytest.param(cls, name, id=f"{cls.__name__}.{name}") for cls, specs in SPECS.items() for name in specs]


def _exported_classes() -> set[type]:
    strategies = {
        obj
        for name in lightning_sync.__all__
        if isinstance(obj := getattr(lightning_sync, name), type) and issubclass(obj, SyncStrategy)
    }
    strategies.discard(SyncStrategy)  # the base: its arguments are every subclass's, checked there
    callbacks = {getattr(callbacks_module, name) for name in callbacks_module.__all__}
    return strategies | set(STRATEGIES) | callbacks


def _constructor_arguments(cls: type) -> set[str]:
    """What ``cls(...)`` accepts: its ``__init__``'s named parameters, and those of the ``__init__``s it forwards
    ``**kwargs`` to, up the MRO, until one takes no ``**kwargs`` (``SyncStrategy``) or Lightning is reached."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("lightning_sync"):
            break
        init = vars(klass).get("__init__")
        if init is None:
            continue
        params = list(inspect.signature(init).parameters.values())[1:]
        names |= {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return names


def _raises_naming_the_argument(cls: type, name: str, value: Any, spec: Arg) -> None:
    with pytest.raises(ValueError) as info:
        cls(**{name: value})
    message = str(info.value)
    assert name in message, f"{cls.__name__}({name}={value!r}): the message does not name {name}: {message}"
    assert re.search(spec.message, message), (
        f"{cls.__name__}({name}={value!r}): the message does not state the allowed range "
        f"(expected /{spec.message}/): {message}"
    )


# ----------------------------------------------------------------------------------------------------- tests
def test_every_constructor_argument_has_a_spec():
    assert set(SPECS) == _exported_classes(), "a strategy or callback is exported without a spec table entry"
    for cls, specs in SPECS.items():
        assert _constructor_arguments(cls) == set(specs), (
            f"{cls.__name__}: arguments without a spec: {sorted(_constructor_arguments(cls) - set(specs))}; "
            f"specs without an argument: {sorted(set(specs) - _constructor_arguments(cls))}"
        )


def test_every_strategy_inherits_syncstrategy_arguments_including_the_ddp_pass_through():
    base = set(inspect.signature(SyncStrategy.__init__).parameters) - {"self"}
    assert set(PASS_THROUGH) <= base
    assert base == {
        "link",
        "verify_sync",
        "sync_stats",
        "injection",
        "injection_seed",
        "compression",
        "replica_size",
        "sharded",
        "save_distributed_checkpoint",
        "intra_link",
        "fault_tolerance",
        "local_clipping",
        *PASS_THROUGH,
    }
    for cls in STRATEGIES:
        assert base <= _constructor_arguments(cls), cls.__name__
        for name in PASS_THROUGH:
            assert SPECS[cls][name].note, f"{cls.__name__}.{name}: say who validates what"


@pytest.mark.parametrize("cls,name", CASES)
@HYPOTHESIS
@given(data=st.data())
def test_invalid_values_raise_value_error_naming_the_argument_and_range(cls, name, data):
    spec = SPECS[cls][name]
    _raises_naming_the_argument(cls, name, data.draw(spec.invalid, label=name), spec)


@pytest.mark.parametrize("cls,name", CASES)
@HYPOTHESIS
@given(data=st.data())
def test_valid_values_construct(cls, name, data):
    cls(**{name: data.draw(SPECS[cls][name].valid, label=name)})


@pytest.mark.parametrize("cls,name", CASES)
def test_boundaries(cls, name):
    spec = SPECS[cls][name]
    assert spec.edges_valid and spec.edges_invalid, "every argument lists its boundary cases"
    for value in spec.edges_valid:
        cls(**{name: value})
    for value in spec.edges_invalid:
        _raises_naming_the_argument(cls, name, value, spec)


@pytest.mark.parametrize(
    "name,value,attribute",
    [
        ("start_method", "fork", "_start_method"),
        ("timeout", timedelta(seconds=7), "_timeout"),
        ("timeout", None, "_timeout"),
        ("process_group_backend", "gloo", "_process_group_backend"),
        ("accelerator", "cpu", "_accelerator"),
        ("parallel_devices", [torch.device("cpu")], "parallel_devices"),
        ("cluster_environment", LightningEnvironment(), "cluster_environment"),
        ("checkpoint_io", TorchCheckpointIO(), "_checkpoint_io"),
        ("precision_plugin", Precision(), "_precision_plugin"),
    ],
)
def test_pass_through_arguments_reach_ddp_strategy_unchanged(name, value, attribute):
    for cls in STRATEGIES:
        assert getattr(cls(**{name: value}), attribute) is value, f"{cls.__name__}.{name}"


def test_link_string_is_parsed():
    assert BSPStrategy(link="1gbit,2ms").link == LinkModel("1gbit", "2ms")


# ============================================================================================ part 2: the matrix
COLUMNS = (
    "manual optimization",
    "multiple optimizers",
    "accumulate_grad_batches=2",
    "precision='16-mixed'",
    "gradient_clip_val=1.0",
    "EarlyStopping",
    "ModelCheckpoint(every_n_train_steps=N)",
    "ModelCheckpoint(every_n_epochs=1)",
)


@dataclass(frozen=True)
class Cell:
    supported: bool
    reason: str = ""  #: rejected: why, and what to use instead (the table's text)
    match: str = ""  #: rejected: regex the error must match
    error: type = ValueError  #: rejected: the exception (ours are ValueError; Lightning's are its own)


OK = Cell(True)
_MANUAL = Cell(
    False,
    "it acts inside the optimizer closure of automatic optimization; use automatic optimization (or DDPStrategy)",
    r"does not support manual optimization \(automatic_optimization=False\)",
)
_MULTI = Cell(
    False,
    "Lightning allows several optimizers only with manual optimization, which is rejected; use one optimizer "
    "with parameter groups",
    r"Training with multiple optimizers is only supported with manual optimization",
    RuntimeError,
)
_FP16 = Cell(
    False,
    "fp16 AMP hands the strategy loss-scaled gradients; use precision='bf16-mixed' or '32-true'",
    r"does not support precision='16-mixed'.*Use precision='bf16-mixed'",
)
_ACCUM = Cell(
    False,
    "its schedule counts batches or times single steps; use a larger batch size",
    r"does not support accumulate_grad_batches=2.*Use a larger batch size",
)
_CLIP = Cell(
    False,
    "the LGP correction assumes the unclipped local gradient was applied; remove gradient_clip_val",
    r"does not support gradient clipping.*Remove gradient_clip_val",
)
_STEP_CHECKPOINT = Cell(
    False,
    "ranks run different numbers of steps and meet only at epoch ends; use ModelCheckpoint(every_n_epochs=N)",
    r"does not support ModelCheckpoint\(every_n_train_steps=.*Use ModelCheckpoint\(every_n_epochs=N\)",
)


def _row(**cells: Cell) -> dict[str, Cell]:
    row = dict.fromkeys(COLUMNS, OK)
    row.update({"manual optimization": _MANUAL, "multiple optimizers": _MULTI, "precision='16-mixed'": _FP16})
    keys = {"accumulate": "accumulate_grad_batches=2", "clip": "gradient_clip_val=1.0"}
    keys["step_checkpoint"] = "ModelCheckpoint(every_n_train_steps=N)"
    row.update({keys[k]: v for k, v in cells.items()})
    return row


MATRIX: dict[type, dict[str, Cell]] = {
    BSPStrategy: _row(),
    SelSyncStrategy: _row(),
    LocalSGDStrategy: _row(),
    FedAvgStrategy: _row(accumulate=_ACCUM),
    ADPSGDStrategy: _row(accumulate=_ACCUM),
    OSPStrategy: _row(accumulate=_ACCUM, clip=_CLIP),
    ASPStrategy: _row(step_checkpoint=_STEP_CHECKPOINT),
    SSPStrategy: _row(step_checkpoint=_STEP_CHECKPOINT),
    ALADDINStrategy: _row(step_checkpoint=_STEP_CHECKPOINT),
    SyncSwitchStrategy: _row(accumulate=_ACCUM, step_checkpoint=_STEP_CHECKPOINT),
    DiLoCoStrategy: _row(),
}


def render_matrix_markdown() -> str:
    """The matrix as a Markdown table: one row per strategy, one column per Trainer setting."""
    lines = ["| strategy | " + " | ".join(f"`{c}`" if "=" in c else c for c in COLUMNS) + " |"]
    lines.append("|" + "---|" * (len(COLUMNS) + 1))
    for cls, row in MATRIX.items():
        cells = ["supported" if row[c].supported else f"rejected at setup: {row[c].reason}" for c in COLUMNS]
        lines.append(f"| `{cls.strategy_name}` ({cls.__name__}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- models and probes
class _ManualModel(DigitsCNN):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):  # never reached: rejected at setup
        raise AssertionError("manual optimization ran")


class _TwoOptimizers(DigitsCNN):
    def configure_optimizers(self):
        params = list(self.parameters())
        half = len(params) // 2
        return torch.optim.SGD(params[:half], lr=0.05), torch.optim.SGD(params[half:], lr=0.05)


class _TwoOptimizersManual(_TwoOptimizers, _ManualModel):
    pass


def _grad_norm(module: torch.nn.Module) -> float:
    return float(
        torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in module.parameters() if p.grad is not None]))
    )


class _ClipProbe(Callback):
    """Gradient norm before clipping (``on_before_optimizer_step``, after the strategy's own step hook) and after
    (the optimizer's step post-hook: the gradient the update used); for BSP, whether the all-reduce came first."""

    def on_train_start(self, trainer, pl_module):
        self.before, self.after, self.averaged_first = [], [], []
        self._module = pl_module
        trainer.optimizers[0].register_step_post_hook(lambda *_: self.after.append(_grad_norm(self._module)))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.before.append(_grad_norm(pl_module))
        self.averaged_first.append(trainer.strategy.step_counter.sync_steps == trainer.global_step + 1)


_BATCHES = 2  # training batches per epoch (of 8 samples)
_EPOCHS = 2


def _strategy(cls: type, **kw: Any) -> SyncStrategy:
    own = {FedAvgStrategy: {"syncs_per_epoch": 2}, LocalSGDStrategy: {"period": 2}, DiLoCoStrategy: {"sync_every": 2}}
    own = own.get(cls, {})
    return cls(timeout=timedelta(seconds=60), **own, **kw)


def _trainer(strategy: SyncStrategy, callbacks: list[Callback] = (), **kw: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_epochs=_EPOCHS,
        limit_train_batches=_BATCHES,
        limit_val_batches=1,
        callbacks=list(callbacks),
        **quiet_trainer_kwargs(**kw),
    )


def _steps_in(directory: Path) -> list[int]:
    return sorted(int(re.search(r"step=(\d+)", p.name).group(1)) for p in directory.glob("*.ckpt"))


MATRIX_CASES = [
    pytest.param(cls, column, id=f"{cls.strategy_name}-{re.sub(r'[^A-Za-z0-9_=]+', '_', column).strip('_')}")
    for cls in MATRIX
    for column in COLUMNS
]


@pytest.mark.filterwarnings("ignore:.*runs with world size 1")
@pytest.mark.parametrize("cls,column", MATRIX_CASES)
def test_trainer_setting(single_process, tmp_path, cls, column):
    cell = MATRIX[cls][column]
    model: pl.LightningModule = DigitsCNN(channels=4, hidden=16)  # small: the fits show behaviour, not speed
    callbacks: list[Callback] = []
    kw: dict[str, Any] = {}
    strategy_kw: dict[str, Any] = {}
    steps = _EPOCHS * _BATCHES
    if column == "manual optimization":
        model = _ManualModel()
    elif column == "multiple optimizers":
        model = _TwoOptimizers()
    elif column == "accumulate_grad_batches=2":
        kw["accumulate_grad_batches"] = 2
        steps //= 2
    elif column == "precision='16-mixed'":
        # On CPU, Trainer(precision="16-mixed") becomes bf16-mixed in Lightning itself (see the test below); a real
        # fp16 AMP plugin, given to the strategy, goes through the same connector and setup as on a GPU.
        strategy_kw["precision_plugin"] = MixedPrecision("16-mixed", "cpu")
    elif column == "gradient_clip_val=1.0":
        kw["gradient_clip_val"] = 1.0
        callbacks.append(probe := _ClipProbe())
    elif column == "EarlyStopping":
        callbacks.append(EarlyStopping(monitor="val/loss", mode="min", stopping_threshold=1e9))  # stop at once
        steps = _BATCHES
    elif column.startswith("ModelCheckpoint"):
        every = {"every_n_train_steps": 2} if "steps" in column else {"every_n_epochs": 1}
        callbacks.append(ModelCheckpoint(dirpath=tmp_path, filename="{step}", save_top_k=-1, **every))
        kw["enable_checkpointing"] = True
    strategy = _strategy(cls, **strategy_kw)
    trainer = _trainer(strategy, callbacks, **kw)

    if not cell.supported:
        with pytest.raises(cell.error, match=cell.match):
            trainer.fit(model, DigitsDataModule(batch_size=8))
        assert trainer.global_step == 0  # at setup, before any step
        if column == "multiple optimizers":  # and with manual optimization, the strategy rejects it
            with pytest.raises(ValueError, match=_MANUAL.match):
                _trainer(_strategy(cls)).fit(_TwoOptimizersManual(), DigitsDataModule(batch_size=8))
        return

    trainer.fit(model, DigitsDataModule(batch_size=8))
    assert trainer.state.finished and trainer.global_step == steps
    assert strategy.step_counter.steps == steps  # the strategy acted at every optimizer step
    if column == "gradient_clip_val=1.0":
        assert len(probe.before) == len(probe.after) == steps and max(probe.before) > 1.0
        for before, after in zip(probe.before, probe.after):
            assert after == pytest.approx(min(before, 1.0), rel=1e-4)  # the update used the clipped gradient
        if cls is BSPStrategy:  # clipping sees the averaged gradient, as with DDP
            assert all(probe.averaged_first)
    elif column == "EarlyStopping":
        assert trainer.should_stop and trainer.current_epoch == 1 < _EPOCHS
    elif column.startswith("ModelCheckpoint"):
        expected = list(range(2, steps + 1, 2)) if "steps" in column else [_BATCHES * (e + 1) for e in range(_EPOCHS)]
        assert _steps_in(tmp_path) == expected
        for path in tmp_path.glob("*.ckpt"):
            assert Path(SyncStrategy.rank_file(path, 0)).exists()  # this rank's part beside each checkpoint


def test_matrix_agrees_with_supports_accumulation():
    for cls, row in MATRIX.items():
        assert row["accumulate_grad_batches=2"].supported == cls.supports_accumulation, cls.__name__


def test_matrix_renders_as_markdown():
    table = render_matrix_markdown().splitlines()
    assert len(table) == 2 + len(MATRIX)
    for line, cls in zip(table[2:], MATRIX):
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        assert cells[0] == f"`{cls.strategy_name}` ({cls.__name__})" and len(cells) == 1 + len(COLUMNS)
        assert all(c == "supported" or c.startswith("rejected at setup: ") for c in cells[1:])


def test_fp16_on_cpu_becomes_bf16_in_lightning():
    """Why the matrix passes an fp16 plugin to the strategy: on CPU, Lightning turns precision='16-mixed' into
    bf16-mixed (with a warning) before the strategy sees it, and bf16 is supported."""
    with pytest.warns(UserWarning, match="Using `precision='bf16-mixed'` instead"):
        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=BSPStrategy(), precision="16-mixed", logger=False)
    assert trainer.strategy.precision_plugin.precision == "bf16-mixed"


@pytest.mark.filterwarnings("ignore:.*runs with world size 1")
def test_parameter_server_strategy_with_timeout_none_sets_up(single_process):
    """timeout=None means torch's default; the parameter server's work counter (a TCPStore) needs a timedelta."""
    strategy = ASPStrategy(timeout=None)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=0,
        **quiet_trainer_kwargs(),
    )
    trainer.fit(DigitsCNN(), DigitsDataModule(batch_size=8))
    assert trainer.global_step == 2


@pytest.mark.filterwarnings("ignore:.*runs with world size 1")
def test_replica_groups_that_the_topology_cannot_make_are_refused_at_setup(single_process):
    """``replica_size`` must divide the world size, and ``intra_link`` needs replica groups of more than one rank
    (``"node"`` on one device per node makes each rank its own replica): refused at setup, before any collective,
    saying why and what to use instead. ``"node"`` with one device trains as flat."""

    def fit(strategy: SyncStrategy) -> pl.Trainer:
        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, **quiet_trainer_kwargs())
        trainer.fit(DigitsCNN(), DigitsDataModule(batch_size=8))
        return trainer

    with pytest.raises(ValueError, match=r"replica_size must divide the world size 1 .*use a divisor of 1, 'node'"):
        fit(LocalSGDStrategy(replica_size=2))
    with pytest.raises(ValueError, match=r"intra_link emulates the link inside a replica group.*Set replica_size"):
        fit(SelSyncStrategy(replica_size="node", intra_link="10gbit"))
    trainer = fit(LocalSGDStrategy(replica_size="node"))
    assert trainer.global_step == 1 and trainer.strategy.ranks_per_replica == 1


if __name__ == "__main__":
    print(render_matrix_markdown())
