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


SHAPE = dict(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
FAMILIES = {
    "llama": ("llama", {}),
    # Llama 3.2: tied embeddings, Llama 3.1's scaling with a 4-position original context, far below the text's
    "llama3": ("llama", dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 4})),
    "qwen3": ("qwen3", dict(head_dim=12)),
    "olmo2": ("olmo2", {}),
    "smollm3": ("smollm3", dict(no_rope_layer_interval=3, pad_token_id=None)),  # the third layer without rotary
    # mixtures of experts: 4 experts, top 2; Qwen3-MoE's first layer dense
    "mixtral": ("mixtral", dict(num_local_experts=4)),
    "olmoe": ("olmoe", dict(num_experts=4, num_experts_per_tok=2, pad_token_id=None)),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0],
                                    norm_topk_prob=True)),
}


MIXTURES = ("mixtral", "olmoe", "qwen3_moe")
"""More of the same reference runs, kept to the full tier (docs/dev/notes.md, "Two tiers")"""


@pytest.fixture(params=[pytest.param(kind, marks=pytest.mark.slow) if kind in MIXTURES else kind for kind in FAMILIES])
def checkpoint(request, tokenizer_jsons, tmp_path):
    """A random model of each imported family, 3 layers with grouped-query attention, of the "bos" tokenizer's 400
    ids, saved in several safetensors shards with that tokenizer.json beside it."""
    torch.manual_seed(0)
    model_type, fields = FAMILIES[request.param]
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **SHAPE, **fields)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # logits far from uniform, so greedy choices are clear
    hf.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1
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
