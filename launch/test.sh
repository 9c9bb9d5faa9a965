#!/usr/bin/env bash
# Lint, check the layers contract, then run the test suite (CPU only; real 2-process gloo groups where
# distribution matters). A back-arrow or an import circle fails here, before any test runs.
#   bash launch/test.sh            the full suite: what CI runs
#   bash launch/test.sh --quick    the tests that start no process and train only a few steps in-process
# Other arguments go to pytest. Either tier ends with its 10 slowest tests and fails when its wall time is over
# LM_TEST_BUDGET_S (default 900 s for the full suite, 180 s for --quick; docs/dev/notes.md, CI).
# The tests run in LM_TEST_WORKERS pytest-xdist processes (default 2; 0 runs them in this one), a file to a
# worker, so that a file's fixtures are made once.
set -euo pipefail
cd "$(dirname "$0")/.."
. launch/activate.sh
tier=(); budget=900
if [ "${1:-}" = "--quick" ]; then
  shift
  tier=(-m "not process and not slow"); budget=180
fi
export LM_TEST_BUDGET_S="${LM_TEST_BUDGET_S:-$budget}"
# torch.compile's kernel cache stays inside the checkout, so reruns in the same workspace are warm
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$PWD/.cache/inductor}"
ruff check lm tests experiments
lint-imports --no-logo
workers="${LM_TEST_WORKERS:-2}"
# a torch thread per worker: two workers' intra-op thread pools on 2 cores spin against each other
[ "$workers" = 0 ] || export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
python -m pytest -q -n "$workers" --dist loadfile ${tier[@]+"${tier[@]}"} "$@"
