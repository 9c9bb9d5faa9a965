"""The encoder alone: a bidirectional transformer under a masked-LM head or a fine-tuning head (BERT, ModernBERT).

Token embeddings (plus learned or sinusoidal positions, or rotary positions inside attention) are
normalised (`emb_norm`, as BERT and ModernBERT do; no sqrt(d_model) scaling, the norm sets the scale)
and feed n_layer non-causal blocks, the GPT's and the encoder-decoder's `Block`, so attention is the same
SDPA call with a boolean key-padding mask where a batch is padded. A pre-norm stack ends in a final norm.

Heads (`model.head`):
- mlm: BERT's prediction head, dense -> GELU -> norm -> output layer over the padded vocabulary, tied to
  the token embedding by default. Training runs it on the masked positions only (`lm.models.encoder.family`):
  at a 30% mask rate that skips 70% of the largest matmul and of the float32 logits.
- classify / regress: one linear layer `score` on a pooled vector, the first position ([CLS]) or the mean
  over the real tokens.
Every module outside the head (the trunk) has the same name under every head, so a classifier loads its
trunk from a masked-LM checkpoint by name.

References: Devlin et al. 2019, "BERT"; Warner et al. 2024, "ModernBERT" (30% masking, no 80/10/10).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from lm.models.attention import document_mask, key_padding_mask
from lm.models.block import Block
from lm.models.encoder.config import EncoderConfig
from lm.models.init import init_weights_, residual_projections
from lm.models.layers import PositionTable, add_positions, make_norm


class Encoder(nn.Module):
    """Encoder-only model with a masked-LM, classification or regression head; see the module docstring."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # Built on the meta device and drawn by init_weights, as the GPT (see there for why).
        device = torch.get_default_device()
        with torch.device("meta"):
            self.wte = nn.Embedding(cfg.padded_vocab_size, cfg.d_model)
            if cfg.pos == "learned":
                self.wpe = PositionTable(cfg.block_size, cfg.d_model)
            self.emb_norm = make_norm(cfg)
            self.drop = nn.Dropout(cfg.dropout)
            self.blocks = nn.ModuleList(Block(cfg, causal=False) for _ in range(cfg.n_layer))
            # A post-norm block already ends in a norm; pre-norm leaves the stream unnormalised.
            self.ln_f = make_norm(cfg) if cfg.final_norm else nn.Identity()
            if cfg.head == "mlm":
                self.mlm_dense = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
                self.mlm_norm = make_norm(cfg)
                self.lm_head = nn.Linear(cfg.d_model, cfg.padded_vocab_size, bias=cfg.bias)
            else:
                # always biased: a class prior (or a regression target's mean) is one number per output
                self.score = nn.Linear(cfg.d_model, cfg.num_classes or 1, bias=True)
        self.to_empty(device=device)
        self.init_weights()

    def init_weights(self) -> None:
        """(Re)initialise every parameter from the global torch RNG (see GPT.init_weights).

        A tied output layer is skipped by the draw (its weight is the embedding's) but keeps a bias of its
        own, which `to_empty` left uninitialised: it starts at zero, as every other bias.
        """
        tied = self.cfg.head == "mlm" and self.cfg.tie_embeddings
        if tied:
            self.lm_head.weight = self.wte.weight
        init_weights_(self, residual_projections(self.blocks), {self.lm_head} if tied else set(), self.cfg.n_layer)
        if tied and self.lm_head.bias is not None:
            nn.init.zeros_(self.lm_head.bias)

    def forward(self, ids: torch.Tensor, keep: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Trunk output (B, T, C), after the final norm, for ids (B, T); a head (`mlm_logits`, `task_outputs`)
        reads it.

        keep: (B, T) bool, True for real tokens and False for padding, which no position attends to; None
        when nothing is padded (no mask, so SDPA may pick its fastest kernel). positions: (B, T) int, for
        windows packed from several documents (data.document_mask): each token's position inside its own
        document, 0 where one starts; attention then stays inside each document (`document_mask`) and the
        position encodings restart at each, so a document's outputs are those it gets alone.
        """
        cfg = self.cfg
        T = ids.size(1)
        if T > cfg.block_size:
            raise ValueError(f"sequence of {T} tokens exceeds model.block_size={cfg.block_size}")
        pos = torch.arange(T, device=ids.device) if positions is None else positions  # (T,) or (B, T)
        x, rope = add_positions(self.wte(ids), pos, cfg, getattr(self, "wpe", None))  # (B, T, C)
        x = self.drop(self.emb_norm(x))
        mask = key_padding_mask(keep)  # (B, 1, 1, T) or None, shared by every block
        if positions is not None:
            documents = document_mask(positions)  # (B, 1, T, T)
            mask = documents if mask is None else documents & mask
        for block in self.blocks:
            x = block(x, rope, None, mask)
        return self.ln_f(x)

    def mlm_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Masked-LM head: trunk output h (..., C) -> logits (..., padded_vocab_size)."""
        return self.lm_head(self.mlm_norm(F.gelu(self.mlm_dense(h), approximate="tanh")))

    def pool(self, h: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """The vector a fine-tuning head reads: h (B, T, C), keep (B, T) bool or None -> (B, C).

        first: the [CLS] position, which attends to the whole sequence; mean: the mean over real tokens,
        so padding changes nothing.
        """
        if self.cfg.pooling == "first":
            return h[:, 0]
        if keep is None:
            return h.mean(dim=1)
        weight = keep.to(h.dtype)[..., None]  # (B, T, 1)
        return (h * weight).sum(dim=1) / weight.sum(dim=1)

    def task_outputs(self, h: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """A classify or regress head's output for trunk output h (B, T, C): (B, num_classes) logits, or (B,)
        predictions."""
        out = self.score(self.pool(h, keep))  # (B, num_classes) or (B, 1)
        return out[:, 0] if self.cfg.head == "regress" else out
