"""Exporting an encoder with the masked-LM head as transformers' BertForMaskedLM: a random model's logits
come back from `from_pretrained` to 1e-5 (padded batches too), the written tensors are ours, every option
BERT cannot reproduce is refused by name before anything is written (the family then exports lm's own code), and
`python -m lm.export` does it from a consolidated checkpoint."""

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from transformers import BertForMaskedLM

from lm.checkpoint.model_weights import tied_names
from lm.cli import run
from lm.config import load_config
from lm.errors import ExportError
from lm.export import main
from lm.hf.export_files import write_export
from lm.hf.targets import pick_target
from lm.models.encoder import hf as encoder_hf
from lm.models.encoder.config import EncoderConfig
from lm.models.encoder.model import Encoder
from lm.models.registry import get_family
from tests.models.test_parity_hf import random_model

VOCAB = 300  # + [MASK], [CLS], padding = 303 ids, padded to 320 rows
BERT = dict(norm_position="post")
TOKEN_TYPES = "bert.embeddings.token_type_embeddings.weight"


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def tiny_config(**overrides: object) -> EncoderConfig:
    fields = dict(vocab_size=VOCAB, block_size=32, n_layer=2, n_head=4, d_model=64, d_ff=96, norm_eps=1e-6,
                  **BERT)
    fields.update(overrides)
    return EncoderConfig(**fields)


def bert_target(cfg: EncoderConfig):
    """BERT's target for `cfg` (ExportError when BERT does not reproduce it; the family then exports the model as
    lm's own code, tests/hf/test_remote_code.py)."""
    return pick_target(cfg, encoder_hf.TARGETS, cfg.title)


def export(model: Encoder, out: Path) -> list[str]:
    """The export as `lm.export` does it: the target first, then the files."""
    return write_export(model, bert_target(model.cfg), None, "gpt2", out)[0]


def random_encoder(cfg: EncoderConfig, seed: int = 0) -> Encoder:
    """Every parameter drawn anew (`random_model`), so no zero or one left by the init hides a misplaced tensor."""
    return random_model(cfg, seed)


