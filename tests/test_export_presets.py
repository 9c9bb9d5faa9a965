"""Every preset in configs/ exports to Hugging Face: a run of each (its model at a tiny size, one training step on
Macbeth under the preset's own engine, optimizer and data options) goes through `python -m lm.export --to hf` to
the class expected of it, and transformers scores the export on the val split as `python -m lm.eval` scores the
run, within 1e-3: next-token windows for a decoder (within each document where the run masks documents), the run's
own masking or span corruption for the others."""

import dataclasses
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from lm.cli import run
from lm.data.objectives import document_positions
from lm.data.prepare import prepare
from lm.eval import main as eval_main
from lm.export import main as export_main
from lm.inference.scoring import eval_windows, first_tokens, stream_windows, val_streams
from lm.models.registry import family_of
from lm.tokenizer import load_tokenizer

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
EXPECTED = {
    "demo": "GPT2LMHeadModel", "mixture": "GPT2LMHeadModel", "gpt2-124m": "GPT2LMHeadModel",
    "gpt-1.3b": "GPT2LMHeadModel", "llama-tiny": "LlamaForCausalLM", "llama-7b": "LlamaForCausalLM",
    "llama3-8b": "LlamaForCausalLM", "llama3-70b": "LlamaForCausalLM", "demo-modern": "LMDecoderForCausalLM",
    "demo-encoder": "LMEncoderForMaskedLM", "demo-encdec": "LMEncDecForConditionalGeneration",
    "moe-tiny": "Qwen3MoeForCausalLM", "olmoe-1b-7b": "OlmoeForCausalLM", "qwen3-30b-a3b": "Qwen3MoeForCausalLM",
}
"""The class each preset's run exports as: a native transformers class where one computes the model"""
SEQ_LEN, MAX_TOKENS = 32, 8 * 32 + 1  # 8 windows of val tokens


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def data_dirs(tiny_data_dir, tiny_data_config, tmp_path_factory) -> dict[str, Path]:
    """Macbeth prepared with each tokenizer the presets name, and a second gpt2 copy for the mixture."""
    root = tmp_path_factory.mktemp("preset_data")
    cl100k = root / "cl100k"
    prepare(dataclasses.replace(tiny_data_config, tokenizer="cl100k_base", dir=str(cl100k)))
    shutil.copytree(tiny_data_dir, root / "macbeth-again")
    return {"gpt2": tiny_data_dir, "cl100k_base": cl100k, "again": root / "macbeth-again"}


def tiny_run(preset: Path, data_dirs: dict[str, Path], out: Path) -> Path:
    """A run of `preset` by the real Trainer: 2 layers of width 64 (4 heads; 2 key/value heads, a feed-forward
    width of 128 and 8 experts where the preset sets them), one step on CPU in float32."""
    from lm.config import load_config
    from lm.distributed.env import init_distributed
    from lm.training.trainer import Trainer

    raw = yaml.safe_load(preset.read_text())
    model, data = raw["model"], raw["data"]
    flags = ["--model.n_layer=2", "--model.d_model=64", "--model.n_head=4", "--model.block_size=64",
             f"--data.seq_len={SEQ_LEN}", "--train.steps=1", "--train.batch_size=2", "--train.micro_batch_size=2",
             "--train.device=cpu", "--train.dtype=float32", "--train.compile=false", "--train.eval_batches=1",
             "--log.sample_every=0", "--log.tensorboard=false", "--parallel.activation_checkpointing=0",
             f"--train.out_dir={out}"]
    flags += ["--model.n_kv_head=2"] if model.get("n_kv_head") else []
    flags += ["--model.d_ff=128"] if model.get("d_ff") else []
    # a mixture of experts keeps its router and expert kind at 8 experts of 32 units, 2 per token; a balancing bias
    # that has moved has no place in transformers' classes (refused by name: tests/models/test_moe_balancing.py)
    flags += ["--model.n_experts=8", "--model.experts_per_token=2", "--model.expert_d_ff=32"] \
        if model.get("n_experts") else []
    flags += ["--model.router_bias_rate=0"] if model.get("router_bias_rate") else []
    tokenizer_dir = data_dirs[data.get("tokenizer", "gpt2")]
    if data.get("mixture"):
        flags.append(f"--data.mixture=[{{dir: {tokenizer_dir}, weight: 3}}, {{dir: {data_dirs['again']}, weight: 1}}]")
    else:
        flags.append(f"--data.dir={tokenizer_dir}")
    cfg = load_config(preset, flags)
    Trainer(cfg, init_distributed("cpu")).fit()
    return out


