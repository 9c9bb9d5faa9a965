"""lm.eval and lm.sample read a Hugging Face checkpoint directory directly, with its own tokenizer.json."""

import re
import shutil

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from lm import eval as eval_tool
from lm import sample as sample_tool
from lm.cli import run
from lm.tokenizer import load_tokenizer

TEXT = "So foul and fair a day I have not seen."


@pytest.fixture
def checkpoint(tokenizer_jsons, tmp_path):
    """A random Llama of the "bos" tokenizer's 400 ids, saved with that tokenizer.json beside it."""
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    hf = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # logits far from uniform, so greedy choices are clear
    hf.save_pretrained(tmp_path / "hf")
    shutil.copy(tokenizer_jsons["bos"], tmp_path / "hf/tokenizer.json")
    return hf, tmp_path / "hf"


def test_eval_scores_a_text_as_transformers_does(checkpoint, tmp_path, capsys):
    hf, directory = checkpoint
    (tmp_path / "line.txt").write_text(TEXT)
    capsys.readouterr()
    assert run(eval_tool.main, ["--checkpoint", str(directory), "--text", str(tmp_path / "line.txt")]) == 0
    loss = float(re.search(r"loss: ([\d.]+) nats/token", capsys.readouterr().out).group(1))
    tokenizer = load_tokenizer(str(directory / "tokenizer.json"))
    ids = torch.tensor([[tokenizer.bos_token, *tokenizer.encode_ordinary(TEXT)]])  # one window: the whole text
    with torch.no_grad():
        expected = F.cross_entropy(hf(ids[:, :-1]).logits[0], ids[0, 1:]).item()
    assert loss == pytest.approx(expected, abs=1e-4)  # printed to 4 decimals


def test_greedy_sampling_continues_as_transformers_generate(checkpoint, capsys):
    hf, directory = checkpoint
    capsys.readouterr()
    assert run(sample_tool.main, ["--checkpoint", str(directory), "--prompt", "So foul", "--temperature", "0",
                                  "--max-new-tokens", "12"]) == 0
    printed = capsys.readouterr().out.rstrip("\n")
    tokenizer = load_tokenizer(str(directory / "tokenizer.json"))
    prompt = [tokenizer.bos_token, *tokenizer.encode_ordinary("So foul")]
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                          eos_token_id=tokenizer.eot_token, pad_token_id=tokenizer.eot_token)[0, len(prompt):].tolist()
    if tokenizer.eot_token in out:
        out = out[:out.index(tokenizer.eot_token)]
    assert len(out) > 3 and printed == "So foul" + tokenizer.decode(out)
