"""Importing transformers checkpoints: small random models of each supported class, built with `from_config`
and written with `save_pretrained` (whole and sharded), give our model their logits to 1e-5, and round
trip through the export."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from lm.checkpoint.loading import load_for_inference
from lm.errors import CheckpointError, ConfigError
from lm.hf.import_weights import load_hf_weights
from lm.hf.targets import Part, Target, hf_state_dict, pick_target, row_spans, split_rows
from lm.models.gpt.config import GPTConfig
from lm.models.gpt.model import GPT
from lm.models.hf_checkpoint import read_hf_model
from lm.models.registry import get_family

VOCAB = 300  # not a multiple of 64: an imported model keeps exactly these rows
ROTARY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-6)
CLASSES = {
    "gpt2": ("gpt2", dict(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=4, n_inner=96,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "gpt2-untied": ("gpt2", dict(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                 tie_word_embeddings=False)),
    "llama": ("llama", {**ROTARY, "rope_theta": 500.0}),
    "llama-bias-tied": ("llama", {**ROTARY, "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}),
    "mistral": ("mistral", {**ROTARY, "sliding_window": None, "head_dim": 16}),
    "qwen2": ("qwen2", {**ROTARY, "tie_word_embeddings": True}),
    # Qwen3's heads are 24 wide here: q and k are 96, not hidden_size, wide; per-head q/k norms
    "qwen3": ("qwen3", {**ROTARY, "head_dim": 24, "tie_word_embeddings": False}),
    "olmo2": ("olmo2", {**ROTARY}),  # post-sublayer norms, q/k norms over the whole projection
    "smollm3": ("smollm3", {**ROTARY, "num_hidden_layers": 4, "no_rope_layer_interval": 2,
                             "pad_token_id": None}),  # layers 2, 4: NoPE
    # Llama 3.2's shape: tied, rope_type llama3; a window of 32 is 4x its 8-position original context
    "llama3": ("llama", {**ROTARY, "tie_word_embeddings": True, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8}}),
}


def hf_checkpoint(kind: str, directory: Path, shard: str | None = None, seed: int = 0,
                  classes: dict[str, tuple[str, dict]] = CLASSES) -> PreTrainedModel:
    """A random transformers model of `kind` (of `classes`: model_type and config fields) saved into `directory`
    (sharded into files of at most `shard`). Every parameter is drawn anew, biases and gains included: the init's
    zeros and ones would hide a misplaced tensor."""
    model_type, fields = classes[kind]
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields), attn_implementation="eager")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            is_gain = p.dim() == 1 and not name.endswith("bias")
            p.normal_(1.0 if is_gain else 0.0, 0.2 if is_gain else 0.1)
    hf.save_pretrained(directory, **({"max_shard_size": shard} if shard else {}))
    return hf.eval()


def imported(directory: Path) -> GPT:
    source = read_hf_model(directory)
    assert source.arch == "gpt"
    model = GPT(GPTConfig(**source.fields))
    load_hf_weights(source, model)
    return model.eval()


def target(cfg: GPTConfig) -> Target:
    return pick_target(cfg, get_family("gpt").hf.targets, cfg.title)


def assert_same_logits(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape and theirs.std() > 0.3
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", CLASSES)
def test_imported_models_give_transformers_logits(kind, tmp_path):
    hf = hf_checkpoint(kind, tmp_path)
    model = imported(tmp_path)
    assert model.cfg.padded_vocab_size == VOCAB  # no padding rows in the softmax
    idx = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_same_logits(model.logits(model(idx)), hf(idx).logits)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2", "qwen3", "olmo2", "llama3", "smollm3"])
def test_a_sharded_save_imports_alike_and_decodes_through_the_kv_cache(kind, tmp_path):
    hf = hf_checkpoint(kind, tmp_path, shard="20KB")
    assert len(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]) > 10
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    model = imported(tmp_path)
    idx = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(2))
    cache = model.new_cache(batch_size=2, max_len=20)
    with torch.no_grad():
        # a prompt, then single tokens, then a chunk after a non-empty cache
        ours = torch.cat([model.logits(model(idx[:, a:b], cache=cache))
                          for a, b in [(0, 8), (8, 9), (9, 10), (10, 20)]], 1)
        assert_same_logits(ours, hf(idx).logits)


FIELDS = {"norm_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings", "block_size": "max_position_embeddings",
          "n_layer": "num_hidden_layers", "d_model": "hidden_size", "n_head": "num_attention_heads",
          "n_kv_head": "num_key_value_heads", "d_ff": "intermediate_size", "vocab_size": "vocab_size"}


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "olmo2", "smollm3", "mixtral",
                                        "qwen3_moe", "olmoe"])
@pytest.mark.parametrize("n_head", [None, 8])
def test_a_key_a_config_json_leaves_out_has_the_classs_default_as_in_transformers(model_type, n_head, tmp_path):
    # OLMo 2's rms_norm_eps is 1e-5 and SmolLM3 ties its embeddings by default; one default for every class had
    # imported other logits, or refused the weights
    given = {"model_type": model_type} | ({"num_attention_heads": n_head} if n_head else {})
    if model_type == "mistral":  # its default window, 4096, binds below its default context: refused (below)
        given["sliding_window"] = None
    (tmp_path / "config.json").write_text(json.dumps(given))
    fields, hf = read_hf_model(tmp_path).fields, AutoConfig.for_model(**given)
    assert {ours: fields[ours] for ours in FIELDS} == {ours: getattr(hf, theirs) for ours, theirs in FIELDS.items()}
    # the head width: Qwen3's default is 128 whatever the heads, the others' d_model / n_head
    width = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert (fields.get("d_head") or fields["d_model"] // fields["n_head"]) == width


def test_an_original_gpt2_config_without_newer_keys_imports_with_the_classs_defaults(tmp_path):
    # OpenAI's GPT-2 config.json names no tie_word_embeddings (tied) and its dropouts are 0.1
    given = {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 50257}
    (tmp_path / "config.json").write_text(json.dumps(given))
    fields, hf = read_hf_model(tmp_path).fields, AutoConfig.for_model(**given)
    assert fields["tie_embeddings"] is hf.tie_word_embeddings is True
    assert fields["dropout"] == hf.resid_pdrop == 0.1
    assert (fields["block_size"], fields["norm_eps"]) == (hf.n_positions, hf.layer_norm_epsilon)


def test_a_directory_holding_one_file_and_a_sharded_save_is_read_as_transformers_reads_it(tmp_path):
    # an export with --force over a sharded save leaves the index and its shards beside the new model.safetensors
    hf_checkpoint("llama", tmp_path / "old", shard="20KB")
    hf = hf_checkpoint("llama", tmp_path / "new", seed=1)
    for shard in [*(tmp_path / "old").glob("model-*.safetensors"), tmp_path / "old/model.safetensors.index.json"]:
        shard.rename(tmp_path / "new" / shard.name)
    again = type(hf).from_pretrained(tmp_path / "new", attn_implementation="eager").eval()
    model = imported(tmp_path / "new")
    idx = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(again(idx).logits, hf(idx).logits)  # transformers reads model.safetensors
        assert_same_logits(model.logits(model(idx)), hf(idx).logits)


@pytest.mark.parametrize("kind", ["gpt2-untied", "llama", "qwen2", "mistral", "qwen3", "olmo2", "llama3", "smollm3"])
def test_import_then_export_gives_back_the_same_tensors(kind, tmp_path):
    hf = hf_checkpoint(kind, tmp_path)
    model = imported(tmp_path)
    exported = hf_state_dict(model, target(model.cfg))
    theirs = {name: t for name, t in hf.state_dict().items()
              if not (hf.config.tie_word_embeddings and name == "lm_head.weight")}
    assert sorted(exported) == sorted(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(exported[name], tensor), name


@pytest.mark.parametrize("overrides", [
    {},
    dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_head=2, d_ff=96, tie_embeddings=False),
    dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, qkv_bias=True, n_kv_head=1),
], ids=["gpt2", "llama", "qwen2"])
def test_export_then_import_gives_our_logits(overrides, tmp_path):
    # our own model pads its vocabulary to 64 rows; the export drops the padding and the import keeps none
    cfg = GPTConfig(vocab_size=VOCAB, block_size=32, n_layer=2, n_head=4, d_model=64, **overrides)
    torch.manual_seed(3)
    ours = GPT(cfg).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # biases and gains off their init
    (tmp_path / "config.json").write_text(json.dumps(target(cfg).config(cfg, None, torch.float32)))
    save_file(hf_state_dict(ours, target(cfg)), tmp_path / "model.safetensors", metadata={"format": "pt"})
    again = imported(tmp_path)
    idx = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert_same_logits(again.logits(again(idx)), ours.logits(ours(idx))[..., :VOCAB])


def test_weights_of_another_precision_are_cast_to_the_models(tmp_path):
    hf = hf_checkpoint("llama", tmp_path)
    hf.to(torch.bfloat16).save_pretrained(tmp_path)
    model = imported(tmp_path)
    assert model.wte.weight.dtype == torch.float32
    assert torch.equal(model.wte.weight, hf.model.embed_tokens.weight.float())


def test_row_spans_cut_a_rank_block_across_the_stored_tensors():
    parts = (Part("q", 8), Part("k", 4), Part("v", 4))
    assert row_spans(parts, 0, 16) == [(parts[0], 0, 8), (parts[1], 0, 4), (parts[2], 0, 4)]
    assert row_spans(parts, 6, 10) == [(parts[0], 6, 8), (parts[1], 0, 2)]
    assert row_spans(parts, 12, 16) == [(parts[2], 0, 4)]
    assert row_spans(parts, 16, 16) == []  # the empty last block of an uneven FSDP split


def test_a_slab_part_is_one_expert_of_a_stacked_weight_stored_as_a_linear():
    stacked = torch.arange(2 * 3 * 5.0).reshape(2, 3, 5)  # (experts, in, out), as our Experts keep w_in
    parts = (Part("experts.0.up_proj.weight", 1, transposed=True, slab=True),
             Part("experts.1.up_proj.weight", 1, transposed=True, slab=True))
    assert [part.stored_shape((3, 5)) for part in parts] == [(5, 3), (5, 3)]  # a Linear's (out, in)
    assert [(part, piece.tolist()) for part, piece in split_rows(stacked, parts)] == \
        [(parts[0], stacked[0].t().tolist()), (parts[1], stacked[1].t().tolist())]
    assert row_spans(parts, 1, 2) == [(parts[1], 0, 1)]  # an FSDP rank holding the second expert reads its tensor
    assert Part("q", 8).stored_shape((64,)) == (8, 64) and Part("c", 8, True, 8, 24).stored_shape((64,)) == (64, 24)


# (class, config.json entries to change, the text the refusal must hold): every setting we refuse
REFUSALS = [
    ("llama", dict(rope_parameters=None, rope_scaling={"type": "dynamic", "factor": 2.0}),
     "rope_scaling.rope_type='dynamic'"),
    ("llama", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
     "rope_parameters.rope_type='yarn'"),
    ("llama", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}),
     "rope_parameters of rope_type 'llama3' without low_freq_factor, high_freq_factor"),
    ("qwen3", dict(attention_bias=True), "attention_bias=true"),
    ("olmo2", dict(attention_bias=True), "attention_bias=true"),
    ("qwen3", dict(use_sliding_window=True), "use_sliding_window=true"),
    ("llama", dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ("llama", dict(attention_bias=True), "attention_bias=True with mlp_bias=False"),
    ("llama", dict(attention_dropout=0.1), "attention_dropout=0.1"),
    ("llama", dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    ("llama", dict(pretraining_tp=2), "pretraining_tp=2"),
    ("llama", dict(quantization_config={"quant_method": "gptq"}), "quantization_config"),
    ("llama", dict(architectures=["Gemma2ForCausalLM"]), "architectures=['Gemma2ForCausalLM'] is not one lm"),
    ("llama", dict(model_type="mistral"), "architectures=['LlamaForCausalLM'] with model_type='mistral', which "
     "transformers builds as another class"),
    ("smollm3", dict(no_rope_layers=[0, 1, 1, 1]), "no_rope_layers=[0, 1, 1, 1] with no_rope_layer_interval=2"),
    ("mistral", dict(sliding_window=16), "sliding_window=16 below max_position_embeddings=32"),
    ("qwen2", dict(use_sliding_window=True), "use_sliding_window=true"),
    ("qwen2", dict(layer_types=["full_attention", "sliding_attention"]), "layer_types="),
    ("gpt2", dict(activation_function="gelu"), "activation_function='gelu'"),
    ("gpt2", dict(resid_pdrop=0.1, attn_pdrop=0.0), "resid_pdrop=0.1, embd_pdrop=0.0, attn_pdrop=0.0"),
    ("gpt2", dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx=True"),
    ("gpt2", dict(add_cross_attention=True), "add_cross_attention=True"),
]


def refused_checkpoint(kind: str, edit: dict, directory: Path, classes: dict[str, tuple[str, dict]] = CLASSES) -> Path:
    """A saved checkpoint of `kind` (of `classes`) whose config.json then has `edit` applied."""
    hf_checkpoint(kind, directory, classes=classes)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **edit}))
    return directory


@pytest.mark.parametrize("kind, edit, fragment", REFUSALS, ids=[f"{k}-{next(iter(e))}" for k, e, _ in REFUSALS])
def test_settings_we_cannot_reproduce_are_refused_by_name(kind, edit, fragment, tmp_path):
    with pytest.raises(CheckpointError, match="config.json: ") as err:
        read_hf_model(refused_checkpoint(kind, edit, tmp_path))
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_a_mistral_config_without_a_window_has_mistrals_default_one(tmp_path):
    """MistralConfig's sliding_window is 4096: past it, transformers' logits differ from full attention's."""
    config_path = refused_checkpoint("mistral", dict(max_position_embeddings=8192), tmp_path) / "config.json"
    config = json.loads(config_path.read_text())
    del config["sliding_window"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="sliding_window=4096 below max_position_embeddings=8192"):
        read_hf_model(tmp_path)


