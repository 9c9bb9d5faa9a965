"""LSTM: a recurrent language model, the baseline the transformers are measured against.

Token embeddings feed n_layer stacked LSTM layers of width d_model; an output head, tied to the token
embedding by default, gives logits over the (padded) vocabulary. Dropout sits on the non-recurrent
connections only: on the embeddings, between layers and before the head (Zaremba et al. 2014). Each
layer is its own `nn.LSTM`, so sharding and activation checkpointing can work layer by layer, as they
do block by block for the GPT.

No positions: the recurrence orders the tokens. Sampling carries each layer's (h, c) from step to step
(`RecurrentState`), where the GPT keeps a KV cache.

References: Hochreiter & Schmidhuber 1997, "Long Short-Term Memory"; Zaremba et al. 2014, "Recurrent
Neural Network Regularization"; Press & Wolf 2017, "Using the Output Embedding to Improve Language Models".
"""

import math

import torch
import torch.nn as nn

from lm.models.config import ModelConfig
from lm.models.loss import chunked_cross_entropy, head_loss


class RecurrentState:
    """Each layer's last hidden and cell state after the `length` positions fed so far."""

    def __init__(
        self,
        n_layer: int,
        batch_size: int,
        hidden: int,
        max_len: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        # zeros, as nn.LSTM starts without a state, so prefill-then-decode equals one full forward
        self.layers = [
            tuple(torch.zeros(1, batch_size, hidden, device=device, dtype=dtype) for _ in range(2))
            for _ in range(n_layer)
        ]  # each (h, c), each (1, B, H)
        self.length = 0
        self.max_len = max_len

    def advance(self, n: int) -> None:
        """Count `n` more positions fed; like a KV cache, refuse more than max_len in all."""
        if self.length + n > self.max_len:
            raise ValueError(f"recurrent state overflow: {self.length + n} positions exceed its max_len={self.max_len}")
        self.length += n


class LSTMLM(nn.Module):
    """Recurrent language model; see the module docstring."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.arch != "lstm":
            raise ValueError(f"LSTMLM: model.arch is {cfg.arch!r}; build it with lm.models.factory.build_model")
        self.cfg = cfg
        # Built on the meta device and drawn by init_weights, as the GPT is, so the same seed gives the
        # same weights however the model is built and later materialised (FSDP builds it on meta).
        device = torch.get_default_device()
        with torch.device("meta"):
            self.wte = nn.Embedding(cfg.padded_vocab_size, cfg.d_model)
            self.drop = nn.Dropout(cfg.dropout)
            self.layers = nn.ModuleList(
                nn.LSTM(cfg.d_model, cfg.d_model, num_layers=1, bias=cfg.bias, batch_first=True)
                for _ in range(cfg.n_layer)
            )
            self.lm_head = nn.Linear(cfg.d_model, cfg.padded_vocab_size, bias=False)
        self.to_empty(device=device)
        self.init_weights()

    def init_weights(self) -> None:
        """(Re)initialise every parameter from the global torch RNG, in a fixed order.

        Embedding (and an untied head) ~ N(0, 0.02) as in the GPT; every LSTM weight and bias
        ~ U(-1/sqrt(d_model), 1/sqrt(d_model)), PyTorch's own LSTM default. As in the GPT, the tie is
        restored first, since `to_empty()` unties the head.
        """
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        nn.init.normal_(self.wte.weight, mean=0.0, std=0.02)
        bound = 1.0 / math.sqrt(self.cfg.d_model)
        for layer in self.layers:
            for param in layer.parameters():
                nn.init.uniform_(param, -bound, bound)
        if not self.cfg.tie_embeddings:
            nn.init.normal_(self.lm_head.weight, mean=0.0, std=0.02)

    def new_cache(
        self,
        batch_size: int,
        max_len: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> RecurrentState:
        """A zero recurrent state for `batch_size` sequences of up to `max_len` positions (the GPT's
        `new_cache` contract, so the samplers treat both models alike)."""
        return RecurrentState(self.cfg.n_layer, batch_size, self.cfg.d_model, max_len, device, dtype)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache: RecurrentState | None = None,
        last_only: bool = False, with_z: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Logits for every position and, given targets, the mean cross-entropy loss.

        idx, targets: (B, T) token ids. With a cache (a `RecurrentState`), idx holds the T tokens after
        the cache.length already fed; the layers start from its states and leave their last ones in it.
        `last_only` (sampling, no targets) runs the output head on the last position alone: logits
        (B, 1, padded_vocab_size). Returns logits (B, T, padded_vocab_size) and a float32 scalar loss,
        or None without targets; with targets and `model.loss_chunk` > 0, (None, loss); `with_z`: the loss
        is (2,), cross-entropy and z-loss term; all as in the GPT.
        """
        cfg = self.cfg
        T = idx.shape[1]
        start = 0 if cache is None else cache.length
        # nothing in an LSTM limits the length; block_size is kept as the longest sequence it was
        # trained and is sampled on, so both architectures accept the same inputs
        if start + T > cfg.block_size:
            raise ValueError(
                f"sequence of {start + T} tokens ({start} fed before + {T} new) exceeds "
                f"model.block_size={cfg.block_size}"
            )
        if cache is not None:
            cache.advance(T)

        x = self.drop(self.wte(idx))  # (B, T, C)
        for i, layer in enumerate(self.layers):
            if cache is None:
                x, _ = layer(x)  # (B, T, C), starting from a zero state
            else:
                x, cache.layers[i] = layer(x, cache.layers[i])  # h, c each (1, B, C)
            x = self.drop(x)
        if last_only:
            if targets is not None:
                raise ValueError("LSTMLM.forward: last_only is for sampling; the loss needs every position's logits")
            return self.lm_head(x[:, -1:]), None  # (B, 1, padded_vocab_size)
        if targets is not None and cfg.loss_chunk:
            return None, chunked_cross_entropy(self.lm_head, x, targets, cfg.loss_chunk, with_z)
        logits = self.lm_head(x)  # (B, T, padded_vocab_size)
        return logits, None if targets is None else head_loss(logits, targets, with_z)
