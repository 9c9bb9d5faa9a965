import dataclasses

import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from lm.config import load_config
from lm.data.config import DataConfig
from lm.data.span_corruption import corrupted_lengths
from lm.models.encdec.config import EncDecConfig
from lm.models.encdec.model import EncoderDecoder
from lm.models.gpt.config import GPTConfig
from lm.models.lstm.config import LSTMConfig
from lm.models.registry import family_of
from lm.plan import counts
from lm.plan.flops import peak_flops, peak_of
from lm.train import dry_run


def flops_per_token(cfg, seq_len: int) -> float:
    return counts.flops_per_token(cfg, seq_len, DataConfig())


def num_params(cfg) -> int:
    return counts.num_params(cfg)


def test_flops_per_token_gpt2_small():
    cfg = GPTConfig(n_layer=12, n_head=12, d_model=768, block_size=1024)
    n = num_params(cfg) - 1024 * 768  # the position table does no matmul
    assert n == 124_475_904 - 786_432
    assert flops_per_token(cfg, 1024) == 6 * n + 12 * 12 * 768 * 1024


def test_an_lstm_does_no_attention():
    cfg = LSTMConfig(vocab_size=100, n_layer=2, d_model=16)
    assert flops_per_token(cfg, 64) == 6 * num_params(cfg)
    untied = LSTMConfig(vocab_size=100, n_layer=2, d_model=16, tie_embeddings=False)  # a second table, looked up
    assert num_params(untied) == num_params(cfg) + 128 * 16 and flops_per_token(untied, 64) == 6 * num_params(cfg)


def test_encdec_flops_count_encoder_on_source_and_decoder_on_target_tokens():
    # counted on a built model here, from the config alone in flops_per_token
    cfg = EncDecConfig(vocab_size=100, block_size=32, n_layer=2, n_head=2, d_model=16, n_sentinels=3)
    model = EncoderDecoder(cfg)
    per_block_enc = sum(p.numel() for p in model.encoder[0].parameters())
    per_block_dec = sum(p.numel() for p in model.decoder[0].parameters())
    norm = 2 * 16  # LayerNorm weight and bias
    memory_kv = 2 * (16 * 32 + 32)  # each decoder block's cross-attention keys and values, on the source tokens
    enc, dec = 2 * per_block_enc + norm + memory_kv, 2 * per_block_dec + norm + 128 * 16 - memory_kv
    S, T = corrupted_lengths(13)
    expected = (6 * (enc * S + dec * T) + 12 * 2 * 16 * (S * S + T * T + T * S)) / 12
    assert flops_per_token(cfg, 12) == expected


def test_no_peak_on_a_cpu():
    assert peak_flops(torch.device("cpu")) is None


def test_a_mixture_of_experts_counts_its_active_parameters():
    # block 0 dense (gelu MLP 32 -> 64 -> 32), block 1 a mixture of 4 gelu experts 16 wide, 2 per token; rotary
    # positions (no table), no biases, RMSNorm, a tied head over 128 padded rows
    cfg = GPTConfig(vocab_size=96, vocab_multiple=64, block_size=16, n_layer=2, n_head=4, d_model=32, d_ff=64,
                    mlp="gelu", pos="rope", norm="rmsnorm", bias=False, n_experts=4, experts_per_token=2,
                    expert_d_ff=16, moe_first_dense=1)
    attention, norms = 4 * 32 * 32, 2 * 32
    experts = 4 * 2 * 32 * 16
    total = 128 * 32 + 2 * (attention + norms) + 2 * 32 * 64 + 32 * 4 + experts + 32
    assert (total, experts) == (20_768, 4_096)
    assert counts.num_params(cfg) == total
    active = total - experts // 2  # the 2 of 4 experts a token does not go through
    assert active == 18_720
    assert counts.num_params(cfg, active=True) == counts.num_params(cfg, non_embedding=True, active=True) == active
    assert flops_per_token(cfg, 16) == 6 * 18_720 + 12 * 2 * 4 * 8 * 16
    dense = GPTConfig(**{**cfg.__dict__, "n_experts": 0, "expert_d_ff": 0, "moe_first_dense": 0})
    assert counts.num_params(dense, active=True) == counts.num_params(dense)


def test_the_dry_run_states_total_and_active_parameters(capsys):
    # configs/moe-tiny.yaml: 16 experts 168 wide, 2 per token, in each of 4 blocks; a token goes through
    # demo-modern's whole count
    dry_run(load_config("configs/moe-tiny.yaml"), 2, 80.0)
    out = capsys.readouterr().out
    idle = 4 * (16 - 2) * 3 * 128 * 168
    assert idle == 3_612_672
    assert "parameters: 10,773,888 (7,161,216 active per token)\n" in out
    assert "10,773,888 parameters (all held; 7,161,216 active per token), world size 2" in out
    assert counts.num_params(load_config("configs/demo-modern.yaml").model) == 10_773_888 - idle == 7_161_216


@pytest.mark.parametrize("config, overrides", [
    ("configs/demo.yaml", []),
    ("configs/demo.yaml", ["--model.tie_embeddings=false"]),  # the input table is looked up, not multiplied
    ("configs/moe-tiny.yaml", []),
    ("configs/demo-encoder.yaml", []),
    ("configs/demo-encdec.yaml", []),  # the cross-attention's keys and values run on the source tokens
])
def test_flops_per_token_is_what_a_training_step_multiplies(config, overrides):
    """The estimate against torch's own count of one forward and backward of the family's loss (attention by
    the math kernel, experts one matmul each, so that every matmul is counted), at a small vocabulary where an
    embedding table counted wrongly shows."""
    cfg = load_config(config, overrides)
    model_cfg = dataclasses.replace(cfg.model, vocab_size=512)
    family = family_of(model_cfg)
    torch.manual_seed(0)
    model = family.build(model_cfg)
    for module in model.modules():
        if hasattr(module, "grouped"):
            module.grouped = False
    seq_len, batch = cfg.data.seq_len, 2
    objective = family.training.objective(model_cfg, cfg.data, seq_len, 0, None)
    rows = np.random.default_rng(0).integers(1, 500, size=(batch, seq_len + 1))
    tensors = [torch.as_tensor(a) for a in objective(rows, np.arange(batch))]
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        family.training.loss(model, model, tensors).optimized.backward()
    measured = counter.get_total_flops() / (batch * seq_len)
    assert counts.flops_per_token(model_cfg, seq_len, cfg.data) == pytest.approx(measured, rel=0.02)


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12), ("NVIDIA H200 NVL", 835e12), ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA L40", 181e12), ("NVIDIA L40S", 362e12), ("NVIDIA L4", 121e12), ("NVIDIA GH200 480GB", 989e12),
    ("NVIDIA RTX A1000 Laptop GPU", None), ("NVIDIA A10G", None), ("NVIDIA A10", 125e12),
])
def test_a_gpu_gets_its_own_peak_or_none(name, peak):
    # matched as words: an L40 took the L4's peak, so its MFU read 1.5x too high
    assert peak_of(name) == peak
