"""Fine-tuning through the real tools: lm.finetune trains a head on the session's pretrained encoder
(`encoder_run`), lm.predict scores files with it, lm.eval scores the encoder's masked tokens; bad input is one
`error:` line and no run directory."""

import json
import math
import random
import shutil
from pathlib import Path

import pytest
import torch

from lm import eval as eval_tool
from lm import finetune, predict
from lm.checkpoint.consolidated import consolidate
from lm.checkpoint.store import resolve_checkpoint
from lm.checkpoint.trunk import check_trunk, load_trunk, saved_config
from lm.cli import run
from lm.config import load_config
from lm.distributed.env import DistEnv
from lm.errors import CheckpointError, ConfigError
from lm.finetune import encoder_base
from lm.models.registry import family_of
from lm.tokenizer import model_tokenizer
from lm.training.task_data import open_task_data, read_task_rows
from tests.conftest import ENCODER, write_rows
from tests.test_bad_inputs import digest

FT = ["--train.batch_size=16", "--train.micro_batch_size=8", "--train.device=cpu", "--log.every=5",
      "--log.tensorboard=false", "--train.eval_every=10", "--checkpoint.every=10", "--optim.lr=3e-3",
      "--schedule.warmup_steps=3"]


def finetune_run(encoder: Path, out: Path, *extra: str) -> int:
    return run(finetune.main, ["--encoder", str(encoder), f"--train.out_dir={out}", *FT, *extra])


