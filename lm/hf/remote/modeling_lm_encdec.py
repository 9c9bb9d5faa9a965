"""lm's encoder-decoder (model.arch encdec: the transformer of "Attention Is All You Need", pretrained by span
corruption) as a transformers model. `lm.export` writes this file beside the weights;
`AutoModelForSeq2SeqLM.from_pretrained(path, trust_remote_code=True)` loads it, and its logits are lm's.

Token embeddings scaled by sqrt(d_model) plus sinusoidal or learned positions feed n_layer encoder blocks; the
decoder's n_layer blocks add cross-attention to the encoder's output (lm's own block.py, written beside this file);
a pre-norm stack ends in a norm of its own. The source is text with sentinel ids (config.sentinel_start + i) where
spans are missing; the decoder starts from the padding id (config.pad_token_id, generation's decoder_start_token_id)
and writes each sentinel followed by its span. `generate` encodes the source once and caches the decoder's own keys
and values; the cross-attention keys and values are projected from the encoder's output at every step.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import DynamicCache, EncoderDecoderCache, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, Seq2SeqLMOutput

from .block import Block
from .configuration_lm import LMEncDecConfig, TransformerConfig
from .hf_glue import key_mask, layer_caches, output_with_cache, wants_cache
from .layers import add_positions, make_norm


def embed(ids: torch.Tensor, table: nn.Embedding, pos_table: nn.Embedding | None, start: int,
          config: TransformerConfig, block_size: int) -> torch.Tensor:
    """ids (B, T) at positions start.. -> (B, T, C): the token embedding scaled by sqrt(d_model), plus positions."""
    T = ids.size(1)
    if start + T > block_size:
        raise ValueError(f"sequence of {start + T} tokens exceeds the model's block_size={block_size}")
    positions = torch.arange(start, start + T, device=ids.device)
    x, _ = add_positions(table(ids) * math.sqrt(config.d_model), positions, config, pos_table)
    return x


class LMEncDecEncoder(nn.Module):
    """The encoder stack with its token embedding (the one both stacks read, with share_embeddings)."""

    main_input_name = "input_ids"

    def __init__(self, config: LMEncDecConfig) -> None:
        super().__init__()
        self.config, self.layer_config = config, TransformerConfig(config)
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        if config.pos == "learned":
            self.pos = nn.Embedding(config.block_size, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(self.layer_config, causal=False) for _ in range(config.n_layer))
        self.norm = make_norm(self.layer_config) if self.layer_config.final_norm else nn.Identity()

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                **kwargs) -> BaseModelOutput:
        """The encoder's output (B, S, C) for source ids (B, S); attention_mask (B, S): 1 for real tokens, 0 for
        padding, which no position attends to."""
        x = self.drop(embed(input_ids, self.embed, getattr(self, "pos", None), 0, self.layer_config,
                            self.config.block_size))
        mask = key_mask(attention_mask)  # (B, 1, 1, S) or None
        for block in self.blocks:
            x = block(x, mask=mask)
        return BaseModelOutput(last_hidden_state=self.norm(x))


class LMEncDecDecoder(nn.Module):
    """The decoder stack, with a token embedding of its own unless it shares the encoder's (share_embeddings)."""

    def __init__(self, config: LMEncDecConfig) -> None:
        super().__init__()
        self.config, self.layer_config = config, TransformerConfig(config)
        if not config.share_embeddings:
            self.embed = nn.Embedding(config.vocab_size, config.d_model)
        if config.pos == "learned":
            self.pos = nn.Embedding(config.block_size, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(self.layer_config, causal=True, cross=True) for _ in range(config.n_layer))
        self.norm = make_norm(self.layer_config) if self.layer_config.final_norm else nn.Identity()

    def forward(self, input_ids: torch.LongTensor, table: nn.Embedding, memory: torch.Tensor,
                memory_mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """Hidden states (B, T, C) of decoder inputs (B, T), embedded by `table`, after the positions already in
        `cache`, over the encoder's output memory (B, S, C) with its padding memory_mask (B, 1, 1, S) or None."""
        past = cache.get_seq_length() if cache is not None else 0
        x = self.drop(embed(input_ids, table, getattr(self, "pos", None), past, self.layer_config,
                            self.config.block_size))
        for block, layer_cache in zip(self.blocks, layer_caches(cache, self.config.n_layer)):
            x = block(x, cache=layer_cache, memory=memory, memory_mask=memory_mask)
        return self.norm(x)


class LMEncDecForConditionalGeneration(PreTrainedModel, GenerationMixin):
    """Encoder, decoder and output layer. Parameters keep lm's names inside each stack (blocks.<i>.attn.q, ...
    cross.kv, mlp.fc); the stacks' embeddings, positions and final norms are encoder.embed, encoder.pos,
    encoder.norm and the decoder's alike (decoder.embed only when the stacks do not share one)."""

    config_class = LMEncDecConfig
    base_model_prefix = "lm_encdec"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    _supports_sdpa = True  # attention is torch's scaled_dot_product_attention, whatever attn_implementation says

    def __init__(self, config: LMEncDecConfig) -> None:
        super().__init__(config)
        self.encoder = LMEncDecEncoder(config)
        self.decoder = LMEncDecDecoder(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        # a tied output layer is the decoder's embedding: the weights file holds it once
        self._tied_weights_keys = {"lm_head.weight": f"{self.target_embedding_name}.weight"} \
            if config.tie_word_embeddings else {}
        self.post_init()

    @property
    def target_embedding_name(self) -> str:
        """The decoder's token embedding: its own, or the encoder's when the stacks share one."""
        return "encoder.embed" if self.config.share_embeddings else "decoder.embed"

    def get_encoder(self) -> LMEncDecEncoder:
        return self.encoder

    def get_decoder(self) -> LMEncDecDecoder:
        return self.decoder

    def get_input_embeddings(self) -> nn.Embedding:
        return self.get_submodule(self.target_embedding_name)

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                decoder_input_ids: torch.LongTensor | None = None, encoder_outputs=None, cache=None,
                labels: torch.LongTensor | None = None, use_cache: bool | None = None, past_key_values=None,
                **kwargs) -> Seq2SeqLMOutput:
        """Logits (B, T, vocab_size) of decoder inputs decoder_input_ids (B, T) over the source input_ids (B, S)
        (or its encoder_outputs), after the decoder positions already in `cache` when one is given (transformers
        4.x passes it as past_key_values), else kept in a new cache when use_cache asks for one (`wants_cache`).
        Without decoder inputs, labels (B, T) shifted right behind the start id; the loss is the mean cross-entropy
        of the labels, -100 ignored."""
        cfg = self.config
        if encoder_outputs is None:
            encoder_outputs = self.encoder(input_ids, attention_mask)
        memory = encoder_outputs[0]  # (B, S, C)
        if decoder_input_ids is None:
            shifted = torch.cat([labels.new_full((labels.size(0), 1), cfg.pad_token_id), labels[:, :-1]], dim=1)
            decoder_input_ids = shifted.masked_fill(shifted == -100, cfg.pad_token_id)
        cache = cache if cache is not None else past_key_values
        if cache is None and wants_cache(use_cache, cfg, self.training):
            cache = EncoderDecoderCache(DynamicCache(), DynamicCache())  # the cache the next call continues
        # an encoder-decoder cache keeps self-attention's keys and values apart from cross-attention's
        self_cache = getattr(cache, "self_attention_cache", cache)
        h = self.decoder(decoder_input_ids, self.get_input_embeddings(), memory, key_mask(attention_mask), self_cache)
        logits = self.lm_head(h)  # (B, T, vocab_size)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
        return output_with_cache(Seq2SeqLMOutput, cache if use_cache is not False else None, loss=loss,
                                 logits=logits, encoder_last_hidden_state=memory)
