#!/usr/bin/env bash
# Every GPU measurement of docs/benchmarks.md, on one machine with a CUDA GPU, each part's output saved
# under OUT (default runs/bench-gpu):
#   tests     the CUDA-only tests (tests/gpu: no host sync in a step, a fused SDPA kernel, bf16 NCCL runs)
#   training  lm.bench's training table (eager and compiled, against transformers)
#   engines   lm.bench's table of each engine (ddp, fsdp, DeepSpeed ZeRO 1-3)
#   sampling  lm.bench's sampling table (KV cache, no cache, the compiled static cache, transformers' generate)
#   profile   torch.profiler's top CUDA ops of a gpt2-124m step, ours and transformers'
#   docmask   experiments.docmask's tables: the demo model with SDPA is_causal vs the boolean document mask, and
#             attention alone beside compiled flex_attention with a document block mask
#   losschunk experiments.losschunk's table: demo model step time and peak memory with model.loss_chunk off and on
#   train     40 real optimizer steps of configs/gpt2-124m.yaml (compiled, bf16) under torchrun, whose
#             log lines report tokens/s and MFU
#   muon      the same 40 steps with optim.name=muon (Newton-Schulz in bf16 on the GPU): its cost in tokens/s
#   float8    compiled bf16 against train.float8=tensorwise under fsdp: 20 steps of gpt2-124m (4 micro-batches of 32),
#             then 100 of gpt-1.3b (one micro-batch of 8 x 2048), each pair compared by experiments.compare_runs
#             (largest relative loss difference, tokens/s ratio)
#   ckpt      the checkpoint stall at gpt-1.3b: two eager steps of one sequence each (the size of the state, not
#             the step, sets a save's time) and a save at step 2, synchronous, then with checkpoint.async (the
#             log's "allocated the host copy" after step 1, "copied to host memory in X s" and the background
#             write's time, which the end of the run waits for)
# The runs of train, muon and float8 save no checkpoint (checkpoint.every=0), which at gpt-1.3b would take a minute.
# Usage: bash launch/bench_gpu.sh [OUT] [PART ...]   (all parts by default; exits 1 if any part failed)
# A first argument that names a part is a part, not OUT; a name that is no part is refused before any part runs.
# OUT (relative to the checkout) is a path with a / in it (runs/bench-gpu, ./out) or a directory that exists:
# a bare new word is taken for a misspelt part, which as OUT would have run every part, hours of a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
all=(tests training engines sampling docmask losschunk profile train muon float8 ckpt)
is_part() { local p; for p in "${all[@]}"; do [ "$p" = "$1" ] && return 0; done; return 1; }
out=runs/bench-gpu
if [ $# -gt 0 ] && ! is_part "$1"; then
    if [[ "$1" != */* ]] && [ ! -d "$1" ]; then
        echo "bench_gpu.sh: '$1' is no part (${all[*]}) and not OUT (a path with a /, or a directory that exists)" >&2
        exit 2
    fi
    out="$1"
    shift
fi
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=("${all[@]}")
for p in "${parts[@]}"; do
    is_part "$p" || { echo "bench_gpu.sh: unknown part '$p' (${all[*]})" >&2; exit 2; }
done
mkdir -p "$out"
py="${PYTHON:-python}"  # PYTHON=python3 where that is the interpreter holding torch
export PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$PWD/.cache/inductor}"

# lm_train PRESET OUT FLAGS...: a one-GPU torchrun of the preset from scratch, its log in OUT.log
lm_train() {
    local preset="$1" run="$2"
    shift 2
    "$py" -m torch.distributed.run --standalone --nproc_per_node=1 -m lm.train --config "configs/$preset.yaml" \
        --log.every=5 --train.eval_every=100000 --checkpoint.every=0 --log.sample_every=0 \
        --log.tensorboard=false --checkpoint.resume=never --train.out_dir="$run" "$@" > "$run.log" 2>&1 ||
        { tail -20 "$run.log"; return 1; }
}

# float8_pair PRESET STEPS BATCH: compiled bf16 and tensorwise float8 runs under fsdp, then their comparison
float8_pair() {
    local flags=(--train.steps="$2" --train.batch_size="$3" --parallel.engine=fsdp --train.compile=true)
    "$py" -m lm.prepare --config "configs/$1.yaml" &&
    lm_train "$1" "$out/$1-bf16" "${flags[@]}" &&
    lm_train "$1" "$out/$1-float8" "${flags[@]}" --train.float8=tensorwise &&
    "$py" -m experiments.compare_runs "$out/$1-bf16" "$out/$1-float8"
}

part() {
    case "$1" in
        tests) "$py" -m pytest -q -rs tests/gpu ;;
        training|engines|sampling) "$py" -m lm.bench --device cuda --sections "$1" ;;
        docmask|losschunk) "$py" -m "experiments.$1" --device cuda ;;
        profile) "$py" -m lm.bench --device cuda --profile --presets gpt2-124m --warmup 3 --reps 5 ;;
        train) "$py" -m lm.prepare --config configs/gpt2-124m.yaml &&
               "$py" -m torch.distributed.run --standalone --nproc_per_node=1 -m lm.train --config configs/gpt2-124m.yaml \
                   --train.steps=40 --log.every=5 --train.eval_every=1000 --checkpoint.every=0 \
                   --log.sample_every=0 --train.out_dir="$out/gpt2-124m-run" --checkpoint.resume=never ;;
        muon) "$py" -m lm.prepare --config configs/gpt2-124m.yaml &&
              "$py" -m torch.distributed.run --standalone --nproc_per_node=1 -m lm.train --config configs/gpt2-124m.yaml \
                  --optim.name=muon --train.steps=40 --log.every=5 --train.eval_every=1000 --checkpoint.every=0 \
                  --log.sample_every=0 --train.out_dir="$out/gpt2-124m-muon-run" --checkpoint.resume=never ;;
        float8) float8_pair gpt2-124m 20 128 && float8_pair gpt-1.3b 100 8 ;;
        ckpt) local ckpt=(--train.steps=2 --train.batch_size=1 --train.micro_batch_size=1 --train.compile=false
                          --train.eval_batches=1 --checkpoint.every=2 --checkpoint.keep=1)
              "$py" -m lm.prepare --config configs/gpt-1.3b.yaml &&
              lm_train gpt-1.3b "$out/ckpt-sync" "${ckpt[@]}" &&
              rm -rf "$out/ckpt-sync/checkpoints" &&  # 16 GB of the device's 64 GB of disk
              lm_train gpt-1.3b "$out/ckpt-async" "${ckpt[@]}" --checkpoint.async=true &&
              grep -h "saved checkpoint\|copied to host memory\|allocated the host copy" "$out/ckpt-sync.log" \
                  "$out/ckpt-async.log" ;;
    esac
}

failed=()
{ nvidia-smi; "$py" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"; } \
    > "$out/device.txt" 2>&1
for p in "${parts[@]}"; do
    echo "== $p: $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)" | tee "$out/$p.txt"
    part "$p" 2>&1 | tee -a "$out/$p.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || failed+=("$p")
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "bench_gpu.sh: failed: ${failed[*]} (see $out/<part>.txt)" >&2
    exit 1
fi
