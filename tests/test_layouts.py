"""`python -m lm.layouts`: one short job under several layouts, their losses side by side."""

import dataclasses
import json
import math
import random
import subprocess
import sys
import types
from pathlib import Path

import pytest

import lm.layouts as layouts_tool
from lm.cli import run
from lm.config import load_config
from lm.distributed.layout import check_world
from lm.errors import ConfigError, LMError
from lm.layouts import MAX_NPROC, Layout, main, parse_layout, run_keys, summary, table


def tiny(data_config) -> list[str]:
    """The config flags of a tiny decoder on the session's prepared data (lm.layouts prepares it again: reused)."""
    return ["--model.n_layer=2", "--model.d_model=32", "--model.block_size=32", "--model.n_head=4",
            "--model.tie_embeddings=false", "--train.batch_size=8", "--train.micro_batch_size=2",
            "--train.device=cpu", "--train.eval_batches=2", f"--data.dir={data_config.dir}",
            f"--data.source={data_config.source}", f"--data.val_fraction={data_config.val_fraction}",
            f"--data.shard_tokens={data_config.shard_tokens}", f"--data.seq_len={data_config.seq_len}"]


def layouts(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lm.layouts", *args], capture_output=True, text=True, timeout=600,
                          cwd=cwd)


@pytest.mark.process
def test_three_layouts_of_a_mixture_print_the_same_losses_side_by_side(tiny_data_dir, tiny_data_config, tmp_path,
                                                                       capsys):
    """One process, tensor parallelism and expert parallelism in one call of the tool. Pipeline layouts go through
    the same code (a layout is a world size and run keys); their losses against one process are the pipeline
    tests' (tests/distributed/test_pipeline.py), and a mixture under pp is refused.

    The tool's `main` runs in-process (the out-directory refusal below runs it as `python -m lm.layouts`): it
    still starts lm.prepare, lm.train and both torchruns as the processes they are, which is what is tested."""
    moe = ["--model.n_experts=4", "--model.experts_per_token=2", "--model.expert_d_ff=32"]
    code = run(main, ["--layout", "1", "--layout", "2:tp=2", "--layout", "2:ep=2", "--steps", "3", "--max-rel", "1e-4",
                      "--out", str(tmp_path / "runs"), *tiny(tiny_data_config), *moe])
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    lines = captured.out.strip().splitlines()
    table_start = next(i for i, line in enumerate(lines) if line.startswith("step"))
    header, *rows, last = lines[table_start:]
    assert header.split() == ["step", "1", "2:tp=2", "2:ep=2", "max", "diff"]
    assert [row.split()[0] for row in rows] == ["1", "2", "3"]
    for row in rows:  # the all-to-all and FSDP2 sum in another order than one process
        losses = [float(v) for v in row.split()[1:4]]
        assert max(losses) - min(losses) == pytest.approx(float(row.split()[4]), abs=2e-6)  # 6 decimals shown
        assert max(losses) - min(losses) < 1e-4 * max(losses)
    assert last.startswith("largest difference: ")
    # the runs are kept in --out, each with its log beside it
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["1", "1.log", "2_ep2", "2_ep2.log", "2_tp2",
                                                                     "2_tp2.log"]
    # each of the 2 ranks held half of the experts: an ep ignored would train the same
    assert "expert parallelism: 2 ranks split the experts of 2 layers" in (tmp_path / "runs/2_ep2.log").read_text()


def test_the_table_names_the_largest_difference():
    runs = [Layout("1", 1, ()), Layout("4:tp=2", 4, (("tp", "2"),)), Layout("4:pp=2", 4, (("pp", "2"),))]
    text, worst = table(runs, [{1: 3.0, 2: 2.5}, {1: 3.0, 2: 2.4}, {1: 3.1, 2: 2.5}])
    assert worst[0] == pytest.approx(0.1) and worst[1:] == (1, "1", "4:pp=2")
    assert text.splitlines()[2].split() == ["2", "2.500000", "2.400000", "2.500000", "1.00e-01"]