def test_an_export_of_a_rotary_model_trained_with_dropout_reads_back():
    """Dropout changes training, not the weights: the export wrote it as attention_dropout, which lm's import
    refuses (lm's dropout drops residuals too), so an export of such a run could not be read back."""
    from lm.models.gpt.config import GPTConfig
    from lm.models.gpt.hf import _llama_config, rotary_fields

    cfg = GPTConfig(n_layer=2, n_head=2, d_model=32, block_size=32, vocab_size=96, pos="rope", norm="rmsnorm",
                    mlp="swiglu", bias=False, dropout=0.1)
    problems: list[str] = []
    rotary_fields(_llama_config(cfg, None, torch.float32), "llama", problems)
    assert problems == []


def test_a_llama3_config_of_transformers_4_imports_alike(tmp_path):
    """transformers 4.x wrote Llama 3's scaling as rope_scaling beside a top-level rope_theta."""
    hf = hf_checkpoint("llama3", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    params = config.pop("rope_parameters")
    config |= {"rope_theta": params.pop("rope_theta"), "rope_scaling": params}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = imported(tmp_path)
    assert (model.cfg.rope_scaling, model.cfg.rope_factor, model.cfg.rope_original_context) == ("llama3", 8.0, 8)
    idx = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_same_logits(model.logits(model(idx)), hf(idx).logits)


def test_a_mistral_window_that_cannot_bind_is_full_attention(tmp_path):
    hf_checkpoint("mistral", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "sliding_window": 32}))
    assert read_hf_model(tmp_path).fields["block_size"] == 32


