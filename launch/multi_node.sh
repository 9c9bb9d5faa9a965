#!/usr/bin/env bash
# One node's share of a multi-node run: start it on every node with the same NNODES, MASTER_ADDR,
# MASTER_PORT and RUN_ID. Arguments go to lm.train.
#   NNODES=2 MASTER_ADDR=node0 RUN_ID=gpt2 bash launch/multi_node.sh --config configs/gpt2-124m.yaml
#
# NNODES          nodes in the run (required)
# MASTER_ADDR     host of the rendezvous store, one of the nodes (required); MASTER_PORT (29500)
# NPROC_PER_NODE  processes per node (default: the GPUs torch sees, else 1)
# RUN_ID          rendezvous id shared by the nodes of one run (lm); MAX_RESTARTS (0)
# NODE_RANK       unset: c10d rendezvous assigns node ranks, and a node that restarts rejoins the run;
#                 set: static rendezvous with this fixed rank, and node 0 hosts the store
# WORLD_SIZE      optional check: the total number of processes you expect (NNODES x NPROC_PER_NODE)
set -euo pipefail
cd "$(dirname "$0")/.."
. launch/checks.sh

count NNODES "${NNODES:-}"
[ -n "${MASTER_ADDR:-}" ] || die "MASTER_ADDR: set it to the host name or address of one node"
port MASTER_PORT "${MASTER_PORT:-29500}"
natural MAX_RESTARTS "${MAX_RESTARTS:-0}"
. launch/activate.sh
python -c 'import socket, sys; socket.getaddrinfo(sys.argv[1], None)' "$MASTER_ADDR" 2>/dev/null \
  || die "MASTER_ADDR: '$MASTER_ADDR' does not resolve to an address on this node"
nproc="${NPROC_PER_NODE:-$(python -c 'import torch; print(torch.cuda.device_count() or 1)')}"
count NPROC_PER_NODE "$nproc"
if [ -n "${WORLD_SIZE:-}" ] && [ "$WORLD_SIZE" != "$((NNODES * nproc))" ]; then
  die "WORLD_SIZE=$WORLD_SIZE, but NNODES=$NNODES x NPROC_PER_NODE=$nproc is $((NNODES * nproc)) processes"
fi
port="${MASTER_PORT:-29500}"
if [ -n "${NODE_RANK:-}" ]; then
  [[ "$NODE_RANK" =~ ^[0-9]+$ ]] && [ "$NODE_RANK" -lt "$NNODES" ] \
    || die "NODE_RANK must be in 0..$((NNODES - 1)), got '$NODE_RANK'"
  rdzv=(--rdzv_backend=static --node_rank="$NODE_RANK" --master_addr="$MASTER_ADDR" --master_port="$port")
else
  rdzv=(--rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$port")
fi
exec bash launch/torchrun.sh --nnodes="$NNODES" --nproc_per_node="$nproc" "${rdzv[@]}" --rdzv_id="${RUN_ID:-lm}" \
  --max-restarts="${MAX_RESTARTS:-0}" -m lm.train "$@"
