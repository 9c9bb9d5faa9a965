"""A Hugging Face tokenizer.json as data.tokenizer: its ids, where its EOS and BOS come from, its hash, and the
prompt and decoding conventions shared with the tiktoken encodings."""

import hashlib
import json
import shutil

import pytest
from tokenizers import Tokenizer, models

from lm.config import JobConfig
from lm.data.config import DataConfig
from lm.errors import ConfigError, TokenizerError
from lm.models.config import ModelConfig
from lm.tokenizer import (
    HFTokenizer,
    check_vocab_size,
    continuation_text,
    document_prefix,
    is_tokenizer_file,
    load_tokenizer,
    model_tokenizer,
    prompt_ids,
    tokenizer_hash,
    tokenizer_identity,
)

TEXT = "Fair is foul, and foul is fair:\nHover through the fog and filthy air.\n"


@pytest.fixture(autouse=True)
def fresh_cache():
    """Files are edited and moved here: load each spec afresh, and leave no stale one to other tests."""
    load_tokenizer.cache_clear()
    yield
    load_tokenizer.cache_clear()


def copy_tokenizer(source, directory, config: dict | None = None):
    """`source` copied into `directory` (created), with a tokenizer_config.json holding `config` if given."""
    directory.mkdir(parents=True)
    path = shutil.copy(source, directory / "tokenizer.json")
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path)


def test_ids_eos_and_bos_from_the_post_processor(tokenizer_jsons):
    path = str(tokenizer_jsons["bos"])
    tok = load_tokenizer(path)
    reference = Tokenizer.from_file(path)
    assert isinstance(tok, HFTokenizer) and tok.name == path and tok.n_vocab == 400
    assert (tok.bos_token, tok.eot_token) == (reference.token_to_id("<s>"), reference.token_to_id("</s>")) == (0, 1)
    ids = tok.encode_ordinary(TEXT)
    # no post-processor BOS: lm adds it where a document starts
    assert ids == reference.encode(TEXT, add_special_tokens=False).ids == reference.encode(TEXT).ids[1:]
    assert tok.decode(ids) == TEXT
    assert document_prefix(tok) == [0] and load_tokenizer(path) is tok


def test_special_token_text_stays_text(tokenizer_jsons):
    tok = load_tokenizer(str(tokenizer_jsons["bos"]))
    text = "an end </s> and a start <s> as characters"
    ids = tok.encode_ordinary(text)
    assert 0 not in ids and 1 not in ids and tok.decode(ids) == text


def test_eos_from_a_well_known_token_and_no_bos(tokenizer_jsons):
    tok = load_tokenizer(str(tokenizer_jsons["eot"]))
    assert (tok.eot_token, tok.bos_token, tok.n_vocab) == (0, None, 400)
    assert document_prefix(tok) == []


@pytest.mark.parametrize("config, bos, eos", [
    ({"eos_token": {"content": "<s>"}}, None, 0),  # the config's EOS wins over the well-known </s>
    ({"eos_token": "</s>", "bos_token": "<s>", "add_bos_token": False}, None, 1),
    ({"eos_token": "</s>", "bos_token": {"content": "</s>"}, "add_bos_token": True}, None, 1),  # BOS = EOS: none
    ({"bos_token": "<s>", "add_bos_token": True}, 0, 1),
], ids=["eos-dict", "add-bos-false", "bos-is-eos", "add-bos-true"])
def test_tokenizer_config_decides(tokenizer_jsons, tmp_path, config, bos, eos):
    tok = load_tokenizer(copy_tokenizer(tokenizer_jsons["metaspace"], tmp_path / "t", config))
    assert (tok.bos_token, tok.eot_token) == (bos, eos)


def test_a_bos_token_alone_adds_no_bos(tokenizer_jsons, tmp_path):
    # GPT-2's checkpoints name a bos_token, but neither add_bos_token nor the post-processor adds it
    path = copy_tokenizer(tokenizer_jsons["eot"], tmp_path / "t", {"bos_token": "<|endoftext|>", "eos_token": None})
    tok = load_tokenizer(path)
    assert (tok.bos_token, tok.eot_token) == (None, 0)


def word_level_without_eos() -> Tokenizer:
    tokenizer = Tokenizer(models.WordLevel({"a": 0, "<pad>": 1}, unk_token="<pad>"))
    tokenizer.add_special_tokens(["<pad>"])
    return tokenizer


@pytest.mark.parametrize("make, message", [
    (lambda d: None, r"data.tokenizer: cannot read '.*missing/tokenizer.json' \(No such file or directory\); "
                     r"expected the path of a Hugging Face tokenizer.json"),
    (lambda d: (d / "tokenizer.json").write_text('{"version": "1.0"}'),
     r"/bad/tokenizer.json: not a Hugging Face tokenizer.json \(Exception: "),
    (lambda d: word_level_without_eos().save(str(d / "tokenizer.json")),
     r"/bad/tokenizer.json: no end-of-sequence token found; expected eos_token in a tokenizer_config.json beside it "
     r"or one of the added tokens \['<\|endoftext\|>', '</s>', '<eos>', '<\|end_of_text\|>'\]"),
], ids=["missing", "not-a-tokenizer", "no-eos"])
def test_unusable_file(tmp_path, make, message):
    directory = tmp_path / ("missing" if "cannot read" in message else "bad")
    directory.mkdir()
    make(directory)
    with pytest.raises(TokenizerError, match=message):
        load_tokenizer(str(directory / "tokenizer.json"))


