"""lm's decoder-only transformer (model.arch gpt) as a transformers model, for the configurations no transformers
class computes (QK-norm, a ReLU squared MLP, post-norm blocks, sinusoidal positions, a logit soft-cap, ...).
`lm.export` writes this file beside the weights; `AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`
loads it, and its logits are lm's.

Token embeddings (plus learned or sinusoidal positions, or rotary positions inside attention) feed n_layer causal
blocks (lm's own block.py, written beside this file), then a final norm (pre-norm models) and the output layer,
tied to the embedding or not. `generate` keeps each layer's keys and values in transformers' cache; a batch of
prompts may be left-padded (attention_mask), each row then getting the positions it has alone.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .block import Block
from .configuration_lm import LMDecoderConfig, TransformerConfig
from .hf_glue import TokenEmbeddings, layer_caches, output_with_cache, padded_causal_mask, token_positions, wants_cache
from .layers import add_positions, make_norm


class LMDecoderForCausalLM(TokenEmbeddings, PreTrainedModel, GenerationMixin):
    """The decoder and its output layer; parameter names are lm's own (wte, wpe, blocks.<i>..., ln_f, lm_head)."""

    config_class = LMDecoderConfig
    base_model_prefix = "lm_decoder"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    _supports_sdpa = True  # attention is torch's scaled_dot_product_attention, whatever attn_implementation says

    def __init__(self, config: LMDecoderConfig) -> None:
        super().__init__(config)
        self.layer_config = TransformerConfig(config)
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        if config.pos == "learned":
            self.wpe = nn.Embedding(config.block_size, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(self.layer_config, causal=True) for _ in range(config.n_layer))
        self.ln_f = make_norm(self.layer_config) if self.layer_config.final_norm else nn.Identity()
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        # a tied output layer is the embedding: the weights file holds it once
        self._tied_weights_keys = {"lm_head.weight": "wte.weight"} if config.tie_word_embeddings else {}
        self.post_init()

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache=None, labels: torch.LongTensor | None = None,
                use_cache: bool | None = None, past_key_values=None, **kwargs) -> CausalLMOutputWithPast:
        """Logits (B, T, vocab_size) of input_ids (B, T), after the positions already in `cache` when one is given
        (transformers 4.x passes it as past_key_values), else kept in a new cache when use_cache asks for one
        (`wants_cache`). attention_mask (B, past + T): 1 for real tokens, 0 for padding. labels (B, T): the loss is
        the mean cross-entropy of each next token, -100 ignored."""
        cfg = self.config
        cache = cache if cache is not None else past_key_values
        if cache is None and wants_cache(use_cache, cfg, self.training):
            cache = DynamicCache()  # a first call starts the cache the next call continues
        past = cache.get_seq_length() if cache is not None else 0
        T = input_ids.size(1)
        if past + T > cfg.block_size:
            raise ValueError(f"sequence of {past + T} tokens ({past} cached + {T} new) exceeds the model's "
                             f"block_size={cfg.block_size}")
        positions = token_positions(attention_mask, position_ids, past, T, input_ids.device)  # (T,) or (B, T)
        x, rope = add_positions(self.wte(input_ids), positions, self.layer_config, getattr(self, "wpe", None))
        x = self.drop(x)  # (B, T, C)
        mask = padded_causal_mask(attention_mask, past, T, input_ids.device)
        for i, (block, layer_cache) in enumerate(zip(self.blocks, layer_caches(cache, cfg.n_layer))):
            rotary = not (cfg.nope_interval and (i + 1) % cfg.nope_interval == 0)  # every n-th layer: no positions
            x = block(x, rope=rope if rotary else None, cache=layer_cache, mask=mask)
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab_size)
        if cfg.logit_softcap:
            logits = cfg.logit_softcap * torch.tanh(logits.float() / cfg.logit_softcap)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return output_with_cache(CausalLMOutputWithPast, cache if use_cache is not False else None, loss=loss,
                                 logits=logits)