def test_layouts_that_agree_bit_for_bit_name_the_first_step():
    """Every difference 0.0 (the same layout twice, or tp=2 on the CPU): the summary is of step 1, not a KeyError."""
    runs = [Layout("1", 1, ()), Layout("1:engine=fsdp", 1, (("engine", "fsdp"),))]
    losses = [{1: 10.794645, 2: 10.5}, {1: 10.794645, 2: 10.5}]
    _, worst = table(runs, losses)
    assert worst == (0.0, 1, "1", "1:engine=fsdp")
    line, relative = summary(losses, worst)
    assert relative == 0.0
    assert line == "largest difference: 0.000e+00 nats (0.00e+00 relative) at step 1, between 1 and 1:engine=fsdp"


def test_the_summary_is_relative_to_a_layout_that_logged_the_step():
    runs = [Layout("1", 1, ()), Layout("2:tp=2", 2, (("tp", "2"),))]
    losses = [{1: 4.0}, {1: 4.0, 2: 2.0}]  # the first layout has no step 2 (its row shows "-")
    text, worst = table(runs, losses)
    assert text.splitlines()[2].split() == ["2", "-", "2.000000", "0.00e+00"]
    assert summary(losses, worst)[1] == 0.0
    assert table(runs, [{}, {}])[1] is None  # nothing logged: no largest difference to name


