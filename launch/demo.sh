#!/usr/bin/env bash
# The Quick start run on 2 CPU processes: prepare Shakespeare into shards, pretrain a small decoder with the
# project's best recipe (configs/demo-modern.yaml) under torchrun, report validation perplexity next to the
# unigram baseline and print a sample. Extra arguments go to lm.train; what lm.prepare reads among them (the
# data keys, model.vocab_size) to it too, and lm.eval and lm.sample read the run directory --train.out_dir names.
# 640 of the preset's 760 steps, evaluated and saved twice: Muon's matrix iterations make a step ~12%
# slower than the GPT-2 preset's on a CPU, and the demo takes no longer than that preset's 760 steps did.
# The run resumes from runs/demo-modern if it is there; delete that directory to train from scratch.
set -euo pipefail
cd "$(dirname "$0")/.."
. launch/activate.sh

run=runs/demo-modern
data=()
for arg in "$@"; do
  case "$arg" in
    --train.out_dir=*) run="${arg#*=}" ;;
    --data.*|--model.vocab_size=*) data+=("$arg") ;;  # what lm.prepare reads (a tiktoken tokenizer's size)
  esac
done
python -m lm.prepare --config configs/demo-modern.yaml ${data[@]+"${data[@]}"}
bash launch/torchrun.sh --standalone --nproc_per_node=2 -m lm.train --config configs/demo-modern.yaml \
  --train.steps=640 --train.eval_every=320 --checkpoint.every=320 "$@"
python -m lm.eval --checkpoint "$run" --stride 128 --batch-size 16
python -m lm.sample --checkpoint "$run" --prompt "ROMEO:" --max-new-tokens 100 --seed 1