def test_tensors_that_do_not_match_the_config_are_refused_before_any_is_read(tmp_path):
    hf = hf_checkpoint("llama", tmp_path)
    weights = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "model.layers.1.mlp.up_proj.weight"}
    weights["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)  # a Qwen3-style norm we do not have
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"its weights do not match its config.json: missing "
                                              r"model.layers.1.mlp.up_proj.weight; holds tensors lm's model has no "
                                              r"place for: model.layers.0.self_attn.q_norm.weight"):
        imported(tmp_path)


def test_a_checkpoint_without_safetensors_is_refused_with_the_way_out(tmp_path):
    hf_checkpoint("llama", tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"no model.safetensors or model.safetensors.index.json \(found: "
                                              r"pytorch_model.bin\); lm imports safetensors"):
        imported(tmp_path)


def assert_imports_with_hfs_logits(weights: dict, hf, tmp_path) -> None:
    """`weights` saved as tmp_path's model.safetensors import into a model with the logits of `hf`."""
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = imported(tmp_path)
    idx = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert_same_logits(model.logits(model(idx)), hf(idx).logits)


def test_an_older_gpt2_file_without_the_prefix_and_with_mask_buffers_imports(tmp_path):
    # files written before transformers added `transformer.` to the body's names, with each layer's causal-mask
    # buffer saved beside the weights (here as bool, which no weight is): read as save_pretrained's names
    hf = hf_checkpoint("gpt2", tmp_path)
    weights = {name.removeprefix("transformer."): t.contiguous() for name, t in hf.state_dict().items()
               if name != "lm_head.weight"}
    weights.update({f"h.{i}.attn.bias": torch.ones(1, 1, 32, 32, dtype=torch.bool).tril() for i in range(2)})
    (tmp_path / "model.safetensors").unlink()
    assert_imports_with_hfs_logits(weights, hf, tmp_path)


