"""A Hugging Face tokenizer.json, read for training and prompts: the `tokenizers` library's tokenizer behind the
part of `tiktoken.Encoding` lm uses, with its end-of-sequence and beginning-of-sequence ids.

The file and the tokenizer_config.json beside it come from other tools, so what lm reads of them (the added
tokens, the post-processor, the special tokens and add_bos_token) is checked against a schema (`lm.schema`) as
soon as each is parsed, a bad value named by file and key; the `tokenizers` library checks the rest as it
builds the tokenizer.
"""

import hashlib
import json
from pathlib import Path
from typing import Any

import tokenizers

from lm.errors import TokenizerError
from lm.schema import Each, Entries, Spec, Table, flag, name, or_null, token_id
from lm.schema import check as check_schema

__all__ = ["END_OF_SEQUENCE", "TOKENIZER_CONFIG", "TOKENIZER_CONFIG_KEYS", "TOKENIZER_JSON", "HFTokenizer",
           "read_tokenizer_json"]

TOKENIZER_CONFIG = "tokenizer_config.json"
END_OF_SEQUENCE = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
"""Special tokens taken as the end of a sequence, in this order, when no tokenizer_config.json says which."""

# What lm reads of a tokenizer.json: its added tokens (to find an EOS) and its post-processor's template (a BOS).
_PROCESSOR: dict[str, Spec] = {
    "type": name,
    "single": Each(Table({"SpecialToken": Table({"id": name}, "an object")}, "an object")),
    "special_tokens": Entries(Table({"ids": Each(token_id)}, "an object")),
}
_PROCESSOR["processors"] = Each(Table(_PROCESSOR))  # a Sequence holds post-processors of any type, Sequences too
TOKENIZER_JSON: dict[str, Spec] = {
    "added_tokens": Each(Table({"id": token_id, "content": name}, "an object with a token's id and content")),
    "post_processor": or_null(Table(_PROCESSOR)),
}


def _special_token(value: Any) -> str:
    """A special token of tokenizer_config.json: its text, or transformers' AddedToken object holding it."""
    ok = isinstance(value, str) or isinstance(value, dict) and isinstance(value.get("content"), str)
    return "" if ok else "a token's text or an object with its text as content"


# What lm reads of a tokenizer_config.json: its EOS and BOS, and whether a BOS starts a text.
TOKENIZER_CONFIG_KEYS: dict[str, Spec] = {
    "eos_token": or_null(_special_token), "bos_token": or_null(_special_token),
    "add_bos_token": or_null(flag),  # null adds none, as in transformers
}


class HFTokenizer:
    """A Hugging Face tokenizer.json behind the part of `tiktoken.Encoding`'s interface lm uses (`name`,
    `n_vocab`, `eot_token`, `encode_ordinary`, `decode`), plus its `bos_token` (None when it adds none).

    Text is encoded without the post-processor's special tokens (lm adds BOS and EOS itself), and the text of
    a special token in the input stays text, as tiktoken's `encode_ordinary` keeps "<|endoftext|>": a corpus
    holding the characters "</s>" must not end a document there. Truncation and padding stored in the file
    are switched off, as they would cut documents short.
    """

    path: Path
    """The tokenizer.json."""
    config_path: Path | None
    """The tokenizer_config.json beside it, if there is one (it chose `eot_token` and `bos_token`)."""
    name: str
    """The path as given (data.tokenizer)."""
    n_vocab: int
    """Ids the tokenizer can produce: its highest id + 1, added tokens included."""
    eot_token: int
    """The end-of-sequence id, which ends every document."""
    bos_token: int | None
    """The id that starts every document, or None."""
    hash: str
    """`tokenizer_hash` of the file."""

    def __init__(self, path: Path, tokenizer: tokenizers.Tokenizer, eos: int, bos: int | None,
                 config_path: Path | None, digest: str) -> None:
        # EOS and BOS stand where lm puts them only: an added token a file leaves unspecial is matched in text
        added = tokenizer.get_added_tokens_decoder()
        tokenizer.add_special_tokens([tokenizers.AddedToken(added[i].content, single_word=added[i].single_word,
                                                            lstrip=added[i].lstrip, rstrip=added[i].rstrip,
                                                            normalized=added[i].normalized, special=True)
                                      for i in {eos, bos} if i in added and not added[i].special])
        tokenizer.encode_special_tokens = True
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self._tokenizer = tokenizer
        self.path, self.config_path, self.name = path, config_path, str(path)
        self.n_vocab = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        self.eot_token, self.bos_token, self.hash = eos, bos, digest

    def encode_ordinary(self, text: str) -> list[int]:
        """The ids of `text`, with no special token added and none read from the text."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_ordinary_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode_ordinary` of each text; `tokenizers` releases the GIL here (not in a single encode), so
        threads calling it encode in parallel. encode_batch_fast (tokenizers >= 0.20) skips the character
        offsets, a third of the time."""
        encode = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens written out as tiktoken's decode writes "<|endoftext|>"."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary string of `token_id` (a special token's text)."""
        return self._tokenizer.id_to_token(token_id)


def read_tokenizer_json(path: Path) -> HFTokenizer:
    """The tokenizer of a tokenizer.json, with its EOS and BOS (see `_find_eos`, `_find_bos`); TokenizerError naming
    the file, and the key where one is to blame, when it cannot be read, is not a tokenizer or has no EOS."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise TokenizerError(f"data.tokenizer: cannot read {str(path)!r} ({err.strerror}); expected the path of a "
                             "Hugging Face tokenizer.json") from None
    try:
        text = data.decode("utf-8")
        definition = json.loads(text)
    except ValueError as err:  # UnicodeDecodeError and JSONDecodeError both
        raise TokenizerError(f"{path}: not a Hugging Face tokenizer.json ({type(err).__name__}: {err})") from None
    if not isinstance(definition, dict):
        raise TokenizerError(f"{path}: holds a {type(definition).__name__}; expected the JSON object of a "
                             "Hugging Face tokenizer.json")
    check_schema(definition, TOKENIZER_JSON, path, TokenizerError)
    try:
        tokenizer = tokenizers.Tokenizer.from_str(text)
    except Exception as err:  # the library raises a bare Exception for every parse error
        raise TokenizerError(f"{path}: not a Hugging Face tokenizer.json ({type(err).__name__}: {err})") from None
    config_path = path.with_name(TOKENIZER_CONFIG)
    has_config = config_path.is_file()
    config = _read_config(config_path) if has_config else {}
    eos = _find_eos(tokenizer, definition, config, config_path, path)
    bos = _find_bos(tokenizer, definition, config, config_path, path)
    if bos == eos:  # GPT-2's checkpoints name <|endoftext|> both: the previous document's end starts the next
        bos = None
    digest = json_hash(hashlib.sha256(data).hexdigest(), bos, eos)
    return HFTokenizer(path, tokenizer, eos, bos, config_path if has_config else None, digest)


