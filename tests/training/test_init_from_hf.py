"""Continued pretraining from a Hugging Face checkpoint: the config comes from the checkpoint, every engine's
first loss on 2 gloo ranks is transformers' loss on the same batch, and so is every parallel layout's."""

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from lm.checkpoint.resume import model_diff
from lm.cli import run
from lm.config import load_config
from lm.data.config import DataConfig
from lm.data.loader import TokenLoader
from lm.data.prepare import prepare
from lm.errors import ConfigError
from lm.export import main as export_main
from lm.train import main as train_main
from tests.distributed.test_engines import ENGINES, held_share, train
from tests.distributed.test_expert_parallel import expert_share
from tests.hf.test_import import REFUSALS, refused_checkpoint

GPT2_VOCAB = 50257  # the shards of tiny_data_dir are gpt2 ids
# the model keys of test_engines.TINY (2 layers, 2 heads, width 32, 32 positions), which must agree
LLAMA = ("llama", dict(vocab_size=GPT2_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32))
QWEN3 = ("qwen3", {**LLAMA[1], "head_dim": 8})  # heads narrower than hidden_size / num_attention_heads
OLMO2 = ("olmo2", LLAMA[1])
# 4 experts, 2 a token, the first layer dense: under fsdp each rank reads the tensors of its 2 experts alone
QWEN3_MOE = ("qwen3_moe", {**LLAMA[1], "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                           "mlp_only_layers": [0], "norm_topk_prob": True})
LLAMA3 = ("llama", {**LLAMA[1], "tie_word_embeddings": True, "rope_parameters": {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8}})
GPT2 = ("gpt2", dict(vocab_size=GPT2_VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0))


def save_hf(kind: tuple[str, dict], directory: Path, **changes: object) -> PreTrainedModel:
    model_type, fields = kind
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**fields, **changes}))
    with torch.no_grad():
        for p in hf.parameters():  # gains and biases off their init, logits O(1)
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(directory, max_shard_size="2MB")  # sharded: a file holds a part of the embedding
    return hf.eval()


def first_batch_loss(hf: PreTrainedModel, data_dir: Path, *flags: str) -> float:
    """transformers' mean loss on the first global batch the run reads (the same for any world size)."""
    cfg = load_config(None, [f"--data.dir={data_dir}", *flags])
    loader = TokenLoader(data_dir, "train", cfg.data.seq_len, cfg.train.seed, 0, 1, cfg.train.batch_size,
                         cfg.train.batch_size)
    (x, y), = loader.next_batch()
    with torch.no_grad():
        logits = hf(torch.from_numpy(x)).logits
    return F.cross_entropy(logits.flatten(0, 1), torch.from_numpy(y).flatten()).item()


@pytest.mark.process
@pytest.mark.parametrize("engine, kind, lr", [
    ("ddp", LLAMA, 1e-3), ("fsdp", LLAMA, 1e-3), ("fsdp", GPT2, 1e-3), ("zero3", LLAMA, 1e-3), ("fsdp", QWEN3, 1e-3),
    ("ddp", OLMO2, 1e-3), ("fsdp", QWEN3_MOE, 1e-3),
    ("zero3", LLAMA3, 1e-2),  # starts near the uniform loss, where 5 steps at 1e-3 move it less than the batches do
], ids=["ddp-llama", "fsdp-llama", "fsdp-gpt2", "zero3-llama", "fsdp-qwen3", "ddp-olmo2", "fsdp-qwen3moe",
        "zero3-llama3"])
