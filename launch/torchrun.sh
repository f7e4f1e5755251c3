#!/usr/bin/env bash
# Distributed training with torchrun: one node, or several with c10d rendezvous by IP address.
#
#   one node (GPUs of this machine, or NPROC_PER_NODE CPU processes):
#     launch/torchrun.sh --config-name v3.2_warmup model.pretrained=/ckpt/V3.1-Terminus ...
#   several nodes: run the same command on every node, MASTER_ADDR = IP address of node 0
#     NNODES=16 MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 RUN_ID=warmup1 launch/torchrun.sh --config-name ...
#
# Environment: NNODES (1), NPROC_PER_NODE (GPUs on this node, else 1), MASTER_ADDR (127.0.0.1;
# an IP address: hostnames do not always resolve between nodes), MASTER_PORT (29500),
# RUN_ID (the rendezvous id, the same on every node; default dsa-train), PYTHON (python3),
# MAX_RESTARTS (3: after a rank fails, torchrun restarts all workers, which resume from the last
# checkpoint).
# The recipe's `parallel` group must match NNODES x NPROC_PER_NODE ranks (checked at start-up).
# Every rank gets the same run directory (the recipe's run_dir: set it explicitly, e.g.
# run_dir=/shared/runs/NAME, on a file system all nodes see). SIGTERM to this script reaches
# torchrun, which forwards it to the ranks: they checkpoint at the next step and exit 75.
set -euo pipefail
PYTHON=${PYTHON:-python3}
NNODES=${NNODES:-1}
if [ -z "${NPROC_PER_NODE:-}" ]; then
  NPROC_PER_NODE=$("$PYTHON" -c 'import torch; print(max(torch.cuda.device_count(), 1))')
fi
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
RUN_ID=${RUN_ID:-dsa-train}
if [ "$NPROC_PER_NODE" -ge 1 ] && ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
fi
MAX_RESTARTS=${MAX_RESTARTS:-3}
# gloo and NCCL keep a socket per peer: raise the open-files soft limit to the hard limit
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
# restarts need a fresh rendezvous store per attempt (torch shares the agent's by default)
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
# a node-local Triton cache (a shared one races between nodes)
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-${TMPDIR:-/tmp}/dsa-triton-$RUN_ID-$(hostname -s)}
exec "$PYTHON" -m torch.distributed.run \
  --nnodes="$NNODES" --nproc_per_node="$NPROC_PER_NODE" \
  --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv_id="$RUN_ID" \
  --max_restarts="$MAX_RESTARTS" \
  -m dsa_train.launch.rank "$@"
