"""The decoder-only family's keys: the shared transformer keys, and the options only this family has."""

import math
from dataclasses import dataclass
from typing import ClassVar

from lm.errors import ConfigError
from lm.models.config import TransformerConfig


@dataclass
class GPTConfig(TransformerConfig):
    """A decoder-only transformer: GPT-2 by default, Llama-style by options (see `TransformerConfig`)."""

    arch: str = "gpt"
    title: ClassVar[str] = "a decoder-only GPT"
    document_masking: ClassVar[bool] = True
    z_loss: ClassVar[bool] = True
    rope_theta: float = 10000.0
    """Base of the rotary frequencies (pos: rope)."""
    qkv_bias: bool = False
    """Biases on the query/key/value projection even without `bias`, as in Qwen2 (`bias` implies them)."""
    qk_norm: bool = False
    """RMSNorm on each head's queries and keys (learned weight of head size), before rotary positions."""
    logit_softcap: float = 0.0
    """Squash the logits into (-c, c) as c * tanh(logits / c), in float32 (Gemma 2, modded-nanogpt); 0: off."""
    loss_chunk: int = 0
    """Compute the output head and loss this many of the B*T positions at a time, recomputing each chunk's
    logits in backward, so the full (B*T, vocab) logits never exist. 0: off, the whole head at once."""

    def tensor_parallel_problem(self, tp: int) -> str | None:
        """Each rank keeps n_head / tp query heads, n_kv_head / tp key/value heads, d_ff / tp hidden units and
        a 1/tp slice of the (padded) vocabulary, so tp must divide all four."""
        sizes = {"query heads (model.n_head)": self.n_head, "key/value heads (model.n_kv_head)": self.kv_heads,
                 "feed-forward units (model.d_ff)": self.ff_dim, "padded vocabulary rows": self.padded_vocab_size}
        for what, n in sizes.items():
            if n % tp:
                common = math.gcd(*sizes.values())
                fits = ", ".join(str(d) for d in range(1, common + 1) if common % d == 0)
                found = f"{tp} tensor-parallel ranks are more than its {n} {what}" if tp > n else \
                    f"its {n} {what} do not split over {tp} tensor-parallel ranks"
                return f"{found}; a tp that splits this model: {fits}"
        if self.loss_chunk:
            return ("model.loss_chunk cuts the positions into chunks, and the vocabulary-parallel loss needs "
                    "each rank's whole slice of logits; set model.loss_chunk=0 (the logits are 1/tp per rank)")
        return None

    def context_parallel_problem(self) -> str | None:
        return None  # GPT.forward takes a SequenceShard

    def pipeline_problem(self, stages: int) -> str | None:
        """Every stage holds one block or more; the embedding sits on the first stage and the head on the last,
        so they cannot share one weight."""
        if stages > self.n_layer:
            return (f"{stages} pipeline stages (parallel.pp x parallel.pp_stages_per_rank) are more than the "
                    f"model's {self.n_layer} layers (model.n_layer); use at most {self.n_layer}")
        if self.tie_embeddings:
            return ("the token embedding sits on the first pipeline stage and the output head on the last, so "
                    "they cannot share one weight; set model.tie_embeddings=false")
        return None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.logit_softcap < 0:
            raise ConfigError(f"model.logit_softcap: must be >= 0 (0 = off), got {self.logit_softcap}")
        if self.loss_chunk < 0:
            raise ConfigError(f"model.loss_chunk: must be >= 0 (0 turns chunking off), got {self.loss_chunk}")
