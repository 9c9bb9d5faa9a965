"""Numerical parity with Hugging Face transformers: our GPT and the transformers model built from the export
mapping (the family's `Target`: its config.json and `hf_state_dict`) give the same logits to 1e-5 on CPU in
float32."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from lm.config import load_config
from lm.errors import ExportError
from lm.hf.targets import Target, hf_state_dict, pick_target
from lm.models.gpt import hf as gpt_hf
from lm.models.gpt.config import GPTConfig
from lm.models.gpt.model import GPT
from lm.models.registry import family_of

VOCAB = 300  # not a multiple of 64: the mapping must drop our 20 padding rows
GPT2 = {}
LLAMA = dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_head=2, d_ff=96, rope_theta=500.0,
             tie_embeddings=False)


def tiny_config(**overrides: object) -> GPTConfig:
    fields = dict(vocab_size=VOCAB, block_size=32, n_layer=2, n_head=4, d_model=64, norm_eps=1e-5)
    fields.update(overrides)
    return GPTConfig(**fields)


def target(cfg: GPTConfig) -> Target:
    return pick_target(cfg, family_of(cfg).hf.targets, cfg.title)


def random_model(cfg: GPTConfig, seed: int = 0) -> torch.nn.Module:
    """The model `cfg` describes with every parameter drawn anew, biases and norm gains included: zero biases
    or unit gains (the init) would let a dropped or misplaced tensor go unnoticed. Gains centre on 1 so
    logits stay O(1)."""
    torch.manual_seed(seed)
    model = family_of(cfg).build(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_gain = name.endswith(".weight") and p.dim() == 1
            p.normal_(1.0 if is_gain else 0.0, 0.2 if is_gain else 0.1)
    return model.eval()


def hf_model(model: GPT, attn: str = "eager") -> PreTrainedModel:
    """The transformers model our mapping describes, holding our weights."""
    fields = target(model.cfg).config(model.cfg, None, torch.float32)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
    missing, unexpected = hf.load_state_dict(hf_state_dict(model, target(model.cfg)), strict=False)
    assert unexpected == []
    # A tied head is not written: transformers ties lm_head to the embedding itself.
    assert missing == (["lm_head.weight"] if model.cfg.tie_embeddings else [])
    if model.cfg.tie_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.get_input_embeddings().weight.data_ptr()
    return hf


def assert_same_logits(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Our logits over the tokenizer's ids equal transformers' to 1e-5, and are not trivially small."""
    assert ours.shape[-1] == tiny_config().padded_vocab_size and theirs.shape[-1] == VOCAB
    assert theirs.std() > 0.3
    torch.testing.assert_close(ours[..., :VOCAB], theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("overrides", [
    GPT2,
    dict(tie_embeddings=False, d_ff=96, norm_eps=1e-6),  # n_inner and an untied head pass through
], ids=["gpt2", "gpt2-untied-dff"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_gpt2_logits_match_transformers(overrides, attn):
    model = random_model(tiny_config(**overrides))
    hf = hf_model(model, attn)
    assert type(hf).__name__ == "GPT2LMHeadModel"
    idx = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_same_logits(model.logits(model(idx)), hf(idx).logits)


@pytest.mark.parametrize("overrides", [
    LLAMA,
    {**LLAMA, "tie_embeddings": True},
    {**LLAMA, "bias": True, "n_kv_head": 0},  # attention_bias, mlp_bias; multi-head attention
    {**LLAMA, "n_kv_head": 1, "d_ff": 0},  # multi-query attention; default SwiGLU width
], ids=["gqa-untied", "gqa-tied", "mha-bias", "mqa"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_llama_logits_match_transformers(overrides, attn):
    model = random_model(tiny_config(**overrides))
    hf = hf_model(model, attn)
    assert type(hf).__name__ == "LlamaForCausalLM"
    idx = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_same_logits(model.logits(model(idx)), hf(idx).logits)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_qwen2_logits_match_transformers(attn):
    # biases on q/k/v alone: neither GPT-2 (biases everywhere) nor Llama (on every projection or none)
    model = random_model(tiny_config(**{**LLAMA, "qkv_bias": True, "tie_embeddings": True}))
    hf = hf_model(model, attn)
    assert type(hf).__name__ == "Qwen2ForCausalLM" and hf.model.layers[0].self_attn.o_proj.bias is None
    idx = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_same_logits(model.logits(model(idx)), hf(idx).logits)


QWEN3 = {**LLAMA, "qk_norm": True, "d_head": 24}  # q and k are 4 * 24 = 96 wide, not d_model
OLMO2 = {**LLAMA, "qk_norm": True, "qk_norm_scope": "all", "norm_position": "output"}
LLAMA3 = {**LLAMA, "rope_scaling": "llama3", "rope_factor": 8.0, "rope_low_freq_factor": 1.0,
          "rope_high_freq_factor": 4.0, "rope_original_context": 8, "rope_theta": 10000.0, "tie_embeddings": True}


@pytest.mark.parametrize("overrides, hf_class", [
    (QWEN3, "Qwen3ForCausalLM"),
    ({**QWEN3, "tie_embeddings": True, "d_head": 0, "n_kv_head": 1}, "Qwen3ForCausalLM"),
    (OLMO2, "Olmo2ForCausalLM"),
    # every wavelength band of Llama 3.1's scaling occurs in a 32-token window with an 8-token original context
    (LLAMA3, "LlamaForCausalLM"),
    ({**LLAMA, "rope_scaling": "linear", "rope_factor": 4.0}, "LlamaForCausalLM"),
    ({**QWEN3, "rope_scaling": "linear", "rope_factor": 2.0}, "Qwen3ForCausalLM"),
    ({**LLAMA, "nope_interval": 2, "tie_embeddings": True}, "SmolLM3ForCausalLM"),
], ids=["qwen3", "qwen3-tied-mqa", "olmo2", "llama3-scaling", "llama-linear", "qwen3-linear", "smollm3"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_newer_families_match_transformers(overrides, hf_class, attn):
    model = random_model(tiny_config(**overrides))
    hf = hf_model(model, attn)
    assert type(hf).__name__ == hf_class
    idx = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_same_logits(model.logits(model(idx)), hf(idx).logits)


def test_llama3_scaling_changes_the_logits_past_the_original_context():
    """The scaled frequencies matter: without them the same weights give other logits."""
    scaled = random_model(tiny_config(**LLAMA3))
    plain = tiny_config(**{**LLAMA3, "rope_scaling": "none"})
    unscaled = family_of(plain).build(plain).eval()
    unscaled.load_state_dict(scaled.state_dict())
    idx = torch.randint(0, VOCAB, (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (scaled.logits(scaled(idx)) - unscaled.logits(unscaled(idx))).abs().max() > 1e-2


@pytest.mark.parametrize("overrides", [GPT2, LLAMA, QWEN3, OLMO2, {**LLAMA, "nope_interval": 2}],
                         ids=["gpt2", "llama", "qwen3", "olmo2", "smollm3"])
def test_incremental_decoding_matches_a_full_transformers_forward(overrides):
    """Our KV-cached decoding (a prompt, then single tokens, then a chunk after a non-empty cache) gives
    the logits transformers computes for the whole sequence at once."""
    model = random_model(tiny_config(**overrides))
    hf = hf_model(model)
    idx = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(2))
    cache = model.new_cache(batch_size=2, max_len=20)
    pieces = [(0, 8), *((t, t + 1) for t in range(8, 16)), (16, 20)]
    with torch.no_grad():
        ours = torch.cat([model.logits(model(idx[:, a:b], cache=cache)) for a, b in pieces], dim=1)
        assert_same_logits(ours, hf(idx).logits)
    assert cache.length == 20


def test_vocabulary_is_the_tokenizers_and_tied_heads_are_written_once():
    tied = hf_state_dict(random_model(tiny_config()), target(tiny_config()))
    assert tied["transformer.wte.weight"].shape == (VOCAB, 64) and "lm_head.weight" not in tied
    untied = hf_state_dict(random_model(tiny_config(**LLAMA)), target(tiny_config(**LLAMA)))
    assert untied["lm_head.weight"].shape == untied["model.embed_tokens.weight"].shape == (VOCAB, 64)
    assert untied["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 16, 64)
    pointers = [t.untyped_storage().data_ptr() for t in untied.values()]
    assert len(set(pointers)) == len(pointers)  # safetensors refuses shared storage
    config = target(tiny_config(**LLAMA)).config(tiny_config(**LLAMA), None, torch.float32)
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 500.0}
    assert config["rope_theta"] == 500.0 and config["num_key_value_heads"] == 2
    assert config["rope_scaling"] is None


@pytest.mark.parametrize("scaled", [LLAMA3, {**LLAMA, "rope_scaling": "linear", "rope_factor": 4.0}],
                         ids=["llama3", "linear"])
def test_a_scaled_rope_is_written_for_transformers_4_too(scaled):
    # transformers 5 reads rope_parameters, 4.x the top-level rope_scaling: without it a 4.x reader loads the model
    # unscaled, and its logits past the original context go wrong without a word
    config = target(tiny_config(**scaled)).config(tiny_config(**scaled), None, torch.float32)
    assert config["rope_scaling"] == config["rope_parameters"] and config["rope_parameters"]["rope_type"] != "default"


@pytest.mark.parametrize("overrides, fragments", [
    (dict(pos="sinusoidal"), [
        "(model.pos=sinusoidal, model.norm=layernorm, model.mlp=gelu, model.bias=true, model.qkv_bias=false, ",
        "GPT2LMHeadModel (GPT-2) needs model.pos=learned;",
        "LlamaForCausalLM (Llama) needs model.pos=rope, model.norm=rmsnorm, model.mlp=swiglu",
    ]),
    (dict(norm="rmsnorm"), [
        "(model.norm=rmsnorm, model.pos=learned, model.mlp=gelu, model.bias=true, model.qkv_bias=false, ",
        "GPT2LMHeadModel (GPT-2) needs model.norm=layernorm;",
        "LlamaForCausalLM (Llama) needs model.pos=rope, model.mlp=swiglu",
    ]),
    ({**LLAMA, "norm_position": "post"}, ["model.norm_position=post", "needs model.norm_position=pre"]),
    (dict(mlp="relu"), ["GPT2LMHeadModel (GPT-2) needs model.mlp=gelu;"]),
    (dict(n_kv_head=2), ["GPT2LMHeadModel (GPT-2) needs model.n_kv_head=0 (one key/value head per query head)"]),
    (dict(bias=False), ["GPT2LMHeadModel (GPT-2) needs model.bias=true;"]),
], ids=["sinusoidal", "rmsnorm-learned", "post-norm", "relu", "gpt2-gqa", "gpt2-no-bias"])
def test_configs_no_native_class_computes_name_their_keys_and_export_as_lm_code(overrides, fragments):
    """The native classes refuse by name what they do not compute; the family's last target, lm's own code
    (tests/hf/test_remote_code.py), takes it."""
    cfg = tiny_config(**overrides)
    with pytest.raises(ExportError) as err:
        pick_target(cfg, gpt_hf.TARGETS, cfg.title)
    assert target(cfg).hf_class == "LMDecoderForCausalLM"
    message = str(err.value)
    assert message.startswith("cannot export to Hugging Face: no transformers model has this combination")
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message


def test_each_config_maps_to_one_target():
    assert target(tiny_config()).name == "GPT-2" and target(tiny_config(**LLAMA)).name == "Llama"
    assert target(tiny_config(**LLAMA, qkv_bias=True)).name == "Qwen2"
    # biases everywhere already include q/k/v: still Llama's attention_bias and mlp_bias
    assert target(tiny_config(**{**LLAMA, "bias": True}, qkv_bias=True)).name == "Llama"
    assert target(tiny_config(**QWEN3)).name == "Qwen3" and target(tiny_config(**OLMO2)).name == "OLMo 2"
    assert target(tiny_config(**LLAMA3)).name == "Llama"


def test_a_family_without_a_transformers_class_is_refused_by_name():
    cfg = load_config(None, ["--model.arch=lstm"]).model
    with pytest.raises(ExportError, match=r"cannot export to Hugging Face: an LSTM \(model.arch=lstm\) has no "
                                          "transformers counterpart"):
        pick_target(cfg, family_of(cfg).hf.targets, cfg.title)