@pytest.mark.parametrize("args, message", [
    # llama-tiny's batch of 4 in micro-batches of 2 does not split over 4 data-parallel replicas
    (["--layout", "4", "--layout", "1"], "error: --layout 4: train.batch_size: 4 is not a multiple of "
     "train.micro_batch_size (2) x 4 data-parallel replica(s) (world size 4); expected a multiple of 8"),
    (["--layout", "1", "--layout", "8:tp=2"], "error: --layout 8:tp=2: train.batch_size: 4 is not a multiple of "
     "train.micro_batch_size (2) x 4 data-parallel replica(s) (world size 8 / (tp 2))"),
    (["--layout", "1", "--layout", "2:tp=8"], "error: --layout 2:tp=8: parallel.tp=8: 8 tensor-parallel ranks are "
     "more than its 4 query heads (model.n_head)"),
])
def test_every_layout_is_checked_before_any_trains(args, message, tmp_path, capsys):
    """In-process: a refused layout is refused before lm.prepare or any training starts, the later ones too."""
    out = tmp_path / "runs"
    assert run(main, ["--config", "configs/llama-tiny.yaml", *args, "--steps", "1", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines()[-1].startswith(message), captured.err
    assert "training" not in captured.out and not out.exists()


@pytest.mark.parametrize("text, parsed", [
    ("1", (1, ())), ("4:tp=2", (4, (("tp", "2"),))),
    ("8:pp=2,parallel.pp_schedule=gpipe,tp=2", (8, (("pp", "2"), ("pp_schedule", "gpipe"), ("tp", "2")))),
])
def test_layouts_read_a_process_count_and_parallel_keys(text, parsed):
    layout = parse_layout(text)
    assert (layout.nproc, layout.settings) == parsed


def exit_code(argv: list[str]) -> int:
    """The exit status `python -m lm.layouts ARGV` would have: `run`'s, or argparse's exit (a usage error)."""
    try:
        return run(main, argv)
    except SystemExit as stop:
        return stop.code


@pytest.mark.parametrize("args, message", [
    (["--layout", "x:tp=2", "--layout", "1"], "error: --layout x:tp=2: expected NPROC or NPROC:key=value,..."),
    (["--layout", "2:tp", "--layout", "1"], "error: --layout 2:tp: 'tp' is not key=value"),
    (["--layout", "3:tp=2", "--layout", "1"], "error: --layout 3:tp=2: parallel.tp=2 does not divide the world "
     "size 3"),
    (["--layout", "2:tp=2", "--layout", "1", "--model.n_kv_head=1"], "error: --layout 2:tp=2: parallel.tp=2: 2 "
     "tensor-parallel ranks are more than its 1 key/value heads"),
    (["--layout", "2:pp=2", "--layout", "1", "--model.tie_embeddings=true"], "error: --layout 2:pp=2: parallel."
     "pp=2: the token embedding sits on the first pipeline stage"),
    (["--layout", "2:ep=2", "--layout", "1"], "error: --layout 2:ep=2: parallel.ep=2: the model has no experts"),
    (["--layout", "2:tp=2"], "--layout: give two or more layouts to compare"),
    (["--layout", "1", "--layout", "2:tp=2", "--max-rel", "-1"], "--max-rel: must be >= 0, got -1"),
    (["--layout", "2:tp=2", "--layout", "2:tp=2"], "error: --layout 2:tp=2: given twice; give each layout once"),
    (["--layout", "2:tp=2,parallel.tp=1", "--layout", "1"], "error: --layout 2:tp=2,parallel.tp=1: parallel.tp is "
     "given twice"),
    # what lm.layouts sets for each run would replace these without a word
    (["--layout", "1", "--layout", "2:tp=2", "--train.steps=5"], "error: --train.steps: lm.layouts trains each "
     "layout --steps steps; give --steps"),
    (["--layout", "1", "--layout", "2:tp=2", "--log.every=5"], "error: --log.every: lm.layouts sets"),
    (["--layout", "1", "--layout", "2:tp=2", "--parallel.tp=1"], "error: --parallel.tp: a layout's own key"),
    (["--layout", "1", "--layout", "2:tp=2", "--parallel.engine=ddp"], "error: --parallel.engine: a layout's own "
     "key (a layout without engine= runs under fsdp); give it in each --layout, e.g. --layout 2:engine=..."),
])
def test_bad_layouts_are_refused_before_anything_runs(args, message, tmp_path, capsys):
    """In-process, through `run` as `python -m lm.layouts` calls it (exit 2 and the `error:` line, argparse's too);
    `test_an_out_directory_with_files_in_it_is_refused` is the refusal of a real `python -m lm.layouts` process."""
    # the case's own flags (after the two layouts) again at the end, so that they win over these defaults
    code = exit_code([*args, "--model.n_head=4", "--model.d_model=32", "--model.block_size=32", "--data.seq_len=16",
                      "--model.tie_embeddings=false", *args[4:], "--out", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err.strip().splitlines()[-1]
    assert "Traceback" not in err and not (tmp_path / "runs").exists()


@pytest.mark.process
def test_an_out_directory_with_files_in_it_is_refused(tmp_path):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "keep.txt").write_text("mine")
    result = layouts("--layout", "1", "--layout", "2:tp=2", "--model.n_head=4", "--out", str(tmp_path / "runs"))
    assert result.returncode == 2 and "exists and is not an empty directory" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: --out ") and "Traceback" not in result.stderr
    assert (tmp_path / "runs" / "keep.txt").read_text() == "mine"


def test_parse_layout_errors_are_config_errors():
    with pytest.raises(ConfigError):
        parse_layout("0")


@pytest.mark.parametrize("text", ["²", "1025", "1000000007:tp=2", "9" * 30 + ":tp=2"])
def test_a_process_count_that_is_no_count_or_past_the_machine_is_refused_at_once(text):
    """A superscript digit passed str.isdigit and failed int() (a traceback); a huge count with a tp that does not
    divide it had every number up to it tried as a divisor for the error message (10 s at 10^8, for ever at 10^29)."""
    with pytest.raises(ConfigError, match=f"a process count from 1 to {MAX_NPROC} first"):
        parse_layout(text)


RANDOM_LAYOUT_CASES = 96
"""Seeded random --layout lists (the README's figure of inputs tried counts them)."""

PLAIN_NPROCS = ["1", "2", "2", "4", "4", "8", "3", "6", "5", "7"]
"""world sizes 1 to 8, the ones that split a batch more often"""
NPROCS = {**{text: int(text) for text in PLAIN_NPROCS}, "16": 16, str(MAX_NPROC): MAX_NPROC, "٤": 4,
          **dict.fromkeys(["0", "-1", "", "x", "1.5", "²", "+2", " 2", str(MAX_NPROC + 1), "1000000007", str(2**63),
                           "9" * 30])}
"""NPROC texts and the process count each means (None: not a count lm.layouts takes): world sizes 1 to 8, 16, the
most it starts, digits of another script; nothing, signs, fractions, superscripts, counts past the bound (a
prime, past int64)"""
SETTINGS = {"tp": ["tp=2", "tp=2", "tp=4", "tp=8", "tp=3", "tp=1"], "cp": ["cp=2", "cp=1"],
            "pp": ["pp=2", "pp=2,pp_schedule=gpipe", "pp=2,pp_schedule=interleaved_1f1b,pp_stages_per_rank=2",
                   "pp=4", "pp=2,pp_stages_per_rank=2"],
            "ep": ["ep=2", "ep=4"], "dp_replicate": ["dp_replicate=2", "dp_replicate=1"],
            "engine": ["engine=fsdp", "engine=ddp", "engine=deepspeed,zero_stage=2", "engine=deepspeed"]}
"""the parallel keys drawn, and the items each is drawn as (a key with the keys it needs, or not)"""
SOUND = {"tp": ["tp=2"], "cp": ["cp=2"], "pp": ["pp=2"], "ep": ["ep=2"], "dp_replicate": ["dp_replicate=2"],
         "engine": ["engine=ddp", "engine=fsdp"]}
"""an item of each key that suits a model and a world of 2 or 4: the lists drawn from these are often taken"""
ODD_VALUES = ["0", "-1", "x", "2.5", "null", "true", "[2]", "1e3", "0x2", "9" * 30]
ODD_ITEMS = {"tp": False, "=2": False, "tp=": False, "bogus=1": True, "model.n_layer=2": True}
"""items that are not a parallel key=value, and whether lm.layouts' parser takes them (key=value) all the same"""
CONFIGS = {"llama-tiny": (["--config", "configs/llama-tiny.yaml"], ["tp", "cp", "dp_replicate", "engine"]),
           "moe-tiny": (["--config", "configs/moe-tiny.yaml"], ["tp", "ep", "dp_replicate", "engine"]),
           "tiny": (["--model.n_layer=2", "--model.d_model=32", "--model.n_head=4", "--model.n_kv_head=2",
                     "--model.block_size=64", "--data.seq_len=64", "--model.tie_embeddings=false"],
                    ["tp", "cp", "pp", "dp_replicate", "engine"])}
"""the presets, and a tiny model on lm's defaults, with the keys of SETTINGS that may suit them (the others are
drawn at the awkward rate)"""


@dataclasses.dataclass(frozen=True)
class Drawn:
    text: str
    nproc: int | None
    """None: the text is not a layout"""
    overrides: tuple[str, ...]
    """what the layout means on lm.train's command line"""


def random_layout(rng: random.Random, odd: float, keys: list[str], sound: bool) -> Drawn:
    """A --layout value: NPROC and 0 to 3 parallel keys (of `keys`), awkward at the rate `odd` (a count that is not
    one, a key the model does not suit, an item that is not key=value or names no parallel key, a value that is
    not a count); `sound`: 1, 2 or 4 processes and at most one key, of SOUND."""
    nproc_text = rng.choice(["1", "2", "4"] if sound else list(NPROCS) if rng.random() < odd else PLAIN_NPROCS)
    items, overrides, parses = [], {}, NPROCS[nproc_text] is not None
    keys = list(SETTINGS) if rng.random() < odd else keys
    for key in rng.sample(keys, rng.choice([0, 1] if sound else [0, 1, 1, 2, 2, 3])):
        for item in rng.choice((SOUND if sound else SETTINGS)[key]).split(","):
            name, _, value = item.partition("=")
            if rng.random() < odd / 4:
                item = rng.choice(list(ODD_ITEMS))
                parses = parses and ODD_ITEMS[item]
                name, _, value = item.partition("=")
            elif rng.random() < odd / 4:
                value = rng.choice(ODD_VALUES)
                item = f"{name}={value}"
            items.append(f"parallel.{item}" if rng.random() < 0.1 else item)
            parses = parses and name.removeprefix("parallel.") not in overrides  # a key given twice is refused
            overrides[name] = value
    text = nproc_text + (":" + ",".join(items) if items else "")
    engine = [] if "engine" in overrides else ["--parallel.engine=fsdp"]  # lm.layouts' default engine
    flags = (*engine, *(f"--parallel.{key}={value}" for key, value in overrides.items()))
    return Drawn(text, NPROCS[nproc_text] if parses else None, flags)


def train_refuses(config: list[str], fixed: list[str], layout: Drawn) -> bool:
    """Whether lm.train refuses the layout's run before any process group forms: its command line read as
    lm.train reads it (`parse_cli`'s `load_config`, without the argparse help that parse_cli builds first), and
    the world it would start checked as `run_job` checks it."""
    if layout.nproc is None:
        return True
    config_file = config[1] if config[:1] == ["--config"] else None
    flags = config[2:] if config_file else config
    try:
        check_world(load_config(config_file, [*flags, *fixed, *layout.overrides]), layout.nproc)
    except LMError:
        return True
    return False


class Accepted(Exception):
    """lm.layouts got past its checks, to where it would make the runs' directory and train."""


def test_random_layout_lists_are_accepted_as_lm_train_would_run_them_or_refused_naming_one(monkeypatch, tmp_path,
                                                                                         capsys):
    """In-process, stopped before anything runs: a random list of 2 to 4 layouts (world sizes 1 to 8, random
    parallel keys, some impossible for the model or the batch, some not layouts at all), over a preset or a tiny
    config, with a batch that splits or does not. lm.layouts takes it only if lm.train takes every layout's run
    for its world size; else exit 2 with one error line naming a --layout value lm.train would refuse."""

    def stop(out: str | None) -> Path:
        raise Accepted

    monkeypatch.setattr(layouts_tool, "runs_dir", stop)
    rng = random.Random(8)
    accepted = refused = 0
    for i in range(RANDOM_LAYOUT_CASES):
        sound = rng.random() < 0.4
        odd = 0.0 if sound else rng.choice([0.0, 0.2, 0.5])
        config, keys = CONFIGS[rng.choice(list(CONFIGS))]
        batch = [f"--train.batch_size={rng.choice([32, 32, 16, 8, 12, 6, 4, 1])}",
                 f"--train.micro_batch_size={rng.choice([1, 1, 2, 4])}"] if rng.random() < 0.8 else []
        batch += [f"--data.seq_len={rng.choice([48, 64, 100])}"] if rng.random() < 0.2 else []
        drawn = []
        for _ in range(rng.choice([2, 2, 3, 4])):
            layout = random_layout(rng, odd, keys, sound)
            while sound and layout.text in {d.text for d in drawn}:  # a sound list names each layout once
                layout = random_layout(rng, odd, keys, sound)
            drawn.append(layout)
        steps = rng.choice([1, 3])
        argv = [*config, *(f"--layout={layout.text}" for layout in drawn), *batch, "--steps", str(steps),
                "--out", str(tmp_path / "runs")]
        bad = {layout.text for layout in drawn if train_refuses(config, [*batch, *run_keys(steps)], layout)}
        runs = [parse_layout(layout.text).dir_name if layout.nproc else layout.text for layout in drawn]
        bad |= {layout.text for i, layout in enumerate(drawn) if runs[i] in runs[:i]}  # given twice
        try:
            code = run(main, argv)
        except Accepted:
            assert not bad, (i, argv, bad)
            accepted += 1
            continue
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("error: --layout "), (i, argv, code, err)
        named = next((layout.text for layout in drawn if err[0].startswith(f"error: --layout {layout.text}: ")), None)
        assert named in bad, (i, argv, err, bad)
        assert not (tmp_path / "runs").exists()
        refused += 1
    assert accepted >= RANDOM_LAYOUT_CASES // 8 and refused >= RANDOM_LAYOUT_CASES // 4, (accepted, refused)


def test_the_largest_difference_is_relative_to_the_loss_at_its_step():
    runs = [Layout("1", 1, ()), Layout("2:tp=2", 2, (("tp", "2"),))]
    losses = [{1: 4.0, 2: 2.0}, {1: 4.0, 2: 2.5}]
    _, worst = table(runs, losses)
    assert worst == (0.5, 2, "1", "2:tp=2")
    line, relative = summary(losses, worst)
    assert relative == 0.25  # 0.5 nats of a loss of 2.0, not 0.5 nor relative to another step's loss
    assert line == "largest difference: 5.000e-01 nats (2.50e-01 relative) at step 2, between 1 and 2:tp=2"


def test_the_reference_is_the_first_layout_that_logged_the_step_not_one():
    runs = [Layout("1", 1, ()), Layout("2:tp=2", 2, (("tp", "2"),)), Layout("2:pp=2", 2, (("pp", "2"),))]
    losses = [{1: 4.0}, {1: 4.0, 2: 2.0}, {1: 4.0, 2: 3.0}]  # the first layout stopped before step 2
    _, worst = table(runs, losses)
    assert worst == (1.0, 2, "2:tp=2", "2:pp=2")
    assert summary(losses, worst)[1] == 0.5  # 1.0 nats of the loss 2.0 the second layout logged at step 2


def test_a_nan_loss_is_the_largest_difference():
    runs = [Layout("1", 1, ()), Layout("2:tp=2", 2, (("tp", "2"),))]
    _, worst = table(runs, [{1: 3.0, 2: math.nan, 3: math.nan}, {1: 3.1, 2: 2.5, 3: 2.4}])
    # a diverged layout is the worst step, not hidden behind the 0.1 of step 1: the first step it diverged at
    assert worst[1:] == (2, "2:tp=2", "1") and math.isnan(worst[0])


FAKED = ["--model.n_layer=2", "--model.d_model=32", "--model.block_size=32", "--model.n_head=4",
         "--train.batch_size=8", "--train.micro_batch_size=2", "--train.device=cpu", "--data.seq_len=32"]
"""The config of the layouts `_fake_runs` trains"""


def _fake_runs(monkeypatch, second_loss: float | None) -> None:
    """lm.layouts' main without lm.prepare or lm.train: each layout 'trains' by writing one logged loss."""
    monkeypatch.setattr(layouts_tool, "subprocess",
                        types.SimpleNamespace(run=lambda *a, **k: types.SimpleNamespace(returncode=0)))

    def run_logged(command, log_path):
        out = Path(next(a for a in command if a.startswith("--train.out_dir=")).split("=", 1)[1])
        out.mkdir(parents=True)
        loss = 4.0 if out.name == "1" else second_loss
        (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "train/loss": loss}) + "\n")
        return "finished"

    monkeypatch.setattr(layouts_tool, "run_logged", run_logged)


def test_max_rel_fails_a_difference_just_past_it_and_passes_one_within(monkeypatch, tmp_path, capsys):
    _fake_runs(monkeypatch, 4.4)  # 0.4 nats of 4.0: 0.1 relative
    argv = ["--layout", "1", "--layout", "2:tp=2", "--steps", "1", *FAKED]
    assert run(main, [*argv, "--out", str(tmp_path / "a"), "--max-rel", "0.05"]) == 1
    assert "error: the layouts differ by more than --max-rel 0.05" in capsys.readouterr().err
    assert run(main, [*argv, "--out", str(tmp_path / "b"), "--max-rel", "0.2"]) == 0
    assert "(1.00e-01 relative) at step 1, between 1 and 2:tp=2" in capsys.readouterr().out


def test_a_layout_that_logged_a_non_finite_loss_fails_max_rel(monkeypatch, tmp_path, capsys):
    """The logger writes a loss that was not finite as null: that layout diverged, which no --max-rel passes."""
    _fake_runs(monkeypatch, None)
    argv = ["--layout", "1", "--layout", "2:tp=2", "--steps", "1", *FAKED, "--out", str(tmp_path / "a")]
    assert run(main, [*argv, "--max-rel", "1000"]) == 1
    captured = capsys.readouterr()
    assert "largest difference: nan nats (nan relative) at step 1, between 1 and 2:tp=2" in captured.out
    assert "error: the layouts differ by more than --max-rel 1000" in captured.err