def json_hash(file_sha256: str, bos: int | None, eos: int) -> str:
    """`HFTokenizer.hash` of a tokenizer.json of sha256 `file_sha256` whose BOS and EOS are `bos` and `eos`."""
    ids = {"tokenizer.json": file_sha256, "bos": bos, "eos": eos}
    return hashlib.sha256(json.dumps(ids, sort_keys=True).encode()).hexdigest()


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TokenizerError(f"{path}: unreadable ({type(err).__name__}: {err}); expected the JSON object of "
                             f"{TOKENIZER_CONFIG}") from None
    if not isinstance(config, dict):
        raise TokenizerError(f"{path}: holds a {type(config).__name__}; expected the JSON object of {TOKENIZER_CONFIG}")
    check_schema(config, TOKENIZER_CONFIG_KEYS, path, TokenizerError)
    return config


def _config_token(tokenizer: tokenizers.Tokenizer, config: dict[str, Any], key: str, config_path: Path) -> int | None:
    """The id of the token tokenizer_config.json names under `key` (a string or {"content": ...}), or None."""
    value = config.get(key)
    if value is None:
        return None
    text = value["content"] if isinstance(value, dict) else value
    found = tokenizer.token_to_id(text)
    if found is None:
        raise TokenizerError(f"{config_path}: {key} {text!r} is not a token of the tokenizer.json beside it; "
                             "expected the text of one of its tokens")
    return found


def _find_eos(tokenizer: tokenizers.Tokenizer, definition: dict[str, Any], config: dict[str, Any],
              config_path: Path, path: Path) -> int:
    """The end-of-sequence id: tokenizer_config.json's eos_token, else the first well-known one among the
    file's added tokens (END_OF_SEQUENCE)."""
    eos = _config_token(tokenizer, config, "eos_token", config_path)
    if eos is not None:
        return eos
    added = {t.get("content"): t.get("id") for t in definition.get("added_tokens", [])}
    for token in END_OF_SEQUENCE:
        if added.get(token) is not None:
            return added[token]
    raise TokenizerError(f"{path}: no end-of-sequence token found; expected eos_token in a {TOKENIZER_CONFIG} "
                         f"beside it or one of the added tokens {list(END_OF_SEQUENCE)}")


def _find_bos(tokenizer: tokenizers.Tokenizer, definition: dict[str, Any], config: dict[str, Any],
              config_path: Path, path: Path) -> int | None:
    """The id that starts each document, or None. tokenizer_config.json's add_bos_token decides when present
    (the id its bos_token names); otherwise the file decides: the special token its post-processor puts in
    front of a text (Llama 3's "<|begin_of_text|> $A"). A bos_token alone adds nothing: GPT-2's names one."""
    added_by_file = _template_bos(definition.get("post_processor"))
    if "add_bos_token" not in config:
        return added_by_file
    if not config["add_bos_token"]:
        return None
    bos = _config_token(tokenizer, config, "bos_token", config_path)
    if bos is None:
        bos = added_by_file
    if bos is None:
        raise TokenizerError(f"{config_path}: add_bos_token is true but it names no bos_token and {path.name} adds "
                             "none; expected a bos_token")
    return bos


def _template_bos(processor: dict[str, Any] | None) -> int | None:
    """The id a TemplateProcessing post-processor (alone or in a Sequence) puts before a single text, if any."""
    if processor is None:
        return None
    if processor.get("type") == "Sequence":
        found = (_template_bos(p) for p in processor.get("processors", []))
        return next((bos for bos in found if bos is not None), None)
    if processor.get("type") != "TemplateProcessing" or not processor.get("single"):
        return None
    first = processor["single"][0].get("SpecialToken", {}).get("id")
    ids = processor.get("special_tokens", {}).get(first, {}).get("ids", [])
    return ids[0] if len(ids) == 1 else None
