#!/usr/bin/env bash
# Multi-node training with torchrun: run this same command on every node (any order; torchrun's c10d rendezvous
# waits until NNODES nodes have joined and numbers them).
#
#   RDZV_ENDPOINT=node0.example:29400 NNODES=2 NPROC_PER_NODE=4 bash examples/torchrun.sh --strategy selsync
#
# Everything after the script's name goes to examples/train.py (--strategy, --strategy-arg KEY=VALUE, --link,
# --max-epochs, --max-steps, --out, ...), after the arguments set here, so it can override them.
#
# Environment (this script's):
#   RDZV_ENDPOINT   HOST:PORT of the rendezvous: a host every node reaches (usually node 0) and a free port there.
#                   The node whose hostname or address matches HOST hosts the rendezvous store.
#   NNODES          number of nodes (default 2)
#   NPROC_PER_NODE  processes per node, one per GPU (default 1)
#   RDZV_ID         a job id shared by the nodes of one job (default lightning-sync)
#   ACCELERATOR     passed to --accelerator (default auto: gpu where there is one, else cpu)
#
# torchrun starts every process and sets MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK, GROUP_RANK,
# LOCAL_WORLD_SIZE and TORCHELASTIC_RUN_ID (and OMP_NUM_THREADS=1 with NPROC_PER_NODE > 1, unless set). Lightning
# detects that (TorchElasticEnvironment) and launches nothing itself; the lightning-sync strategies do the same
# whatever their start_method. Trainer(num_nodes=NNODES, devices=NPROC_PER_NODE) must match what torchrun started:
# Lightning checks the world size. Under torchrun the strategy names without _spawn / _notebook are the ones to use.
#
# Network: gloo (CPU) and NCCL (GPU) pick an interface by themselves; where a node has several, name the one the
# nodes share, e.g. GLOO_SOCKET_IFNAME=eth0 / NCCL_SOCKET_IFNAME=eth0 (exported before running this script).
#
# One machine, two "nodes" (each torchrun in its own shell, the same port; what tests/test_examples.py runs):
#   RDZV_ENDPOINT=127.0.0.1:29400 NNODES=2 NPROC_PER_NODE=1 bash examples/torchrun.sh --max-steps 20 &
#   RDZV_ENDPOINT=127.0.0.1:29400 NNODES=2 NPROC_PER_NODE=1 bash examples/torchrun.sh --max-steps 20
set -euo pipefail

: "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=HOST:PORT (a host every node reaches, e.g. node 0, and a free port)}"
NNODES="${NNODES:-2}"
NPROC_PER_NODE="${NPROC_PER_NODE:-1}"
RDZV_ID="${RDZV_ID:-lightning-sync}"
ACCELERATOR="${ACCELERATOR:-auto}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

exec torchrun \
    --nnodes="$NNODES" \
    --nproc-per-node="$NPROC_PER_NODE" \
    --rdzv-backend=c10d \
    --rdzv-endpoint="$RDZV_ENDPOINT" \
    --rdzv-id="$RDZV_ID" \
    "$HERE/train.py" \
    --num-nodes "$NNODES" \
    --devices "$NPROC_PER_NODE" \
    --accelerator "$ACCELERATOR" \
    "$@"
