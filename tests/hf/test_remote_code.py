"""Exports as lm's own code (`lm.hf.remote_code`, `lm/hf/remote/`): for every option of the decoder, the encoder and
the encoder-decoder that no native transformers class computes, a random model written by the export and loaded by
transformers with trust_remote_code=True gives our logits to 1e-5 and greedy `generate` our tokens; a config key
the code predates is refused by name; the files import nothing but torch and transformers."""

import ast
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM

from lm.errors import ExportError
from lm.hf.export_files import write_export
from lm.hf.remote_code import CODE_DIR, exported_source
from lm.hf.targets import pick_target
from lm.models.encdec.config import EncDecConfig
from lm.models.encdec.sampling import generate_seq2seq
from lm.models.encoder.config import EncoderConfig
from lm.models.generate import generate
from lm.models.gpt.config import GPTConfig
from lm.models.gpt.hf_remote import decoder_target
from lm.models.registry import family_of
from tests.models.test_parity_hf import random_model

VOCAB = 300  # not a multiple of 64: the export keeps the ids the model knows, not the padding rows
TINY = dict(vocab_size=VOCAB, block_size=32, n_layer=2, n_head=4, d_model=64, norm_eps=1e-5)
AUTO = {"gpt": AutoModelForCausalLM, "encoder": AutoModelForMaskedLM, "encdec": AutoModelForSeq2SeqLM}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def exported(model: torch.nn.Module, out: Path):
    """`model` written by the export (its family's first target that reproduces it must be lm's own code) and read
    back by transformers with nothing missing or left over."""
    cfg = model.cfg
    target = pick_target(cfg, family_of(cfg).hf.targets, cfg.title)
    assert target.code, f"{target.hf_class} is a native class"
    write_export(model, target, None, "gpt2", out)
    hf, info = AUTO[cfg.arch].from_pretrained(out, local_files_only=True, trust_remote_code=True,
                                              output_loading_info=True)
    assert not any(info.values()), info
    assert type(hf).__name__ == target.hf_class and hf.dtype == torch.float32
    return hf.eval()


def ids(high: int, shape: tuple[int, int], seed: int) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def assert_same(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Our logits over the ids the model knows equal transformers' to 1e-5, and are not trivially small."""
    assert theirs.std() > 0.3
    torch.testing.assert_close(ours[..., :theirs.shape[-1]], theirs, atol=1e-5, rtol=1e-5)


DECODERS = {
    "demo-modern": dict(pos="rope", norm="rmsnorm", mlp="relu2", bias=False, qk_norm=True, n_kv_head=2),
    "sinusoidal-post-relu": dict(pos="sinusoidal", norm_position="post", mlp="relu"),
    "learned-rmsnorm": dict(norm="rmsnorm"),
    "rope-layernorm-gelu-untied": dict(pos="rope", bias=False, tie_embeddings=False),
    "softcap-qkv-bias-qk-norm-swiglu": dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, qkv_bias=True,
                                            qk_norm=True, logit_softcap=30.0),
    "llama-post-norm": dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, norm_position="post", n_kv_head=2),
    "mqa-learned-relu2-bias": dict(mlp="relu2", n_kv_head=1),
    "sinusoidal-swiglu-gqa-untied-bias": dict(pos="sinusoidal", norm="rmsnorm", mlp="swiglu", n_kv_head=2,
                                              tie_embeddings=False, d_ff=96),
    # the options of the imported families, with what no transformers class has beside them
    "relu2-olmo2-norms-d-head": dict(pos="rope", norm="rmsnorm", mlp="relu2", bias=False, n_kv_head=2,
                                     norm_position="output", qk_norm=True, qk_norm_scope="all", d_head=24),
    # and settings away from their defaults, which an export that left them out would load as the defaults
    "relu2-llama3-scaling-nope": dict(pos="rope", norm="rmsnorm", mlp="relu2", bias=False, rope_scaling="llama3",
                                      rope_factor=8.0, rope_original_context=8, nope_interval=2, rope_theta=500.0,
                                      rope_low_freq_factor=2.0, rope_high_freq_factor=8.0),
    "softcap-linear-scaling-qk-norm": dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, qk_norm=True,
                                           logit_softcap=30.0, rope_scaling="linear", rope_factor=4.0,
                                           rope_theta=300.0, norm_eps=0.1),
}


@pytest.mark.parametrize("overrides", DECODERS.values(), ids=DECODERS.keys())
def test_decoder_logits_and_greedy_tokens_are_ours(overrides, tmp_path):
    model = random_model(GPTConfig(**{**TINY, **overrides}))
    hf = exported(model, tmp_path / "out")
    idx = ids(VOCAB, (2, 32), seed=1)
    with torch.no_grad():
        assert_same(model.logits(model(idx)), hf(idx).logits)
    prompt = ids(VOCAB, (1, 4), seed=2)
    tokens = hf.generate(prompt, max_new_tokens=12, do_sample=False)[0, 4:].tolist()
    assert tokens == generate(model, prompt[0].tolist(), 12, temperature=0.0)


