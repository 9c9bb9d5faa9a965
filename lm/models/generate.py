"""Autoregressive sampling of a next-token model with a cache (a KV cache, or an LSTM's recurrent state).

Prefill the prompt into the cache once, then decode token by token (or, without a cache, run the whole
sequence again for every token: the baseline the cache is measured against). Any model with the
`DecoderLM` methods samples here: the GPT's `new_cache` is a KV cache, the LSTM's its per-layer (h, c) state,
fed and updated alike. `filter_logits` and `pick_token` serve the encoder-decoder's sampler too.

Compiled decoding (`compiled=True`, a model with `new_static_cache`) keeps the keys and values in a static cache,
whose shapes stay the same at every position, so the one-token step is compiled once and then replayed (on CUDA,
as one CUDA graph): eager decoding of a small model is bound by kernel launches, not by reading its weights. The
token is picked outside the compiled step, by the same `pick_token`, so a seed draws the same tokens either way.
"""

import functools
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
import torch.nn.functional as F

from lm.errors import ConfigError, PromptError
from lm.models.kv_cache import StaticKVCache

log = logging.getLogger("lm.sample")


class DecoderLM(Protocol):
    """What `generate` and `generate_batch` need of a model (an nn.Module): a config with block_size and
    vocab_size, a forward from ids (and a cache) to hidden states, `logits` of those, and `new_cache`."""

    cfg: object

    def __call__(self, idx: torch.Tensor, positions: None = None, cache: object = None) -> torch.Tensor: ...

    def logits(self, h: torch.Tensor) -> torch.Tensor: ...

    def new_cache(self, batch_size: int, max_len: int, device: torch.device | str | None = None,
                  dtype: torch.dtype | None = None) -> object: ...


def fit_prompt(ids: list[int], max_new_tokens: int, block_size: int) -> list[int]:
    """Keep the tail of a prompt so that prompt + generated tokens fit the model's context."""
    if max_new_tokens >= block_size:
        raise PromptError(f"--max-new-tokens: {max_new_tokens} leaves no room for a prompt in the "
                         f"model's context of {block_size} tokens")
    room = block_size - max_new_tokens
    if len(ids) > room:
        log.warning("prompt has %d tokens; keeping its last %d so that %d new tokens fit the context of %d",
                    len(ids), room, max_new_tokens, block_size)
        return ids[-room:]
    return ids