def lm_eval_loss(run_dir: Path, data_dir: Path, causal: bool, capsys) -> float:
    """The loss `python -m lm.eval` prints for the first MAX_TOKENS val tokens; a decoder's in windows of SEQ_LEN
    that do not overlap."""
    stride = ["--stride", str(SEQ_LEN)] if causal else []
    capsys.readouterr()
    assert run(eval_main, ["--checkpoint", str(run_dir), "--data-dir", str(data_dir), "--seq-len", str(SEQ_LEN),
                           *stride, "--max-tokens", str(MAX_TOKENS)]) == 0
    return float(re.search(r"^loss: (\S+) nats/token", capsys.readouterr().out, re.M).group(1))


@torch.no_grad()
def next_token_nll(hf, tokens: np.ndarray, document_eot: int | None) -> tuple[float, int]:
    """Summed NLL and count of transformers' next-token predictions over lm.eval's windows (stride SEQ_LEN); with
    `document_eot` each document of a window is run alone, as lm's document mask keeps attention inside it."""
    nll, count = 0.0, 0
    for start, end, first in eval_windows(len(tokens), SEQ_LEN, SEQ_LEN):
        x = torch.from_numpy(tokens[start:end].astype(np.int64))
        y = torch.from_numpy(tokens[start + 1:end + 1].astype(np.int64))
        starts = [0] if document_eot is None else \
            np.flatnonzero(document_positions(x.numpy()[None], document_eot)[0] == 0).tolist()
        logits = torch.cat([hf(x[None, a:b]).logits[0] for a, b in zip(starts, [*starts[1:], len(x)])])  # (T, V)
        scored = torch.arange(len(x)) + start + 1 >= first
        nll += F.cross_entropy(logits[scored].float(), y[scored], reduction="sum").item()
        count += int(scored.sum())
    return nll, count


@torch.no_grad()
def objective_nll(hf, cfg, streams: list[np.ndarray]) -> tuple[float, int]:
    """Summed NLL and count of transformers' predictions of the targets of the run's own objective (an encoder's
    masked tokens, an encoder-decoder's spans), window k corrupted with the key k as lm.eval does."""
    objective = family_of(cfg.model).training.objective(cfg.model, cfg.data, SEQ_LEN, cfg.train.seed)
    rows = stream_windows(streams, SEQ_LEN)
    batch = [torch.from_numpy(t) for t in objective(np.stack(rows), np.arange(len(rows)))]
    if cfg.model.arch == "encoder":
        ids, labels = batch[:2]
        logits, keep = hf(ids).logits, labels != -100
        targets = labels
    else:
        src, tgt_in, targets = batch
        logits = hf(input_ids=src, decoder_input_ids=tgt_in).logits
        keep = targets != cfg.model.pad_id
    return F.cross_entropy(logits[keep].float(), targets[keep], reduction="sum").item(), int(keep.sum())


def test_every_preset_is_listed():
    assert {p.stem for p in CONFIGS.glob("*.yaml")} == set(EXPECTED)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_run_of_every_preset_exports_and_transformers_scores_it_as_lm_eval(name, data_dirs, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM

    from lm.checkpoint.store import read_config, resolve_checkpoint

    run_dir = tiny_run(CONFIGS / f"{name}.yaml", data_dirs, tmp_path / "run")
    cfg = read_config(resolve_checkpoint(run_dir))
    out = tmp_path / "hf"
    assert run(export_main, ["--checkpoint", str(run_dir), "--to", "hf", str(out)]) == 0
    auto = {"gpt": AutoModelForCausalLM, "encoder": AutoModelForMaskedLM, "encdec": AutoModelForSeq2SeqLM}
    hf = auto[cfg.model.arch].from_pretrained(out, local_files_only=True, trust_remote_code=True).eval()
    assert type(hf).__name__ == EXPECTED[name]

    data_dir = Path(cfg.data.sources[0].dir)
    causal = family_of(cfg.model).training.causal_lm
    ours = lm_eval_loss(run_dir, data_dir, causal, capsys)
    streams = first_tokens(val_streams(data_dir, cfg.data.tokenizer, cfg.model.vocab_size), MAX_TOKENS)
    if causal:
        eot = load_tokenizer(cfg.data.tokenizer).eot_token if cfg.data.document_mask else None
        nll, count = map(sum, zip(*(next_token_nll(hf, np.asarray(s), eot) for s in streams)))
    else:
        nll, count = objective_nll(hf, cfg, streams)
    assert count > 0
    assert nll / count == pytest.approx(ours, rel=1e-3)
