"""A model's own tokenizer.json through the real tools: lm.prepare -> lm.train -> lm.eval --text -> lm.sample ->
lm.export, with its BOS and EOS; training on shards of another tokenizer is refused before the run directory
exists."""

import json
import logging
import re
import shutil

import pytest

from lm import eval as eval_tool
from lm import export as export_tool
from lm import prepare as prepare_tool
from lm import sample as sample_tool
from lm import train as train_tool
from lm.cli import run
from lm.tokenizer import load_tokenizer

TEXT = "Fair is foul, and foul is fair:\nHover through the fog and filthy air.\n"
PROMPT = "KING DUNCAN. What bloody man is that?"


def train_flags(tokenizer, data_dir, out, vocab_size) -> list[str]:
    """A 2-layer, d=32 GPT trained 4 steps, its embedding 16 rows larger than the tokenizer's 400 ids."""
    return [
        f"--data.tokenizer={tokenizer}", f"--model.vocab_size={vocab_size}", "--model.n_layer=2", "--model.n_head=2",
        "--model.d_model=32", "--model.block_size=32", "--data.seq_len=16", f"--data.dir={data_dir}",
        "--train.steps=4", "--train.batch_size=4", "--train.micro_batch_size=2", "--train.device=cpu",
        "--train.eval_batches=2", "--log.tensorboard=false", f"--log.sample_prompt={PROMPT}", "--log.sample_tokens=8",
        f"--train.out_dir={out}",
    ]


@pytest.fixture(scope="module")
def prepared(tokenizer_jsons, tiny_corpus_dir, tmp_path_factory):
    """Macbeth's scenes prepared by `python -m lm.prepare` with the "bos" tokenizer.json."""
    data = tmp_path_factory.mktemp("tokenizer_json") / "data"
    assert run(prepare_tool.main, [f"--data.source={tiny_corpus_dir}/*.txt", f"--data.dir={data}",
                                   f"--data.tokenizer={tokenizer_jsons['bos']}", "--data.val_fraction=0.1",
                                   "--data.shard_tokens=4096"]) == 0
    return data


@pytest.fixture(scope="module")
def trained(prepared, tokenizer_jsons, tmp_path_factory):
    out = tmp_path_factory.mktemp("tokenizer_json_run") / "run"
    assert run(train_tool.main, train_flags(tokenizer_jsons["bos"], prepared, out, 416)) == 0
    return out


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.mark.slow
def test_prepare_train_eval_sample(tokenizer_jsons, prepared, trained, tmp_path, capsys, caplog):
    capsys.readouterr()
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    assert run(eval_tool.main, ["--checkpoint", str(trained), "--text", str(text)]) == 0
    out = capsys.readouterr().out
    # <s> leads the text, as it leads every training document, so each of the text's tokens is scored
    n_tokens = len(load_tokenizer(str(tokenizer_jsons["bos"])).encode_ordinary(TEXT))
    assert f"tokens scored: {n_tokens}\n" in out and "bits per byte:" in out

    assert run(sample_tool.main, ["--checkpoint", str(trained), "--prompt", PROMPT, "--max-new-tokens", "12",
                                  "--seed", "3"]) == 0
    sampled = capsys.readouterr().out
    assert sampled.startswith(PROMPT) and len(sampled) > len(PROMPT) + 1
    assert run(sample_tool.main, ["--checkpoint", str(trained), "--max-new-tokens", "12"]) == 0  # from <s>
    assert capsys.readouterr().out.strip()


@pytest.mark.slow
def test_training_logged_a_sample_of_the_prompt(prepared, tokenizer_jsons, tmp_path, caplog):
    out = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="lm.train"):
        assert run(train_tool.main, train_flags(tokenizer_jsons["bos"], prepared, out, 400)
                   + ["--train.steps=1"]) == 0
    samples = [r.getMessage() for r in caplog.records if "sample:" in r.getMessage()]
    assert samples and samples[-1].startswith("step 1 | sample: " + repr(PROMPT)[:-1])


@pytest.mark.slow
@pytest.mark.parametrize("tokenizer, vocab_size, message", [
    ("eot", 400, r"error: {data}: prepared with tokenizer '{bos}' \(tokenizer hash [0-9a-f]{{12}}\), but "
                 r"data.tokenizer='{eot}' \(tokenizer hash [0-9a-f]{{12}}\), which makes other ids; prepare again"),
    ("bos", 399, r"error: model.vocab_size: 399 is smaller than tokenizer '{bos}', which has 400 ids"),
], ids=["other-tokenizer", "vocab-too-small"])
def test_training_is_refused_before_the_run_exists(prepared, tokenizer_jsons, tmp_path, capsys, tokenizer,
                                                   vocab_size, message):
    out = tmp_path / "run"
    assert run(train_tool.main, train_flags(tokenizer_jsons[tokenizer], prepared, out, vocab_size)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    expected = message.format(data=prepared, bos=tokenizer_jsons["bos"], eot=tokenizer_jsons["eot"])
    assert len(lines) == 1 and re.match(expected, lines[0]), lines
    assert not out.exists()


def test_a_mixture_knows_a_tokenizer_file_by_its_hash(prepared, tokenizer_jsons, tiny_corpus_dir, tmp_path, capsys):
    copy = tmp_path / "copy" / "tokenizer.json"
    copy.parent.mkdir()
    shutil.copy(tokenizer_jsons["bos"], copy)
    for name, tokenizer in [("same", copy), ("other", tokenizer_jsons["eot"])]:
        assert run(prepare_tool.main, [f"--data.source={tiny_corpus_dir}/scene_0*.txt", f"--data.dir={tmp_path / name}",
                                       f"--data.tokenizer={tokenizer}", "--data.val_fraction=0.2"]) == 0
    flags = train_flags(tokenizer_jsons["bos"], prepared, tmp_path / "run", 400) + ["--train.steps=1"]
    assert run(train_tool.main, [*flags, f"--data.mixture=[{{dir: {prepared}}}, {{dir: {tmp_path / 'same'}}}]"]) == 0
    capsys.readouterr()
    assert run(train_tool.main, [*flags, f"--data.mixture=[{{dir: {prepared}}}, {{dir: {tmp_path / 'other'}}}]"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: data.mixture: {prepared} was prepared with tokenizer '{tokenizer_jsons['bos']}' "
                          f"(400 ids) but {tmp_path / 'other'} with '{tokenizer_jsons['eot']}' (400 ids); all sources "
                          "must share one tokenizer")


def test_export_copies_the_tokenizer(trained, tokenizer_jsons, tmp_path):
    from transformers import AutoTokenizer

    out = tmp_path / "hf"
    assert run(export_tool.main, ["--checkpoint", str(trained), "--to", "hf", str(out)]) == 0
    assert (out / "tokenizer.json").read_bytes() == tokenizer_jsons["bos"].read_bytes()
    assert not (out / "vocab.json").exists()
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["vocab_size"]) == (0, 1, 416)
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (0, 1)
    ours = load_tokenizer(str(tokenizer_jsons["bos"]))
    hf = AutoTokenizer.from_pretrained(out, local_files_only=True)
    ids = ours.encode_ordinary(TEXT)
    assert hf.encode(TEXT, add_special_tokens=False) == ids and hf.encode(TEXT) == [0, *ids]
    assert (hf.bos_token_id, hf.eos_token_id) == (0, 1) and hf.decode(ids) == TEXT