def test_an_older_llama_file_with_rotary_buffers_imports(tmp_path):
    # transformers up to 4.30 saved each layer's rotary inv_freq beside the weights: computed, not learned
    hf = hf_checkpoint("llama", tmp_path)
    weights = {name: t.contiguous() for name, t in hf.state_dict().items()}
    weights.update({f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(8) for i in range(2)})
    assert_imports_with_hfs_logits(weights, hf, tmp_path)


def test_a_weight_stored_as_integers_is_refused_before_any_is_read(tmp_path):
    hf = hf_checkpoint("llama", tmp_path)
    weights = {k: v.contiguous() for k, v in hf.state_dict().items()}
    weights["model.norm.weight"] = weights["model.norm.weight"].to(torch.int32)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model.safetensors: model.norm.weight is stored as I32; lm imports "
                                              r"floating-point weights"):
        imported(tmp_path)


def edit_config(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **changes}))


def test_the_hand_edit_that_extends_the_context_is_refused_where_transformers_moves_the_logits(tmp_path):
    """A transformers 5 save (rope_parameters: default) with the common hand edit that extends the context, a
    rope_scaling of linear x2: transformers applies rope_scaling, so lm, which read rope_parameters, would have
    scored another model."""
    hf = hf_checkpoint("llama", tmp_path)
    edit_config(tmp_path, rope_scaling={"type": "linear", "factor": 2.0})
    idx = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        moved = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()(idx).logits
        assert (moved - hf(idx).logits).abs().max() > 1e-3
    with pytest.raises(CheckpointError) as err:
        read_hf_model(tmp_path)
    assert str(err.value).startswith(f"{tmp_path / 'config.json'}: ")
    assert "rope_scaling and rope_parameters disagree: rope_type 'linear' against 'default'" in str(err.value)


