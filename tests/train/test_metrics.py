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
