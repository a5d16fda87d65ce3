"""Pick each method's hyperparameters for one workload, by time to target, and write them as `compare` recipes.

For each method, every candidate of its grid (below; `--grid NAME.KEY=v1,v2` replaces or adds one) is run as a
`compare` row — real `lightning-sync fit` runs, `--seeds` seeds, at `--link`, stopping at the workload's target —
and the candidate with the lowest mean time to target wins (MLPerf's summary, see `lightning_sync.benchmark.ttt`;
a candidate whose mean is missed loses to any that has one; ties: more runs reached, then the better best metric);
when every candidate missed, no recipe is written (the method keeps its defaults) and the script says so.
The winner is written to `<recipes>/<workload>/<method>.yaml` with how it was chosen (the command, the link, the
seeds, every candidate's mean and reached count), for `lightning-sync compare --recipes`.

Grids (the paper's or the pack's default first):

* selsync: `sync_fraction` in {0.25 (the default, with `delta="auto"`), 0.125, 0.0625, 0.5}: the fraction of
  steps that synchronise, δ being set online to meet it. The paper's fixed δ = 0.3 was set for its smoothing and
  models; with ours Δ can sit far below or above it, which is why the pack's default calibrates δ online from the
  measured Δ instead. A fixed-δ sweep stays available with
  `--grid selsync.delta=0.3,0.1,...`: then the 25/50/75% quantiles of Δ measured in a calibration run (SelSync with
  δ = 0, which syncs every step and logs Δ) are added to the candidates (the fraction of steps that sync is then
  about 1 - quantile).
* localsgd: `period` in {8 (default), 2, 4, 16}; fedavg: `syncs_per_epoch` in {4 (default), 1, 2, 8};
  adpsgd: `p_init` in {4 (default), 2, 8}; osp: `max_unimportant_fraction` (the ICS share's cap) in
  {0.8 (the paper's), 0.5, 0.95};
* asp, ssp, aladdin: a scale of the learning rate (the model's lr times s) in {1, 0.5, 0.25, 0.125} on top of their
  DDP-anchored defaults (ASP/SSP push 1/m of each update with the derived worker momentum; ALADDIN weighs each
  update 1/n); sync_switch: `asp_lr_scale` in {1 (default), 0.5, 0.25, 0.125}.

`--methods selsync+bf16` tunes the compressed variant (the recipe is written for `selsync`; use it with
`compare --strategies selsync+bf16 --recipes`); `--strategy-arg NAME.KEY=VALUE` (as in `compare`) is set on every
candidate of NAME (e.g. `selsync.evaluate=last_sync`) and written into the recipe's arguments with the chosen
value (the recipe is what was measured). Recipes tuned at another link go to their own root
(`--write examples/recipes_100mbit`, then `compare --recipes-dir examples/recipes_100mbit`).

Any other registered strategy (a new method) is tuned only through `--grid`. BSP and ddp have nothing to tune (the
learning rate is DDP's, the user's).

    python benchmarks/tune.py --workload vgg --devices 4 --link 1gbit,1ms --seeds 2 --write examples/recipes

Smoke scale (checks the script, not a tuning): `--methods localsgd --grid localsgd.period=4,8 --seeds 1
--trainer.max_epochs=2 --write runs/tune/recipes`.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from typing import Any

import yaml

from lightning_sync.benchmark.recipes import Recipe, recipe_path, write_recipe
from lightning_sync.benchmark.runs import REFERENCE, Row, RunResult, base_lr, make_row
from lightning_sync.benchmark.ttt import Summary, summarize_runs
from lightning_sync.compare import compress_row

#: method -> (init argument or "lr_scale", candidate values); the first is the default
GRIDS: dict[str, tuple[str, list[Any]]] = {
    "selsync": ("sync_fraction", [0.25, 0.125, 0.0625, 0.5]),
    "localsgd": ("period", [8, 2, 4, 16]),
    "fedavg": ("syncs_per_epoch", [4, 1, 2, 8]),
    "adpsgd": ("p_init", [4, 2, 8]),
    "osp": ("max_unimportant_fraction", [0.8, 0.5, 0.95]),
    "asp": ("lr_scale", [1.0, 0.5, 0.25, 0.125]),
    "ssp": ("lr_scale", [1.0, 0.5, 0.25, 0.125]),
    "aladdin": ("lr_scale", [1.0, 0.5, 0.25, 0.125]),
    "sync_switch": ("asp_lr_scale", [1.0, 0.5, 0.25, 0.125]),
}
DELTA_QUANTILES = (0.25, 0.5, 0.75)


def _value(text: str) -> Any:
    return yaml.safe_load(text)


def parse_grid(items: list[str]) -> dict[str, tuple[str, list[Any]]]:
    grids: dict[str, tuple[str, list[Any]]] = {}
    for item in items:
        name, _, rest = item.partition(".")
        key, _, values = rest.partition("=")
        if not name or not key or not values:
            raise ValueError(f"--grid must look like NAME.KEY=v1,v2,...; got {item!r}")
        grids[name.replace("-", "_")] = (key, [_value(v) for v in values.split(",")])
    return grids


def candidate_row(
    method: str, key: str, value: Any, lr: float | None, cli_args: list[str] | None = None, codec: str = ""
) -> Row:
    """One candidate: ``method`` with ``key=value``, the ``--strategy-arg`` values of every candidate (``cli_args``)
    and, with ``codec``, its compressed variant (``selsync+bf16``)."""
    recipe = Recipe(method, {} if key == "lr_scale" else {key: value}, lr_scale=value if key == "lr_scale" else None)
    row = make_row(method, cli_args, recipe=recipe, lr=lr)
    if codec:
        compress_row(row, codec)
    row.label = f"{method}{'+' + codec if codec else ''} {key}={value}"
    return row


def score(summary: Summary, best: float, mode: str) -> tuple[float, int, float]:
    """Lower is better: the mean time (inf when missed), more runs reached, the better best metric."""
    mean = summary.mean_s if summary.mean_s is not None else math.inf
    return (mean, -summary.reached, -best if mode == "max" else best)


def delta_quantiles(results: list[RunResult]) -> list[float]:
    """Quantiles of SelSync's logged relative gradient change Delta (``sync/delta``) over the calibration runs."""
    deltas = sorted(h["sync/delta"] for r in results for h in r.history if "sync/delta" in h and h["sync/delta"] > 0)
    if not deltas:
        return []
    return [round(deltas[min(len(deltas) - 1, int(q * len(deltas)))], 4) for q in DELTA_QUANTILES]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from lightning_sync.benchmark.grid import run_grid
    from lightning_sync.compare import parse_args, parse_strategy_args, prepare

    argv = list(sys.argv[1:] if argv is None else argv)
    tune = argparse.ArgumentParser(add_help=False)
    tune.add_argument("--methods", default=",".join(GRIDS), help="methods to tune (default: every method with a grid)")
    tune.add_argument("--grid", action="append", default=[], metavar="NAME.KEY=v1,v2", help="replace/add a grid")
    tune.add_argument("--write", default="examples/recipes", help="recipes root (<root>/<workload>/<method>.yaml)")
    tune.add_argument("--no-calibrate", action="store_true", help="selsync: skip the delta=0 calibration run")
    targs, rest = tune.parse_known_args(argv)
    if not any(a == "--link" or a.startswith("--link=") for a in rest):
        rest += ["--link", "1gbit,1ms"]
    if not any(a.startswith("--out") for a in rest):
        rest += ["--out", "runs/tune"]
    args, extra, parser = parse_args(rest)
    if len(args.link) != 1:
        parser.error("tune at one link: give --link once")
    grids = dict(GRIDS)
    try:
        grids.update(parse_grid(targs.grid))
    except ValueError as err:
        parser.error(str(err))
    strategy_args = parse_strategy_args(args, parser)
    command = "python benchmarks/tune.py " + shlex.join(argv)
    link = args.link[0]
    grid = prepare(args, extra, parser)
    lr = base_lr(grid.config)
    chosen: dict[str, Any] = {}
    for entry in [m.strip() for m in targs.methods.split(",") if m.strip()]:
        name, _, codec = entry.partition("+")
        method = name.replace("-", "_")
        if method == REFERENCE or method not in grids:
            print(f"[tune] {method}: no grid (give one with --grid {method}.KEY=v1,v2)", flush=True)
            continue
        key, values = grids[method]
        values = list(values)
        if method == "selsync" and key == "delta" and not targs.no_calibrate:
            calibration = make_row("selsync", [*strategy_args.get(method, []), "delta=0.0"])
            if codec:
                compress_row(calibration, codec)
            calibration.label = "selsync delta=0 (calibration)"
            runs = run_grid(grid, [(link, link)], [calibration])
            measured = delta_quantiles(runs)
            print(f"[tune] selsync: Delta quantiles {DELTA_QUANTILES} = {measured}", flush=True)
            values += [q for q in measured if q not in values]
        try:
            rows = [candidate_row(method, key, v, lr, strategy_args.get(method), codec) for v in values]
        except ValueError as err:
            parser.error(f"--methods {entry}: {err}")
        results = run_grid(grid, [(link, link)], rows)
        table = []
        for row, value in zip(rows, values):
            runs = [r for r in results if r.label == row.label]
            times = [r.outcome.time_s if r.ok and r.outcome is not None else None for r in runs]
            bests = [r.outcome.best for r in runs if r.ok and r.outcome is not None and not math.isnan(r.outcome.best)]
            best = sum(bests) / len(bests) if bests else math.nan
            summary = summarize_runs(times)
            table.append((score(summary, best, grid.target.mode), value, summary, best))
        table.sort(key=lambda t: t[0])
        (_, value, summary, best) = table[0]
        if summary.mean_s is None:
            print(
                f"[tune] {method}: no candidate of {key} in {values} reached the target; no recipe written", flush=True
            )
            chosen[method] = {key: None, "mean_s": None, "path": None}
            continue
        fixed = {k: _value(v) for k, _, v in (a.partition("=") for a in strategy_args.get(method, []))}
        recipe = Recipe(
            method,
            {**fixed, **({} if key == "lr_scale" else {key: value})},
            lr_scale=value if key == "lr_scale" else None,
            tuned={
                "command": command,
                "link": link,
                "seeds": len(grid.seeds),
                "target": grid.target.describe(),
                "by": f"lowest mean time to target over {key} in {values}",
                "candidates": [
                    {key: v, "mean_s": s.mean_s, "reached": f"{s.reached}/{s.runs}", "best": b} for _, v, s, b in table
                ],
            },
        )
        path = recipe_path(targs.write, args.workload, method)
        write_recipe(path, recipe, f"{method} on {args.workload}: chosen by benchmarks/tune.py (see 'tuned').")
        chosen[method] = {key: value, "mean_s": summary.mean_s, "path": str(path)}
        mean = "missed" if summary.mean_s is None else f"{summary.mean_s:.1f} s"
        print(
            f"[tune] {method}: {key}={value} ({mean}, {summary.reached}/{summary.runs} reached) -> {path}", flush=True
        )
    return chosen


if __name__ == "__main__":
    main()