def test_training_continues_from_transformers_loss_on_two_ranks(engine, kind, lr, tiny_data_dir, tmp_path):
    hf = save_hf(kind, tmp_path / "hf")
    # validated and saved at the end alone: the step-3 checkpoint and val loss would go unread
    flags = ["--train.steps=5", "--train.eval_every=5", "--checkpoint.every=5", f"--optim.lr={lr}", *ENGINES[engine],
             f"--checkpoint.init_from={tmp_path / 'hf'}"]
    losses = train(2, tmp_path / "run", tiny_data_dir, *flags)
    expected = first_batch_loss(hf, tiny_data_dir, "--data.seq_len=16", "--train.batch_size=8")
    assert losses[1] == pytest.approx(expected, rel=1e-5)
    assert losses[5] < losses[1]
    saved = json.loads((tmp_path / "run/checkpoints/step_00000005/state.json").read_text())
    assert saved["world_size"] == 2


@pytest.mark.process
def test_an_expert_parallel_run_continues_a_mixture_from_transformers_loss(tiny_data_dir, tmp_path):
    """ep=2 x FSDP2 on 4 ranks: each rank reads its one expert of the 4 (its ep rank's 2, halved by FSDP2), and
    trains as one process continuing the same checkpoint."""
    hf = save_hf(QWEN3_MOE, tmp_path / "hf")
    flags = ["--train.steps=3", "--parallel.engine=fsdp", f"--checkpoint.init_from={tmp_path / 'hf'}"]
    split = train(4, tmp_path / "ep2", tiny_data_dir, *flags, "--parallel.ep=2")
    one = train(1, tmp_path / "one", tiny_data_dir, *flags)
    assert expert_share(tmp_path / "ep2") == pytest.approx(1 / 4)  # the layout was applied, not ignored
    expected = first_batch_loss(hf, tiny_data_dir, "--data.seq_len=16", "--train.batch_size=8")
    assert split[1] == pytest.approx(expected, rel=1e-5)
    assert sorted(split) == sorted(one) == [1, 2, 3]
    for step in one:  # the all-to-all and FSDP2 sum in another order than one process
        assert split[step] == pytest.approx(one[step], rel=1e-4), step


@pytest.mark.process
def test_tensor_parallel_and_hsdp_runs_start_from_a_checkpoint_as_one_process_does(tiny_corpus_dir, tokenizer_jsons,
                                                                                  tmp_path):
    """tp=2 (2 ranks), dp_replicate=2 x FSDP2 and tp=2 x FSDP2 (4 ranks): each rank fills its block of every
    parameter, where FSDP2 shards again a dimension tensor parallelism split (a strided shard) too, and the first
    step's loss is one process's. The 400 ids of a tokenizer.json keep the vocabulary even (gpt2's 50,257 rows do
    not split over 2 ranks) and the model small."""
    data = DataConfig(source=str(tiny_corpus_dir / "*.txt"), tokenizer=str(tokenizer_jsons["eot"]),
                      dir=str(tmp_path / "data"), val_fraction=0.1, shard_tokens=4096, num_workers=1, seq_len=16)
    prepare(data)
    hf = save_hf(LLAMA, tmp_path / "hf", vocab_size=400, num_key_value_heads=2)  # a key/value head per tp rank
    shutil.copy(tokenizer_jsons["eot"], tmp_path / "hf/tokenizer.json")
    flags = ["--train.steps=1", "--parallel.engine=fsdp", f"--checkpoint.init_from={tmp_path / 'hf'}"]
    one = train(1, tmp_path / "one", Path(data.dir), *flags)
    assert one[1] == pytest.approx(first_batch_loss(hf, Path(data.dir), "--data.seq_len=16", "--train.batch_size=8"),
                                   rel=1e-5)
    # the share of the parameters rank 0 holds shows each layout was applied, not ignored
    for name, nproc, layout, share in [("tp2", 2, "--parallel.tp=2", 1 / 2),
                                       ("hsdp", 4, "--parallel.dp_replicate=2", 1 / 2),
                                       ("tp2dp2", 4, "--parallel.tp=2", 1 / 4)]:
        split = train(nproc, tmp_path / name, Path(data.dir), *flags, layout)
        assert split[1] == pytest.approx(one[1], rel=1e-5), name
        assert held_share(tmp_path / name) == pytest.approx(share, abs=0.02), name


