"""Exports as lm's own code (`lm.hf.remote_code`, `lm/hf/remote/`): for every option of the decoder, the encoder and
the encoder-decoder that no native transformers class computes, a random model written by the export and loaded by
transformers with trust_remote_code=True gives our logits to 1e-5 and greedy `generate` our tokens; a config key
the code predates is refused by name; the files import nothing but torch and transformers."""

import ast
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSeq2SeqLM,
    DynamicCache,
    EncoderDecoderCache,
)

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


@pytest.mark.parametrize("arch", ["gpt", "encoder", "encdec"])
def test_the_modeling_file_imports_every_file_beside_it_itself(arch, tmp_path):
    """transformers 4.x copies into its module cache only the files a local modeling file imports directly (found by
    this pattern): attention.py, which only block.py imports, would be missing there, and the model fail to load."""
    cfg = {"gpt": GPTConfig(**TINY, **DECODERS["demo-modern"]), "encoder": EncoderConfig(**TINY, pos="rope"),
           "encdec": EncDecConfig(**TINY, n_sentinels=10, **ENCDECS["demo-encdec"])}[arch]
    target = pick_target(cfg, family_of(cfg).hf.targets, cfg.title)
    write_export(random_model(cfg), target, None, "gpt2", tmp_path)
    modeling = tmp_path / target.code[-1].name
    direct = set(re.findall(r"^\s*from\s+\.(\S+)\s+import", modeling.read_text(), flags=re.MULTILINE))
    assert direct == {p.stem for p in target.code[:-1]}
    assert {p.name for p in tmp_path.glob("*.py")} == {p.name for p in target.code}


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


def cache_of(out):
    """The cache a transformers output carries (transformers 5 names the field `cache`, 4.x `past_key_values`);
    KeyError when it carries none."""
    return out["cache"] if "cache" in out else out["past_key_values"]


def carries_cache(out) -> bool:
    """Whether a transformers output carries a cache (a field left None is not in it)."""
    return "cache" in out or "past_key_values" in out


@pytest.mark.parametrize("cache_key", ["cache", "past_key_values"])
def test_decoding_by_hand_with_a_cache_gives_the_full_forwards_logits(cache_key, tmp_path):
    """A prompt, then one token at a time through the cache transformers' output hands back (under either name the
    forward takes it by): the logits of a single forward over the whole sequence. Without use_cache given, the
    config's use_cache (true) keeps the cache coming back, as transformers' own models do."""
    model = random_model(GPTConfig(**TINY, **DECODERS["demo-modern"]))
    hf = exported(model, tmp_path / "out")
    idx = ids(VOCAB, (2, 12), seed=5)
    with torch.no_grad():
        full = hf(idx).logits
        out = hf(idx[:, :8], **{cache_key: DynamicCache()})
        steps = [out.logits]
        for t in range(8, 12):
            out = hf(idx[:, t:t + 1], **{cache_key: cache_of(out)})
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_encdec_decoding_by_hand_with_a_cache_gives_the_full_forwards_logits(tmp_path):
    model = random_model(EncDecConfig(**TINY, n_sentinels=10, **ENCDECS["demo-encdec"]))
    cfg = model.cfg
    hf = exported(model, tmp_path / "out")
    src, tgt = ids(cfg.pad_id, (2, 10), seed=1), ids(cfg.pad_id, (2, 8), seed=2)
    with torch.no_grad():
        full = hf(input_ids=src, decoder_input_ids=tgt).logits
        encoded = hf.get_encoder()(src)
        out = hf(encoder_outputs=encoded, decoder_input_ids=tgt[:, :5],
                 cache=EncoderDecoderCache(DynamicCache(), DynamicCache()))
        steps = [out.logits]
        for t in range(5, 8):
            out = hf(encoder_outputs=encoded, decoder_input_ids=tgt[:, t:t + 1], cache=cache_of(out))
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_decoder_loss_is_the_next_token_cross_entropy_of_our_logits(tmp_path):
    """transformers' convention: labels are the input ids, each position scored on the next one, -100 ignored."""
    model = random_model(GPTConfig(**TINY, **DECODERS["demo-modern"]))
    hf = exported(model, tmp_path / "out")
    idx = ids(VOCAB, (2, 16), seed=1)
    labels = idx.clone()
    labels[1, 10:] = -100  # a shorter second row, padded
    with torch.no_grad():
        loss = hf(idx, labels=labels).loss
        logits = model.logits(model(idx))[..., :VOCAB]
    ours = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    torch.testing.assert_close(loss, ours, atol=1e-5, rtol=1e-5)


