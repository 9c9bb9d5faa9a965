#!/usr/bin/env bash
# Run the test suite (CPU only; real 2-process gloo groups where distribution matters).
set -euo pipefail
cd "$(dirname "$0")/.."
. launch/activate.sh
# torch.compile's kernel cache stays inside the checkout, so reruns in the same workspace are warm
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$PWD/.cache/inductor}"
# and so are the C++ ops DeepSpeed builds at every initialize on CPU (20-60 s each when cold)
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}"
python -m pytest -q "$@"
