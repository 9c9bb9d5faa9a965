import torch

from lm.config import load_config
from lm.data.config import DataConfig
from lm.data.span_corruption import corrupted_lengths
from lm.models.encdec.config import EncDecConfig
from lm.models.encdec.model import EncoderDecoder
from lm.models.gpt.config import GPTConfig
from lm.models.lstm.config import LSTMConfig
from lm.plan import counts
from lm.plan.flops import peak_flops
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


def test_encdec_flops_count_encoder_on_source_and_decoder_on_target_tokens():
    # counted on a built model here, from the config alone in flops_per_token
    cfg = EncDecConfig(vocab_size=100, block_size=32, n_layer=2, n_head=2, d_model=16, n_sentinels=3)
    model = EncoderDecoder(cfg)
    per_block_enc = sum(p.numel() for p in model.encoder[0].parameters())
    per_block_dec = sum(p.numel() for p in model.decoder[0].parameters())
    norm = 2 * 16  # LayerNorm weight and bias
    enc, dec = 2 * per_block_enc + norm, 2 * per_block_dec + norm + 128 * 16
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
