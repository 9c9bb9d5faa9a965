import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest
import tiktoken
from tokenizers import Regex, pre_tokenizers

from lm.data.corpora import find_corpus
from lm.data.shards import check_manifest
from lm.errors import DataError
from lm.hf.tokenizer_files import byte_to_unicode, exported_encoding, hf_pattern, recover_merges, write_hf_tokenizer
from lm.tokenizer import EXPORTED_SHA256, VOCAB_SIZES, load_tokenizer, tokenizer_hash, tokenizer_identity

# Each line aims at a place where a converted tokenizer can drift from tiktoken: contractions and the
# case-insensitive cl100k contraction rule (including "ſ", which folds to "s"), digit runs (cl100k
# splits them in threes), indentation and whitespace runs, unicode whitespace, CJK, emoji joined with
# ZWJ, combining marks, CRLF, " ," and " n't" (which transformers' decode cleanup would rewrite),
# and trailing spaces at the very end (the `\s++$` rule).
_EDGE_CASES = (
    "Don't stop; I'LL go, you'VE seen it, we'Re here, he'd x'ſ O'Neil's 'tis.\n"
    "Numbers: 1234567 3.14159 -42 1,000,000 0x1F ٣٤٥٦ ½ 2² 10000000000000000\n"
    "def f(x):\n    if x:\n\t\treturn {'a': [1, 2]}  # comment\n        \n    return None\n"
    "Unicode: naïve café Ärger 漢字かなカナ 한국어 Ελληνικά русский עברית 😀👍🏽 🏳️‍🌈 e\u0301\n"
    "Spaces:  two   three\u00a0nbsp\u3000ideographic \t tab\r\nCRLF\n\n\n\nblank lines\n"
    "Cleanup bait: a , b . c ? d ! e do n't I 'm it 's\n"
    "Ends with spaces   "
)


@pytest.fixture(scope="module")
def sample_text() -> str:
    play = next(p for p in find_corpus("shakespeare").files if p.name == "hamlet.md")
    return play.read_text() + _EDGE_CASES


@pytest.fixture(scope="module")
def convert(tmp_path_factory):
    """A function returning (name, tiktoken encoding, written paths, transformers tokenizer) for an
    encoding name, converting each encoding once per module (cl100k_base takes about 2 s)."""
    done = {}

    def get(name: str):
        if name not in done:
            done[name] = _convert(name, tmp_path_factory.mktemp(f"hf_{name}"))
        return done[name]

    return get


@pytest.fixture(params=["gpt2", "cl100k_base"])
def converted(request, convert):
    return convert(request.param)


def _convert(name: str, out: Path):
    enc = load_tokenizer(name)
    with pytest.MonkeyPatch.context() as mp:
        # Exporting must not need the Hugging Face libraries: make importing them fail while writing.
        mp.setitem(sys.modules, "tokenizers", None)
        mp.setitem(sys.modules, "transformers", None)
        paths = write_hf_tokenizer(enc, name, out, model_max_length=1024)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(out)
    return name, enc, paths, hf


@pytest.mark.slow
def test_encodes_like_tiktoken(converted, sample_text):
    _, enc, _, hf = converted
    ids = hf.encode(sample_text, add_special_tokens=False)
    assert ids == enc.encode_ordinary(sample_text)
    assert hf.decode(ids) == sample_text


