"""Sampling from an encoder-decoder: it reads the prompt as its source, each `<mask>` in it becoming a sentinel
whose span the decoder writes, and the output is the prompt with the spans filled in; a prompt without
`<mask>` gets one at its end, so the model writes a continuation.

Decoding encodes the source once and projects its cross-attention keys and values once, then decodes token by
token from the start id, the decoder's own keys and values cached.
"""

from typing import TYPE_CHECKING

import torch

from lm.errors import ConfigError, PromptError
from lm.models.encdec.config import EncDecConfig
from lm.models.family import SampleOptions
from lm.models.generate import pick_token

if TYPE_CHECKING:
    from lm.models.encdec.model import EncoderDecoder

__all__ = ["MASK", "encdec_source", "fill_masks", "generate_seq2seq", "split_spans"]

MASK = "<mask>"


def encdec_source(text: str, encode, cfg: EncDecConfig) -> tuple[list[int], list[str]]:
    """Source ids for an encoder-decoder prompt and the text pieces around its masks.

    Every `<mask>` becomes the next sentinel id; a prompt without one gets one at its end. A space right before
    a mask is the span's: GPT-2's and sentencepiece's tokens carry the space before a word, so span corruption hid
    " discontent", never "discontent" after a lone " " token. Returns (ids, pieces) with len(pieces) == number of
    masks + 1, the pieces without those spaces.
    """
    pieces = text.split(MASK)
    if len(pieces) == 1:
        pieces.append("")
    n_masks = len(pieces) - 1
    pieces = [piece.removesuffix(" ") if i < n_masks else piece for i, piece in enumerate(pieces)]
    if n_masks + 1 > cfg.n_sentinels:  # the spans' sentinels plus the end marker
        raise PromptError(f"prompt has {n_masks} {MASK} markers; the model has {cfg.n_sentinels} sentinels, "
                         f"so at most {cfg.n_sentinels - 1} spans can be filled")
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        ids += encode(piece) if piece else []
        if i < n_masks:
            ids.append(cfg.sentinel_start + i)
    if len(ids) > cfg.block_size:
        raise PromptError(f"prompt of {len(ids)} tokens is longer than the encoder's positions "
                         f"(model.block_size={cfg.block_size}); shorten it")
    return ids, pieces


def split_spans(tokens: list[int], n_spans: int, sentinel_start: int) -> list[list[int]]:
    """The decoder's output `s0 span0 s1 span1 ...` cut into n_spans spans (missing ones are empty);
    tokens before the first sentinel, and sentinels out of order, start no span."""
    spans: list[list[int]] = [[] for _ in range(n_spans)]
    current = None
    for token in tokens:
        if sentinel_start <= token < sentinel_start + n_spans:
            current = token - sentinel_start
        elif current is not None:
            spans[current].append(token)
    return spans


def fill_masks(model: "EncoderDecoder", tokenizer, text: str, options: SampleOptions) -> str:
    """The prompt with each `<mask>` replaced by the span an encoder-decoder writes for it."""
    cfg = model.cfg
    if options.compiled:
        # `generate_seq2seq` runs its own loop over the growing cache, which has no compiled path
        raise ConfigError(f"--compile: {cfg.title} (model.arch={cfg.arch}) decodes eagerly only; sample without "
                          "--compile")
    ids, pieces = encdec_source(text, tokenizer.encode_ordinary, cfg)
    n_spans = len(pieces) - 1
    # the end marker, and any sentinel after it, end the output
    stop = set(range(cfg.sentinel_start + n_spans, cfg.sentinel_start + cfg.n_sentinels))
    # model.vocab_size may exceed the tokenizer's ids: the rows between decode to nothing, so they are never drawn
    out = generate_seq2seq(model, ids, options.max_new_tokens, temperature=options.temperature, top_k=options.top_k,
                           top_p=options.top_p, stop_ids=stop, seed=options.seed,
                           text_ids=min(cfg.vocab_size, tokenizer.n_vocab))
    spans = split_spans(out, n_spans, cfg.sentinel_start)
    filled = [pieces[0]]
    for span, piece in zip(spans, pieces[1:]):
        filled += [tokenizer.decode(span), piece]  # spans hold no sentinel: they delimit or stop
    return "".join(filled)


@torch.no_grad()
def generate_seq2seq(
    model: "EncoderDecoder",
    source: list[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_ids: set[int] | None = None,
    seed: int | None = None,
    text_ids: int | None = None,
) -> list[int]:
    """Decode up to `max_new_tokens` target tokens for one source sequence and return them.

    The ids below `text_ids` (default model.cfg.vocab_size: the tokenizer's) and the sentinels can be sampled;
    decoding stops before a token in `stop_ids` (not returned). Sampling options and seeding are those of
    `generate`.
    """
    cfg = model.cfg
    if not source:
        raise ValueError("generate_seq2seq: the source must hold at least one token")
    if len(source) > cfg.block_size:
        raise ValueError(
            f"generate_seq2seq: source of {len(source)} tokens is longer than the encoder's positions "
            f"(model.block_size={cfg.block_size})"
        )
    if not 0 <= max_new_tokens <= cfg.block_size:
        raise ValueError(f"generate_seq2seq: max_new_tokens must be in [0, {cfg.block_size}], got {max_new_tokens}")
    if temperature < 0.0:
        raise ValueError(f"generate_seq2seq: temperature must be >= 0, got {temperature}")
    weight = model.tgt_embed.weight
    generator = None if seed is None else torch.Generator(weight.device).manual_seed(seed)
    text_ids = cfg.vocab_size if text_ids is None else text_ids
    stop_ids = stop_ids or set()

    was_training = model.training
    model.eval()
    try:
        src = torch.tensor([source], dtype=torch.long, device=weight.device)  # (1, S)
        memory_kv = model.memory_kv(model.encode(src))  # once per source, reused by every step
        cache = model.new_cache(1, max(max_new_tokens, 1), weight.device, weight.dtype)
        idx = torch.full((1, 1), cfg.pad_id, dtype=torch.long, device=weight.device)  # the start id
        new_tokens: list[int] = []
        for _ in range(max_new_tokens):
            logits = model.logits(model.decode(idx, memory_kv, cache=cache))[:, -1, :cfg.pad_id]  # (1, pad_id)
            logits[:, text_ids:cfg.sentinel_start] = float("-inf")  # ids no tokenizer decodes
            token = pick_token(logits, temperature, top_k, top_p, generator)  # (1,)
            token_id = int(token.item())
            if token_id in stop_ids:
                break
            new_tokens.append(token_id)
            idx = token.view(1, 1)
        return new_tokens
    finally:
        model.train(was_training)