def test_the_model_comes_from_the_checkpoint(tmp_path):
    save_hf(LLAMA, tmp_path, rope_theta=500.0)
    cfg = load_config(None, [f"--checkpoint.init_from={tmp_path}", "--data.seq_len=16", "--model.n_layer=2",
                             "--model.dropout=0.1"])
    m = cfg.model
    assert (m.pos, m.norm, m.mlp, m.bias, m.n_kv_head, m.d_ff, m.rope_theta) == ("rope", "rmsnorm", "swiglu",
                                                                                  False, 1, 64, 500.0)
    assert (m.vocab_size, m.padded_vocab_size, m.tie_embeddings, m.norm_eps) == (GPT2_VOCAB, GPT2_VOCAB, False, 1e-6)
    assert m.dropout == 0.1  # a training setting, free to differ


def test_the_tokenizer_is_the_checkpoints_and_another_is_refused(tokenizer_jsons, tmp_path):
    save_hf(LLAMA, tmp_path / "hf", vocab_size=400)
    shutil.copy(tokenizer_jsons["eot"], tmp_path / "hf/tokenizer.json")
    init = [f"--checkpoint.init_from={tmp_path / 'hf'}", "--data.seq_len=16"]
    assert load_config(None, init).data.tokenizer == str(tmp_path / "hf/tokenizer.json")
    # the same file elsewhere makes the same ids; another one's embedding rows would stand for other tokens
    assert load_config(None, [*init, f"--data.tokenizer={tokenizer_jsons['eot']}"]).data.tokenizer == \
        str(tokenizer_jsons["eot"])
    with pytest.raises(ConfigError, match=rf"^data.tokenizer: '{tokenizer_jsons['bos']}' is not the tokenizer of "
                                          rf"checkpoint.init_from={tmp_path / 'hf'} \({tmp_path / 'hf/tokenizer.json'}"
                                          r"\), whose embedding rows stand for that tokenizer's ids"):
        load_config(None, [*init, f"--data.tokenizer={tokenizer_jsons['bos']}"])


def test_a_mixture_of_experts_run_sets_its_own_loss_weights(tmp_path):
    # config.json's router_aux_loss_coef gives model.aux_loss_coef, but the losses' weights are the run's to choose
    save_hf(QWEN3_MOE, tmp_path)
    cfg = load_config(None, [f"--checkpoint.init_from={tmp_path}", "--data.seq_len=16",
                             "--model.aux_loss_coef=0.05", "--model.router_z_loss_coef=0.001",
                             "--model.router_bias_update=error"])  # as the balancing bias's rule
    assert (cfg.model.n_experts, cfg.model.aux_loss_coef, cfg.model.router_z_loss_coef) == (4, 0.05, 0.001)
    assert cfg.model.router_bias_update == "error"
    # and a resume may change them, but not whether the routers keep a bias
    assert model_diff(cfg.model, replace(cfg.model, aux_loss_coef=0.0, router_bias_update="sign")) == ""
    assert model_diff(cfg.model, replace(cfg.model, router_bias_rate=0.001)) == "model.router_bias_rate: 0.0 -> 0.001"


def test_a_model_key_that_disagrees_is_one_error(tmp_path):
    save_hf(LLAMA, tmp_path)
    with pytest.raises(ConfigError, match=rf"model.n_layer: 3 disagrees with checkpoint.init_from={tmp_path}, "
                                          r"whose config.json gives 2; the model comes from the checkpoint"):
        load_config(None, [f"--checkpoint.init_from={tmp_path}", "--model.n_layer=3"])
    # a key the family does not take is named, as without init_from (a misspelt one vanished)
    for key in ("n_layers", "z_loss"):
        with pytest.raises(ConfigError, match=rf"^model.{key}: not a key of a decoder-only GPT"):
            load_config(None, [f"--checkpoint.init_from={tmp_path}", f"--model.{key}=2"])


