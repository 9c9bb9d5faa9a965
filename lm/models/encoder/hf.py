"""The encoder and transformers: BERT (`BertForMaskedLM`), for the masked-LM head with learned positions,
LayerNorm with biases, post-norm blocks, GELU (tanh approximation, in the blocks and in the head's transform
alike), multi-head attention and an output layer tied to the embedding. Export only."""

from typing import Any

import torch

from lm.hf.targets import ONE_KV_HEAD, Part, Plan, Target, equals
from lm.models.encoder.config import EncoderConfig

__all__ = ["TARGETS"]


def bert_config(cfg: EncoderConfig, eos_token_id: int | None, dtype: torch.dtype) -> dict[str, Any]:
    """BertForMaskedLM's config.json. Its vocabulary is our whole embedding, padding rows included: [MASK],
    [CLS] and padding come after the tokenizer's ids, and keeping every row makes its logits ours exactly.
    Its token-type table has one row, written as zeros (`token_types`), so it adds nothing."""
    return {
        "model_type": "bert",
        "architectures": ["BertForMaskedLM"],
        "vocab_size": cfg.padded_vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "intermediate_size": cfg.ff_dim,
        # our GELU is the tanh approximation, in the blocks and in the MLM head's transform, which BERT
        # also runs with hidden_act
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": cfg.dropout,
        "max_position_embeddings": cfg.block_size,
        "position_embedding_type": "absolute",  # transformers 4.x reads it; 5 has absolute positions only
        "type_vocab_size": 1,
        "layer_norm_eps": cfg.norm_eps,
        "pad_token_id": cfg.pad_id,
        "tie_word_embeddings": True,
        "is_decoder": False,
        "initializer_range": 0.02,
        "dtype": str(dtype).removeprefix("torch."),
    }


def bert_plan(cfg: EncoderConfig) -> Plan:
    """BertForMaskedLM's names. Our q, k and v are query, key and value; each post-norm block's
    ln_1 and ln_2 are the LayerNorms after its attention and its feed-forward. The embedding covers every
    row (see `bert_config`); the tied output layer is the embedding, and its bias is cls.predictions.bias."""
    d, ff = cfg.d_model, cfg.ff_dim
    plan: Plan = {"wte.weight": (Part("bert.embeddings.word_embeddings.weight", cfg.padded_vocab_size),),
                  "wpe.weight": (Part("bert.embeddings.position_embeddings.weight", cfg.block_size),),
                  "lm_head.bias": (Part("cls.predictions.bias", cfg.padded_vocab_size),)}
    layers = {"emb_norm": ("bert.embeddings.LayerNorm", d), "mlm_dense": ("cls.predictions.transform.dense", d),
              "mlm_norm": ("cls.predictions.transform.LayerNorm", d)}
    for i in range(cfg.n_layer):
        ours, theirs = f"blocks.{i}.", f"bert.encoder.layer.{i}."
        attn = f"{theirs}attention.self."
        layers.update({f"{ours}attn.q": (f"{attn}query", d), f"{ours}attn.k": (f"{attn}key", d),
                       f"{ours}attn.v": (f"{attn}value", d),
                       f"{ours}attn.proj": (f"{theirs}attention.output.dense", d),
                       f"{ours}ln_1": (f"{theirs}attention.output.LayerNorm", d),
                       f"{ours}mlp.fc": (f"{theirs}intermediate.dense", ff),
                       f"{ours}mlp.proj": (f"{theirs}output.dense", d),
                       f"{ours}ln_2": (f"{theirs}output.LayerNorm", d)})
    for ours, (theirs, rows) in layers.items():
        for p in ("weight", "bias"):
            plan[f"{ours}.{p}"] = (Part(f"{theirs}.{p}", rows),)
    return plan


def encoding_note(cfg: EncoderConfig, tokenizer: str) -> str:
    """No tokenizer file knows the ids after the tokenizer's: the export says them."""
    return (f"no tokenizer files: encode text with data.tokenizer={tokenizer} and add the ids beyond it: "
            f"[CLS]={cfg.cls_id} first, [MASK]={cfg.mask_id}, padding={cfg.pad_id}")


def token_types(cfg: EncoderConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """BERT's token-type table, which we do not have: one row of zeros."""
    return {"bert.embeddings.token_type_embeddings.weight": weights["wte.weight"].new_zeros(1, cfg.d_model)}


TARGETS = (
    Target("BERT", "BertForMaskedLM", (
        # BertForSequenceClassification puts a tanh pooler layer between [CLS] and its classifier, which our
        # classify and regress heads do not have: only the masked-LM head has a transformers twin.
        equals("head", "mlm"), equals("pos", "learned"), equals("norm", "layernorm"), equals("bias", True),
        equals("norm_position", "post"), equals("mlp", "gelu"),
        ONE_KV_HEAD,
        # BertForMaskedLM's output layer is the word embedding plus a bias of its own. Untied, transformers 5
        # unties that bias as well (decoder.bias apart from cls.predictions.bias), 4.x keeps one: refused.
        equals("tie_embeddings", True),
    ), bert_config, bert_plan, extra=token_types, tokenizer_files=False, note=encoding_note),
)