@pytest.mark.parametrize("config, message", [
    ({"eos_token": "<eos>"},
     r"tokenizer_config.json: eos_token '<eos>' is not a token of the tokenizer.json beside it"),
    ({"add_bos_token": True}, r"tokenizer_config.json: add_bos_token is true but it names no bos_token and "
                              r"tokenizer.json adds none"),
    ("[1]", r"tokenizer_config.json: holds a list; expected the JSON object of tokenizer_config.json"),
], ids=["unknown-eos", "add-bos-without-bos", "not-an-object"])
def test_bad_tokenizer_config(tokenizer_jsons, tmp_path, config, message):
    path = copy_tokenizer(tokenizer_jsons["eot"], tmp_path / "t")
    (tmp_path / "t" / "tokenizer_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    with pytest.raises(TokenizerError, match=message):
        load_tokenizer(path)


def test_hash_follows_the_bytes_and_the_chosen_ids_not_the_directory(tokenizer_jsons, tmp_path):
    source = tokenizer_jsons["bos"]
    original = tokenizer_hash(str(source))
    assert tokenizer_hash(copy_tokenizer(source, tmp_path / "elsewhere")) == original
    assert tokenizer_identity(str(source)) == original and tokenizer_identity("gpt2") == "gpt2"
    edited = json.loads(source.read_text())
    edited["decoder"] = None
    (tmp_path / "edited").mkdir()
    (tmp_path / "edited" / "tokenizer.json").write_text(json.dumps(edited))
    assert tokenizer_hash(str(tmp_path / "edited" / "tokenizer.json")) != original
    # the same bytes with another EOS chosen by a tokenizer_config.json make other ids
    assert tokenizer_hash(copy_tokenizer(source, tmp_path / "config", {"eos_token": "<s>"})) != original


def test_tiktoken_hashes_need_no_loading():
    assert tokenizer_hash("gpt2") == hashlib.sha256(
        b"gpt2:306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930").hexdigest()
    assert tokenizer_hash("cl100k_base") != tokenizer_hash("gpt2")
    assert document_prefix(load_tokenizer("gpt2")) == []


def test_prompt_ids(tokenizer_jsons):
    gpt2, bos = load_tokenizer("gpt2"), load_tokenizer(str(tokenizer_jsons["bos"]))
    assert prompt_ids(gpt2, "") == [50256] and prompt_ids(gpt2, "Hello world") == [15496, 995]
    assert prompt_ids(bos, "") == [0] and prompt_ids(bos, TEXT) == [0, *bos.encode_ordinary(TEXT)]


def test_continuation_keeps_the_space_a_sentencepiece_decoder_drops_at_the_start(tokenizer_jsons):
    tok = load_tokenizer(str(tokenizer_jsons["metaspace"]))
    prompt = prompt_ids(tok, "Fair is")
    new = tok.encode_ordinary("Fair is foul")[len(prompt) - 1:]
    assert tok.decode(new) == "foul"  # alone, the leading "▁" is dropped
    assert continuation_text(tok, prompt, new) == " foul"
    gpt2 = load_tokenizer("gpt2")
    assert continuation_text(gpt2, [15496], [995]) == " world"


def test_config_checks_the_form_and_never_reads_the_file(tmp_path):
    missing = str(tmp_path / "nowhere" / "tokenizer.json")
    assert is_tokenizer_file(missing) and not is_tokenizer_file("gpt2")
    job = JobConfig(model=ModelConfig(vocab_size=123), data=DataConfig(tokenizer=missing))
    assert job.data.tokenizer == missing
    with pytest.raises(ConfigError, match=r"data.tokenizer: unknown tokenizer 'bpe'; expected one of \['cl100k_base', "
                                          r"'gpt2'\] or the path of a Hugging Face tokenizer.json"):
        DataConfig(tokenizer="bpe")
    with pytest.raises(ConfigError, match=r"model.vocab_size: 50304 does not match tokenizer 'gpt2'"):
        JobConfig(model=ModelConfig(vocab_size=50304))


def test_the_model_must_hold_every_id(tokenizer_jsons):
    path = str(tokenizer_jsons["eot"])
    assert model_tokenizer(path, 448).n_vocab == 400  # more embedding rows than ids is fine (Qwen2)
    check_vocab_size(path, 400, 400)
    with pytest.raises(ConfigError, match=rf"model.vocab_size: 399 is smaller than tokenizer '{path}', which has 400 "
                                          r"ids; set model.vocab_size to at least 400"):
        model_tokenizer(path, 399)
