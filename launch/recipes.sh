#!/usr/bin/env bash
# The recipe comparison of docs/experiments.md ("The recipe comparison"), in one command on the 2-core CPU:
# a learning-rate sweep for each of the three presets at the demo's data, size and token budget (each run a
# 2-process torchrun job, one after another), then experiments/recipes.py: each preset's best run
# scored by lm.eval on the Shakespeare val split and on the King James Bible's (held out), compared at
# equal tokens and at equal wall time, and plotted into docs/experiments/recipes.png; then two ablations.
# About 70 minutes.
# Resumable: run it again after an interruption and finished runs are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
. launch/activate.sh

python -m lm.prepare --config configs/demo.yaml
python -m lm.prepare --config configs/demo.yaml --data.source=kjv --data.dir=data/kjv
# eval 8 times per run for the curves; checkpoints only at the end (lm.eval reads the last)
common=(--nproc 2 --train.eval_every=95 --checkpoint.every=760 --log.sample_every=0)
python -m lm.sweep --config configs/demo.yaml --grid optim.lr=8.75e-4,1.75e-3,3.5e-3,7e-3,1.4e-2 --out runs/recipes/demo "${common[@]}"
python -m lm.sweep --config configs/llama-tiny.yaml --grid optim.lr=8.75e-4,1.75e-3,3.5e-3,7e-3,1.4e-2 --out runs/recipes/llama-tiny \
  "${common[@]}"
# the AdamW rate of the modern preset's embedding, head and norms as the comparison ran it (the preset's own
# was tuned afterwards: docs/experiments.md, "Tuning the demo")
python -m lm.sweep --config configs/demo-modern.yaml --grid optim.muon_lr=0.005,0.01,0.02,0.04 --out runs/recipes/demo-modern \
  --optim.lr=7e-3 "${common[@]}"
# what two pieces give: soft-capping and z-loss on top of the preset; Muon alone on the Llama preset
python -m lm.sweep --config configs/demo-modern.yaml --grid model.logit_softcap=30 --optim.z_loss=1e-4 \
  --optim.lr=7e-3 --optim.muon_lr=0.02 --out runs/recipes/ablation-softcap-zloss "${common[@]}"
python -m lm.sweep --config configs/llama-tiny.yaml --grid optim.name=muon --optim.lr=7e-3 \
  --out runs/recipes/ablation-llama-muon "${common[@]}"
python -m experiments.recipes runs/recipes/demo runs/recipes/llama-tiny runs/recipes/demo-modern \
  --ablations runs/recipes/ablation-softcap-zloss runs/recipes/ablation-llama-muon
