"""Mixtures of experts to and from transformers: tiny random Mixtral, OLMoE and Qwen3-MoE models (built with
`from_config`, saved with `save_pretrained`) import with transformers' logits and loss and export back to the very
tensors saved; lm's own mixtures export as each class and load with `from_pretrained` at our logits; what lm cannot
express is refused by name. Greedy decoding and lm.eval's loss: `test_import_tools.py`. The runs against
transformers are marked slow (docs/dev/notes.md, "Two tiers"); the refusals and the layer patterns are quick."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from lm.cli import run
from lm.errors import CheckpointError, ExportError
from lm.eval import main as eval_main
from lm.export import main as export_main
from lm.hf.export_files import export_hf
from lm.hf.targets import hf_state_dict
from lm.models.gpt.config import GPTConfig, moe_block
from lm.models.gpt.hf_moe import moe_keys
from lm.models.gpt.model import GPT
from lm.models.gpt.moe import router_stats
from lm.models.hf_checkpoint import read_hf_model
from lm.models.registry import get_family
from tests.hf.test_import import VOCAB, assert_same_logits, hf_checkpoint, imported, refused_checkpoint, target
from tests.test_export import checkpoint_of_arch

SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32, num_experts_per_tok=2)
CLASSES = {
    "mixtral": ("mixtral", {**SHAPE, "num_local_experts": 4, "router_aux_loss_coef": 0.02}),
    # norm_topk_prob false, as OLMoE-1B-7B's: the top-2 weights keep the softmax's own values
    "olmoe": ("olmoe", {**SHAPE, "num_experts": 4, "pad_token_id": None, "eos_token_id": None}),
    # a dense first layer (intermediate_size wide), experts of their own width, renormalised, heads 24 wide
    "qwen3_moe": ("qwen3_moe", {**SHAPE, "num_experts": 4, "moe_intermediate_size": 24, "mlp_only_layers": [0],
                                "norm_topk_prob": True, "head_dim": 24}),
    # every second layer a mixture, by decoder_sparse_step
    "qwen3_moe-step": ("qwen3_moe", {**SHAPE, "num_hidden_layers": 4, "num_experts": 4, "moe_intermediate_size": 24,
                                     "decoder_sparse_step": 2}),
}
READ_AS = {  # model.moe_first_dense, moe_every, router_renorm, the experts' width, aux_loss_coef (k x transformers')
    "mixtral": (0, 1, True, 48, 0.04),
    "olmoe": (0, 1, False, 48, 0.02),
    "qwen3_moe": (1, 1, True, 24, 0.002),
    "qwen3_moe-step": (0, 2, False, 24, 0.002),
}


def batch(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(seed))


@pytest.mark.slow  # a transformers reference run
@pytest.mark.parametrize("kind", CLASSES)
def test_imported_mixtures_give_transformers_logits_and_loss_and_export_back_the_same_tensors(kind, tmp_path):
    hf = hf_checkpoint(kind, tmp_path, classes=CLASSES)
    model = imported(tmp_path)
    cfg = model.cfg
    assert (cfg.n_experts, cfg.experts_per_token, cfg.moe_first_dense, cfg.moe_every, cfg.router_renorm,
            cfg.expert_ff) == (4, 2, *READ_AS[kind][:4])
    assert cfg.aux_loss_coef == pytest.approx(READ_AS[kind][4])
    idx = batch(1)
    with torch.no_grad():
        assert_same_logits(model.logits(model(idx)), hf(idx).logits)
        ours = get_family("gpt").training.loss(model, model, [idx[:, :-1], idx[:, 1:]])
        torch.testing.assert_close(ours.terms["loss"].value, hf(idx, labels=idx).loss, atol=1e-5, rtol=1e-5)
    # transformers 5 fuses the experts in memory and saves them one by one, as the hub's checkpoints hold them
    saved = load_file(tmp_path / "model.safetensors")
    exported = hf_state_dict(model, target(cfg))
    assert target(cfg).hf_class == hf.config.architectures[0] and sorted(exported) == sorted(saved)
    for name, tensor in saved.items():
        assert torch.equal(exported[name], tensor), name


@pytest.mark.slow  # a transformers reference run
def test_a_sharded_mixture_imports_alike_and_decodes_through_the_kv_cache(tmp_path):
    hf = hf_checkpoint("mixtral", tmp_path, shard="20KB", classes=CLASSES)
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    model = imported(tmp_path)
    idx = batch(2)[:, :20]
    cache = model.new_cache(batch_size=2, max_len=20)
    with torch.no_grad():
        ours = torch.cat([model.logits(model(idx[:, a:b], cache=cache)) for a, b in [(0, 8), (8, 9), (9, 20)]], 1)
        assert_same_logits(ours, hf(idx).logits)


@pytest.mark.slow  # a transformers reference run
def test_the_balance_term_weighs_what_transformers_router_aux_loss_weighs(tmp_path):
    """With one mixture layer (Qwen3-MoE's second), transformers' aux_loss is k times our moe_balance, and its loss
    with output_router_logits adds router_aux_loss_coef times it: lm's imported aux_loss_coef gives the same sum."""
    hf = hf_checkpoint("qwen3_moe", tmp_path, classes=CLASSES)
    model = imported(tmp_path)
    idx = batch(3)
    with torch.no_grad():
        out = hf(idx, labels=idx, output_router_logits=True)
        cross_entropy = hf(idx, labels=idx).loss
        model(idx)
        (stats,) = router_stats(model)
    assert stats.layer == 1 and 1.0 < stats.balance < 2.0
    torch.testing.assert_close(out.aux_loss, 2 * stats.balance)
    torch.testing.assert_close(out.loss, cross_entropy + model.cfg.aux_loss_coef * stats.balance)


OURS = dict(vocab_size=VOCAB, block_size=32, n_layer=2, n_head=4, d_model=64, pos="rope", norm="rmsnorm",
            mlp="swiglu", bias=False, n_kv_head=2, tie_embeddings=False, n_experts=4, experts_per_token=2,
            expert_d_ff=32, aux_loss_coef=0.02, router_z_loss_coef=1e-3)
EXPORTS = {
    "MixtralForCausalLM": {},
    "OlmoeForCausalLM": dict(qk_norm=True, qk_norm_scope="all", router_renorm=False),
    # blocks 1 and 3 mixtures, 0 and 2 dense MLPs of their own width; heads 24 wide
    "Qwen3MoeForCausalLM": dict(qk_norm=True, d_head=24, n_layer=4, moe_every=2, d_ff=96, router_renorm=False,
                                tie_embeddings=True),
}
MOE_KEYS = ("n_experts", "experts_per_token", "moe_first_dense", "moe_every", "router", "router_renorm",
            "expert_ff", "aux_loss_coef", "router_z_loss_coef", "qk_norm", "qk_norm_scope", "head_dim")


@pytest.mark.slow  # a transformers reference run
@pytest.mark.parametrize("hf_class", EXPORTS)
def test_our_mixtures_export_as_each_class_and_load_with_our_logits(hf_class, tmp_path):
    cfg = GPTConfig(**{**OURS, **EXPORTS[hf_class]})
    torch.manual_seed(3)
    ours = GPT(cfg).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # gains off their init, routers far from uniform
    export_hf(ours, target(cfg), None, "gpt2", tmp_path)  # the model alone: config.json and model.safetensors
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    assert type(hf).__name__ == hf_class and hf.dtype == torch.float32
    idx = batch(4)
    with torch.no_grad():
        assert_same_logits(hf(idx).logits, ours.logits(ours(idx))[..., :VOCAB])
    again = imported(tmp_path)  # and back in: the same mixture, the same coefficients
    assert [getattr(again.cfg, key) for key in MOE_KEYS] == pytest.approx([getattr(cfg, key) for key in MOE_KEYS])


EXPERT_NAMES = {"MixtralForCausalLM": ("block_sparse_moe", "w1", "w3", "w2"),
                "OlmoeForCausalLM": ("mlp", "gate_proj", "up_proj", "down_proj"),
                "Qwen3MoeForCausalLM": ("mlp", "gate_proj", "up_proj", "down_proj")}


@pytest.mark.parametrize("hf_class", EXPORTS)
def test_each_expert_and_router_setting_lands_under_its_transformers_name(hf_class):
    """The export's tensors and config.json keys by name, without a transformers run (the slow test above runs
    one): each expert's gate, up and down projections as Linear weights (out, in), the router's gate, and the
    coefficients in transformers' terms."""
    cfg = GPTConfig(**{**OURS, **EXPORTS[hf_class]})
    torch.manual_seed(3)
    ours = GPT(cfg)
    weights, config = hf_state_dict(ours, target(cfg)), target(cfg).config(cfg, None, torch.float32)
    block, gate, up, down = EXPERT_NAMES[hf_class]
    layer = next(i for i, b in enumerate(ours.blocks) if hasattr(b.mlp, "experts"))
    experts = ours.blocks[layer].mlp.experts
    for e in range(cfg.n_experts):
        prefix = f"model.layers.{layer}.{block}.experts.{e}."
        assert torch.equal(weights[prefix + f"{gate}.weight"], experts.w_gate[e].T)
        assert torch.equal(weights[prefix + f"{up}.weight"], experts.w_in[e].T)
        assert torch.equal(weights[prefix + f"{down}.weight"], experts.w_out[e].T)
    assert torch.equal(weights[f"model.layers.{layer}.{block}.gate.weight"], ours.blocks[layer].mlp.router.gate.weight)
    # transformers divides its balance loss by k where lm's does not; its z-loss coefficient is lm's
    assert config["router_aux_loss_coef"] == pytest.approx(cfg.aux_loss_coef / cfg.experts_per_token)
    assert config["num_experts_per_tok"] == cfg.experts_per_token
    if hf_class != "MixtralForCausalLM":  # Mixtral always renormalises its top k
        assert config["norm_topk_prob"] == cfg.router_renorm
    if hf_class == "Qwen3MoeForCausalLM":  # every dense block listed by index
        assert config["decoder_sparse_step"] == 1 and config["mlp_only_layers"] == [0, 2]


@pytest.mark.parametrize("sparse, keys", [
    ([True, True], (0, 1)), ([False, True, True], (1, 1)), ([False, True, False, True], (0, 2)),
    ([False, False, True, False, True], (1, 2)), ([False, False, False, True], (3, 1)),
    ([True, False, True], None), ([False, True, False, False], None), ([True, True, False], None),
])
def test_a_layer_pattern_reads_as_the_first_dense_blocks_and_a_period(sparse, keys):
    assert moe_keys(sparse) == keys


def test_every_pattern_lm_can_express_is_read_back_as_itself():
    for n in range(1, 8):
        for first in range(n):
            for every in range(1, n + 1):
                sparse = [moe_block(i, first, every) for i in range(n)]
                if any(sparse):
                    found = moe_keys(sparse)
                    assert found is not None and [moe_block(i, *found) for i in range(n)] == sparse


# (class, config.json entries to change, the text the refusal must hold): every setting we refuse
REFUSALS = [
    ("qwen3_moe-step", dict(decoder_sparse_step=1, mlp_only_layers=[1]),
     "mlp_only_layers=[1] with decoder_sparse_step=1 makes blocks 0, 2, 3 mixtures of experts (lm's are every "
     "model.moe_every-th block after the first model.moe_first_dense)"),
    ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise=0.1 (lm's router scores the tokens as they are"),
    ("mixtral", dict(sliding_window=16), "sliding_window=16 below max_position_embeddings=32"),
    ("olmoe", dict(clip_qkv=8.0), "clip_qkv=8.0 (lm does not clip"),
    ("olmoe", dict(attention_bias=True), "attention_bias=true"),
    ("qwen3_moe", dict(use_sliding_window=True), "use_sliding_window=true"),
]


@pytest.mark.parametrize("kind, edit, fragment", REFUSALS, ids=[f"{k}-{next(iter(e))}" for k, e, _ in REFUSALS])
def test_mixtures_we_cannot_reproduce_are_refused_by_name(kind, edit, fragment, tmp_path):
    with pytest.raises(CheckpointError, match="config.json: ") as err:
        read_hf_model(refused_checkpoint(kind, edit, tmp_path, CLASSES))
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_the_tools_refuse_a_layer_pattern_in_one_error_line(tmp_path, capsys):
    directory = refused_checkpoint("qwen3_moe-step", dict(decoder_sparse_step=1, mlp_only_layers=[2]), tmp_path,
                                   CLASSES)
    capsys.readouterr()  # save_pretrained's progress bar
    assert run(eval_main, ["--checkpoint", str(directory)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {directory / 'config.json'}: Qwen3MoeForCausalLM with settings lm cannot reproduce exactly: "
        "mlp_only_layers=[2] with decoder_sparse_step=1 makes blocks 0, 1, 3 mixtures of experts (lm's are every "
        "model.moe_every-th block after the first model.moe_first_dense)"]


@pytest.mark.parametrize("model, wanted", [
    (dict(router="sigmoid"), "MixtralForCausalLM (Mixtral) needs model.router=softmax"),
    (dict(n_shared_experts=1), "MixtralForCausalLM (Mixtral) needs model.n_shared_experts=0"),
    (dict(router_renorm=False), "MixtralForCausalLM (Mixtral) needs model.router_renorm=true"),
    (dict(moe_first_dense=1, n_layer=3), "OlmoeForCausalLM (OLMoE) needs model.qk_norm=true, "
                                          "model.qk_norm_scope=all, model.moe_first_dense=0"),
])
def test_a_mixture_no_class_computes_is_refused_naming_the_keys(model, wanted):
    cfg = GPTConfig(**{**OURS, **model})
    with pytest.raises(ExportError) as err:
        target(cfg)
    assert wanted in str(err.value) and "\n" not in str(err.value)


def test_lm_export_refuses_such_a_mixture_in_one_error_line(trained_run, tmp_path, capsys):
    run_dir = checkpoint_of_arch(trained_run, tmp_path / "moe", pos="rope", norm="rmsnorm", mlp="swiglu", bias=False,
                                 n_experts=4, router="sigmoid")
    out = tmp_path / "out"
    assert run(export_main, ["--checkpoint", str(run_dir), "--to", "hf", str(out)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: cannot export to Hugging Face: no transformers model has this combination (")
    assert "MixtralForCausalLM (Mixtral) needs model.router=softmax" in line
    assert "Qwen3MoeForCausalLM (Qwen3-MoE) needs model.qk_norm=true, model.router=softmax" in line
    assert not out.exists()
