import torch

from lm.data.config import DataConfig
from lm.data.span_corruption import corrupted_lengths
from lm.models.encdec.config import EncDecConfig
from lm.models.encdec.model import EncoderDecoder
from lm.models.gpt.config import GPTConfig
from lm.models.lstm.config import LSTMConfig
from lm.plan import counts
from lm.plan.flops import peak_flops


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
