#!/bin/bash
# CPU time (system-wide, /proc/stat) and fit time of the same DDP steps, emulated link against the namespace cluster.
#
#   sudo bash benchmarks/cluster_cpu.sh [OUT]     (root: the cluster needs network namespaces; OUT default runs/cluster_cpu)
#
# 50 DDP steps on words (2 epochs; target 1 is never met, so both runs train the same steps), 4 ranks: first at an
# emulated 1 Gbit/s + 1 ms, then on `--cluster 4x1gbit` (kernel-limited veth links). Prints per run: wall seconds,
# CPU seconds by kind (user, system, softirq, idle) and, from the run's time_to_target.jsonl, the fit's wall and
# blocked seconds. Nothing else should run meanwhile (the CPU figures are the whole machine's).
# CLUSTER_THREADS=N sets OMP_NUM_THREADS for the cluster run only: CLUSTER_THREADS=2 on a 2-core machine is what
# Lightning's per-node rule gave each host's process before the cluster set its share (the "before" figures).
set -euo pipefail
OUT=${1:-runs/cluster_cpu}
mkdir -p "$OUT"
run() {
  local name=$1; shift
  local a b t0 t1
  a=$(head -1 /proc/stat); t0=$(date +%s.%N)
  lightning-sync compare --workload words --strategies ddp --seeds 1 --target 1 --trainer.max_epochs=2 \
    --out "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
  b=$(head -1 /proc/stat); t1=$(date +%s.%N)
  python3 - "$name" "$a" "$b" "$t0" "$t1" "$OUT/$name" <<'PY'
import json, pathlib, sys
name, a, b, t0, t1, out = sys.argv[1:]
ticks = [y - x for x, y in zip(map(int, a.split()[1:]), map(int, b.split()[1:]))]
kinds = dict(zip(["user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal"], ticks))
records = next(pathlib.Path(out).rglob("time_to_target.jsonl")).read_text().splitlines()
end = [r for r in map(json.loads, records) if r.get("event") == "end"][0]
cpu = " ".join(f"{k} {kinds[k] / 100:.1f} s" for k in ("user", "system", "softirq", "idle"))
print(f"{name}: wall {float(t1) - float(t0):.1f} s; CPU {cpu}; fit {end['wall_s']:.1f} s over {end['step']} steps, "
      f"blocked {end['comm']['blocked_s']:.1f} s")
PY
}
run emulated --link 1gbit,1ms
if [ -n "${CLUSTER_THREADS:-}" ]; then
  OMP_NUM_THREADS=$CLUSTER_THREADS run cluster --cluster 4x1gbit
else
  run cluster --cluster 4x1gbit
fi