def test_encoder_loss_is_the_cross_entropy_of_the_masked_positions(tmp_path):
    """labels hold the original ids at the masked positions and -100 elsewhere; each position scores its own id."""
    model = random_model(EncoderConfig(**TINY, **ENCODERS["demo-encoder"]))
    cfg = model.cfg
    hf = exported(model, tmp_path / "out")
    idx = ids(VOCAB, (2, 16), seed=1)
    idx[:, 0] = cfg.cls_id
    masked = torch.zeros_like(idx, dtype=torch.bool)
    masked[:, [3, 7, 8, 12]] = True
    labels = torch.where(masked, idx, torch.full_like(idx, -100))
    idx = idx.masked_fill(masked, cfg.mask_id)
    with torch.no_grad():
        loss = hf(idx, labels=labels).loss
        logits = model.mlm_logits(model(idx))[..., :cfg.total_vocab_size]
    torch.testing.assert_close(loss, F.cross_entropy(logits[masked], labels[masked]), atol=1e-5, rtol=1e-5)


def test_encdec_labels_alone_are_decoded_behind_the_start_id(tmp_path):
    """Given labels and no decoder inputs, the decoder reads the labels shifted right behind the padding id (the
    start id), a -100 read as padding; the loss is the cross-entropy of the labels, -100 ignored."""
    model = random_model(EncDecConfig(**TINY, n_sentinels=10, **ENCDECS["demo-encdec"]))
    cfg = model.cfg
    hf = exported(model, tmp_path / "out")
    src, labels = ids(cfg.pad_id, (2, 12), seed=1), ids(cfg.pad_id, (2, 8), seed=2)
    labels[1, 5:] = -100  # a shorter second target, padded
    tgt_in = torch.cat([torch.full((2, 1), cfg.pad_id), labels[:, :-1]], dim=1)
    tgt_in = tgt_in.masked_fill(tgt_in == -100, cfg.pad_id)
    with torch.no_grad():
        out = hf(input_ids=src, labels=labels)
        ours = model.logits(model(src, tgt_in))[..., :cfg.total_vocab_size]
    assert_same(ours, out.logits)
    torch.testing.assert_close(out.loss, F.cross_entropy(ours.flatten(0, 1), labels.flatten(), ignore_index=-100),
                               atol=1e-5, rtol=1e-5)


def test_positions_past_block_size_are_refused_by_each_family(tmp_path):
    """A rotary or sinusoidal model has no table to run out of: the forward itself refuses positions past
    block_size, counting those already in the cache."""
    decoder = exported(random_model(GPTConfig(**TINY, **DECODERS["demo-modern"])), tmp_path / "gpt")
    encoder = exported(random_model(EncoderConfig(**TINY, **ENCODERS["demo-encoder"])), tmp_path / "encoder")
    encdec_model = random_model(EncDecConfig(**TINY, n_sentinels=10, **ENCDECS["demo-encdec"]))
    encdec = exported(encdec_model, tmp_path / "encdec")
    too_long = "exceeds the model's block_size=32"
    with torch.no_grad():
        cache = cache_of(decoder(ids(VOCAB, (1, 30), seed=1), cache=DynamicCache()))
        with pytest.raises(ValueError, match=too_long):
            decoder(ids(VOCAB, (1, 3), seed=2), cache=cache)
        with pytest.raises(ValueError, match=too_long):
            encoder(ids(VOCAB, (1, 33), seed=1))
        src = ids(VOCAB, (1, 8), seed=1)
        cache = cache_of(encdec(input_ids=src, decoder_input_ids=ids(VOCAB, (1, 30), seed=2),
                                cache=EncoderDecoderCache(DynamicCache(), DynamicCache())))
        with pytest.raises(ValueError, match=too_long):
            encdec(input_ids=src, decoder_input_ids=ids(VOCAB, (1, 3), seed=3), cache=cache)


