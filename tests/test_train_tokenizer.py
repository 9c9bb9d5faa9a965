"""`python -m lm.train_tokenizer` through its real main: a small byte-level BPE trained on Macbeth's scenes loads in
`tokenizers` and in lm, gives back any UTF-8 text, holds out the documents lm.prepare puts in val and measures
them, and goes through lm.prepare, lm.train, lm.eval, lm.sample and lm.export; bad input ends in one `error:`
line with exit status 2 and no file changed."""

import contextlib
import errno
import hashlib
import io
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import tokenizers

from lm import eval as eval_tool
from lm import export as export_tool
from lm import prepare as prepare_tool
from lm import sample as sample_tool
from lm import train as train_tool
from lm.cli import run
from lm.data.prepare import is_val_document
from lm.data.tokenizer_training import MAX_VOCAB_SIZE, check_vocab_size, special_tokens, train_bpe
from lm.errors import ConfigError
from lm.tokenizer import load_tokenizer
from lm.train_tokenizer import main

VOCAB = 600
TEXTS = [
    "Fair is foul, and foul is fair:\nHover through the fog and filthy air.\n",
    "emoji 👋🏽🧪, CJK 漢字かな, accents café naïve, Ωμέγα, RTL שלום\n",
    "\r\n\t  spaces,\x00 a NUL, \x7f, the text <|endoftext|> and <|pad|> as text, 123456789  \n\n",
    "",
]
COMPRESSION = re.compile(r"held out: (\d+) documents, ([\d,]+) bytes: ([\d.]+) bytes/token \(([\d,]+) tokens\), "
                         r"gpt2 ([\d.]+) \(([\d,]+) tokens\); [\d.]+% (?:fewer|more) tokens than gpt2")


def number(text: str) -> int:
    return int(text.replace(",", ""))


@dataclass(frozen=True)
class Trained:
    path: Path
    printed: str
    corpus: Path


@pytest.fixture(scope="module")
def trained(tiny_corpus_dir, tmp_path_factory) -> Trained:
    """A 600-id tokenizer with <|pad|>, trained by the tool on Macbeth's 28 scenes less the 2 that val_fraction
    0.1 holds out, written into a directory the tool makes; and what it printed."""
    out = tmp_path_factory.mktemp("trained_tokenizer") / "new" / "macbeth.json"
    argv = [f"--data.source={tiny_corpus_dir}/*.txt", "--data.val_fraction=0.1", "--vocab-size", str(VOCAB),
            "--special-token", "<|pad|>", "--out", str(out)]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert run(main, argv) == 0
    return Trained(out, stdout.getvalue(), tiny_corpus_dir)


def test_the_file_loads_with_its_specials_first(trained):
    tokenizer = tokenizers.Tokenizer.from_file(str(trained.path))
    assert tokenizer.get_vocab_size(with_added_tokens=True) == VOCAB
    assert (tokenizer.token_to_id("<|endoftext|>"), tokenizer.token_to_id("<|pad|>")) == (0, 1)
    added = {t["content"]: t["special"] for t in json.loads(trained.path.read_text())["added_tokens"]}
    assert added == {"<|endoftext|>": True, "<|pad|>": True}
    ours = load_tokenizer(str(trained.path))  # as lm.prepare and every tool read it
    assert (ours.n_vocab, ours.eot_token, ours.bos_token) == (VOCAB, 0, None)
    assert "trained on 26 documents" in trained.printed and "600 ids, <|endoftext|> = 0, <|pad|> = 1" in trained.printed


@pytest.mark.parametrize("text", TEXTS, ids=["english", "unicode", "controls-and-specials", "empty"])
def test_any_utf8_text_comes_back_exactly(trained, text):
    ours = load_tokenizer(str(trained.path))
    ids = ours.encode_ordinary(text)
    assert ours.decode(ids) == text
    assert all(2 <= i < VOCAB for i in ids)  # the specials' text in a corpus is text, as lm.prepare reads it


