# Sourced by the launch scripts: use the active virtual environment, else ./.venv from setup.sh.
if [ -z "${VIRTUAL_ENV:-}" ] && [ -f "$(dirname "${BASH_SOURCE[0]}")/../.venv/bin/activate" ]; then
  . "$(dirname "${BASH_SOURCE[0]}")/../.venv/bin/activate"
fi
# DeepSpeed builds its C++ ops for the torch it runs with on first use; they live with the checkout (setup.sh
# builds the CPU one), so another checkout or torch never loads a stale build
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.cache/torch_extensions}"
