#!/bin/bash
# vgg at an emulated 1 Gbit/s: learning-rate scales of the asynchronous family and OSP's cap, one lane per candidate,
# 2 seeds each, on the device machine's 16 CPU cores (no GPU used: the workload's config is accelerator=cpu).
export PYTHONPATH=$PWD:$PWD/.devsite PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
nproc --all; python3 -c "import torch, lightning, sklearn; from lightning.pytorch.cli import _JSONARGPARSE_SIGNATURES_AVAILABLE as J; print(torch.__version__, lightning.__version__, bool(J)); assert J" || exit 3
date -u
lane() {
  name=$1; shift
  timeout 510 python3 benchmarks/tune.py --workload vgg --devices 4 --link 1gbit,1ms --seeds 2 --run-timeout 250 \
    "$@" --write <scratch>/rec_$name --out <scratch>/tune_$name > <scratch>/log_$name.txt 2>&1
  echo "$name rc=$? $(date -u +%T)" >> <scratch>/rcs.txt
}
lane asp1 --methods asp --grid asp.lr_scale=1.0 &
lane asp2 --methods asp --grid asp.lr_scale=2.0 &
lane ssp1 --methods ssp --grid ssp.lr_scale=1.0 &
lane ssp2 --methods ssp --grid ssp.lr_scale=2.0 &
lane aladdin1 --methods aladdin --grid aladdin.lr_scale=1.0 &
lane aladdin2 --methods aladdin --grid aladdin.lr_scale=2.0 &
lane ss1 --methods sync_switch --grid sync_switch.lr_scale=1.0 &
lane ss2 --methods sync_switch --grid sync_switch.lr_scale=2.0 &
lane osp08 --methods osp --grid osp.max_unimportant_fraction=0.8 &
lane osp05 --methods osp --grid osp.max_unimportant_fraction=0.5 &
wait
date -u
cat <scratch>/rcs.txt
grep -h "reached in\|missed\|Error\|error" <scratch>/log_*.txt | head -60
cd /tmp && tar czf $OUT/vgg_tune.tgz --exclude='*.ckpt' --exclude='*.pt' rcs.txt log_*.txt rec_* tune_* 2>&1 | tail -3
ls -la $OUT