def test_the_held_out_documents_are_preparations_val_split(trained, tmp_path):
    """The compression line measures the documents lm.prepare puts in val, in the counts prepare makes of them."""
    found = COMPRESSION.search(trained.printed)
    assert found, trained.printed
    documents, size, new_rate, new, gpt2_rate, gpt2 = found.groups()
    files = sorted(trained.corpus.glob("*.txt"))
    val = [f.read_text() for i, f in enumerate(files) if is_val_document(i, 0.1)]
    assert number(documents) == len(val) == 2
    assert number(size) == sum(len(t.encode()) for t in val)
    assert number(gpt2) == sum(len(load_tokenizer("gpt2").encode_ordinary(t)) for t in val)
    assert float(gpt2_rate) == pytest.approx(number(size) / number(gpt2), abs=1e-3)
    assert float(new_rate) == pytest.approx(number(size) / number(new), abs=1e-3)

    data = tmp_path / "data"
    assert run(prepare_tool.main, [f"--data.source={trained.corpus}/*.txt", f"--data.tokenizer={trained.path}",
                                   "--data.val_fraction=0.1", f"--data.dir={data}"]) == 0
    manifest = json.loads((data / "manifest.json").read_text())
    assert (manifest["vocab_size"], manifest["eot_id"], manifest["dtype"]) == (VOCAB, 0, "uint16")
    assert "bos_id" not in manifest
    # each val document's tokens, then its end-of-text
    assert manifest["splits"]["val"]["tokens"] == number(new) + 2


