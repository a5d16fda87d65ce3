#!/usr/bin/env bash
# Every GPU measurement of issue 51, prepared for a lent GPU machine (device tool: 15 min of device time in all,
# start included, at most 10 min a command). Two commands, each under 10 minutes:
#
#     bash benchmarks/gpu_session.sh tests overhead     # ~5 min: GPU tests; hot-path overhead (parts 1 and 4)
#     bash benchmarks/gpu_session.sh compare            # ~9 min: time to target on the GPU, vgg, 1 and 10 Gbit/s
#
# Prepare here first (the device machine has no network, and its python lacks jsonargparse):
#     pip download -d .whl "jsonargparse[signatures]==4.53.0"      # .whl/ is git-ignored: pass carry [".whl"]
# Results go to $OUT (default runs/gpu_session): env.txt, gpu_tests.txt, overhead.txt, compare_<link>/ (tables,
# plots, runs.csv). Every step has its own time limit, so one that hangs cannot take the others' time.
#
# What each part measures:
# * tests: python -m pytest -m gpu tests/test_gpu.py (every strategy on one GPU over NCCL, two ranks sharing it over
#   gloo, every packaged workload's fit and validation on the GPU, compare --accelerator gpu).
# * overhead: benchmarks/overhead.py --accelerator gpu, part 1 (BSP's step vs Lightning DDP's, goal <= 1.03) and
#   part 4 (SelSync's non-syncing step, exact and overlapped vote, vs local SGD's step with no collective, without
#   and with an emulated 1 ms latency; goal for the overlapped vote <= 1.03), ResNet-18, batch 128, two ranks on GPU 0.
# * compare: vgg with batch 32 per rank (two ranks: the 4-rank CPU configuration's global batch of 64), two ranks
#   sharing GPU 0 over gloo as one-GPU nodes, emulated links 1 Gbit/s and 10 Gbit/s, rows DDP, BSP, local SGD+bf16,
#   DiLoCo+bf16, SelSync, OSP (the recipes tuned at 1 Gbit/s on CPU where they exist, --recipes only), one seed
#   each, and DDP's seeds 1-2 in a second invocation, merged: DDP over 3 seeds (the goal table's reference).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PARTS=${*:-tests overhead compare}

if ! python3 -c "import jsonargparse" 2>/dev/null; then
    python3 -m pip install --quiet --no-index --find-links .whl "jsonargparse[signatures]" 2>&1 | tail -2
fi
python3 -m pip install --quiet --no-deps --no-build-isolation -e . 2>&1 | tail -2
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__)"
    git log --oneline -1 2>/dev/null || true
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

for PART in $PARTS; do
    case $PART in
    tests)
        timeout 180 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py > "$OUT/gpu_tests.txt" 2>&1
        tail -3 "$OUT/gpu_tests.txt"
        ;;
    overhead)
        timeout 300 python3 benchmarks/overhead.py --accelerator gpu --parts 1,4 --repeats 3 --steps 60 \
            > "$OUT/overhead.txt" 2>&1
        grep -E "^## |median" "$OUT/overhead.txt"
        ;;
    compare)
        for LINK in 1gbit,1ms 10gbit,1ms; do
            TAG=${LINK%%,*}
            LIMIT=$([ "$TAG" = 1gbit ] && echo 330 || echo 150)
            timeout "$LIMIT" lightning-sync compare --workload vgg --accelerator gpu --devices 2 \
                --data.init_args.batch_size=32 --strategies ddp,bsp,localsgd+bf16,diloco+bf16,selsync,osp \
                --recipes only --seeds 1 --link "$LINK" --run-timeout 120 \
                --out "$OUT/compare_${TAG}_rows" > "$OUT/compare_${TAG}_rows.log" 2>&1
            timeout "$LIMIT" lightning-sync compare --workload vgg --accelerator gpu --devices 2 \
                --data.init_args.batch_size=32 --strategies ddp --seeds 2 --seed-base 1 --link "$LINK" \
                --run-timeout 120 --out "$OUT/compare_${TAG}_ddp" > "$OUT/compare_${TAG}_ddp.log" 2>&1
            lightning-sync compare --merge "$OUT/compare_${TAG}_rows" "$OUT/compare_${TAG}_ddp" \
                --out "$OUT/compare_${TAG}" > "$OUT/compare_${TAG}.log" 2>&1
            cat "$OUT/compare_${TAG}/${TAG}-1ms/table.md" 2>/dev/null || tail -5 "$OUT/compare_${TAG}_rows.log"
        done
        ;;
    *) echo "unknown part $PART (tests, overhead, compare)"; exit 2 ;;
    esac
done
