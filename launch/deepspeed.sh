#!/usr/bin/env bash
# A run under the DeepSpeed launcher: on the hosts of an MPI-style HOSTFILE (one "host slots=N" line per
# node; DeepSpeed reaches them with pdsh over passwordless ssh, and every node needs this checkout and
# its venv at the same path), or on this machine alone without HOSTFILE. Arguments go to lm.train:
#   HOSTFILE=hosts bash launch/deepspeed.sh --config configs/gpt2-124m.yaml \
#     --parallel.engine=deepspeed --parallel.zero_stage=2
# Without HOSTFILE it starts NPROC_PER_NODE processes (default: the GPUs torch sees, else 2; on a CPU
# the launcher starts as many as --num_gpus says). MASTER_ADDR (default: the first host's
# `hostname -I`, 127.0.0.1 locally) and MASTER_PORT (29500) are where the process group meets.
# --no_local_rank: lm.train takes RANK, LOCAL_RANK and WORLD_SIZE from the environment the launcher sets.
set -euo pipefail
. "$(dirname "$0")/checks.sh"
port MASTER_PORT "${MASTER_PORT:-29500}"
[ -z "${NPROC_PER_NODE+set}" ] || count NPROC_PER_NODE "$NPROC_PER_NODE"  # DeepSpeed reads 0 or less as "all"
if [ -n "${HOSTFILE:-}" ]; then
  # DeepSpeed would fall back to this machine alone, with only a warning, if the file were missing
  [ -f "$HOSTFILE" ] || die "HOSTFILE: no file '$HOSTFILE'"
  where=(--hostfile="$(realpath "$HOSTFILE")" ${MASTER_ADDR:+--master_addr="$MASTER_ADDR"})
fi
cd "$(dirname "$0")/.."
. launch/activate.sh
if [ -z "${HOSTFILE:-}" ]; then
  where=(--num_nodes=1 --num_gpus="${NPROC_PER_NODE:-$(python -c 'import torch; print(torch.cuda.device_count() or 2)')}")
fi
exec deepspeed "${where[@]}" --master_port="${MASTER_PORT:-29500}" --no_local_rank --module lm.train "$@"
