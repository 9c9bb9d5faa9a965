"""The documentation stays true: every command README.md and docs/ show parses against the real tool, and every
relative link and image they hold resolves.

A command is a line of a fenced code block that runs `python -m lm.<tool>`, `lm <tool>`, torchrun (or
`launch/torchrun.sh`) with `-m lm.<tool>`, a script under launch/, or `python -m experiments.<name>`. Each lm
tool's own `main` runs on the command's arguments until its arguments are parsed and, for the tools configured
by `--config` and `--section.key=value`, until its config is built: an unknown flag, a misspelled key, a key the
model family does not take or a value of the wrong type fails the test; nothing is trained, read or written.
Arguments a launch script hands to lm.train are checked as lm.train's. Where a page shows the `error:` line a
command ends with (an example of a refusal), the command must fail with that line.
"""

import argparse
import importlib
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

import lm.config.command_line
import lm.errors
import lm.finetune
import lm.layouts
import lm.sweep.__main__
from lm.__main__ import TOOLS
from lm.config import load_config

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
TRAIN_ARGS_SCRIPTS = {"single_node.sh", "multi_node.sh", "deepspeed.sh", "demo.sh", "slurm.sbatch"}
"""Launch scripts whose arguments go to lm.train"""


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    words: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    """Variables set in front of the command (LM_FAMILIES=...)"""
    refused: str = ""
    """The `error: ...` line the page shows under the command: then the command must fail with it"""

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {shlex.join(self.words)}"


def code_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line inside fenced code blocks, continuation lines joined; each fence is a
    line ``` of its own, so that a block's last line is never followed by the next block's first."""
    lines, inside, joined, start = [], False, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            inside = not inside
            lines.append((number, "```"))
            continue
        if not inside:
            continue
        if not joined:
            start = number
        joined += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            lines.append((start, joined.strip()))
            joined = ""
    return lines


