"""Compiled decoding on a GPU: the one-token step captured as a CUDA graph (torch.compile's reduce-overhead) gives
eager's greedy tokens, compiles once for a shape and is not skipped by CUDA graphs (a cache written in place must
keep its address). Skipped without CUDA; the CPU side is tests/models/test_generate.py."""

import pytest
import torch

from lm.models.generate import generate, generate_batch
from lm.models.gpt.config import GPTConfig
from lm.models.gpt.model import GPT

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_cuda_graph_decoding_gives_eager_tokens_and_captures_once():
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, d_model=128, pos="rope",
                          n_kv_head=2)).cuda().eval()
    prompts = torch.randint(0, 256, (4, 5), device="cuda")
    eager = generate_batch(model, prompts, 40, temperature=0.0)
    graphs, skips = counters["stats"]["unique_graphs"], counters["inductor"]["cudagraph_skips"]
    for shift in (0, 1):  # a second call of the same shape reuses the cache and the graph
        assert torch.equal(generate_batch(model, (prompts + shift) % 256, 40, temperature=0.0, compiled=True),
                           generate_batch(model, (prompts + shift) % 256, 40, temperature=0.0))
    assert counters["stats"]["unique_graphs"] - graphs == 1
    assert counters["inductor"]["cudagraph_skips"] == skips
    assert generate(model, prompts[0].tolist(), 20, temperature=0.0, compiled=True) == eager[0, :20].tolist()
