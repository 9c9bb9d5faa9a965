#!/usr/bin/env bash
# One node's share of a multi-node run; start it on every node with the same MASTER_ADDR and RUN_ID.
#   NNODES=2 MASTER_ADDR=node0 bash launch/multi_node.sh --config configs/gpt2-124m.yaml
# c10d rendezvous assigns node ranks; a node that joins late or restarts rejoins the same run.
set -euo pipefail
cd "$(dirname "$0")/.."
. launch/activate.sh
: "${NNODES:?set NNODES to the number of nodes}"
: "${MASTER_ADDR:?set MASTER_ADDR to the host name of one node}"
nproc="${NPROC_PER_NODE:-$(python -c 'import torch; print(torch.cuda.device_count() or 1)')}"
exec torchrun \
  --nnodes="$NNODES" --nproc_per_node="$nproc" \
  --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:${MASTER_PORT:-29500}" --rdzv_id="${RUN_ID:-lm}" \
  --max-restarts="${MAX_RESTARTS:-0}" \
  -m lm.train "$@"