def test_the_files_written_for_an_encoding_are_known_as_that_encoding(converted, tmp_path):
    name, _, paths, _ = converted
    out = paths[0].parent
    assert hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest() == EXPORTED_SHA256[name]
    assert exported_encoding(out) == name
    for path in paths:
        shutil.copy(path, tmp_path / path.name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    assert exported_encoding(tmp_path) is None  # edited: the file's own settings apply
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert exported_encoding(tmp_path) == name
    (tmp_path / "tokenizer.json").write_bytes((out / "tokenizer.json").read_bytes() + b" ")
    assert exported_encoding(tmp_path) is None


def test_data_prepared_with_an_encoding_or_its_export_serves_either(converted, tmp_path):
    # the documented round trip: lm.export a run, prepare new text with the export's tokenizer.json, then evaluate
    # or train the export, whose data.tokenizer is the encoding's name (and the other way round)
    name, _, paths, _ = converted
    export = str(paths[0].parent / "tokenizer.json")
    assert tokenizer_identity(export) == name
    by_export = {"tokenizer": export, "tokenizer_hash": tokenizer_hash(export), "vocab_size": VOCAB_SIZES[name]}
    by_name = {"tokenizer": name, "vocab_size": VOCAB_SIZES[name]}
    for manifest, tokenizer in ((by_export, name), (by_name, export)):
        check_manifest(manifest, tokenizer, VOCAB_SIZES[name], "data/x")
    # an edited file makes other ids: its own hash, which neither matches
    shutil.copytree(paths[0].parent, tmp_path / "edited")
    edited = tmp_path / "edited" / "tokenizer.json"
    edited.write_bytes(edited.read_bytes() + b" ")
    assert tokenizer_identity(str(edited)) == tokenizer_hash(str(edited)) != name
    with pytest.raises(DataError, match=rf"prepared with tokenizer '{name}', but data.tokenizer='{edited}' "
                                        r"\(tokenizer hash [0-9a-f]{12}\), which makes other ids"):
        check_manifest(by_name, str(edited), VOCAB_SIZES[name], "data/x")
    with pytest.raises(DataError, match=rf"prepared with tokenizer '{export}' \(lm's export of {name}\), but "
                                        rf"data.tokenizer='{edited}'"):
        check_manifest(by_export, str(edited), VOCAB_SIZES[name], "data/x")


def test_edge_cases_one_line_at_a_time(converted):
    # A line starting the text exercises the regexes without a preceding space or newline.
    _, enc, _, hf = converted
    for line in _EDGE_CASES.splitlines(keepends=True):
        assert hf.encode(line, add_special_tokens=False) == enc.encode_ordinary(line), line


def test_special_tokens_and_vocab_size(converted):
    _, enc, _, hf = converted
    assert len(hf) == enc.n_vocab
    assert hf.convert_tokens_to_ids("<|endoftext|>") == enc.eot_token
    assert hf.eos_token_id == hf.bos_token_id == enc.eot_token
    # Like every Hugging Face tokenizer, it reads special-token text as the special token.
    text = "one<|endoftext|>two"
    assert hf.encode(text, add_special_tokens=False) == enc.encode(text, allowed_special="all")
    assert enc.eot_token in hf.encode(text, add_special_tokens=False)
    for token, i in enc._special_tokens.items():
        assert hf.convert_tokens_to_ids(token) == i
    assert hf.encode("no bos added") == enc.encode_ordinary("no bos added")
    assert hf.model_max_length == 1024


def test_written_files(converted):
    name, enc, paths, _ = converted
    expected = {"tokenizer.json", "tokenizer_config.json"} | ({"vocab.json", "merges.txt"} if name == "gpt2" else set())
    assert {p.name for p in paths} == expected
    assert all(p.is_file() for p in paths)
    config = json.loads(paths[0].with_name("tokenizer_config.json").read_text())
    assert config["eos_token"] == config["bos_token"] == config["unk_token"] == "<|endoftext|>"
    if name == "gpt2":
        out = paths[0].parent
        vocab = json.loads((out / "vocab.json").read_text())
        merges = (out / "merges.txt").read_text().splitlines()
        assert len(vocab) == enc.n_vocab and vocab["<|endoftext|>"] == enc.eot_token
        assert merges[0] == "#version: 0.2" and merges[1:4] == ["Ġ t", "Ġ a", "h e"]  # as in OpenAI's file
        assert len(merges) - 1 == enc.n_vocab - 1 - 256


def test_classic_gpt2_files_load(convert, sample_text, monkeypatch):
    _, enc, paths, _ = convert("gpt2")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import GPT2Tokenizer

    classic_dir = paths[0].parent / "classic"
    classic_dir.mkdir(exist_ok=True)
    for file_name in ("vocab.json", "merges.txt"):
        (classic_dir / file_name).write_bytes((paths[0].parent / file_name).read_bytes())
    classic = GPT2Tokenizer.from_pretrained(classic_dir)
    assert classic.encode(sample_text, add_special_tokens=False) == enc.encode_ordinary(sample_text)


def test_byte_to_unicode_is_a_printable_bijection():
    table = byte_to_unicode()
    assert sorted(table) == list(range(256))
    assert len(set(table.values())) == 256
    assert all(c.isprintable() and not c.isspace() for c in table.values())
    assert table[ord(" ")] == "Ġ" and table[ord("\n")] == "Ċ" and table[ord("a")] == "a"


def test_recover_merges_replays_bpe():
    singles = {bytes([b]): b for b in range(256)}
    # "abc" is formed from "ab" + "c" because "ab" outranks "bc"; "bcd" from "bc" + "d".
    ranks = {**singles, b"ab": 256, b"bc": 257, b"abc": 258, b"bcd": 259}
    assert recover_merges(ranks) == [(b"a", b"b"), (b"b", b"c"), (b"ab", b"c"), (b"bc", b"d")]
    # A token that lower-ranked merges cannot build has no merge rule.
    with pytest.raises(ValueError, match="not reachable"):
        recover_merges({**singles, b"xyz": 256})


def _pieces(pattern: str, text: str) -> list[str]:
    split = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    return [piece for piece, _ in split.pre_tokenize_str(text)]


def test_pattern_rewrite_for_oniguruma():
    # Unrewritten, Oniguruma reads `{1,3}+` as "one or more runs of 1-3 digits".
    assert _pieces(r"\p{N}{1,3}+", "1234567") == ["1234567"]
    assert _pieces(hf_pattern(r"\p{N}{1,3}+"), "1234567") == ["123", "456", "7"]
    assert hf_pattern(r"a{2}+|[x\]]{1,}+") == r"(?>a{2})|(?>[x\]]{1,})"
    assert hf_pattern(r"\s++$|[$]|\$") == r"\s++\z|[$]|\$"
    assert hf_pattern(load_tokenizer("gpt2")._pat_str) == load_tokenizer("gpt2")._pat_str.replace("$", r"\z")
    with pytest.raises(ValueError, match="possessive interval"):
        hf_pattern(r"(ab){2}+")


def test_any_id_gaps_become_reserved_tokens(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    ranks = {bytes([b]): b for b in range(256)} | {b"ab": 256}
    enc = tiktoken.Encoding("toy", pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 260})
    write_hf_tokenizer(enc, "toy", tmp_path, model_max_length=8)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert len(hf) == enc.n_vocab == 261
    assert hf.convert_ids_to_tokens([257, 259]) == ["<|reserved_257|>", "<|reserved_259|>"]
    assert hf.encode("abab a", add_special_tokens=False) == enc.encode_ordinary("abab a") == [256, 256, 32, 97]
    assert hf.decode([256, 257, 260], skip_special_tokens=True) == "ab"


def test_rejects_bad_arguments(tmp_path):
    enc = load_tokenizer("gpt2")
    with pytest.raises(ValueError, match="model_max_length"):
        write_hf_tokenizer(enc, "gpt2", tmp_path, model_max_length=0)
    no_eot = tiktoken.Encoding("toy", pat_str=r"\S+", mergeable_ranks={bytes([b]): b for b in range(256)},
                               special_tokens={})
    with pytest.raises(ValueError, match="endoftext"):
        write_hf_tokenizer(no_eot, "toy", tmp_path, model_max_length=8)
