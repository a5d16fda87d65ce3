#!/bin/bash
# words at an emulated 1 Gbit/s + 1 ms: Lightning's DDP and OSP at its defaults, 2 seeds, 4 ranks with one thread
# each, on the device machine's 16 CPU cores (no GPU used: the workload's config is accelerator=cpu). The same
# configuration as the 2-core runs, but with spare cores for OSP's in-flight all-reduce (its ICS stage).
export PYTHONPATH=$PWD:$PWD/.devsite PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
S=${SCRATCH:-$(mktemp -d)}  # scratch folder (the run used the device's /tmp)
nproc --all; python3 --version; python3 -c "import torch, lightning, sklearn; from lightning.pytorch.cli import _JSONARGPARSE_SIGNATURES_AVAILABLE as J; print(torch.__version__, lightning.__version__, bool(J)); assert J" || exit 3
date -u
timeout 500 python3 -m lightning_sync.cli compare --workload words --strategies ddp,osp --seeds 2 --link 1gbit,1ms \
    --run-timeout 200 --out $S/out > $S/compare.log 2>&1
echo "compare rc=$? $(date -u +%T)"
tail -40 $S/compare.log
cp $S/compare.log $OUT/
cd $S && tar czf $OUT/words1g_osp_device.tgz --exclude='*.ckpt' --exclude='*.pt' out 2>&1 | tail -3
ls -la $OUT
