"""Exporting a model trained with a tokenizer.json copies that file and the tokenizer_config.json beside it, so
transformers loads the original model's tokenizer offline; without a tokenizer_config.json one is written."""

import json

import pytest
import torch

from lm.hf.export_files import export_hf
from lm.hf.targets import pick_target
from lm.models.gpt.config import GPTConfig
from lm.models.gpt.model import GPT
from lm.models.registry import get_family
from lm.tokenizer import load_tokenizer

TEXT = "Fair is foul, and foul is fair:\nHover through the fog and filthy air.\n"


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def tiny_model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=400, block_size=16, n_layer=1, n_head=2, d_model=16)).eval()


def export(model: GPT, tokenizer, name: str, out):
    return export_hf(model, pick_target(model.cfg, get_family("gpt").hf.targets, "a GPT"), tokenizer, name, out)


def test_tokenizer_and_its_config_are_copied(tokenizer_jsons, tmp_path):
    from transformers import AutoTokenizer

    path = tokenizer_jsons["metaspace"]
    written = export(tiny_model(), load_tokenizer(str(path)), str(path), tmp_path)
    names = {p.name for p in written}
    assert {"tokenizer.json", "tokenizer_config.json", "config.json", "model.safetensors"} <= names
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (path.parent / name).read_bytes()
    ours = load_tokenizer(str(path))
    hf = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    ids = ours.encode_ordinary(TEXT)
    assert hf.encode(TEXT, add_special_tokens=False) == ids
    assert (hf.bos_token_id, hf.eos_token_id) == (ours.bos_token, ours.eot_token) == (0, 1)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 1)
    # generate() pads finished rows with end-of-text, not with the start token
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1}


def test_an_imported_models_token_ids_and_generation_config_are_written_back(tokenizer_jsons, tmp_path):
    # a chat model's pad and end ids, and its generation settings, are its own, not what lm reads off the tokenizer
    origin = tmp_path / "origin"
    origin.mkdir()
    (origin / "config.json").write_text(json.dumps({"model_type": "gpt2", "bos_token_id": 2, "eos_token_id": 3,
                                                     "pad_token_id": 4}))
    (origin / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "eos_token_id": [3, 5]}))
    path = tokenizer_jsons["metaspace"]
    model = tiny_model()
    target = pick_target(model.cfg, get_family("gpt").hf.targets, "a GPT")
    export_hf(model, target, load_tokenizer(str(path)), str(path), tmp_path / "out", origin=origin)
    config = json.loads((tmp_path / "out/config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (2, 3, 4)
    assert (tmp_path / "out/generation_config.json").read_bytes() == (origin / "generation_config.json").read_bytes()


def test_a_config_is_written_when_the_tokenizer_has_none(tokenizer_jsons, tmp_path):
    from transformers import AutoTokenizer

    path = tokenizer_jsons["eot"]
    export(tiny_model(), load_tokenizer(str(path)), str(path), tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config == {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                      "model_max_length": 16, "clean_up_tokenization_spaces": False}
    hf = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    ids = load_tokenizer(str(path)).encode_ordinary(TEXT)
    assert hf.encode(TEXT) == ids and hf.decode(ids) == TEXT and hf.eos_token_id == 0
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}


# GPTConfig, load_tokenizer) and its `export` helper.


def test_an_end_of_text_id_the_model_has_no_row_for_is_not_written_as_its_eos(tmp_path):
    # gpt2's <|endoftext|> is id 50256: a model of 50256 ids has no logit for it, so config.json must not name
    # it (transformers' generate would stop on, and pad with, an id the model cannot produce)
    tok = load_tokenizer("gpt2")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.eot_token, block_size=16, n_layer=1, n_head=2, d_model=16)).eval()
    written = {p.name for p in export(model, tok, "gpt2", tmp_path)}
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["eos_token_id"] is None and config["bos_token_id"] is None
    assert "generation_config.json" not in written
