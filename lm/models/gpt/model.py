"""GPT: a decoder-only transformer language model, GPT-2 by default and Llama-style by options.

Token embeddings (plus learned or sinusoidal positions, or rotary positions inside attention) feed
n_layer causal blocks; a final norm (pre-norm models) and an output head, tied to the token embedding by
default, give logits over the (padded) vocabulary. `pos: rope`, `norm: rmsnorm`, `mlp: swiglu`,
`n_kv_head` and `bias: false` together make a Llama block.

References: Radford et al. 2019, "Language Models are Unsupervised Multitask Learners";
Vaswani et al. 2017, "Attention Is All You Need"; Touvron et al. 2023, "LLaMA".
"""

from collections.abc import Iterable

import torch
import torch.nn as nn

from lm.models.attention import SequenceShard, document_causal_mask
from lm.models.block import Block
from lm.models.gpt.config import GPTConfig
from lm.models.gpt.moe import MoE, Router
from lm.models.init import init_weights_, residual_projections
from lm.models.kv_cache import KVCache, StaticKVCache
from lm.models.layers import PositionTable, add_positions, make_norm, rope_angles


def check_positions(positions: torch.Tensor, idx: torch.Tensor, cache: KVCache | None) -> None:
    """Reject per-document `positions` where they cannot apply: they must match idx (B, T), and they describe
    one whole packed window, which a cache (extending one sequence) has not."""
    if positions.shape != idx.shape:
        raise ValueError(f"GPT.forward: positions has shape {tuple(positions.shape)}; it must match idx, "
                         f"{tuple(idx.shape)}")
    if cache is not None:
        raise ValueError("GPT.forward: positions (packed documents) are for training and scoring whole windows; "
                         "they cannot be combined with a KV cache")


def static_positions(cache: StaticKVCache, num_tokens: int) -> torch.Tensor:
    """The positions (T,) a static cache was advanced to, which must be those of the `num_tokens` tokens fed. A
    tensor, not cache.length: an int read here would make compiled decoding compile again at every position."""
    if cache.positions.numel() != num_tokens:
        raise ValueError(f"GPT.forward: the static KV cache was advanced by {cache.positions.numel()} positions for "
                         f"{num_tokens} tokens; call cache.advance({num_tokens}) before the forward")
    return cache.positions