def test_rope_tables_that_agree_import_as_transformers_reads_them(tmp_path):
    """4.x's rope_scaling (its `type`, no rope_theta) beside 5's rope_parameters and a top-level rope_theta, all
    one linear x2 scaling at theta 500: transformers applies rope_scaling, lm reads the same model."""
    classes = {"linear": ("llama", {**ROTARY, "rope_parameters": {"rope_type": "linear", "rope_theta": 500.0,
                                                                  "factor": 2.0}})}
    hf_checkpoint("linear", tmp_path, classes=classes)
    edit_config(tmp_path, rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=500.0)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    model = imported(tmp_path)
    assert (model.cfg.rope_scaling, model.cfg.rope_factor, model.cfg.rope_theta) == ("linear", 2.0, 500.0)
    idx = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert_same_logits(model.logits(model(idx)), theirs(idx).logits)


def test_a_tied_config_whose_head_is_not_the_embedding_is_refused(tmp_path):
    """transformers 5 leaves such a head untied and uses it; lm's tied model would use the embedding."""
    hf_checkpoint("llama", tmp_path)  # untied: the file holds its own lm_head.weight
    edit_config(tmp_path, tie_word_embeddings=True)
    with pytest.raises(CheckpointError) as err:
        imported(tmp_path)
    assert str(err.value).startswith(f"{tmp_path}: tie_word_embeddings is true but lm_head.weight is not a copy of "
                                     "model.embed_tokens.weight; transformers then unties the head")


