#!/usr/bin/env bash
# The Quick start run on 2 CPU processes: prepare Shakespeare into shards, pretrain the demo GPT under
# torchrun, report validation perplexity and print a sample. Extra arguments go to lm.train.
# The run resumes from runs/demo if it is there; delete that directory to train from scratch.
set -euo pipefail
cd "$(dirname "$0")/.."
. launch/activate.sh

python -m lm.prepare --config configs/demo.yaml
bash launch/torchrun.sh --standalone --nproc_per_node=2 -m lm.train --config configs/demo.yaml "$@"
python -m lm.eval --checkpoint runs/demo --stride 128 --batch-size 16
python -m lm.sample --checkpoint runs/demo --prompt "ROMEO:" --max-new-tokens 100 --seed 1
