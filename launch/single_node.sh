#!/usr/bin/env bash
# Train on every GPU of this machine, or on 2 processes when it has none. Arguments go to lm.train.
#   bash launch/single_node.sh --config configs/gpt2-124m.yaml [--section.key=value ...]
# NPROC_PER_NODE overrides the number of processes.
set -euo pipefail
cd "$(dirname "$0")/.."
. launch/activate.sh
nproc="${NPROC_PER_NODE:-$(python -c 'import torch; print(torch.cuda.device_count() or 2)')}"
exec bash launch/torchrun.sh --standalone --nproc_per_node="$nproc" -m lm.train "$@"