def test_a_tied_head_saved_as_the_embeddings_copy_imports(tmp_path):
    hf = hf_checkpoint("llama-bias-tied", tmp_path)
    weights = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = imported(tmp_path)
    idx = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert_same_logits(model.logits(model(idx)), hf(idx).logits)


def test_a_transformers_checkpoint_with_a_short_context_reads_with_windows_that_fit_it(tmp_path):
    """lm.eval and lm.sample read a Hugging Face directory with the default config's data.seq_len (256) cut to the
    model's positions: a model of 32 positions is read, with windows of 32."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", vocab_size=50257, n_positions=32, n_embd=16,
                                                               n_layer=1, n_head=2))
    hf.save_pretrained(tmp_path)
    _, cfg, source = load_for_inference(tmp_path, torch.device("cpu"))
    assert source == tmp_path and cfg.model.block_size == 32 and cfg.data.seq_len == 32


def test_a_config_naming_two_classes_is_refused(tmp_path):
    # transformers' Auto classes build one class; a list of two leaves which one was meant to lm's guess
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM", "MistralForCausalLM"], "model_type": "llama"}))
    with pytest.raises(CheckpointError, match=r"architectures=\['LlamaForCausalLM', 'MistralForCausalLM'\] is not "
                                              r"one lm imports"):
        read_hf_model(tmp_path)


def test_a_gpt2_file_with_the_masked_bias_buffers_of_older_transformers_imports(tmp_path):
    # transformers 2.x-4.x saved each layer's attn.masked_bias (a -1e4 scalar) beside attn.bias: a buffer holding
    # no weight, skipped like attn.bias rather than refused as a tensor lm has no place for
    hf = hf_checkpoint("gpt2", tmp_path)
    weights = {name: t.contiguous() for name, t in hf.state_dict().items() if name != "lm_head.weight"}
    weights.update({f"transformer.h.{i}.attn.masked_bias": torch.tensor(-1e4) for i in range(2)})
    assert_imports_with_hfs_logits(weights, hf, tmp_path)


def test_a_tensor_of_another_shape_is_refused_by_name_before_any_is_read(tmp_path):
    # a tensor of the right rank but the wrong width would otherwise be read as rows of our width, running into
    # the next tensor's bytes
    hf = hf_checkpoint("llama", tmp_path)
    weights = {k: v.contiguous() for k, v in hf.state_dict().items()}
    weights["model.layers.0.mlp.up_proj.weight"] = torch.zeros(96, 32)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.up_proj.weight has shape \[96, 32\]; its "
                                              r"config.json implies \[96, 64\]"):
        imported(tmp_path)


def test_a_model_with_padding_rows_is_refused_with_the_key_that_fixes_it(tmp_path):
    # the checkpoint has 300 embedding rows; a model padded to 320 would keep 20 rows of its random init in every
    # softmax, so the import names model.vocab_multiple=1 rather than fill part of the embedding
    hf_checkpoint("llama", tmp_path)
    source = read_hf_model(tmp_path)
    model = GPT(GPTConfig(**{**source.fields, "vocab_multiple": 64}))
    assert model.wte.weight.shape[0] == 320
    with pytest.raises(CheckpointError, match=r"wte.weight has 320 rows, the checkpoint 300; import with "
                                              r"model.vocab_multiple=1"):
        load_hf_weights(source, model)


def test_every_setting_we_cannot_reproduce_is_named_in_one_message(tmp_path):
    edit = dict(hidden_act="gelu", attention_dropout=0.1, quantization_config={"quant_method": "gptq"})
    with pytest.raises(CheckpointError) as err:
        read_hf_model(refused_checkpoint("llama", edit, tmp_path))
    assert str(err.value) == (
        f"{tmp_path / 'config.json'}: LlamaForCausalLM with settings lm cannot reproduce exactly: "
        "quantization_config (lm imports full-precision weights); hidden_act='gelu' (lm's SwiGLU gates with silu); "
        "attention_dropout=0.1 (lm's model.dropout also drops residuals; import with 0)")


def test_split_rows_cuts_consecutive_rows_into_each_part():
    fused = torch.arange(16.0).reshape(8, 2)
    parts = (Part("q", 4), Part("k", 2), Part("v", 2, transposed=True))
    pieces = split_rows(fused, parts)
    assert [part for part, _ in pieces] == list(parts)
    assert [piece.tolist() for _, piece in pieces] == [fused[:4].tolist(), fused[4:6].tolist(), fused[6:].t().tolist()]


def test_a_transformers_checkpoint_is_loaded_for_inference_in_eval_mode(tmp_path):
    """GPT-2's config has dropout 0.1: scoring and sampling a transformers checkpoint must not run it."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", vocab_size=50257, n_positions=32, n_embd=16,
                                                               n_layer=1, n_head=2))
    hf.save_pretrained(tmp_path)
    model, _, _ = load_for_inference(tmp_path, torch.device("cpu"))
    assert not model.training and not any(m.training for m in model.modules())
    idx = torch.randint(0, 50257, (2, 16))
    with torch.no_grad():
        assert torch.equal(model(idx), model(idx))