def exported(model: Encoder, out: Path) -> BertForMaskedLM:
    """`model` written by the export and read back by transformers alone, with nothing missing or left over."""
    export(model, out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    hf, info = BertForMaskedLM.from_pretrained(out, local_files_only=True, output_loading_info=True)
    assert not any(info.values()), info
    assert hf.dtype == torch.float32
    # the output layer is the word embedding, and its bias the head's own
    assert hf.cls.predictions.decoder.weight.data_ptr() == hf.bert.embeddings.word_embeddings.weight.data_ptr()
    return hf.eval()


def ids_of(cfg: EncoderConfig, shape: tuple[int, int], seed: int) -> torch.Tensor:
    """Random ids over every id the model knows, [MASK] and [CLS] included, each row starting with [CLS]."""
    ids = torch.randint(0, cfg.total_vocab_size, shape, generator=torch.Generator().manual_seed(seed))
    ids[:, 0] = cfg.cls_id
    return ids


def test_transformers_gives_our_logits(tmp_path):
    model = random_encoder(tiny_config())
    hf = exported(model, tmp_path / "bert")
    ids = ids_of(model.cfg, (3, 32), seed=1)
    with torch.no_grad():
        ours = model.mlm_logits(model(ids))
        theirs = hf(ids).logits
    assert ours.shape == theirs.shape == (3, 32, 320) and theirs.std() > 0.3
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_transformers_gives_our_logits_under_a_padding_mask(tmp_path):
    """Rows padded to the longest: our boolean `keep` and BERT's attention_mask give the same logits at every
    real position."""
    model = random_encoder(tiny_config(), seed=2)
    hf = exported(model, tmp_path / "bert")
    cfg = model.cfg
    ids = ids_of(cfg, (3, 20), seed=3)
    keep = torch.arange(20)[None, :] < torch.tensor([20, 13, 5])[:, None]  # (B, T)
    ids[~keep] = cfg.pad_id
    with torch.no_grad():
        ours = model.mlm_logits(model(ids, keep))
        theirs = hf(ids, attention_mask=keep.long()).logits
        unpadded = model.mlm_logits(model(ids[1:2, :13]))
    torch.testing.assert_close(ours[keep], theirs[keep], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(theirs[1, :13], unpadded[0], atol=1e-5, rtol=1e-5)  # padding changes nothing


def test_the_written_tensors_are_ours(tmp_path):
    """Each of our parameters is the rows of its BERT tensors in the file (q/k/v cut in three), the token-type
    table is one row of zeros, and the config describes the model: its whole padded vocabulary, our padding id."""
    model = random_encoder(tiny_config())
    cfg = model.cfg
    out = tmp_path / "bert"
    export(model, out)
    written = load_file(out / "model.safetensors")
    plan = bert_target(cfg).plan(cfg)
    assert set(written) == {part.name for parts in plan.values() for part in parts} | {TOKEN_TYPES}
    ours = model.state_dict()
    assert set(ours) - set(plan) == {"lm_head.weight"}  # tied: the embedding
    for name, parts in plan.items():
        torch.testing.assert_close(torch.cat([written[part.name] for part in parts]), ours[name], atol=0, rtol=0)
    assert written[TOKEN_TYPES].shape == (1, 64) and not written[TOKEN_TYPES].any()

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["BertForMaskedLM"] and config["model_type"] == "bert"
    assert (config["vocab_size"], config["pad_token_id"]) == (320, VOCAB + 2)
    assert config["hidden_act"] == "gelu_pytorch_tanh"
    assert (config["type_vocab_size"], config["intermediate_size"]) == (1, 96)
    assert (config["max_position_embeddings"], config["layer_norm_eps"]) == (32, 1e-6)


@pytest.mark.parametrize("overrides, have, needs", [
    ({"norm_position": "pre"}, "model.norm_position=pre", "model.norm_position=post"),
    ({"pos": "rope"}, "model.pos=rope", "model.pos=learned"),
    ({"pos": "sinusoidal"}, "model.pos=sinusoidal", "model.pos=learned"),
    ({"norm": "rmsnorm"}, "model.norm=rmsnorm", "model.norm=layernorm"),
    ({"mlp": "swiglu"}, "model.mlp=swiglu", "model.mlp=gelu"),
    ({"bias": False}, "model.bias=false", "model.bias=true"),
    ({"tie_embeddings": False}, "model.tie_embeddings=false", "model.tie_embeddings=true"),
    ({"n_kv_head": 2}, "model.n_kv_head=2", "model.n_kv_head=0 (one key/value head per query head)"),
    ({"head": "classify", "num_classes": 3}, "model.head=classify", "model.head=mlm"),
])
def test_what_bert_cannot_reproduce_is_refused_by_name_writing_nothing(tmp_path, overrides, have, needs):
    model = random_encoder(tiny_config(**overrides))
    with pytest.raises(ExportError) as err:
        export(model, tmp_path / "out")
    assert str(err.value) == (f"cannot export to Hugging Face: no transformers model has this combination ({have}): "
                              f"BertForMaskedLM (BERT) needs {needs}")
    assert list(tmp_path.iterdir()) == []
    if model.cfg.head == "mlm":  # the family's last target, lm's own code, takes the rest
        assert pick_target(model.cfg, get_family("encoder").hf.targets, "").hf_class == "LMEncoderForMaskedLM"


def test_every_key_in_the_way_is_named_in_one_message():
    with pytest.raises(ExportError) as err:
        bert_target(tiny_config(norm_position="pre", pos="rope", mlp="swiglu"))
    assert ("(model.pos=rope, model.norm_position=pre, model.mlp=swiglu): BertForMaskedLM (BERT) needs "
            "model.pos=learned, model.norm_position=post, model.mlp=gelu") in str(err.value)
    assert bert_target(tiny_config()).hf_class == "BertForMaskedLM"


def consolidated(model: Encoder, path: Path) -> Path:
    """`model` as a consolidated checkpoint file (the format of `python -m lm.consolidate`), with a job config
    of the tokenizer gpt2."""
    task = {"task": {"file": "labels.csv"}} if model.cfg.task_head else {}  # a fine-tuned head's rows
    job = load_config(base={"model": vars(model.cfg), "data": {"seq_len": model.cfg.block_size}, **task})
    aliases = tied_names(model)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if k not in aliases}
    save_file(tensors, path, metadata={"format": "pt", "lm_config": yaml.safe_dump(job.to_dict(), sort_keys=False),
                                       "step": "0", "engine": "ddp", "source": str(path), "tied": json.dumps(aliases)})
    return path


def test_the_cli_exports_a_consolidated_encoder_and_prints_its_special_ids(tmp_path, caplog):
    model = random_encoder(tiny_config(vocab_size=50257, d_model=32, n_head=2, d_ff=0, norm_eps=1e-12))
    checkpoint = consolidated(model, tmp_path / "encoder.safetensors")
    out = tmp_path / "hf"
    with caplog.at_level("INFO", logger="lm.export"):
        assert run(main, ["--checkpoint", str(checkpoint), "--to", "hf", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert "as BertForMaskedLM" in caplog.text
    assert "no tokenizer files: encode text with data.tokenizer=gpt2 and add the ids beyond it: [CLS]=50258 first, " \
           "[MASK]=50257, padding=50259" in caplog.text
    hf = BertForMaskedLM.from_pretrained(out, local_files_only=True).eval()
    ids = ids_of(model.cfg, (2, 32), seed=4)
    with torch.no_grad():
        torch.testing.assert_close(model.mlm_logits(model(ids)), hf(ids).logits, atol=1e-5, rtol=1e-5)


def test_the_cli_refuses_a_fine_tuning_head_in_one_line_before_out_exists(tmp_path, capsys):
    """BERT's classifier has a tanh pooler ours has not, and lm's own code has the masked-LM head alone."""
    model = random_encoder(tiny_config(vocab_size=50257, d_model=32, n_head=2, head="classify", num_classes=3))
    checkpoint = consolidated(model, tmp_path / "encoder.safetensors")
    assert run(main, ["--checkpoint", str(checkpoint), "--to", "hf", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: cannot export to Hugging Face: no transformers model has this combination "
        "(model.head=classify): BertForMaskedLM (BERT) needs model.head=mlm; LMEncoderForMaskedLM (lm's own code) "
        "needs model.head=mlm"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["encoder.safetensors"]


def test_the_cli_exports_an_encoder_bert_cannot_compute_as_lm_code_without_tokenizer_files(tmp_path, caplog):
    """Rotary positions go out as lm's own code; as for BERT, no tokenizer files (they would encode text without
    the [CLS] the model always saw first), and the note names the ids to add."""
    model = random_encoder(tiny_config(vocab_size=50257, d_model=32, n_head=2, d_ff=0, pos="rope"))
    checkpoint = consolidated(model, tmp_path / "encoder.safetensors")
    out = tmp_path / "hf"
    with caplog.at_level("INFO", logger="lm.export"):
        assert run(main, ["--checkpoint", str(checkpoint), "--to", "hf", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "attention.py", "block.py", "config.json", "configuration_lm.py", "hf_glue.py", "kv_cache.py", "layers.py",
        "model.safetensors", "modeling_lm_encoder.py"]
    assert "as LMEncoderForMaskedLM" in caplog.text and "trust_remote_code=True" in caplog.text
    assert "no tokenizer files: encode text with data.tokenizer=gpt2 and add the ids beyond it: [CLS]=50258 first, " \
           "[MASK]=50257, padding=50259" in caplog.text
