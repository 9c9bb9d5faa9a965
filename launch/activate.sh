# Sourced by the launch scripts: use the active virtual environment, else ./.venv from setup.sh.
if [ -z "${VIRTUAL_ENV:-}" ] && [ -f "$(dirname "${BASH_SOURCE[0]}")/../.venv/bin/activate" ]; then
  . "$(dirname "${BASH_SOURCE[0]}")/../.venv/bin/activate"
fi