def filter_logits(
    logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """Set to -inf every logit outside the top-k, then outside the top-p nucleus.

    logits: (..., V); returns a new tensor of the same shape, the input is left unchanged.
    top_k: keep the k largest logits (values tied with the k-th are kept too); None keeps all.
    top_p: in (0, 1]; keep the smallest set of most probable tokens whose cumulative probability reaches
    top_p, which always holds at least the most probable token; None or 1 keeps all.
    """
    if top_k is not None:
        if top_k < 1:
            raise ValueError(f"top_k must be at least 1, got {top_k}")
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_p is not None and top_p < 1.0:  # 1 keeps all: a float32 sum can reach 1 before the last tokens
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (..., V)
        cum_probs = sorted_logits.float().softmax(dim=-1).cumsum(dim=-1)
        # A token is outside the nucleus when the more probable tokens before it already reach top_p.
        # Shifting the cumulative sum (rather than subtracting each probability) keeps it exact at ties.
        mass_before = F.pad(cum_probs[..., :-1], (1, 0))
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def pick_token(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Pick one token id per row of logits (B, V); returns (B,) long."""
    if temperature == 0.0:
        return torch.argmax(logits, dim=-1)
    logits = filter_logits(logits.float() / temperature, top_k, top_p)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)[:, 0]


def next_logits(model: DecoderLM, x: torch.Tensor, cache: object = None) -> torch.Tensor:
    """The next-token logits (B, padded_vocab_size) after x (B, T), whose positions follow those in `cache`: the
    forward, then the head on the last position alone. The step compiled decoding compiles."""
    h = model(x, cache=cache)  # (B, T, C)
    return model.logits(h[:, -1:])[:, -1]


@functools.cache
def compiled_step(device_type: str) -> Callable[[DecoderLM, torch.Tensor, object], torch.Tensor]:
    """`next_logits` compiled, one wrapper per device type for the whole process: dynamo keeps its graphs per
    wrapper, so a second `torch.compile` of the same step would compile again. On CUDA, `reduce-overhead`
    captures the step in a CUDA graph, which replays its hundred-odd kernel launches as one."""
    return torch.compile(next_logits, mode="reduce-overhead" if device_type == "cuda" else None)


STATIC_CACHES: "weakref.WeakKeyDictionary[torch.nn.Module, StaticKVCache]" = weakref.WeakKeyDictionary()
"""Each model's last static cache, which the model's next compiled decoding of the same shape reuses: the compiled
step guards on the address of the storage it writes in place (a CUDA graph replays fixed addresses), so new
storage would compile it again."""


def _static_cache(model: DecoderLM, batch_size: int, max_len: int, weight: torch.Tensor) -> StaticKVCache:
    """An empty static KV cache of the weights' device and dtype: the model's last one when it fits, or a new one.
    A model without a static cache is refused in one line."""
    new_static_cache = getattr(model, "new_static_cache", None)
    if new_static_cache is None:
        raise ConfigError(f"--compile: {model.cfg.title} (model.arch={model.cfg.arch}) has no static KV cache, "
                          "which compiled decoding needs; sample without --compile")
    cache = STATIC_CACHES.get(model)
    storage = None if cache is None else cache.layers[0].k  # (B, nkv, max_len, hs)
    if storage is None or (storage.size(0), storage.size(2), storage.device, storage.dtype) != (
            batch_size, max_len, weight.device, weight.dtype):
        cache = new_static_cache(batch_size, max_len, weight.device, weight.dtype)
        for layer in cache.layers:
            torch._dynamo.mark_static_address(layer.k)
            torch._dynamo.mark_static_address(layer.v)
        STATIC_CACHES[model] = cache
    cache.reset()
    return cache


def _static_step(model: DecoderLM, x: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
    """`next_logits` of x (B, T) with a static cache, compiled for one token. A longer prompt's prefill runs eager:
    one call per sequence, already as wide as the prompt, and compiled it would compile again for each new prompt
    length (or take dynamic shapes) to save one eager forward."""
    cache.advance(x.size(1))
    if x.size(1) > 1:
        return next_logits(model, x, cache)
    if x.is_cuda:  # each step a new replay of the CUDA graph, which overwrites the last step's logits (picked already)
        torch.compiler.cudagraph_mark_step_begin()
    return compiled_step(x.device.type)(model, x, cache)


def _decode(model: DecoderLM, idx: torch.Tensor, steps: int, vocab_size: int, use_cache: bool, compiled: bool,
            temperature: float, top_k: int | None, top_p: float | None,
            generator: torch.Generator | None) -> Iterator[torch.Tensor]:
    """Yield `steps` next tokens (B,) after the prompts idx (B, T), each picked by `pick_token` outside any graph.

    With the cache the prompt is prefilled once and each step feeds only the new token; compiled, into a static
    cache through the compiled step; without a cache each step runs the whole sequence so far through the model
    again.
    """
    cache, x = None, idx
    if use_cache or compiled:
        weight = next(model.parameters())  # the cache takes the weights' device and dtype
        max_len = min(model.cfg.block_size, idx.size(1) + steps)  # the last token is never fed
        if compiled:
            cache = _static_cache(model, idx.size(0), max_len, weight)
        else:
            cache = model.new_cache(idx.size(0), max_len, weight.device, weight.dtype)
    for _ in range(steps):
        if cache is None:
            logits = next_logits(model, idx)  # `_check_length`: it fits
        elif compiled:
            logits = _static_step(model, x, cache)
        else:
            logits = next_logits(model, x, cache)
        # Slicing off the padding rows is the same as masking them to -inf, and cheaper.
        token = pick_token(logits[:, :vocab_size], temperature, top_k, top_p, generator)  # (B,)
        del logits  # a CUDA graph's output, which its next replay overwrites
        yield token
        if cache is None:
            idx = torch.cat([idx, token[:, None]], dim=1)
        else:
            x = token[:, None]  # decode: feed only the new token; the cache holds the rest


def _check_length(model: DecoderLM, prompt_len: int, max_new_tokens: int, name: str) -> None:
    if max_new_tokens < 0:
        raise ValueError(f"{name}: max_new_tokens must be >= 0, got {max_new_tokens}")
    if prompt_len + max(max_new_tokens - 1, 0) > model.cfg.block_size:
        raise ValueError(
            f"{name}: prompt of {prompt_len} tokens plus max_new_tokens={max_new_tokens} does not fit "
            f"model.block_size={model.cfg.block_size}; truncate the prompt"
        )


@torch.no_grad()
def generate(
    model: DecoderLM,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eot_id: int | None = None,
    seed: int | None = None,
    vocab_size: int | None = None,
    compiled: bool = False,
) -> list[int]:
    """Continue `prompt` by up to `max_new_tokens` sampled tokens and return the new tokens only.

    temperature 0 picks the argmax; otherwise logits are divided by temperature, filtered by
    `filter_logits(top_k, top_p)` and sampled. Only the first `vocab_size` logits (default
    model.cfg.vocab_size) can be sampled; the rest are embedding padding. Generation stops before
    `eot_id` (which is not returned) or after max_new_tokens. The same seed gives the same tokens;
    seed None draws from the global torch RNG. The caller truncates a prompt that would not fit:
    prompt plus max_new_tokens may exceed model.block_size by one, since the last token is never fed back.
    `compiled`: decode through a static KV cache with the one-token step compiled (`torch.compile`; on CUDA, one
    CUDA graph), to eager's greedy tokens; a model without a static cache raises ConfigError.
    """
    if not prompt:
        raise ValueError("generate: prompt must hold at least one token")
    _check_length(model, len(prompt), max_new_tokens, "generate")
    if temperature < 0.0:
        raise ValueError(f"generate: temperature must be >= 0, got {temperature}")
    vocab_size = model.cfg.vocab_size if vocab_size is None else vocab_size
    weight = next(model.parameters())
    generator = None if seed is None else torch.Generator(weight.device).manual_seed(seed)

    was_training = model.training
    model.eval()
    try:
        idx = torch.tensor([prompt], dtype=torch.long, device=weight.device)  # (1, T): prefill first
        new_tokens: list[int] = []
        for token in _decode(model, idx, max_new_tokens, vocab_size, True, compiled, temperature, top_k, top_p,
                             generator):
            token_id = int(token.item())  # one host sync per token, needed to test for eot anyway
            if token_id == eot_id:
                break
            new_tokens.append(token_id)
        return new_tokens
    finally:
        model.train(was_training)


@torch.no_grad()
def generate_batch(
    model: DecoderLM,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    compiled: bool = False,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Continue every prompt of idx (B, T) by exactly `max_new_tokens` tokens; returns them (B, N).

    No stop token and no host sync per token: the fixed-length batched form that benchmarks and
    batch sampling want. Sampling options, `compiled` and `vocab_size` are those of `generate`; only real
    vocabulary ids are drawn. use_cache False runs the whole sequence again for every token (the baseline the cache
    is measured against).
    """
    _check_length(model, idx.size(1), max_new_tokens, "generate_batch")
    if temperature < 0.0:
        raise ValueError(f"generate_batch: temperature must be >= 0, got {temperature}")
    was_training = model.training
    model.eval()
    try:
        vocab_size = model.cfg.vocab_size if vocab_size is None else vocab_size
        tokens = list(_decode(model, idx, max_new_tokens, vocab_size, use_cache, compiled, temperature, top_k, top_p,
                              generator))
        return torch.stack(tokens, dim=1) if tokens else idx.new_empty(idx.size(0), 0)
    finally:
        model.train(was_training)
