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

from lm.models.lstm.config import LSTMConfig


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

    def __init__(self, cfg: LSTMConfig) -> None:
        super().__init__()
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

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits (..., padded_vocab_size) of hidden states h (..., C)."""
        return self.lm_head(h)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None,
                cache: RecurrentState | None = None) -> torch.Tensor:
        """The last layer's hidden states (B, T, C) of token ids idx (B, T), after dropout; `logits` turns them
        into logits. With a cache (a `RecurrentState`), idx holds the T tokens after the cache.length already
        fed; the layers start from its states and leave their last ones in it. `positions` (packed documents)
        cannot apply: the recurrence carries each document into the next, so it must be None.
        """
        cfg = self.cfg
        if positions is not None:
            raise ValueError("LSTMLM.forward: an LSTM cannot keep packed documents apart (its state runs across "
                             "them); positions must be None")
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
        return x
