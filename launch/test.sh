#!/usr/bin/env bash
# Run the test suite (CPU only; real 2-process gloo groups where distribution matters).
set -euo pipefail
cd "$(dirname "$0")/.."
. launch/activate.sh
python -m pytest -q "$@"
