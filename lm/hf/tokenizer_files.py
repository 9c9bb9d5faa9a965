"""Hugging Face tokenizer files for our tiktoken encodings, written offline as plain JSON.

A tiktoken encoding is a byte-level BPE given only as `token bytes -> rank`; Hugging Face's `tokenizers`
wants a vocabulary of strings plus an ordered merge list. We map bytes to strings with GPT-2's
bytes-to-unicode table and recover each token's merge by replaying BPE on its bytes with only lower
ranks allowed. The files are built as dicts and dumped with `json`, so exporting needs neither
`tokenizers` nor `transformers`; `transformers.AutoTokenizer.from_pretrained(out_dir)` then encodes
exactly like `encoding.encode_ordinary`, except that, like every Hugging Face tokenizer, it turns the
text of a special token ("<|endoftext|>") into that token, as `encoding.encode(allowed_special="all")`.
"""

import functools
import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tiktoken

from lm.tokenizer import EXPORTED_SHA256, load_tokenizer

__all__ = [
    "byte_to_unicode", "exported_encoding", "hf_pattern", "recover_merges", "tokenizer_config",
    "tokenizer_json", "write_hf_tokenizer",
]

ENDOFTEXT = "<|endoftext|>"

_NO_RANK = float("inf")


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters.

    Byte-level BPE vocabularies store tokens as strings, and whitespace/control bytes would be mangled
    or stripped by JSON tooling and by `tokenizers` itself; printable Latin-1 bytes keep their own
    character and the other 68 are moved, in byte order, to U+0100 onwards.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    moved = (b for b in range(256) if b not in table)
    table.update({b: chr(256 + n) for n, b in enumerate(moved)})
    return dict(sorted(table.items()))


def _token_string(token: bytes, table: Mapping[int, str]) -> str:
    """The vocabulary string of a token's bytes."""
    # latin-1 turns byte b into chr(b), which str.translate then maps in C, not byte by byte in Python.
    return token.decode("latin-1").translate(table)


def _split_in_two(token: bytes, ranks: Mapping[bytes, int]) -> tuple[bytes, bytes]:
    """The two tokens BPE joins to form `token`: BPE over its bytes using only ranks below its own.

    tiktoken merges, at every step, the adjacent pair whose concatenation has the lowest rank; stopping
    before `token`'s own rank leaves exactly the pair whose merge creates it. Pair ranks are kept in a
    list and updated only next to each merge, so the scan is `min` over a short list in C.
    """
    limit, rank_of = ranks[token], ranks.get
    parts = [token[i:i + 1] for i in range(len(token))]
    pair_ranks: list[float] = [rank_of(token[i:i + 2], _NO_RANK) for i in range(len(token) - 1)]
    while len(parts) > 2:
        best = min(pair_ranks)
        if best >= limit:
            raise ValueError(f"token {token!r} (rank {limit}) is not reachable by BPE merges of lower rank")
        i = pair_ranks.index(best)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
        del pair_ranks[i]
        if i > 0:
            pair_ranks[i - 1] = rank_of(parts[i - 1] + parts[i], _NO_RANK)
        if i < len(pair_ranks):
            pair_ranks[i] = rank_of(parts[i] + parts[i + 1], _NO_RANK)
    return parts[0], parts[1]


def recover_merges(ranks: Mapping[bytes, int]) -> list[tuple[bytes, bytes]]:
    """BPE merge rules of a tiktoken rank table, ordered by the rank of the token each one creates.

    With merges in this order, Hugging Face's BPE (lowest-priority merge first) replays tiktoken's
    (lowest-ranked result first) step for step. Single bytes are the alphabet, not merges.
    """
    multi_byte = sorted((rank, token) for token, rank in ranks.items() if len(token) > 1)
    return [_split_in_two(token, ranks) for _, token in multi_byte]


# Oniguruma, the regex engine of `tokenizers`, reads patterns with Ruby syntax, which differs from
# tiktoken's Rust regex in two places these patterns touch:
# - `X{n,m}+` means "repeat X{n,m} one or more times", not a possessive interval: cl100k's
#   `\p{N}{1,3}+` would take a whole run of digits instead of chunks of three. The atomic group
#   `(?>X{n,m})` is the same possessive repeat. (`?+`, `*+` and `++` are possessive in both.)
# - `$` is the end of any line, while in Rust (without the m flag) it is the end of the text, which
#   Oniguruma spells `\z`. The possessive `\s++$` never stops before a newline anyway; the rewrite
#   keeps that from depending on the surrounding pattern.
_INTERVAL_PLUS = r"(\{\d+(?:,\d*)?\})\+"
_ATOM = r"\\p\{\w+\}|\\[a-zA-Z]|\[(?:\\.|[^\]\\])*\]|[^\\()\[\]|]"
_POSSESSIVE_INTERVAL = re.compile(f"({_ATOM}){_INTERVAL_PLUS}")


def _end_of_text_anchors(pattern: str) -> str:
    """`pattern` with every `$` outside a bracket class and not escaped replaced by `\\z`."""
    out, in_class, i = [], False, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if c == "[":
            in_class = True
        elif c == "]":
            in_class = False
        out.append("\\z" if c == "$" and not in_class else c)
        i += 1
    return "".join(out)


def hf_pattern(pat_str: str) -> str:
    """tiktoken's pre-tokenizer regex rewritten so that Oniguruma matches the same pieces.

    Only a possessive interval on a single atom (a character, escape, `\\p{..}` class or bracket
    class) is rewritten; one on a group would need a real parser, so it is refused rather than
    silently changed in meaning.
    """
    pattern = _POSSESSIVE_INTERVAL.sub(r"(?>\1\2)", pat_str)
    if re.search(_INTERVAL_PLUS, pattern):
        raise ValueError(f"cannot translate the possessive interval in {pat_str!r} for Oniguruma")
    return _end_of_text_anchors(pattern)