@pytest.mark.parametrize("name", ["demo-modern", "mqa-learned-relu2-bias"])
def test_left_padded_prompts_generate_as_each_alone(name, tmp_path):
    """A batch of prompts of 6 and 3 tokens, the second left-padded: each row gets the positions it has alone,
    with transformers' cache or without."""
    model = random_model(GPTConfig(**TINY, **DECODERS[name]))
    hf = exported(model, tmp_path / "out")
    prompts = [ids(VOCAB, (1, 6), seed=3)[0], ids(VOCAB, (1, 3), seed=4)[0]]
    batch = torch.stack([prompts[0], torch.cat([torch.zeros(3, dtype=torch.long), prompts[1]])])  # (2, 6)
    mask = torch.tensor([[1] * 6, [0] * 3 + [1] * 3])
    for use_cache in (True, False):
        out = hf.generate(batch, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                          use_cache=use_cache)[:, 6:]
        for row, prompt in zip(out.tolist(), prompts):
            assert row == generate(model, prompt.tolist(), 8, temperature=0.0)


ENCODERS = {
    "demo-encoder": dict(pos="rope"),
    "sinusoidal-rmsnorm-swiglu-gqa-untied-nobias": dict(pos="sinusoidal", norm="rmsnorm", mlp="swiglu", n_kv_head=2,
                                                        tie_embeddings=False, bias=False),
    "learned-post-relu2": dict(norm_position="post", mlp="relu2"),
}


@pytest.mark.parametrize("overrides", ENCODERS.values(), ids=ENCODERS.keys())
def test_encoder_logits_are_ours_under_a_padding_mask(overrides, tmp_path):
    model = random_model(EncoderConfig(**TINY, **overrides))
    cfg = model.cfg
    hf = exported(model, tmp_path / "out")
    assert hf.config.vocab_size == cfg.total_vocab_size == VOCAB + 3
    idx = ids(cfg.total_vocab_size, (3, 32), seed=1)
    idx[:, 0] = cfg.cls_id
    keep = torch.arange(32)[None, :] < torch.tensor([32, 20, 7])[:, None]  # (B, T)
    idx[~keep] = cfg.pad_id
    with torch.no_grad():
        assert_same(model.mlm_logits(model(idx[:1])), hf(idx[:1]).logits)
        ours, theirs = model.mlm_logits(model(idx, keep)), hf(idx, attention_mask=keep.long()).logits
    assert_same(ours[keep], theirs[keep])


ENCDECS = {
    "demo-encdec": dict(pos="sinusoidal", mlp="relu"),
    "learned-post-unshared-untied-gqa": dict(norm_position="post", share_embeddings=False, tie_embeddings=False,
                                             n_kv_head=2, norm="rmsnorm", mlp="swiglu", bias=False),
    "shared-untied-gelu": dict(pos="sinusoidal", tie_embeddings=False),
    "unshared-tied": dict(pos="sinusoidal", share_embeddings=False),
}


@pytest.mark.parametrize("overrides", ENCDECS.values(), ids=ENCDECS.keys())
def test_encdec_logits_and_greedy_tokens_are_ours(overrides, tmp_path):
    model = random_model(EncDecConfig(**TINY, n_sentinels=10, **overrides))
    cfg = model.cfg
    hf = exported(model, tmp_path / "out")
    assert hf.config.vocab_size == cfg.total_vocab_size and hf.generation_config.decoder_start_token_id == cfg.pad_id
    src, tgt = ids(cfg.pad_id, (2, 20), seed=1), ids(cfg.pad_id, (2, 12), seed=2)
    keep = torch.arange(20)[None, :] < torch.tensor([20, 9])[:, None]  # (B, S): the second source padded
    src[~keep] = cfg.pad_id
    with torch.no_grad():
        assert_same(model.logits(model(src, tgt, keep)), hf(input_ids=src, attention_mask=keep.long(),
                                                              decoder_input_ids=tgt).logits)
    source = [*range(5, 12), cfg.sentinel_start, *range(40, 45)]  # a span missing in the middle
    tokens = hf.generate(torch.tensor([source]), max_new_tokens=12, do_sample=False)[0, 1:].tolist()
    assert tokens == generate_seq2seq(model, source, 12, temperature=0.0)


