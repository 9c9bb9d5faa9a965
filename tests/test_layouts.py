"""`python -m lm.layouts`: one short job under several layouts, their losses side by side."""

import subprocess
import sys

import pytest

from lm.cli import run
from lm.errors import ConfigError
from lm.layouts import Layout, main, parse_layout, summary, table


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
def test_three_layouts_print_the_same_losses_side_by_side(tiny_data_dir, tiny_data_config, tmp_path):
    result = layouts("--layout", "1", "--layout", "2:tp=2", "--layout", "2:pp=2", "--steps", "3", "--max-rel", "1e-5",
                     "--out", str(tmp_path / "runs"), *tiny(tiny_data_config))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    table_start = next(i for i, line in enumerate(lines) if line.startswith("step"))
    header, *rows, last = lines[table_start:]
    assert header.split() == ["step", "1", "2:tp=2", "2:pp=2", "max", "diff"]
    assert [row.split()[0] for row in rows] == ["1", "2", "3"]
    for row in rows:
        losses = [float(v) for v in row.split()[1:4]]
        assert max(losses) - min(losses) == pytest.approx(float(row.split()[4]), abs=2e-6)  # 6 decimals shown
        assert max(losses) - min(losses) < 1e-4
    assert last.startswith("largest difference: ")
    # the runs are kept in --out, each with its log beside it
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["1", "1.log", "2_pp2", "2_pp2.log", "2_tp2",
                                                                     "2_tp2.log"]


@pytest.mark.process
def test_an_expert_parallel_layout_of_a_mixture_trains_as_one_process(tiny_data_config, tmp_path):
    moe = ["--model.n_experts=4", "--model.experts_per_token=2", "--model.expert_d_ff=32"]
    result = layouts("--layout", "1", "--layout", "2:ep=2", "--steps", "2", "--max-rel", "1e-4",
                     "--out", str(tmp_path / "runs"), *tiny(tiny_data_config), *moe)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    header, *rows, _ = lines[next(i for i, line in enumerate(lines) if line.startswith("step")):]
    assert header.split() == ["step", "1", "2:ep=2", "max", "diff"]
    rows = [row.split() for row in rows]
    assert [row[0] for row in rows] == ["1", "2"]
    for row in rows:  # the all-to-all and FSDP2 sum in another order than one process
        assert float(row[2]) == pytest.approx(float(row[1]), rel=1e-4)
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


@pytest.mark.process
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
])
def test_bad_layouts_are_refused_before_anything_runs(args, message, tmp_path):
    # the case's own flags (after the two layouts) again at the end, so that they win over these defaults
    result = layouts(*args, "--model.n_head=4", "--model.d_model=32", "--model.block_size=32", "--data.seq_len=16",
                     "--model.tie_embeddings=false", *args[4:], "--out", str(tmp_path / "runs"))
    assert result.returncode == 2
    assert message in result.stderr.strip().splitlines()[-1]
    assert "Traceback" not in result.stderr and not (tmp_path / "runs").exists()


@pytest.mark.process
def test_an_out_directory_with_files_in_it_is_refused(tmp_path):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "keep.txt").write_text("mine")
    result = layouts("--layout", "1", "--layout", "2:tp=2", "--model.n_head=4", "--out", str(tmp_path / "runs"))
    assert result.returncode == 2 and "exists and is not an empty directory" in result.stderr
    assert (tmp_path / "runs" / "keep.txt").read_text() == "mine"


def test_parse_layout_errors_are_config_errors():
    with pytest.raises(ConfigError):
        parse_layout("0")
