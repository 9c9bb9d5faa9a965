"""GPT-2: a decoder-only transformer language model.

Token and learned position embeddings feed n_layer pre-LayerNorm blocks (attention, then an MLP, each
added back to the residual stream); a final LayerNorm and an output head tied to the token embedding
give logits over the (padded) vocabulary.

References: Radford et al. 2019, "Language Models are Unsupervised Multitask Learners";
Vaswani et al. 2017, "Attention Is All You Need".
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from lm.models.attention import CausalSelfAttention
from lm.models.config import ModelConfig
from lm.models.kv_cache import KVCache, LayerKVCache


class MLP(nn.Module):
    """Position-wise feed-forward network d -> 4d -> d."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, C) -> (B, T, C)."""
        # GPT-2 was trained with the tanh approximation of GELU; keep it so its weights load unchanged.
        return self.drop(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    """One transformer block; LayerNorm comes before each sublayer (GPT-2), not after (original)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cache: LayerKVCache | None = None) -> torch.Tensor:
        """x: (B, T, C) -> (B, T, C)."""
        x = x + self.attn(self.ln_1(x), cache)
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """GPT-2 language model; see the module docstring."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # The layers are built on the meta device so that their own default init neither costs time nor
        # draws from the RNG: init_weights draws every value, so the same seed gives the same weights
        # whether the model is built here or on the meta device and materialised later.
        device = torch.get_default_device()
        with torch.device("meta"):
            self.wte = nn.Embedding(cfg.padded_vocab_size, cfg.d_model)
            self.wpe = nn.Embedding(cfg.block_size, cfg.d_model)
            self.drop = nn.Dropout(cfg.dropout)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
            self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
            self.lm_head = nn.Linear(cfg.d_model, cfg.padded_vocab_size, bias=False)
        self.to_empty(device=device)
        self.init_weights()

    def init_weights(self) -> None:
        """(Re)initialise every parameter from the global torch RNG, in a fixed order.

        Call it after `to_empty()` on a model built on the meta device: that materialises each module's
        parameters separately, which unties the output head from the token embedding, so the tie is
        restored here before anything is drawn.
        """
        self.lm_head.weight = self.wte.weight
        # GPT-2 scales the init of the projections that write into the residual stream by 1/sqrt(2L), so
        # the stream's variance stays O(1) after 2L additions (attention + MLP per layer).
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        residual_projections = {m for block in self.blocks for m in (block.attn.proj, block.mlp.proj)}
        for module in self.modules():
            if module is self.lm_head:
                continue  # its weight is wte's, drawn once as an embedding
            if isinstance(module, nn.Linear):
                std = residual_std if module in residual_projections else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count, the tied head counted once; `non_embedding` leaves out the position table.

        The token embedding stays in because, tied, it is also the output layer (as in GPT-2's counts).
        """
        n = sum(p.numel() for p in self.parameters())  # parameters() yields a shared tensor once
        if non_embedding:
            n -= self.wpe.weight.numel()
        return n

    def new_cache(
        self,
        batch_size: int,
        max_len: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> KVCache:
        """An empty KV cache for up to `max_len` positions of `batch_size` sequences."""
        cfg = self.cfg
        return KVCache(cfg.n_layer, batch_size, cfg.n_head, max_len, cfg.head_dim, device, dtype)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache: KVCache | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits for every position and, given targets, the mean cross-entropy loss.

        idx, targets: (B, T) token ids. With a cache, idx holds the T tokens after the cache.length
        already cached, and their keys and values are appended to it.
        Returns logits (B, T, padded_vocab_size) and a float32 scalar loss, or None without targets.
        """
        B, T = idx.shape
        start = 0 if cache is None else cache.length
        if start + T > self.cfg.block_size:
            raise ValueError(
                f"sequence of {start + T} tokens ({start} cached + {T} new) exceeds "
                f"model.block_size={self.cfg.block_size}"
            )

        pos = torch.arange(start, start + T, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for i, block in enumerate(self.blocks):
            x = block(x, None if cache is None else cache[i])
        logits = self.lm_head(self.ln_f(x))  # (B, T, padded_vocab_size)

        loss = None
        if targets is not None:
            # Softmax over ~50k classes loses too much precision in bf16; compute the loss in float32.
            loss = F.cross_entropy(logits.float().view(B * T, -1), targets.reshape(B * T))
        return logits, loss
