#!/usr/bin/env bash
# Run the test suite (CPU only; real 2-process gloo groups where distribution matters).
set -euo pipefail
cd "$(dirname "$0")/.."
. launch/activate.sh
# torch.compile's kernel cache stays inside the checkout, so reruns in the same workspace are warm
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$PWD/.cache/inductor}"
python -m pytest -q "$@"