def test_a_checkpoint_without_a_tokenizer_json_that_the_default_cannot_read_says_what_to_add(tmp_path):
    """300 ids: the default tokenizer (gpt2's 50,257) does not fit, and the error says where a tokenizer.json goes."""
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", vocab_size=300, n_positions=32, n_embd=16,
                                                               n_layer=1, n_head=2))
    hf.save_pretrained(tmp_path)
    with pytest.raises(ConfigError) as error:
        load_for_inference(tmp_path, torch.device("cpu"))
    message = str(error.value)
    assert message.startswith(f"{tmp_path}: has no tokenizer.json, and the default tokenizer does not fit its model (")
    assert message.endswith("); put the checkpoint's tokenizer.json beside its config.json")


def small_llama(directory: Path, **fields) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **{**ROTARY, **fields}))
    hf.save_pretrained(directory)
    return {k: v.detach().contiguous() for k, v in hf.state_dict().items()}


def test_a_tied_head_that_differs_from_the_embedding_in_its_last_row_only_is_refused(tmp_path):
    weights = small_llama(tmp_path, tie_word_embeddings=True)
    head = weights["model.embed_tokens.weight"].clone()
    head[-1] += 1.0  # every row but the last is the embedding's copy
    weights["lm_head.weight"] = head
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    source = read_hf_model(tmp_path)
    with pytest.raises(CheckpointError, match=r"tie_word_embeddings is true but lm_head.weight is not a copy of "
                                              r"model.embed_tokens.weight"):
        load_hf_weights(source, GPT(GPTConfig(**source.fields)))


def test_an_index_without_a_weight_map_is_refused_as_such(tmp_path):
    small_llama(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "model-00001-of-00001.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 1}}))
    source = read_hf_model(tmp_path)
    with pytest.raises(CheckpointError, match=r"model.safetensors.index.json: not an index with a weight_map: "
                                              r"'weight_map'"):
        load_hf_weights(source, GPT(GPTConfig(**source.fields)))


class GPTWithAnExtraScale(GPT):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        self.extra_scale = nn.Parameter(torch.ones(3))


def test_a_parameter_the_plan_does_not_fill_is_refused_by_name(tmp_path):
    small_llama(tmp_path)
    source = read_hf_model(tmp_path)
    model = GPTWithAnExtraScale(GPTConfig(**source.fields))
    with pytest.raises(CheckpointError, match=r"lm's model has parameters \['extra_scale'\] that the import does "
                                              r"not fill"):
        load_hf_weights(source, model)


def test_a_tied_gpt2_head_that_is_not_the_embedding_is_refused_naming_gpt2s_embedding(tmp_path):
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "gpt2", vocab_size=300, n_positions=32, n_embd=64, n_layer=2, n_head=4))  # tied, as GPT-2 is
    hf.save_pretrained(tmp_path)
    weights = {k: v.detach().contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    weights["lm_head.weight"] = weights["transformer.wte.weight"] + 1.0
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    source = read_hf_model(tmp_path)
    assert source.fields["tie_embeddings"] is True
    with pytest.raises(CheckpointError, match=r"tie_word_embeddings is true but lm_head.weight is not a copy of "
                                              r"transformer.wte.weight"):
        load_hf_weights(source, GPT(GPTConfig(**source.fields)))
