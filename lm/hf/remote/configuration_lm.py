"""Configurations of the models `lm` exports as code, when no transformers class computes what the model
computes: the decoder (`LMDecoderConfig`), the masked-LM encoder (`LMEncoderConfig`) and the encoder-decoder
(`LMEncDecConfig`). The keys are lm's `model.*` keys with the values the model was built with (n_kv_head and d_ff
as numbers, never 0 for "the default"); transformers' usual names (hidden_size, num_hidden_layers, ...) read them.
`TransformerConfig` hands those keys to lm's layer files, written beside this one, under the names they read.
"""

from transformers import PretrainedConfig


class LMTransformerConfig(PretrainedConfig):
    """The keys of every lm transformer: sizes, positions, norms, feed-forward and attention options."""

    attribute_map = {"hidden_size": "d_model", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
                     "num_key_value_heads": "n_kv_head", "intermediate_size": "d_ff",
                     "max_position_embeddings": "block_size"}

    def __init__(self, vocab_size: int = 50257, block_size: int = 1024, n_layer: int = 12, n_head: int = 12,
                 n_kv_head: int = 12, d_model: int = 768, d_ff: int = 3072, pos: str = "learned",
                 rope_theta: float = 10000.0, norm: str = "layernorm", norm_eps: float = 1e-5,
                 norm_position: str = "pre", mlp: str = "gelu", bias: bool = True, qkv_bias: bool = False,
                 qk_norm: bool = False, dropout: float = 0.0, tie_word_embeddings: bool = True,
                 initializer_range: float = 0.02, use_cache: bool = True, **kwargs) -> None:
        self.vocab_size, self.block_size, self.n_layer, self.d_model, self.d_ff = (
            vocab_size, block_size, n_layer, d_model, d_ff)
        self.n_head, self.n_kv_head = n_head, n_kv_head
        # learned (a table), sinusoidal (fixed) or rope (rotary, base rope_theta)
        self.pos, self.rope_theta = pos, rope_theta
        # layernorm or rmsnorm; pre (before each sublayer, and a final norm) or post (after each residual add)
        self.norm, self.norm_eps, self.norm_position = norm, norm_eps, norm_position
        # gelu (tanh approximation), relu, relu2 (ReLU squared) or swiglu
        self.mlp = mlp
        # biases everywhere; biases on queries, keys and values alone; RMSNorm on each head's queries and keys
        self.bias, self.qkv_bias, self.qk_norm = bias, qkv_bias, qk_norm
        self.dropout = dropout
        self.initializer_range = initializer_range
        # a decoder's forward given no cache starts one (in eval mode), as transformers' own models do
        self.use_cache = use_cache
        # transformers 4.x's config sets tie_word_embeddings itself (true unless given); 5.x leaves it to the model
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


class LMDecoderConfig(LMTransformerConfig):
    """lm's decoder-only transformer (model.arch gpt); `logit_softcap` c > 0 squashes logits to c * tanh(logits / c)."""

    model_type = "lm_decoder"

    def __init__(self, logit_softcap: float = 0.0, **kwargs) -> None:
        self.logit_softcap = logit_softcap
        super().__init__(**kwargs)


class LMEncoderConfig(LMTransformerConfig):
    """lm's encoder with its masked-LM head (model.arch encoder). Its ids are the tokenizer's, then [MASK]
    (mask_token_id), [CLS] (cls_token_id, every sequence's first token) and padding (pad_token_id)."""

    model_type = "lm_encoder"

    def __init__(self, mask_token_id: int | None = None, cls_token_id: int | None = None, **kwargs) -> None:
        self.mask_token_id, self.cls_token_id = mask_token_id, cls_token_id
        super().__init__(**kwargs)


class LMEncDecConfig(LMTransformerConfig):
    """lm's encoder-decoder (model.arch encdec), n_layer encoder and n_layer decoder blocks. Its ids are the
    tokenizer's, then `n_sentinels` sentinels from `sentinel_start` (sentinel i stands for the i-th masked span), then
    padding (pad_token_id), which also starts every decoder sequence. `share_embeddings`: one token embedding for
    the encoder and the decoder."""

    model_type = "lm_encdec"

    def __init__(self, share_embeddings: bool = True, n_sentinels: int = 100, sentinel_start: int | None = None,
                 **kwargs) -> None:
        self.share_embeddings, self.n_sentinels, self.sentinel_start = share_embeddings, n_sentinels, sentinel_start
        kwargs.setdefault("is_encoder_decoder", True)
        super().__init__(**kwargs)


class TransformerConfig:
    """The options of lm's shared layers (layers.py, attention.py, block.py: lm's own files, which the export copies)
    under the names they read in lm (`lm.models.config.TransformerConfig`), taken from an `LMTransformerConfig`.
    The decoder's own keys (d_head, qk_norm_scope, rope scaling) default to what lm's encoders build with; the
    transformers config keeps rope scaling as rope_scaling_type, since transformers owns rope_scaling."""

    SAME_KEYS = ("d_model", "n_head", "pos", "rope_theta", "norm", "norm_eps", "norm_position", "mlp", "bias",
                 "qkv_bias", "qk_norm", "dropout")

    def __init__(self, config: LMTransformerConfig) -> None:
        for key in self.SAME_KEYS:
            setattr(self, key, getattr(config, key))
        self.kv_heads, self.ff_dim = config.n_kv_head, config.d_ff
        self.head_dim = getattr(config, "d_head", 0) or config.d_model // config.n_head
        self.qk_norm_scope = getattr(config, "qk_norm_scope", "head")
        self.rope_scaling = getattr(config, "rope_scaling_type", "none")
        self.rope_factor = getattr(config, "rope_factor", 1.0)
        self.rope_low_freq_factor = getattr(config, "rope_low_freq_factor", 1.0)
        self.rope_high_freq_factor = getattr(config, "rope_high_freq_factor", 4.0)
        self.rope_original_context = getattr(config, "rope_original_context", 8192)
        # a post-norm block already ends in a norm; the other placements end their stack in one
        self.final_norm = config.norm_position != "post"
