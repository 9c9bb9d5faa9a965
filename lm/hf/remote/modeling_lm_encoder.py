"""lm's encoder with its masked-LM head (model.arch encoder, head mlm) as a transformers model, for the
configurations BERT does not compute (rotary or sinusoidal positions, pre-norm, RMSNorm, another MLP, grouped-query
heads, no biases, an untied output layer). `lm.export` writes this file beside the weights;
`AutoModelForMaskedLM.from_pretrained(path, trust_remote_code=True)` loads it, and its logits are lm's.

Token embeddings (plus learned or sinusoidal positions, or rotary positions inside attention) are normalised and
feed n_layer bidirectional blocks (lm's own block.py, written beside this file), then a final norm (pre-norm
models); the head is dense, GELU (tanh approximation), norm and the output layer. The model always saw [CLS]
(config.cls_token_id) first: put it in front of every sequence.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.modeling_outputs import MaskedLMOutput

from .block import Block
from .configuration_lm import LMEncoderConfig, TransformerConfig
from .hf_glue import TokenEmbeddings, key_mask
from .layers import add_positions, make_norm


class LMEncoderForMaskedLM(TokenEmbeddings, PreTrainedModel):
    """The encoder and its masked-LM head; parameter names are lm's own (wte, wpe, emb_norm, blocks.<i>..., ln_f,
    mlm_dense, mlm_norm, lm_head)."""

    config_class = LMEncoderConfig
    base_model_prefix = "lm_encoder"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    _supports_sdpa = True  # attention is torch's scaled_dot_product_attention, whatever attn_implementation says

    def __init__(self, config: LMEncoderConfig) -> None:
        super().__init__(config)
        self.layer_config = layers = TransformerConfig(config)
        d = config.d_model
        self.wte = nn.Embedding(config.vocab_size, d)
        if config.pos == "learned":
            self.wpe = nn.Embedding(config.block_size, d)
        self.emb_norm = make_norm(layers)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(layers, causal=False) for _ in range(config.n_layer))
        self.ln_f = make_norm(layers) if layers.final_norm else nn.Identity()
        self.mlm_dense = nn.Linear(d, d, bias=config.bias)
        self.mlm_norm = make_norm(layers)
        self.lm_head = nn.Linear(d, config.vocab_size, bias=config.bias)
        # a tied output layer's weight is the embedding (its bias is its own): the weights file holds it once
        self._tied_weights_keys = {"lm_head.weight": "wte.weight"} if config.tie_word_embeddings else {}
        self.post_init()

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None, **kwargs) -> MaskedLMOutput:
        """Logits (B, T, vocab_size) of input_ids (B, T); attention_mask (B, T): 1 for real tokens, 0 for padding,
        which no position attends to. labels (B, T): the original ids at the masked positions, -100 elsewhere."""
        cfg = self.config
        T = input_ids.size(1)
        if T > cfg.block_size:
            raise ValueError(f"sequence of {T} tokens exceeds the model's block_size={cfg.block_size}")
        positions = torch.arange(T, device=input_ids.device)
        x, rope = add_positions(self.wte(input_ids), positions, self.layer_config, getattr(self, "wpe", None))
        x = self.drop(self.emb_norm(x))  # (B, T, C)
        mask = key_mask(attention_mask)  # (B, 1, 1, T) or None
        for block in self.blocks:
            x = block(x, rope=rope, mask=mask)
        h = self.ln_f(x)
        logits = self.lm_head(self.mlm_norm(F.gelu(self.mlm_dense(h), approximate="tanh")))  # (B, T, vocab_size)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
        return MaskedLMOutput(loss=loss, logits=logits)