def test_a_config_key_the_code_predates_is_refused_by_name_unless_left_at_its_default():
    """A key added to GPTConfig after the modeling file was written (here head_dim) exports only at its default,
    and a value of a known key the file does not compute is refused too."""
    newer = dataclasses.make_dataclass("NewerGPTConfig", [("head_dim", int, dataclasses.field(default=0))],
                                       bases=(GPTConfig,))
    target = decoder_target(newer)
    assert pick_target(newer(**TINY, qk_norm=True), (target,), "a GPT") is target
    with pytest.raises(ExportError) as err:
        pick_target(newer(**TINY, qk_norm=True, head_dim=32), (target,), "a GPT")
    assert str(err.value) == ("cannot export to Hugging Face: no transformers model has this combination "
                              "(model.head_dim=32): LMDecoderForCausalLM (lm's own code) needs model.head_dim=0 "
                              "(the exported code predates this key)")
    cfg = GPTConfig(**TINY)
    cfg.norm_position = "sandwich"  # a placement a later lm might add
    with pytest.raises(ExportError, match=r"LMDecoderForCausalLM \(lm's own code\) needs model.norm_position=pre "
                                          "or post"):
        pick_target(cfg, (target,), "a GPT")


def test_the_code_imports_only_torch_and_transformers_and_every_file_is_exported():
    """Every file of CODE_DIR goes out with some family, beside lm's own layer files, and as written each imports
    the standard library, torch, transformers and the files beside it, never lm."""
    shipped = set()
    for family in ("gpt", "encoder", "encdec"):
        shipped |= set(family_of(EncDecConfig() if family == "encdec" else
                                 EncoderConfig() if family == "encoder" else GPTConfig()).hf.targets[-1].code)
    assert set(CODE_DIR.glob("*.py")) <= shipped
    assert {p.name for p in shipped - set(CODE_DIR.glob("*.py"))} == {"layers.py", "attention.py", "block.py",
                                                                      "kv_cache.py"}
    names = {p.stem for p in shipped}
    for path in shipped:
        imported = set()
        for node in ast.walk(ast.parse(exported_source(path))):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported.add(node.module.split(".")[0])
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 1 and node.module in names, (path.name, node.module)
        assert imported <= {"collections", "dataclasses", "math", "torch", "transformers"}, (path.name, imported)


def test_a_layer_file_that_imports_more_of_lm_is_refused(tmp_path):
    """An import the export cannot carry stops the export by name instead of writing code that needs lm."""
    layer = tmp_path / "layers.py"
    layer.write_text("import torch\n\nfrom lm.models.block import Block\nfrom lm.errors import ConfigError\n")
    with pytest.raises(ValueError, match="cannot carry `from lm.errors import ConfigError`"):
        exported_source(layer)


HIDDEN_LM = """
import sys, torch
from importlib.abc import MetaPathFinder
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM


class NoLM(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "lm" or name.startswith("lm."):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden)")


sys.meta_path.insert(0, NoLM())
out, idx, src, tgt = sys.argv[1], *torch.load(sys.argv[2])
with torch.no_grad():
    logits = [AutoModelForCausalLM.from_pretrained(f"{out}/gpt", trust_remote_code=True)(idx).logits,
              AutoModelForMaskedLM.from_pretrained(f"{out}/encoder", trust_remote_code=True)(idx).logits,
              AutoModelForSeq2SeqLM.from_pretrained(f"{out}/encdec", trust_remote_code=True)(
                  input_ids=src, decoder_input_ids=tgt).logits]
assert not [name for name in sys.modules if name == "lm" or name.startswith("lm.")]
torch.save(logits, sys.argv[3])
"""


@pytest.mark.process  # transformers loads the exports in a process without lm
def test_exports_load_and_give_our_logits_without_lm(tmp_path):
    """Each family's export holds no import of lm and runs in a Python where lm cannot be imported."""
    models = {"gpt": random_model(GPTConfig(**TINY, **DECODERS["demo-modern"])),
              "encoder": random_model(EncoderConfig(**TINY, **ENCODERS["demo-encoder"])),
              "encdec": random_model(EncDecConfig(**TINY, n_sentinels=10, **ENCDECS["demo-encdec"]))}
    for arch, model in models.items():
        write_export(model, pick_target(model.cfg, family_of(model.cfg).hf.targets, arch), None, "gpt2",
                     tmp_path / arch)
        for path in (tmp_path / arch).glob("*.py"):
            assert not re.search(r"^\s*(from|import)\s+lm\b", path.read_text(), re.MULTILINE), path
    idx, src, tgt = ids(VOCAB, (2, 32), seed=1), ids(VOCAB, (2, 20), seed=2), ids(VOCAB, (2, 12), seed=3)
    torch.save((idx, src, tgt), tmp_path / "inputs.pt")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_MODULES_CACHE": str(tmp_path / "modules"), "PYTHONPATH": ""}
    done = subprocess.run([sys.executable, "-c", HIDDEN_LM, str(tmp_path), str(tmp_path / "inputs.pt"),
                           str(tmp_path / "logits.pt")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    theirs = torch.load(tmp_path / "logits.pt")
    with torch.no_grad():
        ours = [models["gpt"].logits(models["gpt"](idx)), models["encoder"].mlm_logits(models["encoder"](idx)),
                models["encdec"].logits(models["encdec"](src, tgt))]
    for mine, other in zip(ours, theirs):
        assert_same(mine, other)
