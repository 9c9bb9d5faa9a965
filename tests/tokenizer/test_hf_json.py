"""A Hugging Face tokenizer.json as data.tokenizer: its ids, where its EOS and BOS come from, what lm reads of it
and of its tokenizer_config.json checked by file and key, its hash, and the prompt and decoding conventions shared
with the tiktoken encodings."""

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
    forget_tokenizers,
    is_tokenizer_file,
    load_tokenizer,
    model_tokenizer,
    prompt_ids,
    tokenizer_hash,
    tokenizer_identity,
)
from lm.tokenizer.hf_json import read_tokenizer_json

TEXT = "Fair is foul, and foul is fair:\nHover through the fog and filthy air.\n"


@pytest.fixture(autouse=True)
def fresh_cache():
    """Files are edited and moved here: load each spec afresh, and leave no stale one to other tests."""
    forget_tokenizers()
    yield
    forget_tokenizers()


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


def test_an_eos_or_bos_the_file_leaves_unspecial_is_still_never_read_from_text(tokenizer_jsons, tmp_path):
    definition = json.loads(tokenizer_jsons["bos"].read_text())
    for token in definition["added_tokens"]:
        token["special"] = False  # the tokenizers library then matches "</s>" in text, as any added word
    (tmp_path / "tokenizer.json").write_text(json.dumps(definition))
    assert Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode("a </s> b", add_special_tokens=False).ids \
        .count(1) == 1
    tok = load_tokenizer(str(tmp_path / "tokenizer.json"))
    text = "an end </s> and a start <s> as characters"
    ids = tok.encode_ordinary(text)
    assert (tok.bos_token, tok.eot_token) == (0, 1) and 0 not in ids and 1 not in ids and tok.decode(ids) == text


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


ID = "a token id (an integer from 0 to 2147483647)"


def _sequence_of_the_template(definition: dict) -> None:
    definition["post_processor"] = {"type": "Sequence", "processors": [definition["post_processor"]]}


def _set(keys: str, value: object):
    """An edit of a tokenizer.json that puts `value` at the dotted `keys` (list items by number)."""
    def edit(definition: dict) -> None:
        *outer, last = [int(k) if k.isdigit() else k for k in keys.split(".")]
        node = definition
        for key in outer:
            node = node[key]
        node[last] = value
    return edit


# what the "bos" file's JSON holds (its template puts <s> first): each bad value named by its key
BAD_TOKENIZER_JSON = [
    (_set("added_tokens", None), "added_tokens: expected a list, got None"),
    (_set("added_tokens.1", "</s>"), "added_tokens[1]: expected an object with a token's id and content, got '</s>'"),
    (_set("added_tokens.1.id", "1"), f"added_tokens[1].id: expected {ID}, got '1'"),
    (_set("added_tokens.0.id", -1), f"added_tokens[0].id: expected {ID}, got -1"),
    (_set("added_tokens.0.content", 0), "added_tokens[0].content: expected a string, got 0"),
    (_set("post_processor", "TemplateProcessing"),
     "post_processor: expected an object of settings or null, got 'TemplateProcessing'"),
    (_set("post_processor.type", 1), "post_processor.type: expected a string, got 1"),
    (_set("post_processor.single.0", "<s>"), "post_processor.single[0]: expected an object, got '<s>'"),
    (_set("post_processor.single.0.SpecialToken", None),
     "post_processor.single[0].SpecialToken: expected an object, got None"),
    (_set("post_processor.special_tokens", []), "post_processor.special_tokens: expected an object, got []"),
    (_set("post_processor.special_tokens.<s>.ids", 0), "post_processor.special_tokens.<s>.ids: expected a list, got 0"),
    (_set("post_processor.special_tokens.<s>.ids", [True]),
     f"post_processor.special_tokens.<s>.ids[0]: expected {ID}, got True"),
    (_set("post_processor", {"type": "Sequence", "processors": [3]}),
     "post_processor.processors[0]: expected an object of settings, got 3"),
    (lambda d: (_sequence_of_the_template(d), _set("post_processor.processors.0.special_tokens.<s>.ids", "0")(d)),
     "post_processor.processors[0].special_tokens.<s>.ids: expected a list, got '0'"),
]