def _added_tokens(encoding: tiktoken.Encoding) -> dict[int, str]:
    """Every id that is not a BPE token, mapped to its special token string.

    Ids no token uses (cl100k_base has 16 between its rank table and its last special token) get a
    reserved placeholder, so the Hugging Face vocabulary has exactly `encoding.n_vocab` entries like
    the model's embedding, and every id decodes.
    """
    specials = {i: s for s, i in encoding._special_tokens.items()}
    used = set(encoding._mergeable_ranks.values()) | specials.keys()
    unused = {i: f"<|reserved_{i}|>" for i in range(encoding.n_vocab) if i not in used}
    return dict(sorted({**specials, **unused}.items()))


@functools.lru_cache(maxsize=4)
def _merge_strings(encoding: tiktoken.Encoding) -> tuple[str, ...]:
    """tokenizer.json's merges of `encoding`, recovered once per process: that is a BPE run per token (about a
    second for gpt2's 50k), which a process exporting several models (the tests) would otherwise repeat."""
    table, ranks = byte_to_unicode(), encoding._mergeable_ranks
    # "a b" strings rather than pairs: readable by every `tokenizers` release, and unambiguous since
    # the bytes-to-unicode table maps the space byte to "Ġ", so no token string contains a space.
    return tuple(f"{_token_string(a, table)} {_token_string(b, table)}" for a, b in recover_merges(ranks))


def tokenizer_json(encoding: tiktoken.Encoding) -> dict[str, Any]:
    """The `tokenizers` library's tokenizer.json for `encoding`, as a JSON-ready dict."""
    table = byte_to_unicode()
    ranks = encoding._mergeable_ranks
    strings = {token: _token_string(token, table) for token in sorted(ranks, key=ranks.__getitem__)}
    vocab = {strings[token]: ranks[token] for token in strings}
    merges = list(_merge_strings(encoding))
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for i, s in _added_tokens(encoding).items()
        ],
        "normalizer": None,
        # tiktoken splits text with its regex and byte-encodes each piece; ByteLevel's own GPT-2 regex
        # is turned off so the encoding's pattern is the only split.
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": hf_pattern(encoding._pat_str)},
             "behavior": "Isolated", "invert": False},
            byte_level,
        ]},
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
            # tiktoken takes a piece that is itself a token without merging; same here.
            "ignore_merges": True,
            "vocab": vocab,
            "merges": merges,
        },
    }


def tokenizer_config(encoding: tiktoken.Encoding, name: str, model_max_length: int) -> dict[str, Any]:
    """tokenizer_config.json: which transformers class loads tokenizer.json, and the special tokens."""
    if ENDOFTEXT not in encoding._special_tokens:
        raise ValueError(f"tokenizer {name!r} has no {ENDOFTEXT} special token")
    return {
        # The generic class loads tokenizer.json as written; GPT2Tokenizer would rebuild the pipeline
        # with its own pre-tokenizer and drop the encoding's regex.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": ENDOFTEXT,
        "eos_token": ENDOFTEXT,
        "unk_token": ENDOFTEXT,
        "model_max_length": model_max_length,
        # transformers would otherwise "clean up" decoded text (" ," -> ","), breaking the round trip.
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    }


def _classic_gpt2_files(encoding: tiktoken.Encoding, tok_json: Mapping[str, Any]) -> dict[str, str]:
    """vocab.json and merges.txt in the layout of OpenAI's GPT-2 release, for tools that predate tokenizer.json."""
    vocab = dict(tok_json["model"]["vocab"])
    vocab.update({s: i for i, s in _added_tokens(encoding).items()})
    merges = "#version: 0.2\n" + "".join(f"{m}\n" for m in tok_json["model"]["merges"])
    return {"vocab.json": json.dumps(vocab, ensure_ascii=False), "merges.txt": merges}


def write_hf_tokenizer(encoding: tiktoken.Encoding, name: str, out_dir: Path, model_max_length: int) -> list[Path]:
    """Write Hugging Face tokenizer files for `encoding` into `out_dir` and return their paths.

    Always tokenizer.json and tokenizer_config.json; for "gpt2" also vocab.json and merges.txt.
    `name` is our tokenizer name ("gpt2" or "cl100k_base"); `model_max_length` is the model's context.
    """
    if model_max_length <= 0:
        raise ValueError(f"model_max_length must be positive, got {model_max_length}")
    config = tokenizer_config(encoding, name, model_max_length)  # first: it rejects bad input cheaply
    tok_json = tokenizer_json(encoding)
    contents = {
        "tokenizer.json": json.dumps(tok_json, ensure_ascii=False),
        "tokenizer_config.json": json.dumps(config, indent=2) + "\n",
    }
    if name == "gpt2":
        contents.update(_classic_gpt2_files(encoding, tok_json))
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for file_name, text in contents.items():
        path = out_dir / file_name
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


def exported_encoding(directory: Path) -> str | None:
    """The tiktoken encoding whose files `write_hf_tokenizer` wrote into `directory` (its tokenizer.json byte for
    byte, its tokenizer_config.json as written), or None: data prepared with that encoding's name, and a model
    trained on it, make the same ids as this tokenizer.json."""
    try:
        digest = hashlib.sha256((directory / "tokenizer.json").read_bytes()).hexdigest()
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    name = next((name for name, sha in EXPORTED_SHA256.items() if sha == digest), None)
    if name is None or not isinstance(config, dict) or not isinstance(config.get("model_max_length"), int):
        return None
    written = tokenizer_config(load_tokenizer(name), name, config["model_max_length"])
    return name if config == written else None