def commands(page: Path) -> list[Command]:
    """The commands of a page's code blocks: shell words of each command, a line's `&&` parts apart, without
    a prompt or comments; `$NAME` is what a line `NAME=...` of the page set."""
    found, variables = [], {}
    blocks = code_blocks(page.read_text())
    for index, (number, line) in enumerate(blocks):
        after = blocks[index + 1][1] if index + 1 < len(blocks) else ""
        refused = after.removeprefix("error: ") if after.startswith("error: ") else ""
        line = re.sub(r"\$\{?([A-Z_][A-Z0-9_]*)\}?", lambda m: variables.get(m.group(1), m.group(0)),
                      line.removeprefix("$ "))
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # not shell (a table, a log line with an odd quote)
            continue
        if words and all(re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", word, re.S) for word in words):
            variables.update(word.split("=", 1) for word in words)  # NAME=value lines set variables
            continue
        parts, part = [], []
        for word in words:
            if word in ("&&", "||", ";", "|"):
                parts.append(part)
                part = []
            else:
                part.append(word)
        parts.append(part)
        for part in parts:
            env = []
            while part and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", part[0]):
                env.append(tuple(part[0].split("=", 1)))
                part = part[1:]
            if part and _is_command(part) and "..." not in part:  # "...": more of the user's own, not a command
                name = str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else page.name
                found.append(Command(name, number, tuple(part), tuple(env), refused))
    return found


def _is_command(words: list[str]) -> bool:
    text = " ".join(words)
    return (words[0] in ("python", "python3", "torchrun", "lm", "bash", "sbatch")
            and ("-m lm." in text or "-m experiments." in text or words[0] == "lm" or "launch/" in text))


class Parsed(Exception):
    """Raised once a tool has parsed its arguments (and built its config): the command is valid."""


def check_lm(tool: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Run lm.<tool>'s main on `argv` up to its parsed arguments and built config; an error fails the test."""
    if tool not in TOOLS:
        raise AssertionError(f"lm.{tool} is not a tool; the tools are {sorted(TOOLS)}")
    check_main(TOOLS[tool][0], argv, monkeypatch)


def check_main(module_name: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the module's main(argv) up to its parsed arguments and built config; an error fails the test."""
    tool = module_name.removeprefix("lm.").removesuffix(".__main__")
    real_parse_args, real_load_config = argparse.ArgumentParser.parse_args, lm.config.command_line.load_config

    def parse_args(self, args=None, namespace=None):
        raise Parsed(real_parse_args(self, args, namespace))

    def built_config(*args, **kwargs):
        raise Parsed(real_load_config(*args, **kwargs))

    def parsed(*args, **kwargs):
        raise Parsed()

    def no_process(*args, **kwargs):
        raise AssertionError(f"{tool} would start a process: the check got past its arguments")

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
        patch.setattr(lm.config.command_line, "load_config", built_config)
        # lm.finetune reads its base config from the encoder checkpoint a page can only name
        patch.setattr(lm.finetune, "encoder_config", lambda path: load_config(None, ["--model.arch=encoder"]))
        # lm.sweep parses its own way (the base overrides are its unknown arguments): it has checked every
        # combination's config when it first reads its directory
        patch.setattr(lm.sweep.__main__, "refuse_another_sweep", parsed)
        # lm.layouts too: it has checked every layout's config and world size before it picks its directory
        patch.setattr(lm.layouts, "runs_dir", parsed)
        patch.setattr(subprocess, "run", no_process)
        patch.setattr(subprocess, "Popen", no_process)
        module = importlib.import_module(module_name)
        try:
            module.main(list(argv))  # a tool that returns has done no more than parse (a sweep's --dry-run)
        except Parsed:
            return
        except SystemExit as exit_:
            if exit_.code:  # 0: it printed its --help
                raise AssertionError(f"{tool} refused its arguments (exit {exit_.code}); see the output above") \
                    from None


def check(command: Command, monkeypatch: pytest.MonkeyPatch) -> None:
    """The command parses; or, where the page shows the `error:` line it ends with, it fails with that line."""
    for name, value in command.env:
        if name == "LM_FAMILIES":  # the families the command's processes register
            for module in value.split(","):
                importlib.import_module(module)
    if not command.refused:
        parses(command, monkeypatch)
        return
    with pytest.raises((lm.errors.LMError, AssertionError)) as refusal:
        parses(command, monkeypatch)
    assert command.refused in str(refusal.value), f"{command}: the page shows `error: {command.refused}`"


def parses(command: Command, monkeypatch: pytest.MonkeyPatch) -> None:
    words = list(command.words)
    ours = [i for i, word in enumerate(words[1:], 1)
            if words[i - 1] == "-m" and word.startswith(("lm.", "experiments."))]
    if ours:  # python -m lm.X, and torchrun's (or launch/torchrun.sh's) -m lm.X after its own options
        module, argv = words[ours[0]], words[ours[0] + 1:]
        if module.startswith("lm."):
            check_lm(module.removeprefix("lm.").removesuffix(".__main__"), argv, monkeypatch)
            return
        assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), f"no module {module}"
        check_main(module, argv, monkeypatch)
        return
    if words[0] == "lm":
        check_lm(words[1], words[2:], monkeypatch)
        return
    scripts = [w for w in words if w.startswith("launch/")]
    assert scripts, f"no tool or launch script in {command}"
    script = ROOT / scripts[0]
    assert script.is_file(), f"no such script {scripts[0]}"
    if script.name in TRAIN_ARGS_SCRIPTS:
        check_lm("train", words[words.index(scripts[0]) + 1:], monkeypatch)
    elif script.name == "setup.sh":
        assert set(words[words.index(scripts[0]) + 1:]) <= {"--dev", "--deepspeed"}, command


ALL = [command for page in PAGES for command in commands(page)]


def test_the_pages_show_commands():
    assert len(ALL) > 40 and {c.page for c in ALL} >= {"README.md"}


@pytest.mark.process
@pytest.mark.parametrize("command", ALL, ids=str)
def test_every_documented_command_parses(command, monkeypatch):
    check(command, monkeypatch)


@pytest.mark.process
@pytest.mark.parametrize("line", [
    "python -m lm.train --config configs/demo.yaml --train.stpes=3",  # a misspelled key
    "python -m lm.train --config configs/demo.yaml --model.arch=lstm --model.n_head=4",  # not the family's key
    "python -m lm.eval --checkpoint runs/demo --strides 64",  # a misspelled flag
    "torchrun --standalone --nproc_per_node=2 -m lm.train --config configs/no-such.yaml",  # a config not there
    "bash launch/single_node.sh --config configs/demo.yaml --optim.lr=fast",  # a value of the wrong type
    "bash launch/no_such.sh",
    "python -m experiments.lines_task --output data/lines.csv",  # an experiment's misspelled flag
])
def test_a_wrong_command_fails_the_check(line, monkeypatch, tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"```bash\n{line}\n```\n")
    (command,) = commands(page)
    with pytest.raises((AssertionError, lm.errors.LMError)):
        check(command, monkeypatch)


@pytest.mark.process
def test_a_documented_refusal_must_be_the_one_the_tool_gives(monkeypatch, tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```\n$ python -m lm.train --model.n_layr=2\nerror: model.n_layr: not a key of a decoder-only "
                    "GPT\n```\n```\n$ python -m lm.train --model.n_layr=2\nerror: model.n_layr: unknown key\n```\n")
    shown, stale = commands(page)
    check(shown, monkeypatch)
    with pytest.raises(AssertionError, match="the page shows `error: model.n_layr: unknown key`"):
        check(stale, monkeypatch)


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_image_resolves(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code is not a link
    missing = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        if not path.exists():
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)}: links to nothing: {missing}"
