"""Autoregressive sampling with a KV cache (or an LSTM's recurrent state).

Decoder-only LMs (GPT, LSTM): prefill the prompt into the cache once, then decode token by token (or,
without a cache, run the whole sequence again for every token: the baseline the cache is measured
against). The LSTM's `new_cache` is its per-layer (h, c) state, fed and updated like a KV cache, so the
same loop serves both. Encoder-decoder: encode the source once and project its cross-attention keys
and values once, then decode token by token from the start id, the decoder's own keys and values cached.
"""

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from lm.models.encdec import EncoderDecoder
from lm.models.gpt import GPT
from lm.models.lstm import LSTMLM

DecoderLM = GPT | LSTMLM
"""The models `generate` and `generate_batch` sample from: `forward(idx, cache=, last_only=)`, `new_cache`."""


def filter_logits(
    logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """Set to -inf every logit outside the top-k, then outside the top-p nucleus.

    logits: (..., V); returns a new tensor of the same shape, the input is left unchanged.
    top_k: keep the k largest logits (values tied with the k-th are kept too); None keeps all.
    top_p: in (0, 1]; keep the smallest set of most probable tokens whose cumulative probability reaches
    top_p, which always holds at least the most probable token; None keeps all.
    """
    if top_k is not None:
        if top_k < 1:
            raise ValueError(f"top_k must be at least 1, got {top_k}")
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (..., V)
        cum_probs = sorted_logits.float().softmax(dim=-1).cumsum(dim=-1)
        # A token is outside the nucleus when the more probable tokens before it already reach top_p.
        # Shifting the cumulative sum (rather than subtracting each probability) keeps it exact at ties.
        mass_before = F.pad(cum_probs[..., :-1], (1, 0))
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _next_token(
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


def _decode(model: DecoderLM, idx: torch.Tensor, steps: int, vocab_size: int, use_cache: bool, temperature: float,
            top_k: int | None, top_p: float | None, generator: torch.Generator | None) -> Iterator[torch.Tensor]:
    """Yield `steps` next tokens (B,) after the prompts idx (B, T), each picked by `_next_token`.

    With the cache the prompt is prefilled once and each step feeds only the new token; without it each
    step runs the whole sequence so far (its last block_size tokens) through the model again.
    """
    block_size = model.cfg.block_size
    if use_cache:
        weight = model.wte.weight
        cache = model.new_cache(idx.size(0), min(block_size, idx.size(1) + steps), weight.device, weight.dtype)
        x = idx
    for _ in range(steps):
        if use_cache:
            logits, _ = model(x, cache=cache, last_only=True)  # (B, 1, padded_vocab_size)
        else:
            logits, _ = model(idx[:, -block_size:], last_only=True)
        # Slicing off the padding rows is the same as masking them to -inf, and cheaper.
        token = _next_token(logits[:, -1, :vocab_size], temperature, top_k, top_p, generator)  # (B,)
        yield token
        if use_cache:
            x = token[:, None]  # decode: feed only the new token; the cache holds the rest
        else:
            idx = torch.cat([idx, token[:, None]], dim=1)


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
) -> list[int]:
    """Continue `prompt` by up to `max_new_tokens` sampled tokens and return the new tokens only.

    temperature 0 picks the argmax; otherwise logits are divided by temperature, filtered by
    `filter_logits(top_k, top_p)` and sampled. Only the first `vocab_size` logits (default
    model.cfg.vocab_size) can be sampled; the rest are embedding padding. Generation stops before
    `eot_id` (which is not returned) or after max_new_tokens. The same seed gives the same tokens;
    seed None draws from the global torch RNG. The caller truncates a prompt that would not fit:
    prompt plus max_new_tokens may exceed model.block_size by one, since the last token is never fed back.
    """
    if not isinstance(model, (GPT, LSTMLM)):
        raise TypeError(f"generate: takes a decoder-only model (GPT or LSTM), got {type(model).__name__}; "
                        "an encoder-decoder decodes with generate_seq2seq")
    if not prompt:
        raise ValueError("generate: prompt must hold at least one token")
    _check_length(model, len(prompt), max_new_tokens, "generate")
    if temperature < 0.0:
        raise ValueError(f"generate: temperature must be >= 0, got {temperature}")
    vocab_size = model.cfg.vocab_size if vocab_size is None else vocab_size
    weight = model.wte.weight
    generator = None if seed is None else torch.Generator(weight.device).manual_seed(seed)

    was_training = model.training
    model.eval()
    try:
        idx = torch.tensor([prompt], dtype=torch.long, device=weight.device)  # (1, T): prefill first
        new_tokens: list[int] = []
        for token in _decode(model, idx, max_new_tokens, vocab_size, True, temperature, top_k, top_p, generator):
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
) -> torch.Tensor:
    """Continue every prompt of idx (B, T) by exactly `max_new_tokens` tokens; returns them (B, N).

    No stop token and no host sync per token: the fixed-length batched form that benchmarks and
    batch sampling want. Sampling options are those of `generate`; only real vocabulary ids are drawn.
    """
    _check_length(model, idx.size(1), max_new_tokens, "generate_batch")
    if temperature < 0.0:
        raise ValueError(f"generate_batch: temperature must be >= 0, got {temperature}")
    was_training = model.training
    model.eval()
    try:
        tokens = list(_decode(model, idx, max_new_tokens, model.cfg.vocab_size, use_cache, temperature, top_k, top_p,
                              generator))
        return torch.stack(tokens, dim=1) if tokens else idx.new_empty(idx.size(0), 0)
    finally:
        model.train(was_training)


@torch.no_grad()
def generate_seq2seq(
    model: EncoderDecoder,
    source: list[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_ids: set[int] | None = None,
    seed: int | None = None,
) -> list[int]:
    """Decode up to `max_new_tokens` target tokens for one source sequence and return them.

    Any id below model.cfg.pad_id can be sampled (the tokenizer's ids and the sentinels); decoding stops
    before a token in `stop_ids` (not returned). Sampling options and seeding are those of `generate`.
    """
    if not isinstance(model, EncoderDecoder):
        raise TypeError(f"generate_seq2seq: takes an encoder-decoder, got {type(model).__name__}; "
                        "a decoder-only model (GPT or LSTM) samples with generate")
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
            logits = model.decode(idx, memory_kv, cache=cache)  # (1, 1, padded_vocab_size)
            token = _next_token(logits[:, -1, :cfg.pad_id], temperature, top_k, top_p, generator)  # (1,)
            token_id = int(token.item())
            if token_id in stop_ids:
                break
            new_tokens.append(token_id)
            idx = token.view(1, 1)
        return new_tokens
    finally:
        model.train(was_training)
