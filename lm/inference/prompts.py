"""Prompts in, text out: fitting a prompt to a model's context, and an encoder-decoder's `<mask>` prompts.

A GPT or an LSTM continues a prompt. An encoder-decoder reads the prompt as its source: each `<mask>` in
it becomes a sentinel whose span the decoder writes, and the output is the prompt with the spans filled
in; a prompt without `<mask>` gets one at its end, so the model writes a continuation.
"""

import logging

from lm.models.config import ModelConfig
from lm.models.generate import generate_seq2seq

__all__ = ["MASK", "encdec_source", "fill_masks", "fit_prompt", "split_spans"]

log = logging.getLogger("lm.sample")


def fit_prompt(ids: list[int], max_new_tokens: int, block_size: int) -> list[int]:
    """Keep the tail of a prompt so that prompt + generated tokens fit the model's context."""
    if max_new_tokens >= block_size:
        raise ValueError(f"--max-new-tokens: {max_new_tokens} leaves no room for a prompt in the "
                         f"model's context of {block_size} tokens")
    room = block_size - max_new_tokens
    if len(ids) > room:
        log.warning("prompt has %d tokens; keeping its last %d so that %d new tokens fit the context of %d",
                    len(ids), room, max_new_tokens, block_size)
        return ids[-room:]
    return ids


MASK = "<mask>"


def encdec_source(text: str, encode, cfg: ModelConfig) -> tuple[list[int], list[str]]:
    """Source ids for an encoder-decoder prompt and the text pieces around its masks.

    Every `<mask>` becomes the next sentinel id; a prompt without one gets one at its end. Returns
    (ids, pieces) with len(pieces) == number of masks + 1.
    """
    pieces = text.split(MASK)
    if len(pieces) == 1:
        pieces.append("")
    n_masks = len(pieces) - 1
    if n_masks + 1 > cfg.n_sentinels:  # the spans' sentinels plus the end marker
        raise ValueError(f"prompt has {n_masks} {MASK} markers; the model has {cfg.n_sentinels} sentinels, "
                         f"so at most {cfg.n_sentinels - 1} spans can be filled")
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        ids += encode(piece) if piece else []
        if i < n_masks:
            ids.append(cfg.sentinel_start + i)
    if len(ids) > cfg.block_size:
        raise ValueError(f"prompt of {len(ids)} tokens is longer than the encoder's positions "
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


def fill_masks(model, cfg: ModelConfig, tokenizer, text: str, max_new_tokens: int, temperature: float,
               top_k: int | None, top_p: float | None, seed: int) -> str:
    """The prompt with each `<mask>` replaced by the span an encoder-decoder writes for it."""
    ids, pieces = encdec_source(text, tokenizer.encode_ordinary, cfg)
    n_spans = len(pieces) - 1
    # the end marker, and any sentinel after it, end the output
    stop = set(range(cfg.sentinel_start + n_spans, cfg.sentinel_start + cfg.n_sentinels))
    out = generate_seq2seq(model, ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                           stop_ids=stop, seed=seed)
    spans = split_spans(out, n_spans, cfg.sentinel_start)
    filled = [pieces[0]]
    for span, piece in zip(spans, pieces[1:]):
        filled += [tokenizer.decode(span), piece]  # spans hold no sentinel: they delimit or stop
    return "".join(filled)