@pytest.mark.parametrize("edit, message", BAD_TOKENIZER_JSON, ids=[m.split(":")[0] for _, m in BAD_TOKENIZER_JSON])
def test_a_tokenizer_json_value_lm_reads_is_checked_by_key(tokenizer_jsons, tmp_path, edit, message):
    definition = json.loads(tokenizer_jsons["bos"].read_text())
    edit(definition)
    (tmp_path / "tokenizer.json").write_text(json.dumps(definition))
    with pytest.raises(TokenizerError) as err:
        load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert str(err.value) == f"{tmp_path / 'tokenizer.json'}: {message}"


def test_a_template_inside_a_sequence_still_gives_the_bos(tokenizer_jsons, tmp_path):
    definition = json.loads(tokenizer_jsons["bos"].read_text())
    _sequence_of_the_template(definition)
    (tmp_path / "tokenizer.json").write_text(json.dumps(definition))
    assert load_tokenizer(str(tmp_path / "tokenizer.json")).bos_token == 0


def test_a_tokenizer_json_that_is_no_object_is_named(tmp_path):
    (tmp_path / "tokenizer.json").write_text("[1]")
    with pytest.raises(TokenizerError, match=r"tokenizer.json: holds a list; expected the JSON object of a Hugging "
                                             r"Face tokenizer.json"):
        load_tokenizer(str(tmp_path / "tokenizer.json"))


SPECIAL = "a token's text or an object with its text as content or null"


@pytest.mark.parametrize("config, message", [
    ({"add_bos_token": "false", "bos_token": "<s>"}, "add_bos_token: expected true or false or null, got 'false'"),
    ({"add_bos_token": 1}, "add_bos_token: expected true or false or null, got 1"),
    ({"eos_token": 1}, f"eos_token: expected {SPECIAL}, got 1"),
    ({"eos_token": {"__type": "AddedToken"}}, f"eos_token: expected {SPECIAL}, got {{'__type': 'AddedToken'}}"),
    ({"bos_token": {"content": 0}, "add_bos_token": True}, f"bos_token: expected {SPECIAL}, got {{'content': 0}}"),
    ({"bos_token": ["<s>"]}, f"bos_token: expected {SPECIAL}, got ['<s>']"),
], ids=["add-bos-text", "add-bos-number", "eos-number", "eos-without-content", "bos-content-number", "bos-list"])
def test_a_tokenizer_config_value_lm_reads_is_checked_by_key(tokenizer_jsons, tmp_path, config, message):
    path = copy_tokenizer(tokenizer_jsons["metaspace"], tmp_path / "t", config)
    with pytest.raises(TokenizerError) as err:
        load_tokenizer(path)
    assert str(err.value) == f"{tmp_path / 't' / 'tokenizer_config.json'}: {message}"


def test_add_bos_token_null_adds_none_as_in_transformers(tokenizer_jsons, tmp_path):
    path = copy_tokenizer(tokenizer_jsons["bos"], tmp_path / "t", {"add_bos_token": None, "eos_token": "</s>"})
    assert (load_tokenizer(path).bos_token, load_tokenizer(path).eot_token) == (None, 1)


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
    # after an empty prompt (its BOS, or GPT-2's end-of-text) the new ids start the text: no space before them
    assert continuation_text(tok, prompt_ids(tok, ""), tok.encode_ordinary("Fair is")) == "Fair is"
    assert continuation_text(gpt2, prompt_ids(gpt2, ""), [15496, 995]) == "Hello world"


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


def test_a_changed_file_at_the_same_path_is_read_again(tokenizer_jsons, tmp_path):
    """A long-lived process (a pool worker) may meet another tokenizer.json where an earlier job had one."""
    here = tmp_path / "tokenizer.json"
    shutil.copy(tokenizer_jsons["bos"], here)
    assert load_tokenizer(str(here)).bos_token == 0
    assert load_tokenizer(str(here)) is load_tokenizer(str(here))  # unchanged: loaded once
    shutil.copy(tokenizer_jsons["eot"], here)
    assert load_tokenizer(str(here)).bos_token is None


def test_a_changed_tokenizer_config_beside_the_same_file_is_read_again(tokenizer_jsons, tmp_path):
    """The cache key covers tokenizer_config.json: a new one beside an unchanged tokenizer.json changes the BOS."""
    here = copy_tokenizer(tokenizer_jsons["bos"], tmp_path / "t", {"add_bos_token": False, "eos_token": "</s>"})
    assert load_tokenizer(here).bos_token is None
    config = tmp_path / "t" / "tokenizer_config.json"
    config.write_text(json.dumps({"add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>"}))
    assert load_tokenizer(here).bos_token == 0
    config.unlink()
    assert load_tokenizer(here).bos_token == 0 and load_tokenizer(here).config_path is None


