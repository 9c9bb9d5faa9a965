import pytest
import tiktoken
import tiktoken_ext.openai_public as openai_public

import lm.tokenizer
from lm.errors import TokenizerError
from lm.tokenizer import forget_tokenizers, load_tokenizer


@pytest.fixture
def fresh_cache():
    """Let a test load encodings under patched conditions without leaking them to other tests."""
    forget_tokenizers()
    yield
    forget_tokenizers()


def test_gpt2_ids():
    enc = load_tokenizer("gpt2")
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.eot_token == 50256
    assert enc.n_vocab == 50257
    assert enc.name == "r50k_base"


def test_gpt2_round_trip_and_ordinary_endoftext():
    enc = load_tokenizer("gpt2")
    text = "To be, or not to be: that is the question.\n\u00e9t\u00e9 \u2014 <|endoftext|>"
    ids = enc.encode_ordinary(text)
    assert enc.decode(ids) == text
    assert 50256 not in ids  # the characters "<|endoftext|>" stay text


def test_cl100k_ids():
    enc = load_tokenizer("cl100k_base")
    assert enc.encode("hello world") == [15339, 1917]
    assert enc.eot_token == 100257
    assert enc.n_vocab == 100277
    text = "Wherefore art thou, R\u00f6meo? \u6f22\u5b57 12345"
    assert enc.decode(enc.encode_ordinary(text)) == text


@pytest.mark.parametrize("name, constructor", [("gpt2", "r50k_base"), ("cl100k_base", "cl100k_base")])
def test_matches_tiktoken_definition(name, constructor, monkeypatch):
    # tiktoken's constructor would download the ranks; everything else it defines must match ours
    monkeypatch.setattr(openai_public, "load_tiktoken_bpe", lambda *args, **kwargs: {})
    reference = getattr(openai_public, constructor)()
    enc = load_tokenizer(name)
    assert enc._pat_str == reference["pat_str"]
    assert enc._special_tokens == reference["special_tokens"]


def test_cached():
    assert load_tokenizer("gpt2") is load_tokenizer("gpt2")


def test_unknown_name():
    with pytest.raises(ValueError, match=r"'gpt3'.*\['gpt2', 'cl100k_base'\]"):
        load_tokenizer("gpt3")


def test_missing_package_without_network_says_how_to_install(monkeypatch, fresh_cache):
    monkeypatch.setattr(lm.tokenizer, "_package_file", lambda package, relative: None)

    def offline(name):
        raise ConnectionError("no network")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(TokenizerError, match=r"pip install --no-deps openai-whisper==20250625"):
        load_tokenizer("gpt2")


def test_corrupt_rank_file_is_rejected(monkeypatch, fresh_cache, tmp_path):
    bad = tmp_path / "gpt2.tiktoken"
    bad.write_bytes(b"SGVsbG8= 0\n")
    monkeypatch.setattr(lm.tokenizer, "_package_file", lambda package, relative: bad)
    with pytest.raises(TokenizerError, match=r"gpt2.tiktoken: sha256 is .*expected 306cd27f"):
        load_tokenizer("gpt2")