def logged(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_classifier_learns_a_separable_task_and_predicts_it(encoder_run, separable_rows, tmp_path, capsys):
    task = write_rows(tmp_path / "lines.csv", separable_rows)
    out = tmp_path / "ft"
    assert finetune_run(encoder_run, out, "--model.head=classify", "--model.num_classes=2", f"--task.file={task}",
                        "--train.steps=30") == 0
    val = [r for r in logged(out) if "val/accuracy" in r]
    assert [r["step"] for r in val] == [10, 20, 30]
    # tokens are the padded batches' positions: a row is at most 10 tokens, not data.seq_len (16)
    cfg = load_config(out / "config.yaml")
    assert 0 < val[-1]["tokens"] < 30 * cfg.train.batch_size * cfg.data.seq_len * 3 / 4
    assert val[-1]["val/accuracy"] > 0.95 and val[-1]["val/f1"] > 0.95
    assert val[-1]["val/loss"] < val[0]["val/loss"]

    preds = tmp_path / "preds.jsonl"
    capsys.readouterr()
    assert run(predict.main, ["--checkpoint", str(out), "--file", str(task), "--out", str(preds)]) == 0
    printed = capsys.readouterr().out
    lines = [json.loads(line) for line in preds.read_text().splitlines()]
    assert [line["row"] for line in lines] == list(range(len(separable_rows)))
    for line in lines:
        assert math.isclose(sum(line["probabilities"]), 1.0, abs_tol=1e-5)
        assert line["prediction"] == max(range(2), key=lambda c: line["probabilities"][c])
    accuracy = sum(line["prediction"] == row["label"] for line, row in zip(lines, separable_rows)) / len(lines)
    assert accuracy > 0.95
    assert f"accuracy: {accuracy:.4f}" in printed

    # a file without the run's label column is predicted alike and not scored
    unlabelled = write_rows(tmp_path / "unlabelled.jsonl", [{"text": row["text"]} for row in separable_rows])
    again = tmp_path / "again.jsonl"
    assert run(predict.main, ["--checkpoint", str(out), "--file", str(unlabelled), "--out", str(again)]) == 0
    assert again.read_text() == preds.read_text() and "accuracy" not in capsys.readouterr().out
    # unless --label-column asks for labels it lacks
    assert run(predict.main, ["--checkpoint", str(out), "--file", str(unlabelled), "--label-column=label"]) == 2
    assert "no column 'label'" in capsys.readouterr().err
    # an output that cannot be written is refused before the model is loaded, and nothing is touched
    before = task.read_bytes()
    for bad, why in ((tmp_path, "is a directory"), (task / "p.jsonl", "is a file, not a directory"),
                     (task, "is the input")):
        assert run(predict.main, ["--checkpoint", str(tmp_path / "no-run"), "--file", str(task),
                                  "--out", str(bad)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: --out {bad}: ") and why in err[0], err
    assert task.read_bytes() == before
    # an existing output only with --force; never the file the run trained on, whatever the file predicted
    assert run(predict.main, ["--checkpoint", str(out), "--file", str(unlabelled), "--out", str(again)]) == 2
    assert capsys.readouterr().err == f"error: --out {again}: exists; pass --force to replace it\n"
    assert run(predict.main, ["--checkpoint", str(out), "--file", str(unlabelled), "--out", str(task),
                              "--force"]) == 2
    assert capsys.readouterr().err.startswith(f"error: --out {task}: is the input")
    assert task.read_bytes() == before
    # a batch larger than the file is one batch of its rows (it was padded to the full size)
    assert run(predict.main, ["--checkpoint", str(out), "--file", str(unlabelled), "--out", str(again), "--force",
                              "--batch-size", "1000000"]) == 0
    assert again.read_text() == preds.read_text()
    # batches of 7 leave the last one short: its filler rows are neither written nor scored
    capsys.readouterr()
    assert run(predict.main, ["--checkpoint", str(out), "--file", str(task), "--out", str(again), "--force",
                              "--batch-size", "7"]) == 0
    sevens = [json.loads(line) for line in again.read_text().splitlines()]
    assert [(s["row"], s["prediction"]) for s in sevens] == [(line["row"], line["prediction"]) for line in lines]
    assert f"accuracy: {accuracy:.4f}" in capsys.readouterr().out
    # a labelled file of one class is scored all the same
    ships = write_rows(tmp_path / "ships.csv", [row for row in separable_rows if row["label"] == 0][:5])
    assert run(predict.main, ["--checkpoint", str(out), "--file", str(ships)]) == 0
    assert "accuracy: 1.0000" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # an empty column name is no default
        run(predict.main, ["--checkpoint", str(out), "--file", str(unlabelled), "--text-column", ""])
    assert "--text-column: empty" in capsys.readouterr().err


def test_a_regression_head_fits_a_linear_target(encoder_run, tmp_path):
    # 8 words each, "up" or "down": the target is linear in the share of "up" words, which mean pooling reads
    rng = random.Random(1)
    rows = []
    for _ in range(240):
        ups = rng.randint(0, 8)
        words = ["up"] * ups + ["down"] * (8 - ups)
        rng.shuffle(words)
        rows.append({"text": " ".join(words), "label": 2.0 * ups / 8 - 1.0})
    task = write_rows(tmp_path / "levels.jsonl", rows)
    out = tmp_path / "reg"
    assert finetune_run(encoder_run, out, "--model.head=regress", "--model.pooling=mean", f"--task.file={task}",
                        "--train.steps=60", "--optim.lr=5e-3") == 0
    last = [r for r in logged(out) if "val/pearson" in r][-1]
    variance = torch.tensor([r["label"] for r in rows]).var().item()
    assert last["val/pearson"] > 0.95
    assert last["val/mse"] < 0.1 * variance
    assert last["val/loss"] == pytest.approx(last["val/mse"])


@pytest.mark.parametrize("form", ["run", "consolidated"])
def test_the_trunk_comes_from_the_encoder_and_the_head_is_drawn(form, encoder_run, tmp_path):
    source_path = encoder_run
    if form == "consolidated":
        source_path = tmp_path / "encoder.safetensors"
        consolidate(resolve_checkpoint(encoder_run), source_path)
    cfg = load_config(None, [*ENCODER, "--model.head=classify", "--model.num_classes=3", "--task.file=x.csv"])
    check_trunk(saved_config(source_path).model, cfg.model, source_path)
    torch.manual_seed(0)
    model = family_of(cfg.model).build(cfg.model)
    head_before = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("score.")}
    load_trunk(source_path, model)
    from lm.checkpoint.loading import load_for_inference

    encoder, _, _ = load_for_inference(encoder_run, torch.device("cpu"))
    source = encoder.state_dict()
    for name, tensor in model.state_dict().items():
        if name.startswith("score."):
            assert torch.equal(tensor, head_before[name]), name
        else:
            assert torch.equal(tensor, source[name]), name


def test_eval_scores_masked_tokens_as_validation_did(encoder_run, capsys):
    # validation at step 6 scored 2 micro-batches of 2 windows: windows 0..3 of the val split, masked by their ids
    val = [r for r in logged(encoder_run) if r.get("step") == 6 and "val/loss" in r][0]
    assert run(eval_tool.main, ["--checkpoint", str(encoder_run), "--max-tokens", str(4 * 16 + 1)]) == 0
    printed = capsys.readouterr().out
    loss = float(printed.split("loss: ")[1].split()[0])
    accuracy = float(printed.split("masked-token accuracy: ")[1].split()[0])
    assert "masked tokens scored: 16" in printed  # 4 windows x round(0.3 x 15) = 4 targets
    assert loss == pytest.approx(val["val/loss"], abs=1e-4)
    assert accuracy == pytest.approx(val["val/accuracy"], abs=1e-4)
    # not two zeros: at lr 1e-2 the fixture predicts 1 of these 16 masked tokens right
    assert accuracy > 0


@pytest.mark.parametrize("case, message", [
    ("column", "'text'"),
    ("string label", "row 0"),
    ("classes", "num_classes"),
])
def test_bad_labelled_files_are_one_error(case, message, encoder_run, separable_rows, tmp_path, capsys):
    rows = [dict(r) for r in separable_rows]
    flags = ["--model.head=classify", "--model.num_classes=2"]
    if case == "column":
        rows = [{"sentence": r["text"], "label": r["label"]} for r in rows]
    elif case == "string label":
        rows[0]["label"] = "court"
    else:
        flags = ["--model.head=classify", "--model.num_classes=3"]
    task = write_rows(tmp_path / "bad.jsonl", rows)
    out = tmp_path / "ft"
    assert finetune_run(encoder_run, out, *flags, f"--task.file={task}", "--train.steps=2") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and str(task) in err[0] and message in err[0], err
    assert not out.exists()


def test_a_decoder_checkpoint_is_not_an_encoder(trained_run, separable_rows, tmp_path, capsys):
    task = write_rows(tmp_path / "lines.csv", separable_rows)
    out = tmp_path / "ft"
    assert finetune_run(trained_run, out, "--model.head=classify", "--model.num_classes=2",
                        f"--task.file={task}") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "decoder-only GPT (model.arch=gpt)" in err[0] and str(trained_run) in err[0], err
    assert not out.exists()


def test_init_from_besides_the_encoder_is_refused(encoder_run, trained_run, separable_rows, tmp_path, capsys):
    # it replaced --encoder's weights with another checkpoint's, the model still built from --encoder's config
    task = write_rows(tmp_path / "lines.csv", separable_rows)
    out = tmp_path / "ft"
    assert finetune_run(encoder_run, out, "--model.head=classify", "--model.num_classes=2", f"--task.file={task}",
                        f"--checkpoint.init_from={trained_run}") == 2
    assert capsys.readouterr().err == (f"error: checkpoint.init_from: {str(trained_run)!r}, but --encoder "
                                       f"{encoder_run} names the weights to start from (and the model to build); give "
                                       "the checkpoint as --encoder alone\n")
    assert not out.exists()


def test_a_hugging_face_checkpoint_is_no_encoder_to_fine_tune(separable_rows, tmp_path, capsys):
    hf = tmp_path / "bert"
    hf.mkdir()
    (hf / "config.json").write_text('{"architectures": ["BertForMaskedLM"], "model_type": "bert"}')
    task = write_rows(tmp_path / "lines.csv", separable_rows)
    out = tmp_path / "ft"
    assert finetune_run(hf, out, "--model.head=classify", "--model.num_classes=2", f"--task.file={task}") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --encoder: {hf} is a Hugging Face checkpoint; lm.finetune starts from an lm checkpoint "
                   "(a run directory, a step directory or a consolidated .safetensors)"], err
    assert not out.exists()


def test_a_changed_encoder_checkpoint_is_refused_as_a_resume_refuses_it(encoder_run, separable_rows, tmp_path,
                                                                        capsys):
    encoder = tmp_path / "encoder"
    shutil.copytree(encoder_run, encoder)
    shard = sorted(resolve_checkpoint(encoder).glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one changed byte: same size, another sha256
    shard.write_bytes(bytes(data))
    task = write_rows(tmp_path / "lines.csv", separable_rows)
    out = tmp_path / "ft"
    assert finetune_run(encoder, out, "--model.head=classify", "--model.num_classes=2", f"--task.file={task}",
                        "--train.steps=2") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {shard}: sha256 differs from the manifest (corrupt)"], err
    assert not (out / "checkpoints").exists()


def test_a_run_resumes_only_on_its_own_labelled_file(encoder_run, separable_rows, tmp_path, capsys):
    task = write_rows(tmp_path / "lines.csv", separable_rows)
    out = tmp_path / "ft"
    flags = ["--model.head=classify", "--model.num_classes=2", f"--task.file={task}", "--checkpoint.every=2"]
    assert finetune_run(encoder_run, out, *flags, "--train.steps=2") == 0
    capsys.readouterr()
    # the same file read otherwise: another split would score trained rows as validation
    assert finetune_run(encoder_run, out, *flags, "--train.steps=4", "--task.val_fraction=0.5") == 2
    step = out / "checkpoints" / "step_00000002"
    assert capsys.readouterr().err == (
        f"error: {step} trained on the rows of {str(task)!r} read with task.val_fraction=0.1, now 0.5. Resume with "
        "the checkpoint's settings, use another train.out_dir, or set checkpoint.allow_data_change=true to go on "
        "with the new rows\n")
    write_rows(task, [{**row, "text": row["text"] + " again"} for row in separable_rows])
    assert finetune_run(encoder_run, out, *flags, "--train.steps=4") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"task.file={str(task)!r} now holds" in err[0] and "144 train rows" in err[0], err


def test_a_val_fraction_that_holds_out_no_row_names_its_key(encoder_run, separable_rows, tmp_path, capsys):
    # it said "val_fraction=0.1 ... or set it to 0 for no validation", which task.val_fraction refuses
    task = write_rows(tmp_path / "lines.csv", separable_rows[:8])
    out = tmp_path / "ft"
    assert finetune_run(encoder_run, out, "--model.head=classify", "--model.num_classes=2", f"--task.file={task}",
                        "--train.batch_size=2", "--train.micro_batch_size=2") == 2
    assert capsys.readouterr().err == ("error: task.val_fraction=0.1 puts none of the 8 examples in the val split; "
                                       "raise it to at least 0.125 or add examples\n")
    assert not out.exists()


def test_a_pearson_r_that_is_undefined_is_logged_as_null(encoder_run, tmp_path, capsys):
    # one val row has no variance: r was NaN, which metrics.jsonl wrote as NaN, no JSON
    task = write_rows(tmp_path / "levels.jsonl", [{"text": f"up {i}", "label": i / 10} for i in range(10)])
    out = tmp_path / "reg"
    assert finetune_run(encoder_run, out, "--model.head=regress", f"--task.file={task}", "--train.steps=1",
                        "--train.batch_size=2", "--train.micro_batch_size=2") == 0
    [val] = [json.loads(line, parse_constant=pytest.fail) for line in (out / "metrics.jsonl").read_text().splitlines()
             if "val/pearson" in line]
    assert val["val/pearson"] is None and val["val/mse"] >= 0
    capsys.readouterr()
    single = write_rows(tmp_path / "one.jsonl", [{"text": "up", "label": 0.5}])
    assert run(predict.main, ["--checkpoint", str(out), "--file", str(single)]) == 0
    assert "pearson: n/a (the labels or the predictions are constant)" in capsys.readouterr().out


def test_a_run_inside_the_encoders_run_is_refused_and_the_encoder_kept(encoder_run, separable_rows, tmp_path, capsys):
    # a step directory as train.out_dir had its config.yaml written over, which its manifest then refused
    encoder = tmp_path / "encoder"
    shutil.copytree(encoder_run, encoder)
    task = write_rows(tmp_path / "lines.csv", separable_rows[:20])
    step = resolve_checkpoint(encoder)
    before = digest(encoder)
    for given, out in ((encoder, encoder / "checkpoints"), (step, step), (encoder / "checkpoints", step / "run"),
                       (step, encoder)):  # the run itself: it resumed there, and retention deleted the encoder
        assert finetune_run(given, out, "--model.head=classify", "--model.num_classes=2", f"--task.file={task}",
                            "--train.steps=1", "--train.batch_size=2", "--train.micro_batch_size=2") == 2
        where = "is" if out == encoder else "is inside"
        assert capsys.readouterr().err == (
            f"error: train.out_dir: {str(out)!r} {where} {str(encoder)!r}, the run of the checkpoint this run "
            "starts from (checkpoint.init_from, lm.finetune's --encoder); writing there would change that run's "
            "files: put the run elsewhere\n")
        assert digest(encoder) == before


def test_a_task_file_among_the_runs_own_files_is_refused(encoder_run, separable_rows, tmp_path, capsys):
    out = tmp_path / "ft"
    out.mkdir()
    task = write_rows(out / "metrics.jsonl", separable_rows[:20])  # the run would append its metrics to it
    before = task.read_bytes()
    assert finetune_run(encoder_run, out, "--model.head=classify", "--model.num_classes=2", f"--task.file={task}",
                        "--train.steps=1", "--train.batch_size=2", "--train.micro_batch_size=2") == 2
    assert capsys.readouterr().err.startswith(f"error: task.file: {str(task)!r} is one of the files of train.out_dir")
    assert task.read_bytes() == before


def test_a_run_directory_beside_its_task_file_is_no_data_directory(encoder_run, separable_rows, tmp_path,
                                                                   monkeypatch):
    # fine-tuning reads no data.dir, but the default 'data/shakespeare' below the working directory was refused
    # as "prepared data inside the run directory"
    task = write_rows(tmp_path / "lines.csv", separable_rows[:20])
    monkeypatch.chdir(tmp_path)
    assert finetune_run(encoder_run, tmp_path, "--model.head=classify", "--model.num_classes=2", f"--task.file={task}",
                        "--train.steps=1", "--train.batch_size=2", "--train.micro_batch_size=2") == 0
    assert (tmp_path / "checkpoints" / "step_00000001").is_dir() and task.is_file()


def test_predictions_are_never_written_over_the_checkpoint_they_come_from(encoder_run, separable_rows, tmp_path,
                                                                           capsys):
    # --out named the step directory's config.yaml or the consolidated file itself: exit 0, and the model gone;
    # the run's own config.yaml or metrics.jsonl (predictions beside them in the run directory are fine)
    task = write_rows(tmp_path / "lines.csv", separable_rows[:20])
    out = tmp_path / "ft"
    assert finetune_run(encoder_run, out, "--model.head=classify", "--model.num_classes=2", f"--task.file={task}",
                        "--train.steps=1", "--train.batch_size=2", "--train.micro_batch_size=2") == 0
    step = resolve_checkpoint(out)
    consolidate(step, tmp_path / "ft.safetensors")
    before = digest(tmp_path)
    capsys.readouterr()
    for checkpoint, dest, why in ((out, step / "config.yaml", f"is inside the input {out / 'checkpoints'}"),
                                  (step, step.parent / "p.jsonl", f"is inside the input {out / 'checkpoints'}"),
                                  (tmp_path / "ft.safetensors", tmp_path / "ft.safetensors", "is the input"),
                                  (out, out / "config.yaml", f"is the input {out / 'config.yaml'}"),
                                  (step, out / "metrics.jsonl", f"is the input {out / 'metrics.jsonl'}"),
                                  (tmp_path / "ft.safetensors", step / "p.jsonl", f"is inside the checkpoint {step}")):
        assert run(predict.main, ["--checkpoint", str(checkpoint), "--file", str(task), "--out", str(dest)]) == 2
        assert capsys.readouterr().err.startswith(f"error: --out {dest}: {why}")
    assert digest(tmp_path) == before
    assert run(predict.main, ["--checkpoint", str(out), "--file", str(task), "--out", str(out / "p.jsonl")]) == 0


def test_task_val_fraction_holds_out_its_share_of_the_rows(separable_rows, tmp_path):
    from lm.training.task_data import open_task_data

    task = write_rows(tmp_path / "lines.csv", separable_rows)
    cfg = load_config(None, ["--model.arch=encoder", "--model.head=classify", "--model.num_classes=2",
                             "--model.n_head=2", f"--task.file={task}", "--task.val_fraction=0.25", *FT])
    data = open_task_data(cfg, DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    assert (data.train_examples, len(data.val_examples), len(data.val_labels)) == (120, 40, 40)


def test_a_task_file_with_fewer_train_rows_than_one_batch_is_refused_by_name(encoder_run, separable_rows, tmp_path,
                                                                            capsys):
    task = write_rows(tmp_path / "few.csv", separable_rows[:12])  # 10 or 11 train rows, and batches of 16
    out = tmp_path / "ft"
    assert finetune_run(encoder_run, out, "--model.head=classify", "--model.num_classes=2", f"--task.file={task}",
                        "--train.steps=2") != 0
    err = capsys.readouterr().err
    assert "training rows after holding out task.val_fraction" in err and "fewer than one batch" in err
    assert "(train.batch_size=16)" in err
    assert not (out / "checkpoints").exists()


def test_label_column_scores_a_file_whose_labels_are_under_another_name(encoder_run, separable_rows, tmp_path,
                                                                         capsys):
    """--label-column y reads the labels from column y (the run's task.label_column is 'label'): the file is scored
    as the same rows under 'label' are, and without the flag it is only predicted."""
    task = write_rows(tmp_path / "lines.csv", separable_rows)
    out = tmp_path / "ft"
    assert finetune_run(encoder_run, out, "--model.head=classify", "--model.num_classes=2", f"--task.file={task}",
                        "--train.steps=10") == 0
    capsys.readouterr()
    assert run(predict.main, ["--checkpoint", str(out), "--file", str(task)]) == 0
    scored = metrics(capsys.readouterr().out)
    assert scored[0].startswith("loss: ") and any(line.startswith("accuracy: ") for line in scored)
    renamed = write_rows(tmp_path / "renamed.csv", [{"text": r["text"], "y": r["label"]} for r in separable_rows])
    assert run(predict.main, ["--checkpoint", str(out), "--file", str(renamed), "--label-column", "y"]) == 0
    assert metrics(capsys.readouterr().out) == scored
    assert run(predict.main, ["--checkpoint", str(out), "--file", str(renamed)]) == 0
    assert metrics(capsys.readouterr().out) == []


def metrics(out: str) -> list[str]:
    """lm.predict's printed scores: every line after the file's."""
    lines = out.splitlines()
    after = next(i for i, line in enumerate(lines) if line.startswith("file: ")) + 1
    return [line for line in lines[after:] if not line.startswith("predictions: ")]


CPU_RANK = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def test_a_checkpoint_of_another_family_is_no_trunk_to_fine_tune(trained_run):
    # a decoder's weights would fill an encoder's trunk by name where they happen to match: refused by family first
    cfg = load_config(None, [*ENCODER, "--model.head=classify", "--model.num_classes=2", "--task.file=x.csv"])
    with pytest.raises(ConfigError, match="fine-tunes a pretrained checkpoint of its own family") as err:
        check_trunk(saved_config(trained_run).model, cfg.model, trained_run)
    assert "model.arch=gpt" in str(err.value)


def test_an_encoder_of_another_shape_is_no_trunk_to_fine_tune(encoder_run):
    # the head's keys may differ from the checkpoint's; a trunk key (here the depth) may not
    cfg = load_config(None, [*ENCODER, "--model.n_layer=3", "--model.head=classify", "--model.num_classes=2",
                             "--task.file=x.csv"])
    with pytest.raises(ConfigError, match=r"holds another encoder \(.*model\.n_layer: 2 -> 3"):
        check_trunk(saved_config(encoder_run).model, cfg.model, encoder_run)


def test_a_trunk_the_checkpoint_does_not_fill_is_refused_naming_what_it_lacks(encoder_run):
    # a deeper model than the checkpoint: its third block would silently keep the weights it was drawn with
    cfg = load_config(None, [*ENCODER, "--model.n_layer=3", "--model.head=classify", "--model.num_classes=2",
                             "--task.file=x.csv"])
    model = family_of(cfg.model).build(cfg.model)
    with pytest.raises(CheckpointError, match=r"lacks the trunk weights \['blocks\.2\."):
        load_trunk(encoder_run, model)


def test_each_task_row_is_cls_then_its_tokens_cut_to_seq_len(tmp_path):
    words = "the king sailed the ship through the storm and the queen held the crown " * 4
    task = write_rows(tmp_path / "rows.csv", [{"text": words, "label": 0}, {"text": "a ship", "label": 1}])
    cfg = load_config(None, [*ENCODER, "--model.head=classify", "--model.num_classes=2", f"--task.file={task}"])
    examples, labels = read_task_rows(cfg, task)
    encode = model_tokenizer(cfg.data.tokenizer, cfg.model.vocab_size).encode_ordinary
    assert len(encode(words)) > cfg.data.seq_len
    # [CLS] and then the first seq_len - 1 ids: exactly data.seq_len ids, the longest a window holds
    assert examples[0].tolist() == [cfg.model.cls_id, *encode(words)[:cfg.data.seq_len - 1]]
    assert len(examples[0]) == cfg.data.seq_len == 16
    assert examples[1].tolist() == [cfg.model.cls_id, *encode("a ship")]
    assert cfg.model.cls_id != cfg.model.pad_id
    assert labels.tolist() == [0, 1]


def _task_config(task: Path, *extra: str):
    return load_config(None, [*ENCODER, "--model.head=classify", "--model.num_classes=2", f"--task.file={task}",
                              "--train.batch_size=16", "--train.micro_batch_size=8", "--train.device=cpu", *extra])


def test_the_task_loader_shuffles_by_train_seed_and_pads_with_the_pad_id(separable_rows, tmp_path):
    task = write_rows(tmp_path / "lines.csv", separable_rows)
    firsts = {}
    for seed in (3, 4):
        data = open_task_data(_task_config(task, f"--train.seed={seed}"), CPU_RANK)
        batches = data.loader.next_batch()
        firsts[seed] = [row.tolist() for ids, _, _ in batches for row in ids]
        again = open_task_data(_task_config(task, f"--train.seed={seed}"), CPU_RANK).loader.next_batch()
        assert [row.tolist() for ids, _, _ in again for row in ids] == firsts[seed]  # the seed alone decides
        cfg = _task_config(task)
        for ids, _, keep in batches:
            assert not keep.all()  # rows of 4 to 9 ids: the shorter ones are padded
            assert (ids[~keep] == cfg.model.pad_id).all()
            assert (ids[:, 0] == cfg.model.cls_id).all()
    assert firsts[3] != firsts[4]


def test_a_task_batch_that_does_not_split_over_the_ranks_is_one_config_error(separable_rows, tmp_path):
    task = write_rows(tmp_path / "lines.csv", separable_rows)
    three = DistEnv(rank=0, local_rank=0, world_size=3, device=torch.device("cpu"))
    with pytest.raises(ConfigError, match="world size 3"):
        open_task_data(_task_config(task), three)


def test_a_missing_encoder_is_named_by_its_flag(tmp_path, capsys):
    gone = tmp_path / "no_such_run"
    assert run(finetune.main, ["--encoder", str(gone), "--model.head=regress", f"--task.file={tmp_path / 'rows.csv'}",
                               f"--train.out_dir={tmp_path / 'ft'}"]) == 2
    assert capsys.readouterr().err == f"error: --encoder: no such file or directory {str(gone)!r}\n"
    assert not (tmp_path / "ft").exists()


def test_a_fine_tuned_runs_head_is_not_carried_into_the_next_fine_tuning(tmp_path):
    # a fine-tuned encoder as --encoder: its trunk keys are taken, the head is the new run's to choose
    saved = load_config(None, ["--model.arch=encoder", "--model.head=classify", "--model.num_classes=3",
                               "--model.n_layer=3", f"--task.file={tmp_path / 'rows.csv'}"])
    base = encoder_base(tmp_path / "enc", saved)
    assert "head" not in base["model"] and "num_classes" not in base["model"]
    assert base["model"]["arch"] == "encoder" and base["model"]["n_layer"] == 3
    assert base["checkpoint"] == {"init_from": str(tmp_path / "enc")}
    assert base["data"] == {"tokenizer": saved.data.tokenizer, "seq_len": saved.data.seq_len}


def test_a_run_without_a_head_is_refused_before_anything_is_written(encoder_run, tmp_path, capsys):
    # without the check the encoder's masked-token training went on in train.out_dir
    out = tmp_path / "ft"
    assert run(finetune.main, ["--encoder", str(encoder_run), f"--train.out_dir={out}", "--train.device=cpu",
                               "--train.steps=1"]) == 2
    assert capsys.readouterr().err == ("error: model.head: lm.finetune trains a classify or regress head, got 'mlm'; "
                                       "set --model.head=classify (with --model.num_classes) or --model.head=regress\n")
    assert not out.exists()


def test_a_blank_encoder_is_refused_by_its_flag(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        finetune.main(["--encoder", " ", "--model.head=regress", f"--train.out_dir={tmp_path / 'ft'}"])
    assert exit_.value.code == 2
    assert "argument --encoder: expected a path, got ' '" in capsys.readouterr().err


def test_the_encoder_may_be_named_with_a_trailing_slash_or_another_spelling(encoder_run, separable_rows, tmp_path):
    # checkpoint.init_from holds the path as Path() writes it: the same checkpoint, spelt otherwise, is no other one
    task = write_rows(tmp_path / "lines.csv", separable_rows[:20])
    spelt = f"{encoder_run.parent}/./{encoder_run.name}/"
    out = tmp_path / "ft"
    assert run(finetune.main, ["--encoder", spelt, f"--train.out_dir={out}", "--model.head=classify",
                               "--model.num_classes=2", f"--task.file={task}", "--train.device=cpu", "--train.steps=1",
                               "--train.batch_size=2", "--train.micro_batch_size=2", "--log.tensorboard=false"]) == 0
    assert (out / "checkpoints" / "step_00000001").is_dir()


ONE_STEP = ["--train.steps=1", "--train.batch_size=2", "--train.micro_batch_size=2", "--train.device=cpu",
            "--log.tensorboard=false", "--optim.lr=3e-3", "--schedule.warmup_steps=0"]


def one_step_run(encoder_run, out, task, *head):
    assert run(finetune.main, ["--encoder", str(encoder_run), f"--train.out_dir={out}", f"--task.file={task}",
                               *head, *ONE_STEP]) == 0
    return out


@pytest.fixture(scope="module")
def small_classifier(encoder_run, separable_rows, tmp_path_factory):
    """A classifier fine-tuned for one step on 20 separable rows, and its task file."""
    root = tmp_path_factory.mktemp("small_classifier")
    task = write_rows(root / "lines.csv", separable_rows[:20])
    return one_step_run(encoder_run, root / "ft", task, "--model.head=classify", "--model.num_classes=2"), task


def printed_scores(out: str) -> dict[str, str]:
    lines = out.splitlines()
    after = next(i for i, line in enumerate(lines) if line.startswith("file: ")) + 1
    return dict(line.split(": ", 1) for line in lines[after:] if not line.startswith("predictions: "))


@pytest.mark.parametrize("which", ["decoder", "pretrained encoder"])
def test_a_checkpoint_without_a_head_is_refused_in_one_line(which, trained_run, encoder_run, small_classifier,
                                                            capsys):
    checkpoint = trained_run if which == "decoder" else encoder_run
    capsys.readouterr()
    assert run(predict.main, ["--checkpoint", str(checkpoint), "--file", str(small_classifier[1])]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --checkpoint: {resolve_checkpoint(checkpoint)} holds ") and err.count("\n") == 1
    assert err.endswith("pretrained on token shards; lm.predict takes a fine-tuned head (model.head classify or "
                        "regress: lm.finetune)\n")


def test_an_empty_label_column_predicts_a_labelled_file_without_scoring_it(small_classifier, tmp_path, capsys):
    out, task = small_classifier
    scored, unscored = tmp_path / "scored.jsonl", tmp_path / "unscored.jsonl"
    capsys.readouterr()
    assert run(predict.main, ["--checkpoint", str(out), "--file", str(task), "--out", str(scored)]) == 0
    assert "accuracy" in printed_scores(capsys.readouterr().out)
    assert run(predict.main, ["--checkpoint", str(out), "--file", str(task), "--out", str(unscored),
                              "--label-column", ""]) == 0
    assert printed_scores(capsys.readouterr().out) == {}
    assert unscored.read_text() == scored.read_text()


def test_the_file_line_counts_the_rows_and_the_probabilities_give_the_printed_loss(small_classifier, separable_rows,
                                                                                     tmp_path, capsys):
    out, task = small_classifier
    preds = tmp_path / "p.jsonl"
    capsys.readouterr()
    assert run(predict.main, ["--checkpoint", str(out), "--file", str(task), "--out", str(preds)]) == 0
    printed = capsys.readouterr().out
    assert f"file: {task} | 20 rows | model.head=classify\n" in printed
    lines = [json.loads(line) for line in preds.read_text().splitlines()]
    loss = -sum(math.log(line["probabilities"][row["label"]]) for line, row in zip(lines, separable_rows)) / 20
    assert float(printed_scores(printed)["loss"]) == pytest.approx(loss, abs=2e-4)


def test_text_column_reads_the_texts_from_the_column_it_names(small_classifier, separable_rows, tmp_path):
    out, task = small_classifier
    renamed = write_rows(tmp_path / "renamed.csv", [{"sentence": r["text"]} for r in separable_rows[:20]])
    original, again = tmp_path / "original.jsonl", tmp_path / "again.jsonl"
    assert run(predict.main, ["--checkpoint", str(out), "--file", str(task), "--out", str(original)]) == 0
    assert run(predict.main, ["--checkpoint", str(out), "--file", str(renamed), "--out", str(again),
                              "--text-column", "sentence"]) == 0
    assert again.read_text() == original.read_text()


def test_regression_predictions_are_written_unrounded(encoder_run, tmp_path, capsys):
    """Each written prediction is the model's number: their squared errors average to the printed MSE."""
    rows = [{"text": " ".join(["up"] * i + ["down"] * (8 - i)), "label": i / 8} for i in range(9)] * 2
    task = write_rows(tmp_path / "levels.jsonl", rows)
    out = one_step_run(encoder_run, tmp_path / "reg", task, "--model.head=regress")
    preds = tmp_path / "p.jsonl"
    capsys.readouterr()
    assert run(predict.main, ["--checkpoint", str(out), "--file", str(task), "--out", str(preds)]) == 0
    predictions = [json.loads(line)["prediction"] for line in preds.read_text().splitlines()]
    mse = sum((p - row["label"]) ** 2 for p, row in zip(predictions, rows)) / len(rows)
    assert float(printed_scores(capsys.readouterr().out)["mse"]) == pytest.approx(mse, abs=1e-4)


def test_predictions_never_replace_the_tokenizer_json_of_the_run(tokenizer_jsons, separable_rows, tmp_path, capsys,
                                                                  monkeypatch):
    tokenizer = tokenizer_jsons["eot"]
    cfg = load_config(None, ["--model.arch=encoder", "--model.n_head=2", "--model.head=classify",
                             "--model.num_classes=2", f"--data.tokenizer={tokenizer}", "--model.vocab_size=400",
                             f"--task.file={tmp_path / 'task.csv'}"])
    monkeypatch.setattr(predict, "saved_config", lambda path: cfg)  # the run's config, as its checkpoint holds it
    task = write_rows(tmp_path / "rows.csv", separable_rows[:4])
    before = tokenizer.read_bytes()
    assert run(predict.main, ["--checkpoint", str(tmp_path / "run"), "--file", str(task), "--out", str(tokenizer),
                              "--force"]) == 2
    assert capsys.readouterr().err.startswith(f"error: --out {tokenizer}: is the input {tokenizer}")
    assert tokenizer.read_bytes() == before