@pytest.mark.parametrize("arch", ["gpt", "encoder", "encdec"])
def test_config_json_names_the_class_and_transformers_reads_our_sizes(arch, tmp_path):
    """config.json names the class it configures, under the model_type of its configuration class, and
    transformers' usual names read the sizes the model was built with, and whether its output layer is tied
    (transformers 4.x ties by that flag alone)."""
    configs = {"gpt": GPTConfig(**TINY, **DECODERS["sinusoidal-swiglu-gqa-untied-bias"]),
               "encoder": EncoderConfig(**TINY, pos="rope", n_kv_head=2, d_ff=96, tie_embeddings=False),
               "encdec": EncDecConfig(**TINY, n_sentinels=10, n_kv_head=1, **ENCDECS["demo-encdec"])}
    model = random_model(configs[arch])
    cfg = model.cfg
    hf = exported(model, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == [type(hf).__name__]
    config = AutoConfig.from_pretrained(tmp_path / "out", local_files_only=True, trust_remote_code=True)
    assert type(config).model_type == written["model_type"] == hf.config.model_type
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (64, 2, 4)
    assert (config.num_key_value_heads, config.intermediate_size) == (cfg.kv_heads, cfg.ff_dim)
    assert config.max_position_embeddings == 32
    assert config.tie_word_embeddings == cfg.tie_embeddings


def test_exported_ids_are_the_models(tmp_path):
    """The ids a user of each export needs: the encoder's [MASK], [CLS] and padding, the encoder-decoder's
    sentinels and padding, the decoder's start and end ids, and a decoder that generates with its cache."""
    encoder = random_model(EncoderConfig(**TINY, **ENCODERS["demo-encoder"]))
    hf = exported(encoder, tmp_path / "encoder")
    assert (hf.config.mask_token_id, hf.config.cls_token_id, hf.config.pad_token_id) == (
        encoder.cfg.mask_id, encoder.cfg.cls_id, encoder.cfg.pad_id)
    encdec = random_model(EncDecConfig(**TINY, n_sentinels=10, **ENCDECS["demo-encdec"]))
    hf = exported(encdec, tmp_path / "encdec")
    assert (hf.config.sentinel_start, hf.config.n_sentinels, hf.config.pad_token_id) == (
        encdec.cfg.sentinel_start, 10, encdec.cfg.pad_id)
    assert hf.config.is_encoder_decoder and hf.config.decoder_start_token_id == encdec.cfg.pad_id
    decoder = random_model(GPTConfig(**TINY, **DECODERS["demo-modern"]))
    target = pick_target(decoder.cfg, family_of(decoder.cfg).hf.targets, decoder.cfg.title)
    written = target.config(decoder.cfg, 7, torch.float32)
    assert (written["bos_token_id"], written["eos_token_id"], written["use_cache"]) == (7, 7, True)


def test_encdec_generation_never_scores_the_padding_id(tmp_path):
    """lm's sampling draws from the ids below padding: transformers' generate suppresses it at every step."""
    model = random_model(EncDecConfig(**TINY, n_sentinels=10, **ENCDECS["demo-encdec"]))
    cfg = model.cfg
    hf = exported(model, tmp_path / "out")
    source = torch.tensor([[*range(5, 12), cfg.sentinel_start, *range(40, 45)]])
    out = hf.generate(source, max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
    assert len(out.scores) == 6
    for scores in out.scores:
        assert scores[0, cfg.pad_id] == -float("inf") and scores[0, :cfg.pad_id].isfinite().all()


@pytest.mark.parametrize("arch", ["gpt", "encoder", "encdec"])
def test_a_bfloat16_model_is_written_and_loaded_as_bfloat16(arch, tmp_path):
    configs = {"gpt": GPTConfig(**TINY, **DECODERS["demo-modern"]),
               "encoder": EncoderConfig(**TINY, **ENCODERS["demo-encoder"]),
               "encdec": EncDecConfig(**TINY, n_sentinels=10, **ENCDECS["demo-encdec"])}
    model = random_model(configs[arch]).to(torch.bfloat16)
    cfg = model.cfg
    write_export(model, pick_target(cfg, family_of(cfg).hf.targets, cfg.title), None, "gpt2", tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    hf = AUTO[arch].from_pretrained(tmp_path / "out", local_files_only=True, trust_remote_code=True, dtype="auto")
    assert hf.dtype == torch.bfloat16


def test_a_layer_file_that_imports_lm_inside_a_function_is_refused(tmp_path):
    """An import of lm indented in a function body would fail only when called, in a Python without lm."""
    layer = tmp_path / "layers.py"
    layer.write_text("import torch\n\n\ndef helper():\n    from lm.errors import ConfigError\n    return ConfigError\n")
    with pytest.raises(ValueError, match="cannot carry `from lm.errors import ConfigError`"):
        exported_source(layer)


@pytest.mark.parametrize("name", ["demo-modern", "mqa-learned-relu2-bias"])
def test_a_left_padded_batch_called_directly_gives_each_rows_logits_alone(name, tmp_path):
    """Called without position_ids (generate passes its own), a left-padded row's positions count its real tokens
    only, in one forward and token by token after a cache."""
    model = random_model(GPTConfig(**TINY, **DECODERS[name]))
    hf = exported(model, tmp_path / "out")
    long, short = ids(VOCAB, (1, 8), seed=3), ids(VOCAB, (1, 5), seed=4)
    batch = torch.cat([long, torch.cat([torch.zeros(1, 3, dtype=torch.long), short], dim=1)])  # (2, 8)
    mask = torch.tensor([[1] * 8, [0] * 3 + [1] * 5])
    with torch.no_grad():
        alone = [model.logits(model(row))[0, :, :VOCAB] for row in (long, short)]
        whole = hf(batch, attention_mask=mask).logits
        out = hf(batch[:, :6], attention_mask=mask[:, :6], cache=DynamicCache())
        steps = [out.logits]
        for t in (6, 7):
            out = hf(batch[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache_of(out))
            steps.append(out.logits)
    for logits in (whole, torch.cat(steps, dim=1)):
        assert_same(alone[0], logits[0])
        assert_same(alone[1], logits[1, 3:])


def test_position_ids_given_are_the_positions_used(tmp_path):
    """position_ids place the tokens (here 5.. rather than 0..), as lm's positions do within one document."""
    model = random_model(GPTConfig(**TINY, **DECODERS["mqa-learned-relu2-bias"]))
    hf = exported(model, tmp_path / "out")
    idx = ids(VOCAB, (2, 8), seed=1)
    positions = torch.arange(5, 13).expand(2, 8)
    with torch.no_grad():
        assert_same(model.logits(model(idx, positions=positions)), hf(idx, position_ids=positions).logits)


@pytest.mark.parametrize("name", ["demo-modern", "rope-layernorm-gelu-untied"])
def test_resizing_the_vocabulary_grows_the_embedding_and_the_output_layer(name, tmp_path):
    """transformers' resize_token_embeddings (new tokens for fine-tuning) reaches both the embedding and the output
    layer through their accessors; the ids the model knew keep their logits."""
    model = random_model(GPTConfig(**TINY, **DECODERS[name]))
    hf = exported(model, tmp_path / "out")
    idx = ids(VOCAB, (2, 16), seed=1)
    hf.resize_token_embeddings(VOCAB + 8)
    assert hf.get_input_embeddings().weight.shape[0] == hf.get_output_embeddings().weight.shape[0] == VOCAB + 8
    with torch.no_grad():
        logits = hf(idx).logits
        assert logits.shape[-1] == VOCAB + 8
        assert_same(model.logits(model(idx)), logits[..., :VOCAB])


def test_a_first_call_with_use_cache_starts_the_cache_the_next_call_continues(tmp_path):
    """The usual hand-written loop: `out = hf(prompt, use_cache=True)`, then `hf(next_ids, cache=out.cache)`. As in
    transformers' own models the first call starts a cache (also with use_cache unset, from config.use_cache, when
    not training); without one the next token would sit at position 0 with no context."""
    decoder = exported(random_model(GPTConfig(**TINY, **DECODERS["demo-modern"])), tmp_path / "gpt")
    encdec_model = random_model(EncDecConfig(**TINY, n_sentinels=10, **ENCDECS["demo-encdec"]))
    encdec = exported(encdec_model, tmp_path / "encdec")
    idx = ids(VOCAB, (2, 9), seed=3)
    src, tgt = ids(encdec_model.cfg.pad_id, (2, 10), seed=1), ids(encdec_model.cfg.pad_id, (2, 6), seed=2)
    with torch.no_grad():
        for use_cache in (True, None):
            out = decoder(idx[:, :8], use_cache=use_cache)
            assert_same(decoder(idx).logits[:, 8], decoder(idx[:, 8:], cache=cache_of(out)).logits[:, 0])
            out = encdec(input_ids=src, decoder_input_ids=tgt[:, :5], use_cache=use_cache)
            step = encdec(input_ids=src, decoder_input_ids=tgt[:, 5:], cache=cache_of(out)).logits[:, 0]
            assert_same(encdec(input_ids=src, decoder_input_ids=tgt).logits[:, 5], step)
        assert not carries_cache(decoder(idx, use_cache=False))
        assert not carries_cache(encdec(input_ids=src, decoder_input_ids=tgt, use_cache=False))
    decoder.train()  # a training step reads no cache back: none is kept unless asked for
    assert not carries_cache(decoder(idx)) and carries_cache(decoder(idx, use_cache=True))
