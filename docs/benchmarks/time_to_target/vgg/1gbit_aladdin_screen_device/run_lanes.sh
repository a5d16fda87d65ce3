#!/bin/bash
# ALADDIN at an emulated 1 Gbit/s + 1 ms with the fixed parameter-server emulation: a screening of its learning-rate
# scale and of a shorter period with alpha held, on vgg and words, one lane per candidate, 2 seeds each, on the device
# machine's 16 CPU cores (no GPU used: the workloads' configs are accelerator=cpu; 24 ranks on 16 cores).
export PYTHONPATH=$PWD:$PWD/.devsite PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
S=${SCRATCH:-$(mktemp -d)}; mkdir -p $S  # scratch folder (on the device, a fixed scratch folder: <scratch> in the files here)
nproc --all; python3 --version
python3 -c "import torch, lightning, sklearn; from lightning.pytorch.cli import _JSONARGPARSE_SIGNATURES_AVAILABLE as J; print(torch.__version__, lightning.__version__, bool(J)); assert J" || exit 3
git log --oneline -1 2>/dev/null; date -u
lane() {
  name=$1; wl=$2; shift 2
  timeout 520 python3 benchmarks/tune.py --workload $wl --devices 4 --link 1gbit,1ms --seeds 2 --run-timeout 250 \
    --methods aladdin "$@" --write $S/rec_$name --out $S/tune_$name > $S/log_$name.txt 2>&1
  echo "$name rc=$? $(date -u +%T)" >> $S/rcs.txt
}
P2="--strategy-arg aladdin.period=2 --strategy-arg aladdin.alpha=0.75"
lane vgg_s1 vgg --grid aladdin.lr_scale=1.0 &
lane vgg_s05 vgg --grid aladdin.lr_scale=0.5 &
lane vgg_p2 vgg --grid aladdin.lr_scale=1.0 $P2 &
lane words_s1 words --grid aladdin.lr_scale=1.0 &
lane words_s05 words --grid aladdin.lr_scale=0.5 &
lane words_p2 words --grid aladdin.lr_scale=1.0 $P2 &
wait
date -u
cat $S/rcs.txt
grep -h "reached in\|missed\|Error\|error" $S/log_*.txt | head -60
cd $S && tar czf $OUT/aladdin_lanes.tgz --exclude='*.ckpt' --exclude='*.pt' rcs.txt log_*.txt rec_* tune_* 2>&1 | tail -3
ls -la $OUT
