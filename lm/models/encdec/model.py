"""The encoder-decoder transformer of "Attention Is All You Need" (Vaswani et al. 2017).

Token embeddings scaled by sqrt(d_model) plus sinusoidal (or learned) positions feed n_layer encoder
blocks (self-attention, feed-forward); n_layer decoder blocks add causal self-attention and
cross-attention to the encoder output; an output head tied to the target embedding gives logits. The
blocks are the GPT's (`lm.models.block`), so every attention is the same SDPA call: `is_causal` for
decoder self-attention, a boolean key-padding mask only when the source has padding.

`norm_position: post` is the paper's layer (norm after each residual add, no final norm);
`pre` (the default) normalises before each sublayer and once more at the end of each stack.
"""

import math

import torch
import torch.nn as nn

from lm.models.attention import key_padding_mask
from lm.models.block import Block
from lm.models.encdec.config import EncDecConfig
from lm.models.init import init_weights_, residual_projections
from lm.models.kv_cache import KVCache
from lm.models.layers import PositionTable, make_norm, sinusoidal_positions

MemoryKV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per decoder layer, the cross-attention keys and values of the encoder output, each (B, nkv, S, hs)."""


def padding_mask(src: torch.Tensor, pad_id: int) -> torch.Tensor | None:
    """(B, S) bool, True for real tokens, or None when `src` holds no padding (so no mask is applied).

    Reads a value back from the device: call it when preparing inputs, not inside a training step.
    """
    keep = src != pad_id
    return None if bool(keep.all()) else keep


class EncoderDecoder(nn.Module):
    """Encoder-decoder language model; see the module docstring."""

    def __init__(self, cfg: EncDecConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # Built on the meta device and drawn by init_weights, as the GPT (see there for why).
        device = torch.get_default_device()
        with torch.device("meta"):
            self.tgt_embed = nn.Embedding(cfg.padded_vocab_size, cfg.d_model)
            if not cfg.share_embeddings:
                self.src_embed = nn.Embedding(cfg.padded_vocab_size, cfg.d_model)
            if cfg.pos == "learned":
                self.src_pos = PositionTable(cfg.block_size, cfg.d_model)
                self.tgt_pos = PositionTable(cfg.block_size, cfg.d_model)
            self.drop = nn.Dropout(cfg.dropout)
            self.encoder = nn.ModuleList(Block(cfg, causal=False) for _ in range(cfg.n_layer))
            self.decoder = nn.ModuleList(Block(cfg, causal=True, cross=True) for _ in range(cfg.n_layer))
            # Post-norm blocks already end in a norm; pre-norm stacks need one at the end.
            self.enc_norm = make_norm(cfg) if cfg.final_norm else nn.Identity()
            self.dec_norm = make_norm(cfg) if cfg.final_norm else nn.Identity()
            self.lm_head = nn.Linear(cfg.d_model, cfg.padded_vocab_size, bias=False)
        self.to_empty(device=device)
        self.init_weights()

    def init_weights(self) -> None:
        """(Re)initialise every parameter from the global torch RNG (see GPT.init_weights).

        Embeddings are drawn with std d_model^-0.5: multiplied by sqrt(d_model) they have unit variance,
        the scale of the sinusoids they are added to, and tied to the head they give O(1) logits.
        """
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.tgt_embed.weight
        skip = {self.lm_head} if self.cfg.tie_embeddings else set()
        blocks = nn.ModuleList([*self.encoder, *self.decoder])
        init_weights_(self, residual_projections(blocks), skip, 2 * self.cfg.n_layer, self.cfg.d_model ** -0.5)
        if self.cfg.pos == "learned":  # position tables are added unscaled: GPT-2's std
            nn.init.normal_(self.src_pos.weight, std=0.02)
            nn.init.normal_(self.tgt_pos.weight, std=0.02)

    @property
    def source_embedding(self) -> nn.Embedding:
        return self.tgt_embed if self.cfg.share_embeddings else self.src_embed

    def _embed(self, ids: torch.Tensor, table: nn.Embedding, pos_table: nn.Embedding | None,
               start: int) -> torch.Tensor:
        """ids (B, T) at positions start.. -> (B, T, C): scaled token embedding plus position encoding."""
        T = ids.size(1)
        if start + T > self.cfg.block_size:
            raise ValueError(f"sequence of {start + T} tokens exceeds model.block_size={self.cfg.block_size}")
        pos = torch.arange(start, start + T, device=ids.device)  # (T,)
        x = table(ids) * math.sqrt(self.cfg.d_model)  # (B, T, C)
        x = x + (pos_table(pos) if pos_table is not None else sinusoidal_positions(pos, self.cfg.d_model).to(x.dtype))
        return self.drop(x)

    def encode(self, src: torch.Tensor, src_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Encoder output (B, S, C) for source ids (B, S); src_mask (B, S) bool, True for real tokens,
        or None when the source has no padding."""
        if src.size(1) > self.cfg.block_size:
            raise ValueError(
                f"source of {src.size(1)} tokens is longer than the encoder's positions "
                f"(model.block_size={self.cfg.block_size})"
            )
        x = self._embed(src, self.source_embedding, getattr(self, "src_pos", None), 0)
        mask = key_padding_mask(src_mask)
        for block in self.encoder:
            x = block(x, mask=mask)
        return self.enc_norm(x)

    def memory_kv(self, memory: torch.Tensor) -> MemoryKV:
        """Every decoder layer's cross-attention keys and values of the encoder output (B, S, C)."""
        return [block.cross.memory_kv(memory) for block in self.decoder]

    def decode(
        self,
        tgt: torch.Tensor,
        memory_kv: MemoryKV | None = None,
        src_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        memory: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The decoder's final-normed hidden states (B, T, C) for decoder inputs tgt (B, T), given the encoder
        output either as `memory` (B, S, C) or as its per-layer keys and values `memory_kv` (see `memory_kv`);
        `logits` turns them into logits.

        With a cache, tgt holds the T tokens after the cache.length already decoded; their self-attention
        keys and values are appended to it, and memory_kv is computed once per source by the caller.
        """
        start = 0 if cache is None else cache.length
        x = self._embed(tgt, self.tgt_embed, getattr(self, "tgt_pos", None), start)
        memory_mask = key_padding_mask(src_mask)
        for i, block in enumerate(self.decoder):
            x = block(x, cache=None if cache is None else cache[i], memory=memory,
                      memory_kv=None if memory_kv is None else memory_kv[i], memory_mask=memory_mask)
        return self.dec_norm(x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits (..., padded_vocab_size) of the decoder's hidden states h (..., C)."""
        return self.lm_head(h)

    def new_cache(
        self,
        batch_size: int,
        max_len: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> KVCache:
        """An empty decoder self-attention cache for up to `max_len` target positions."""
        cfg = self.cfg
        return KVCache(cfg.n_layer, batch_size, cfg.kv_heads, max_len, cfg.head_dim, device, dtype)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, src_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher-forced decoder hidden states (B, T, C): src (B, S) source ids, tgt_in (B, T) decoder inputs
        (the targets shifted right behind the start id), src_mask: see `encode`."""
        return self.decode(tgt_in, src_mask=src_mask, memory=self.encode(src, src_mask))