class GPT(nn.Module):
    """Decoder-only language model; see the module docstring."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # The layers are built on the meta device so that their own default init neither costs time nor
        # draws from the RNG: init_weights draws every value, so the same seed gives the same weights
        # whether the model is built here or on the meta device and materialised later.
        device = torch.get_default_device()
        with torch.device("meta"):
            self.wte = nn.Embedding(cfg.padded_vocab_size, cfg.d_model)
            if cfg.pos == "learned":
                self.wpe = PositionTable(cfg.block_size, cfg.d_model)
            self.drop = nn.Dropout(cfg.dropout)
            self.blocks = nn.ModuleList(Block(cfg, causal=True, mlp=MoE(cfg, i) if cfg.moe_layer(i) else None)
                                        for i in range(cfg.n_layer))
            # A post-norm block already ends in a norm; the others leave the stream unnormalised.
            self.ln_f = make_norm(cfg) if cfg.final_norm else nn.Identity()
            self.lm_head = nn.Linear(cfg.d_model, cfg.padded_vocab_size, bias=False)
        self.to_empty(device=device)
        self.init_weights()

    def init_weights(self) -> None:
        """(Re)initialise every parameter from the global torch RNG, in a fixed order.

        Call it after `to_empty()` on a model built on the meta device: that materialises each module's
        parameters separately, which unties the output head from the token embedding, so the tie is
        restored here before anything is drawn.
        """
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        skip = {self.lm_head} if self.cfg.tie_embeddings else set()  # tied: drawn once, as the embedding
        init_weights_(self, residual_projections(self.blocks), skip, self.cfg.n_layer)
        for module in self.modules():
            if isinstance(module, Router):
                module.reset_bias()

    def new_cache(
        self,
        batch_size: int,
        max_len: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> KVCache:
        """An empty KV cache for up to `max_len` positions of `batch_size` sequences."""
        cfg = self.cfg
        return KVCache(cfg.n_layer, batch_size, cfg.kv_heads, max_len, cfg.head_dim, device, dtype)

    def new_static_cache(
        self,
        batch_size: int,
        max_len: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> StaticKVCache:
        """An empty static KV cache for up to `max_len` positions of `batch_size` sequences (compiled decoding:
        `lm.models.generate`); `advance` it before each forward."""
        cfg = self.cfg
        if max_len > cfg.block_size:
            raise ValueError(f"GPT.new_static_cache: max_len={max_len} exceeds model.block_size={cfg.block_size}")
        return StaticKVCache(cfg.n_layer, batch_size, cfg.kv_heads, max_len, cfg.head_dim, device, dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits (..., padded_vocab_size) of final-normed hidden states h (..., C); with model.logit_softcap,
        c * tanh(logits / c) in float32, which keeps every logit inside (-c, c)."""
        if h.dim() == 3 and h.size(1) == 1 and not torch.is_grad_enabled():
            # a decode step: the head over a 50k vocabulary is most of its time, and (V, C) @ (C, B) reads the
            # weight ~1.9x faster than (B, C) @ (C, V) on CPU at batch 8
            logits = (self.lm_head.weight @ h[:, 0].t()).t()[:, None]  # (B, 1, padded_vocab_size), strided
        else:
            logits = self.lm_head(h)
        c = self.cfg.logit_softcap
        return c * torch.tanh(logits.float() / c) if c else logits

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None,
                cache: KVCache | StaticKVCache | None = None, shard: SequenceShard | None = None) -> torch.Tensor:
        """The final-normed hidden states (B, T, C) of token ids idx (B, T); `logits` turns them into logits.

        `positions` (B, T) int, for windows packed from several documents: each token's position inside its
        own document, 0 where a document starts. Attention then stays inside each document
        (`document_causal_mask`) and position encodings restart at every document, so each document's
        outputs are those it gets alone; without it, tokens sit at 0..T-1 and attend causally across the
        whole window. With a cache, idx holds the T tokens after the cache.length already cached, and their
        keys and values are appended to it; with a static cache, the T tokens at its `positions`. With a `shard`
        (context parallelism), idx holds the tokens at shard.positions of a longer sequence.
        """
        cfg = self.cfg
        T = idx.shape[1]
        if isinstance(cache, StaticKVCache) and positions is None:
            x, rope = self.embed(idx, static_positions(cache, T))
            return self.ln_f(self.run_blocks(x, rope, enumerate(self.blocks), cache))
        start = 0 if cache is None else cache.length
        if start + T > cfg.block_size:
            raise ValueError(
                f"sequence of {start + T} tokens ({start} cached + {T} new) exceeds "
                f"model.block_size={cfg.block_size}"
            )

        mask = None
        if shard is not None:
            pos = shard.positions  # (T,) of a sequence of shard.length
            mask = torch.arange(shard.length, device=idx.device)[None, :] <= pos[:, None]  # (T, length): causal
        elif positions is None:
            pos = torch.arange(start, start + T, device=idx.device)  # (T,)
        else:
            check_positions(positions, idx, cache)
            pos = positions  # (B, T)
            # built once here rather than in every block: all layers share it
            mask = document_causal_mask(positions)  # (B, 1, T, T)
        x, rope = self.embed(idx, pos)
        return self.ln_f(self.run_blocks(x, rope, enumerate(self.blocks), cache, mask))

    def embed(self, idx: torch.Tensor, pos: torch.Tensor
              ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Token ids idx (B, T) at int positions `pos` (T,) or (B, T) -> the embedded stream (B, T, C), positions
        added as model.pos says, and the rotary angles for attention (None without rope)."""
        x, rope = add_positions(self.wte(idx), pos, self.cfg, getattr(self, "wpe", None))  # (B, T, C)
        return self.drop(x), rope

    def run_blocks(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                   blocks: Iterable[tuple[int, nn.Module]], cache: KVCache | StaticKVCache | None = None,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
        """The stream x (B, T, C) through `blocks`, (layer index, block) pairs in order -> (B, T, C). The index
        picks the layer's cache and whether it rotates (model.nope_interval); a pipeline stage passes its own."""
        for i, block in blocks:
            x = block(x, rope=rope if self.cfg.rotary_layer(i) else None, cache=None if cache is None else cache[i],
                      mask=mask)
        return x


class GPTStage(nn.Module):
    """One pipeline stage of a GPT: its blocks `layers`, with the embeddings when it is the first stage and the
    final norm and head when it is the last. The modules are the whole model's own, not copies, under the same
    names (`blocks.<i>`), so a stage's state dict holds the whole model's keys for its part and checkpoints move
    between layouts. It computes through GPT's own `embed` and `run_blocks`, so a stage's numbers are the model's.

    `sequence_shards`: how many slices the residual stream between stages is cut into along the sequence (the
    tensor-parallel ranks, 1 without them): a later stage receives T / sequence_shards positions of each window,
    and its rotary angles are those of all T.
    """

    def __init__(self, gpt: GPT, layers: range, sequence_shards: int = 1) -> None:
        super().__init__()
        self.cfg, self.sequence_shards = gpt.cfg, sequence_shards
        self.is_first, self.is_last = layers.start == 0, layers.stop == gpt.cfg.n_layer
        if self.is_first:
            self.wte, self.drop = gpt.wte, gpt.drop
            if hasattr(gpt, "wpe"):
                self.wpe = gpt.wpe
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in layers})
        if self.is_last:
            self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) into the first stage, the previous stage's output into the others -> this stage's
        output (B, T, C), final-normed on the last stage (whose `logits` make the logits)."""
        if self.is_first:
            x, rope = GPT.embed(self, x, torch.arange(x.shape[1], device=x.device))  # (B, T, C)
        else:
            pos = torch.arange(x.shape[1] * self.sequence_shards, device=x.device)
            rope = rope_angles(pos, self.cfg) if self.cfg.pos == "rope" else None
        x = GPT.run_blocks(self, x, rope, ((int(i), block) for i, block in self.blocks.items()))
        return self.ln_f(x) if self.is_last else x

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The last stage's logits of final-normed hidden states h (see `GPT.logits`)."""
        return GPT.logits(self, h)
