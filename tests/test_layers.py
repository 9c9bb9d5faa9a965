"""The package's layers hold: the import-linter contracts in pyproject.toml pass, and they do see a
back-arrow or a circle hidden in a function-local import (planted in a copy of the package)."""

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
        "sys.exit(lint_imports_command())"]


def lint_imports(package_parent: Path) -> subprocess.CompletedProcess:
    """lint-imports with the project's contracts over the `lm` package found in `package_parent`."""
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    return subprocess.run([*LINT, "--config", str(ROOT / "pyproject.toml"), "--no-cache", "--no-logo"],
                          cwd=package_parent, env=env, capture_output=True, text=True)


@pytest.mark.process
def test_the_contracts_hold():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 kept, 0 broken" in result.stdout


@pytest.mark.process
@pytest.mark.parametrize("victim, planted, broken", [
    # model code reaching up into the trainer, from inside a function
    ("models/gpt/model.py", "from lm.training import trainer", "Layers: tools on top"),
    # a family's spec reaching up into the engines
    ("models/lstm/family.py", "from lm.distributed import engine", "Layers: tools on top"),
    # a library module importing a tool
    ("report/figures.py", "from lm import plot", "Layers: tools on top"),
    # store <-> resume inside one layer: only the circle contract can see it
    ("checkpoint/store.py", "from lm.checkpoint import resume", "No import circle"),
])
def test_a_function_local_back_arrow_or_circle_breaks_a_contract(tmp_path, victim, planted, broken):
    shutil.copytree(ROOT / "lm", tmp_path / "lm", ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "lm" / victim, "a") as f:
        f.write(f"\n\ndef _planted():\n    {planted}\n\n    return None\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    assert f"{broken}" in result.stdout and "BROKEN" in result.stdout, result.stdout


def imported_modules(package: str, pattern: str = "*.py") -> dict[str, set[str]]:
    """Every module each file of `package` (its files matching `pattern`) imports, function-local imports
    included: {file: {module}}."""
    found = {}
    for path in sorted((ROOT / "lm" / package).glob(pattern)):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                names.add(node.module or "")
        found[path.relative_to(ROOT / "lm" / package).as_posix()] = names
    return found


MODEL_CODE = ["attention.py", "block.py", "config.py", "generate.py", "init.py", "kv_cache.py", "layers.py", "loss.py",
              "sizes.py", "*/model.py", "*/config.py"]
"""The models and the layers they are built from (not the families' specs, which join them to the data
objectives, the tokenizer and Hugging Face)"""


def test_model_code_imports_only_torch_the_models_and_the_errors():
    # the language's own helpers (a context manager, a cache) are fine; files, processes and the network are not
    allowed = {"math", "dataclasses", "collections.abc", "typing", "logging", "contextlib", "functools", "weakref",
               "lm.errors"}
    files = {name: modules for pattern in MODEL_CODE for name, modules in imported_modules("models", pattern).items()}
    assert {"gpt/model.py", "lstm/model.py", "encoder/config.py", "attention.py", "generate.py"} <= set(files)
    for name, modules in files.items():
        for module in modules:
            assert module in allowed or module.startswith(("lm.models", "torch")), f"{name} imports {module}"


def test_no_model_family_imports_torch_distributed():
    for name, modules in imported_modules("models", "**/*.py").items():
        assert not any(module.startswith("torch.distributed") for module in modules), name


def test_data_code_imports_neither_models_nor_torch():
    for name, modules in imported_modules("data").items():
        for module in modules:
            assert not module.startswith(("lm.models", "torch")), f"{name} imports {module}"
