#!/usr/bin/env bash
# Lint, check the layers contract, then run the test suite (CPU only; real 2-process gloo groups where
# distribution matters). A back-arrow or an import circle fails here, before any test runs.
set -euo pipefail
cd "$(dirname "$0")/.."
. launch/activate.sh
# torch.compile's kernel cache stays inside the checkout, so reruns in the same workspace are warm
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$PWD/.cache/inductor}"
# and so are the C++ ops DeepSpeed builds at every initialize on CPU (20-60 s each when cold)
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}"
ruff check lm tests experiments
lint-imports --no-logo
python -m pytest -q "$@"