@pytest.mark.slow
@pytest.mark.parametrize("kind, edit, fragment", REFUSALS, ids=[f"{k}-{next(iter(e))}" for k, e, _ in REFUSALS])
def test_a_refused_checkpoint_stops_the_run_before_it_writes(kind, edit, fragment, tiny_data_dir, tmp_path, capsys):
    checkpoint = refused_checkpoint(kind, edit, tmp_path / "hf")
    argv = [f"--checkpoint.init_from={checkpoint}", f"--data.dir={tiny_data_dir}", "--data.seq_len=16",
            f"--train.out_dir={tmp_path / 'run'}", "--train.device=cpu", "--log.tensorboard=false", "--train.steps=1"]
    capsys.readouterr()  # transformers' progress bars
    assert run(train_main, argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: checkpoint.init_from: {checkpoint / 'config.json'}: ")
    assert fragment in lines[0]
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_missing_a_tensor_stops_the_run_before_it_writes(tiny_data_dir, tmp_path, capsys):
    save_hf(LLAMA, tmp_path / "hf")
    index = json.loads((tmp_path / "hf/model.safetensors.index.json").read_text())
    shard = tmp_path / "hf" / index["weight_map"]["model.layers.1.mlp.down_proj.weight"]
    tensors = load_file(shard)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, shard, metadata={"format": "pt"})
    argv = [f"--checkpoint.init_from={tmp_path / 'hf'}", f"--data.dir={tiny_data_dir}", "--data.seq_len=16",
            f"--train.out_dir={tmp_path / 'run'}", "--train.device=cpu", "--log.tensorboard=false", "--train.steps=1"]
    capsys.readouterr()
    assert run(train_main, argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"error: {tmp_path / 'hf'}: its weights do not match its config.json: missing "
                     "model.layers.1.mlp.down_proj.weight"]
    assert not (tmp_path / "run").exists()


@pytest.mark.process
def test_an_export_of_a_continued_checkpoint_keeps_its_token_ids_and_generation_settings(tiny_data_dir, tmp_path):
    """A Llama 3.2-like checkpoint (tied embedding) whose config.json says bos 1 and eos 2: continued training
    and export write those ids and its generation_config.json back, whatever lm's tokenizer would choose, and
    the log counts the tied embedding outside the non-embedding parameters."""
    save_hf(LLAMA3, tmp_path / "hf", bos_token_id=1, eos_token_id=2)
    generation = {"bos_token_id": 1, "eos_token_id": [2, 7], "temperature": 0.6, "top_p": 0.9, "do_sample": True}
    (tmp_path / "hf/generation_config.json").write_text(json.dumps(generation))
    train(1, tmp_path / "run", tiny_data_dir, "--train.steps=2", f"--checkpoint.init_from={tmp_path / 'hf'}")
    shutil.rmtree(tmp_path / "hf")  # the run keeps what the export needs
    assert run(export_main, ["--checkpoint", str(tmp_path / "run"), "--to", "hf", str(tmp_path / "out")]) == 0
    config = json.loads((tmp_path / "out/config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert json.loads((tmp_path / "out/generation_config.json").read_text()) == generation
    embedding = GPT2_VOCAB * 32
    total, outside = re.search(r"model: ([\d.]+)M parameters \(([\d.]+)M outside the embeddings\)",
                               (tmp_path / "run.log").read_text()).groups()
    assert float(total) - float(outside) == pytest.approx(embedding / 1e6, abs=0.01)


def test_a_yaml_tokenizer_with_the_checkpoints_ids_is_kept_as_written(tokenizer_jsons, tmp_path):
    save_hf(LLAMA, tmp_path / "hf", vocab_size=400)
    shutil.copy(tokenizer_jsons["eot"], tmp_path / "hf/tokenizer.json")
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({"checkpoint": {"init_from": str(tmp_path / "hf")},
                                      "data": {"seq_len": 16, "tokenizer": str(tokenizer_jsons["eot"])}}))
    assert load_config(str(config), []).data.tokenizer == str(tokenizer_jsons["eot"])