def test_prepare_train_eval_sample_export(trained, tmp_path, capsys):
    from transformers import AutoTokenizer

    data, out, hf = tmp_path / "data", tmp_path / "run", tmp_path / "hf"
    assert run(prepare_tool.main, [f"--data.source={trained.corpus}/*.txt", f"--data.tokenizer={trained.path}",
                                   "--data.val_fraction=0.1", f"--data.dir={data}", "--data.shard_tokens=4096"]) == 0
    assert run(train_tool.main, [
        f"--data.tokenizer={trained.path}", f"--model.vocab_size={VOCAB}", "--model.n_layer=1", "--model.n_head=2",
        "--model.d_model=32", "--model.block_size=32", "--data.seq_len=16", f"--data.dir={data}", "--train.steps=2",
        "--train.batch_size=2", "--train.micro_batch_size=2", "--train.device=cpu", "--train.eval_batches=1",
        "--log.tensorboard=false", "--log.sample_tokens=4", f"--train.out_dir={out}",
    ]) == 0
    text = tmp_path / "t.txt"
    text.write_text(TEXTS[0] + TEXTS[1])
    capsys.readouterr()
    assert run(eval_tool.main, ["--checkpoint", str(out), "--text", str(text)]) == 0
    printed = capsys.readouterr().out
    n_tokens = len(load_tokenizer(str(trained.path)).encode_ordinary(text.read_text()))
    loss = float(re.search(r"loss: ([\d.]+) nats/token", printed).group(1))
    bits_per_byte = float(re.search(r"bits per byte: ([\d.]+)", printed).group(1))
    # bits over the file's bytes, not its tokens: the emoji and CJK make bytes outnumber characters
    assert f"tokens scored: {n_tokens}\n" in printed
    assert bits_per_byte == pytest.approx(loss * n_tokens / 0.6931471805599453 / len(text.read_bytes()), rel=1e-3)

    assert run(sample_tool.main, ["--checkpoint", str(out), "--prompt", "café 👋", "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out.startswith("café 👋")

    assert run(export_tool.main, ["--checkpoint", str(out), "--to", "hf", str(hf)]) == 0
    assert (hf / "tokenizer.json").read_bytes() == trained.path.read_bytes()
    auto = AutoTokenizer.from_pretrained(hf, local_files_only=True)
    ids = load_tokenizer(str(trained.path)).encode_ordinary(TEXTS[1])
    assert auto.encode(TEXTS[1], add_special_tokens=False) == ids and auto.decode(ids) == TEXTS[1]
    assert auto.eos_token_id == 0


def test_force_replaces_and_no_val_split_measures_nothing(tiny_corpus_dir, tmp_path, capsys):
    out = tmp_path / "tok.json"
    out.write_text("not yet a tokenizer")
    argv = [f"--data.source={tiny_corpus_dir}/scene_0*.txt", "--data.val_fraction=0", "--vocab-size", "300",
            "--out", str(out), "--force"]
    assert run(main, argv) == 0
    assert "held out: no document (data.val_fraction=0.0)" in capsys.readouterr().out
    assert tokenizers.Tokenizer.from_file(str(out)).get_vocab_size() == 300
    assert [p.name for p in tmp_path.iterdir()] == ["tok.json"]  # no temporary file left
    rows = tmp_path / "rows.jsonl"  # rows without text are no documents, as blank documents of text files are
    rows.write_text("".join(f'{{"text": "{"" if i % 2 else f"word {i}"}"}}\n' for i in range(20)))
    assert run(main, [f"--data.source={rows}", "--data.val_fraction=0.5", "--vocab-size", "300", "--out",
                      str(out), "--force"]) == 0
    printed = capsys.readouterr().out
    assert "trained on 5 documents" in printed and "held out: 5 documents, " in printed


def test_a_small_corpus_gives_fewer_ids_and_says_so(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("to be or not to be\n")
    (tmp_path / "b.txt").write_text("that is the question\n")
    out = tmp_path / "tok.json"
    assert run(main, [f"--data.source={tmp_path}/*.txt", "--data.val_fraction=0.5", "--vocab-size", "5000",
                      "--out", str(out)]) == 0
    n_vocab = tokenizers.Tokenizer.from_file(str(out)).get_vocab_size()
    printed = capsys.readouterr().out
    assert 257 < n_vocab < 300 and f"{n_vocab} ids (of 5,000 asked: no pair is left to merge)" in printed
    assert "trained on 1 document (0.0 MB)" in printed and "held out: 1 document, 21 bytes" in printed
    assert printed.endswith(f"--model.vocab_size={n_vocab}\n")


def digest(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


BAD = [
    ("no-match", ["--data.source={ws}/nothing*.txt"], r"data.source: '{ws}/nothing\*.txt' matches no files"),
    ("vocab-not-int", ["--vocab-size", "16k"], r"argument --vocab-size: expected a positive integer, got '16k'"),
    ("vocab-zero", ["--vocab-size", "0"], r"argument --vocab-size: expected a positive integer, got 0"),
    ("vocab-negative", ["--vocab-size", "-5"], r"argument --vocab-size: expected a positive integer, got -5"),
    ("vocab-nan", ["--vocab-size", "nan"], r"argument --vocab-size: expected a positive integer, got 'nan'"),
    # the tokenizers library aborts the process (a Rust panic) past what it can allocate or a u32 holds
    ("vocab-huge", ["--vocab-size", "1000000000000"],
     r"--vocab-size: 1,000,000,000,000 is too large; at most 1,048,576 \(the largest vocabularies in use hold "
     r"262,144 ids\)"),
    ("vocab-past-int64", ["--vocab-size", str(10**26)], r"--vocab-size: 100000\.\.\. \(27 digits\) is too large"),
    ("vocab-one-too-many", ["--vocab-size", "1048577"], r"--vocab-size: 1,048,577 is too large; at most 1,048,576"),
    ("vocab-too-small", ["--vocab-size", "256"],
     r"--vocab-size: 256 is too small; a byte-level BPE holds 256 byte tokens and 1 special token before any "
     r"merge, so at least 257"),
    ("out-directory", ["--out", "{ws}/dir.json"], r"--out {ws}/dir.json: is a directory"),
    ("out-not-json", ["--out", "{ws}/tok.txt"], r"--out {ws}/tok.txt: must end in .json"),
    ("out-below-file", ["--out", "{ws}/corpus/a.txt/tok.json"], r"{ws}/corpus/a.txt is a file, not a directory"),
    ("out-is-input", ["--data.source={ws}/rows.json", "--out", "{ws}/rows.json", "--force"],
     r"--out {ws}/rows.json: is the input {ws}/rows.json"),
    ("out-name-too-long", ["--out", "{ws}/" + "t" * 245 + ".json"],
     r"--out {ws}/t+\.json: the name 'tttttttttttttttttttttttt\.\.\.' is 250 bytes; its filesystem takes names of at "
     r"most 255, and lm writes it first under a name 14 bytes longer"),
    ("out-directory-name-too-long", ["--out", "{ws}/" + "d" * 256 + "/tok.json"],
     r"the name 'dddddddddddddddddddddddd\.\.\.' is 256 bytes; its filesystem takes names of at most 255$"),
    ("out-root", ["--out", "/"], r"--out /: must end in .json"),
    ("out-exists", ["--out", "{ws}/old.json"], r"--out {ws}/old.json: exists; pass --force to replace it"),
    ("config-beside", ["--out", "{ws}/hf/tokenizer.json"],
     r"{ws}/hf/tokenizer_config.json is beside it and lm would read its special tokens"),
    ("special-twice", ["--special-token", "<|pad|>", "--special-token", "<|pad|>"],
     r"--special-token: '<\|pad\|>' is named twice"),
    ("special-eot", ["--special-token", "<|endoftext|>"], r"--special-token: '<\|endoftext\|>' is the end-of-text"),
    ("special-empty", ["--special-token="], r"--special-token: got an empty string"),
    ("bad-utf8", ["--data.source={ws}/corpus/*.txt,{ws}/binary.txt"], r"{ws}/binary.txt: not UTF-8"),
    ("out-in-a-checkpoint", ["--out", "{ws}/run/checkpoints/step_00000001/state.json", "--force"],
     r"--out {ws}/run/checkpoints/step_00000001/state.json: is inside the checkpoint {ws}/run/checkpoints/"
     r"step_00000001"),
    # rows of empty text: it trained on nothing, wrote --out and then divided by zero
    ("no-text", ["--data.source={ws}/empty_rows.jsonl"],
     r"data.source: {ws}/empty_rows.jsonl: its training documents \(\d+ documents\) hold no text"),
]


@pytest.mark.slow
@pytest.mark.parametrize("extra, error", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input_is_one_error_line_and_writes_nothing(tmp_path, capsys, monkeypatch, extra, error):
    ws = tmp_path / "ws"
    (ws / "corpus").mkdir(parents=True)
    (ws / "corpus" / "a.txt").write_text("To be, or not to be. " * 20)
    (ws / "corpus" / "b.txt").write_text("That is the question. " * 20)
    (ws / "rows.json").write_text('{"text": "one row"}\n{"text": "another"}\n')
    (ws / "binary.txt").write_bytes(b"text \xff\xfe then bytes")
    (ws / "empty_rows.jsonl").write_text('{"text": ""}\n' * 20)
    (ws / "run" / "checkpoints" / "step_00000001").mkdir(parents=True)
    (ws / "run" / "checkpoints" / "step_00000001" / "state.json").write_text('{"step": 1}')
    (ws / "dir.json").mkdir()
    (ws / "old.json").write_text("{}")
    (ws / "hf").mkdir()
    (ws / "hf" / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    monkeypatch.chdir(ws)
    before = digest(ws)
    argv = [f"--data.source={ws}/corpus/*.txt", "--vocab-size", "300", "--out", f"{ws}/out/tok.json"]
    argv += [a.replace("{ws}", str(ws)) for a in extra]  # argparse and the config take the last value given
    try:
        code = run(main, argv)
    except SystemExit as exit_:  # argparse's usage errors
        code = exit_.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error: " in line]
    assert code == 2 and len(lines) == 1, err
    assert re.search(error.replace("{ws}", re.escape(str(ws))), lines[0]), lines[0]
    assert digest(ws) == before


def test_an_output_that_fails_after_training_is_named_by_its_flag(tmp_path, capsys, monkeypatch):
    """What no check before training can see (a full disk) still ends in one line naming --out, and leaves no
    temporary file."""
    (tmp_path / "a.txt").write_text("to be or not to be\n")
    out = tmp_path / "tok.json"

    def full(path, text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path.with_name(".tok.json.1234abcd.tmp")))

    monkeypatch.setattr("lm.train_tokenizer.atomic_write_text", full)
    argv = [f"--data.source={tmp_path}/a.txt", "--data.val_fraction=0", "--vocab-size", "300", "--out", str(out)]
    assert run(main, argv) == 2
    assert capsys.readouterr().err == f"error: --out {out}: cannot write it: No space left on device\n"
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]


def test_the_vocab_size_range_ends_at_max_vocab_size():
    check_vocab_size(MAX_VOCAB_SIZE, special_tokens([]))
    check_vocab_size(257, special_tokens([]))
    with pytest.raises(ConfigError, match="--vocab-size: 1,048,577 is too large"):
        train_bpe(iter([]), MAX_VOCAB_SIZE + 1, special_tokens([]))  # refused before the library sees it


HELD_OUT_TOKENS = re.compile(r"bytes/token \(([\d,]+) tokens\), gpt2 [\d.]+ \(([\d,]+) tokens\); "
                             r"([\d.]+%) (\w+) tokens")


def test_the_share_of_tokens_saved_is_one_less_the_ratio_of_the_counts(tiny_corpus_dir, tmp_path, capsys):
    out = tmp_path / "tok.json"
    assert run(main, [f"--data.source={tiny_corpus_dir}/*.txt", "--data.val_fraction=0.1", "--vocab-size", "300",
                      "--out", str(out)]) == 0
    found = HELD_OUT_TOKENS.search(capsys.readouterr().out)
    new, gpt2 = (int(count.replace(",", "")) for count in found.group(1, 2))
    fewer = 1 - new / gpt2
    assert found.group(3, 4) == (f"{abs(fewer):.1%}", "fewer" if fewer >= 0 else "more")


def test_special_token_text_in_a_held_out_document_is_measured_as_text(tmp_path, capsys):
    """The held-out documents are counted as lm encodes them: a special token's text in a corpus is text."""
    texts = ["to be or not to be, that is the question\n", "the end <|endoftext|> and the end <|endoftext|>\n"]
    for i, text in enumerate(texts):
        (tmp_path / f"{i}.txt").write_text(text)
    [val] = [text for i, text in enumerate(texts) if is_val_document(i, 0.5)]
    out = tmp_path / "tok.json"
    assert run(main, [f"--data.source={tmp_path}/*.txt", "--data.val_fraction=0.5", "--vocab-size", "300",
                      "--out", str(out)]) == 0
    new = int(HELD_OUT_TOKENS.search(capsys.readouterr().out).group(1).replace(",", ""))
    assert new == len(load_tokenizer(str(out)).encode_ordinary(val))


def test_the_training_text_is_reported_in_megabytes(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("abcd " * 60_000)  # 300,000 bytes
    assert run(main, [f"--data.source={tmp_path}/a.txt", "--data.val_fraction=0", "--vocab-size", "300",
                      "--out", str(tmp_path / "tok.json")]) == 0
    assert "trained on 1 document (0.3 MB) in " in capsys.readouterr().out


def test_the_text_column_of_rows_is_the_one_data_text_column_names(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": i, "body": f"line number {i} of the rows"}) + "\n" for i in range(4)))
    assert run(main, [f"--data.source={rows}", "--data.text_column=body", "--data.val_fraction=0", "--vocab-size",
                      "300", "--out", str(tmp_path / "tok.json")]) == 0
    assert "trained on 4 documents" in capsys.readouterr().out


def test_a_bad_vocab_size_is_refused_before_the_corpus_is_looked_for(tmp_path, capsys):
    assert run(main, [f"--data.source={tmp_path}/nothing*.txt", "--vocab-size", "256", "--out",
                      str(tmp_path / "tok.json")]) == 2
    assert capsys.readouterr().err == ("error: --vocab-size: 256 is too small; a byte-level BPE holds 256 byte tokens "
                                       "and 1 special token before any merge, so at least 257\n")
