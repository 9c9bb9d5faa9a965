import math

import pytest
import torch

from lm.models.config import ModelConfig
from lm.train.metrics import flops_per_token, peak_flops, perplexity


def test_flops_per_token_gpt2_small():
    cfg = ModelConfig(n_layer=12, n_head=12, d_model=768, block_size=1024)
    n = 124_000_000
    assert flops_per_token(cfg, n, 1024) == 6 * n + 12 * 12 * 768 * 1024


def test_perplexity_and_peak():
    assert perplexity(math.log(20.0)) == pytest.approx(20.0)
    assert perplexity(1e4) == math.inf
    assert peak_flops(torch.device("cpu")) is None


def test_encdec_flops_count_encoder_on_source_and_decoder_on_target_tokens():
    from lm.models.encdec import EncoderDecoder
    from lm.train.metrics import encdec_flops_per_token

    cfg = ModelConfig(arch="encdec", vocab_size=100, block_size=32, n_layer=2, n_head=2, d_model=16, n_sentinels=3)
    model = EncoderDecoder(cfg)
    per_block_enc = sum(p.numel() for p in model.encoder[0].parameters())
    per_block_dec = sum(p.numel() for p in model.decoder[0].parameters())
    norm = 2 * 16  # LayerNorm weight and bias
    enc, dec = 2 * per_block_enc + norm, 2 * per_block_dec + norm + 128 * 16
    expected = (6 * (enc * 10 + dec * 4) + 12 * 2 * 16 * (100 + 16 + 40)) / 12
    assert encdec_flops_per_token(model, 12, 10, 4) == expected