def test_truncation_and_padding_stored_in_the_file_are_switched_off(tokenizer_jsons, tmp_path):
    """A tokenizer.json saved with truncation would cut every document to its max_length, silently."""
    definition = json.loads(tokenizer_jsons["bos"].read_text())
    definition["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    definition["padding"] = {"strategy": {"Fixed": 512}, "direction": "Right", "pad_to_multiple_of": None,
                             "pad_id": 1, "pad_type_id": 0, "pad_token": "</s>"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(definition))
    tok = load_tokenizer(str(tmp_path / "tokenizer.json"))
    expected = Tokenizer.from_file(str(tokenizer_jsons["bos"])).encode(TEXT, add_special_tokens=False).ids
    assert len(expected) > 4
    assert tok.encode_ordinary(TEXT) == expected
    assert tok.encode_ordinary_batch([TEXT, "a"])[0] == expected
    assert tok.decode(tok.encode_ordinary(TEXT)) == TEXT


def test_decode_writes_special_tokens_out(tokenizer_jsons):
    """As tiktoken writes "<|endoftext|>": a sample that holds the EOS shows where a document ended."""
    tok = load_tokenizer(str(tokenizer_jsons["bos"]))
    ids = tok.encode_ordinary("Fair is foul")
    assert tok.decode([tok.bos_token, *ids, tok.eot_token]) == "<s>Fair is foul</s>"
    eot = load_tokenizer(str(tokenizer_jsons["eot"]))
    assert eot.decode([eot.eot_token]) == "<|endoftext|>"


def test_hash_follows_the_chosen_bos(tokenizer_jsons, tmp_path):
    """The same bytes and EOS, with and without a BOS, make other ids, so their hashes differ."""
    with_bos = str(tokenizer_jsons["bos"])  # the post-processor's <s>
    without = copy_tokenizer(with_bos, tmp_path / "no_bos", {"add_bos_token": False, "eos_token": "</s>"})
    assert (load_tokenizer(with_bos).bos_token, load_tokenizer(without).bos_token) == (0, None)
    assert load_tokenizer(with_bos).eot_token == load_tokenizer(without).eot_token == 1
    assert tokenizer_hash(with_bos) != tokenizer_hash(without)


def test_add_bos_token_without_a_bos_token_takes_the_files_bos(tokenizer_jsons, tmp_path):
    path = copy_tokenizer(tokenizer_jsons["bos"], tmp_path / "t", {"add_bos_token": True, "eos_token": "</s>"})
    assert (load_tokenizer(path).bos_token, load_tokenizer(path).eot_token) == (0, 1)  # its template puts <s> first


def test_a_template_token_of_several_ids_is_no_bos(tokenizer_jsons, tmp_path):
    definition = json.loads(tokenizer_jsons["bos"].read_text())
    definition["post_processor"]["special_tokens"]["<s>"]["ids"] = [0, 1]
    definition["post_processor"]["special_tokens"]["<s>"]["tokens"] = ["<s>", "</s>"]
    (tmp_path / "tokenizer.json").write_text(json.dumps(definition))
    assert load_tokenizer(str(tmp_path / "tokenizer.json")).bos_token is None


def test_a_template_after_another_processor_in_a_sequence_still_gives_the_bos(tokenizer_jsons, tmp_path):
    definition = json.loads(tokenizer_jsons["bos"].read_text())
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True}
    definition["post_processor"] = {"type": "Sequence", "processors": [byte_level, definition["post_processor"]]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(definition))
    assert load_tokenizer(str(tmp_path / "tokenizer.json")).bos_token == 0


def test_n_vocab_counts_added_tokens_past_the_models_vocabulary(tmp_path):
    # an EOS added after training gets the next id: the embedding needs a row for it, so n_vocab is highest id + 1
    tokenizer = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tokenizer.add_special_tokens(["</s>"])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    tok = read_tokenizer_json(tmp_path / "tokenizer.json")
    assert tok.eot_token == 3 and tok.n_vocab == 4
