import math

import pytest
import torch

from lm.errors import ConfigError
from lm.models import generate as generate_module
from lm.models.family import SampleOptions
from lm.models.generate import filter_logits, generate, generate_batch, pick_token
from lm.models.gpt.config import GPTConfig
from lm.models.gpt.model import GPT
from lm.models.lstm.config import LSTMConfig
from lm.models.lstm.model import LSTMLM
from lm.models.next_token import sample
from lm.tokenizer import model_tokenizer

INF = float("inf")


def tiny_model(seed: int = 0, **overrides: object) -> GPT:
    fields = dict(vocab_size=100, block_size=32, n_layer=2, n_head=2, d_model=32)
    fields.update(overrides)
    torch.manual_seed(seed)
    return GPT(GPTConfig(**fields)).eval()


def greedy_without_cache(model: GPT, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Reference decoder: recompute the whole sequence every step."""
    seq = list(prompt)
    for _ in range(max_new_tokens):
        logits = model.logits(model(torch.tensor([seq])))
        seq.append(int(logits[0, -1, : model.cfg.vocab_size].argmax()))
    return seq[len(prompt) :]


# filter_logits


def test_top_k_keeps_the_k_largest() -> None:
    logits = torch.tensor([1.0, 4.0, 2.0, 3.0, 0.0])
    expected = torch.tensor([-INF, 4.0, -INF, 3.0, -INF])
    assert torch.equal(filter_logits(logits, top_k=2), expected)
    assert torch.equal(filter_logits(logits, top_k=1), torch.tensor([-INF, 4.0, -INF, -INF, -INF]))
    assert torch.equal(filter_logits(logits, top_k=5), logits)
    assert torch.equal(filter_logits(logits, top_k=50), logits)


def test_top_k_keeps_ties_with_the_kth_value() -> None:
    logits = torch.tensor([2.0, 1.0, 2.0, 0.0])
    assert torch.equal(filter_logits(logits, top_k=1), torch.tensor([2.0, -INF, 2.0, -INF]))


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    # probabilities 0.1, 0.5, 0.15, 0.25 -> sorted 0.5, 0.25, 0.15, 0.1; cumulative 0.5, 0.75, 0.9, 1.0
    logits = torch.tensor([0.1, 0.5, 0.15, 0.25]).log()
    assert torch.equal(filter_logits(logits, top_p=0.4), torch.tensor([-INF, logits[1], -INF, -INF]))
    assert torch.equal(filter_logits(logits, top_p=0.6), torch.tensor([-INF, logits[1], -INF, logits[3]]))
    assert torch.equal(filter_logits(logits, top_p=0.8), torch.cat([torch.tensor([-INF]), logits[1:]]))
    assert torch.equal(filter_logits(logits, top_p=0.95), logits)
    # 1 keeps every token: a float32 sum of 50k probabilities reaches 1.0 before the last ones
    wide = torch.randn(50257, generator=torch.Generator().manual_seed(0)) * 3
    assert wide.softmax(-1).sort(descending=True).values.cumsum(-1)[:-1].ge(1.0).any()
    assert torch.equal(filter_logits(wide, top_p=1.0), wide)
    assert torch.equal(filter_logits(logits, top_p=1.0), logits)


def test_top_p_drops_a_token_once_the_tokens_before_it_reach_p_exactly() -> None:
    # four equal logits: cumulative 0.25, 0.5, ... exactly; with top_p=0.5 the first two reach it, so two stay
    assert torch.isfinite(filter_logits(torch.zeros(4), top_p=0.5)).sum().item() == 2
    assert torch.isfinite(filter_logits(torch.zeros(2), top_p=0.5)).sum().item() == 1
    assert torch.isfinite(filter_logits(torch.zeros(8), top_p=0.25)).sum().item() == 2


def test_top_p_always_keeps_the_most_probable_token() -> None:
    logits = torch.tensor([0.0, 10.0, 0.0])
    assert torch.equal(filter_logits(logits, top_p=1e-9), torch.tensor([-INF, 10.0, -INF]))


def test_top_k_then_top_p() -> None:
    # probabilities 0.1, 0.5, 0.15, 0.25. top_k=3 drops 0.1 and renormalises the rest to
    # 0.556, 0.278, 0.167 (cumulative 0.556, 0.833), so top_p=0.8 then keeps two tokens;
    # top_p alone (cumulative 0.5, 0.75, 0.9) would keep three.
    logits = torch.tensor([0.1, 0.5, 0.15, 0.25]).log()
    two = torch.tensor([-INF, logits[1], -INF, logits[3]])
    three = torch.tensor([-INF, logits[1], logits[2], logits[3]])
    assert torch.equal(filter_logits(logits, top_k=3, top_p=0.8), two)
    assert torch.equal(filter_logits(logits, top_p=0.8), three)


def test_filter_works_row_by_row_and_leaves_input_alone() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0], [1.0, 2.0, 3.0]])
    before = logits.clone()
    out = filter_logits(logits, top_k=2)
    assert torch.equal(out, torch.tensor([[3.0, 2.0, -INF], [-INF, 2.0, 3.0]]))
    out = filter_logits(logits, top_p=0.5)
    assert torch.equal(out, torch.tensor([[3.0, -INF, -INF], [-INF, -INF, 3.0]]))
    assert torch.equal(logits, before)
    assert torch.equal(filter_logits(logits), logits)


@pytest.mark.parametrize("kwargs", [dict(top_k=0), dict(top_p=0.0), dict(top_p=1.5)])
def test_filter_rejects_bad_arguments(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        filter_logits(torch.zeros(4), **kwargs)


# generate


def test_greedy_generation_with_cache_equals_full_recomputation() -> None:
    model = tiny_model()
    prompt = [5, 17, 42, 8, 99]
    # 5 + 28 = block_size + 1: the last token is sampled but never fed back, so this fits
    assert generate(model, prompt, 28, temperature=0.0) == greedy_without_cache(model, prompt, 28)


def test_same_seed_same_tokens_different_seed_different_tokens() -> None:
    model = tiny_model()
    first = generate(model, [1, 2, 3], 20, temperature=2.0, seed=7)
    assert len(first) == 20
    assert generate(model, [1, 2, 3], 20, temperature=2.0, seed=7) == first
    assert generate(model, [1, 2, 3], 20, temperature=2.0, seed=8) != first


def test_sampling_with_top_k_1_is_greedy() -> None:
    model = tiny_model()
    greedy = generate(model, [4, 5], 10, temperature=0.0)
    assert generate(model, [4, 5], 10, temperature=1.0, top_k=1, seed=3) == greedy


def test_eot_stops_generation_and_is_not_returned() -> None:
    model = tiny_model()
    greedy = generate(model, [1, 2, 3], 15, temperature=0.0)
    eot = greedy[4]
    out = generate(model, [1, 2, 3], 15, temperature=0.0, eot_id=eot)
    assert out == greedy[: greedy.index(eot)]
    assert eot not in out


def test_padding_rows_are_never_sampled(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model()
    real_logits = model.logits

    def logits_favouring_padding(h):
        logits = real_logits(h).clone()
        logits[..., model.cfg.vocab_size :] = 100.0
        return logits

    monkeypatch.setattr(model, "logits", logits_favouring_padding)
    assert all(t < 100 for t in generate(model, [1], 20, temperature=0.0))
    assert all(t < 100 for t in generate(model, [1], 20, temperature=1.0, seed=0))
    assert all(t < 10 for t in generate(model, [1], 20, temperature=5.0, seed=0, vocab_size=10))


def test_prompt_that_does_not_fit_raises() -> None:
    model = tiny_model()
    with pytest.raises(ValueError, match="model.block_size=32"):
        generate(model, list(range(30)), 4)
    with pytest.raises(ValueError, match="model.block_size=32"):
        generate(model, list(range(33)), 0)
    assert generate(model, list(range(30)), 3, temperature=0.0) == greedy_without_cache(
        model, list(range(30)), 3
    )
    assert generate(model, [1, 2], 0) == []


def test_generate_uses_eval_mode_and_restores_training_mode() -> None:
    model = tiny_model(dropout=0.5)
    expected = greedy_without_cache(model, [1, 2, 3], 8)
    model.train()
    assert generate(model, [1, 2, 3], 8, temperature=0.0) == expected
    assert model.training and all(m.training for m in model.modules())
    model.eval()
    generate(model, [1, 2, 3], 2)
    assert not model.training


def test_sampled_frequencies_follow_the_distribution() -> None:
    # the model's logits are replaced by fixed ones, p = 0.5, 0.25, 0.25, so the sampler itself is tested
    model = tiny_model(vocab_size=3)
    fixed = torch.full((64,), -INF)
    fixed[:3] = torch.tensor([0.5, 0.25, 0.25]).log()
    model.logits = lambda h: fixed.expand(1, h.size(1), 64)
    tokens = [t for seed in range(40) for t in generate(model, [0], 32, seed=seed)]
    assert len(tokens) == 40 * 32
    for token, p in enumerate([0.5, 0.25, 0.25]):
        assert math.isclose(tokens.count(token) / len(tokens), p, abs_tol=0.05)


def frequencies(logits: torch.Tensor, n: int = 40000, **options) -> torch.Tensor:
    """How often pick_token draws each id of `logits` (V,) in n draws."""
    picks = pick_token(logits.expand(n, -1).clone(), generator=torch.Generator().manual_seed(0), **options)
    return torch.bincount(picks, minlength=logits.numel()).float() / n


def test_temperature_divides_the_logits_once() -> None:
    # p = 0.5, 0.25, 0.25 at temperature 2 is softmax(log p / 2), proportional to sqrt(p): 0.414, 0.293, 0.293
    # (divided twice, p^(1/4): 0.374, 0.313, 0.313)
    logits = torch.tensor([0.5, 0.25, 0.25]).log()
    for temperature in (2.0, 0.5):
        got = frequencies(logits, temperature=temperature, top_k=None, top_p=None)
        assert torch.allclose(got, (logits / temperature).softmax(-1), atol=0.01)


def test_the_nucleus_is_taken_of_the_tempered_distribution() -> None:
    # p = 0.85, 0.1, 0.05: untempered, top_p=0.8 keeps the first token alone; at temperature 3 the distribution
    # p^(1/3), normalised 0.53, 0.26, 0.21, needs all three tokens to reach 0.8
    logits = torch.tensor([0.85, 0.1, 0.05]).log()
    assert torch.equal(filter_logits(logits, top_p=0.8), torch.tensor([logits[0], -INF, -INF]))
    got = frequencies(logits, temperature=3.0, top_k=None, top_p=0.8)
    assert torch.allclose(got, (logits / 3).softmax(-1), atol=0.01)


@pytest.mark.parametrize(
    "kwargs", [dict(prompt=[], max_new_tokens=3), dict(max_new_tokens=-1), dict(temperature=-0.5)]
)
def test_generate_rejects_bad_arguments(kwargs: dict) -> None:
    args = dict(prompt=[1, 2], max_new_tokens=3) | kwargs
    with pytest.raises(ValueError):
        generate(tiny_model(), **args)


# generate_batch


def test_generate_batch_rows_equal_single_prompt_greedy_with_and_without_cache():
    model = tiny_model(seed=3)
    prompts = torch.tensor([[1, 2, 3], [7, 8, 9], [40, 41, 42]])  # (B, T)
    cached = generate_batch(model, prompts, 20, temperature=0.0)
    uncached = generate_batch(model, prompts, 20, temperature=0.0, use_cache=False)
    assert cached.shape == (3, 20) and torch.equal(cached, uncached)
    for row, prompt in zip(cached.tolist(), prompts.tolist()):
        assert row == greedy_without_cache(model, prompt, 20)


def test_generate_batch_samples_only_real_ids_and_is_seeded():
    model = tiny_model(seed=4, vocab_size=70)  # padded to 128 rows: ids 70..127 must never come out
    prompts = torch.zeros(4, 1, dtype=torch.long)
    a = generate_batch(model, prompts, 30, generator=torch.Generator().manual_seed(5))
    b = generate_batch(model, prompts, 30, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b) and int(a.max()) < 70
    assert len({tuple(r) for r in a.tolist()}) > 1  # rows sample independently


def test_generate_batch_lengths():
    model = tiny_model()
    assert generate_batch(model, torch.zeros(2, 5, dtype=torch.long), 0).shape == (2, 0)
    assert generate_batch(model, torch.zeros(2, 5, dtype=torch.long), 28).shape == (2, 28)  # 5 + 27 = block
    with pytest.raises(ValueError, match="generate_batch: prompt of 5 tokens plus max_new_tokens=29 does not fit"):
        generate_batch(model, torch.zeros(2, 5, dtype=torch.long), 29)


def test_a_decode_steps_logits_equal_the_last_row_of_all_logits():
    model = tiny_model(seed=6)
    idx = torch.randint(0, 100, (2, 9))
    with torch.no_grad():
        h = model(idx)
        full = model.logits(h)
        last = model.logits(h[:, -1:])  # one position without gradients: (V, C) @ (C, B)
    assert last.shape == (2, 1, full.size(-1))
    torch.testing.assert_close(last[:, 0], full[:, -1], rtol=0, atol=1e-6)  # one row: another matmul shape


def test_generate_batch_refuses_a_negative_temperature():
    with pytest.raises(ValueError, match="generate_batch: temperature must be >= 0, got -1.0"):
        generate_batch(tiny_model(), torch.zeros(1, 1, dtype=torch.long), 3, temperature=-1.0)


# compiled decoding: a static cache, the one-token step compiled


@pytest.fixture
def uncompiled_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled decoding with its step run eager: the static cache and the sampler's path, without a compile."""
    monkeypatch.setattr(generate_module, "compiled_step", lambda device_type: generate_module.next_logits)


@pytest.mark.parametrize("overrides", [
    {},
    dict(pos="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=1, qk_norm=True, qk_norm_scope="all", bias=False,
         nope_interval=2, logit_softcap=15.0),
    dict(pos="sinusoidal", norm_position="post", vocab_size=70),
    dict(n_experts=4, experts_per_token=2, expert_d_ff=16),
], ids=["gpt2", "llama-gqa-qknorm-nope-softcap", "sinusoidal-postnorm-padded", "moe"])
def test_the_static_cache_decodes_the_tokens_of_the_growing_one(overrides, uncompiled_step) -> None:
    model = tiny_model(seed=1, **overrides)
    for prompts in (torch.tensor([[1, 2, 3], [7, 8, 9]]), torch.zeros(2, 1, dtype=torch.long)):  # prefill, or none
        eager = generate_batch(model, prompts, 20, temperature=0.0)
        assert torch.equal(generate_batch(model, prompts, 20, temperature=0.0, compiled=True), eager)
        sampled = [generate_batch(model, prompts, 20, temperature=2.0, top_k=20, compiled=compiled,
                                  generator=torch.Generator().manual_seed(3)) for compiled in (False, True)]
        assert torch.equal(*sampled) and len(set(sampled[0].flatten().tolist())) > 5  # tokens that vary
    stop = generate(model, [4, 5], 12, temperature=2.0, seed=1)[6]
    assert generate(model, [4, 5], 12, temperature=2.0, seed=1, eot_id=stop, compiled=True) == generate(
        model, [4, 5], 12, temperature=2.0, seed=1, eot_id=stop)


def test_compiled_decoding_keeps_one_cache_per_model_for_the_same_shape(uncompiled_step) -> None:
    model = tiny_model()
    prompts = torch.zeros(2, 3, dtype=torch.long)
    generate_batch(model, prompts, 5, temperature=0.0, compiled=True)
    cache = generate_module.STATIC_CACHES[model]
    generate_batch(model, prompts + 1, 5, temperature=0.0, compiled=True)
    assert generate_module.STATIC_CACHES[model] is cache  # the same storage, which the compiled step guards on
    generate_batch(model, prompts, 6, temperature=0.0, compiled=True)
    assert generate_module.STATIC_CACHES[model] is not cache and generate_module.STATIC_CACHES[model].max_len == 9


def test_compiled_decoding_refuses_a_model_without_a_static_cache() -> None:
    torch.manual_seed(0)
    lstm = LSTMLM(LSTMConfig(vocab_size=100, block_size=32, n_layer=1, d_model=32))
    with pytest.raises(ConfigError, match=r"^--compile: an LSTM \(model.arch=lstm\) has no static KV cache, which "
                                          r"compiled decoding needs; sample without --compile$"):
        generate(lstm, [1, 2], 4, compiled=True)


@pytest.mark.slow
def test_compiled_decoding_gives_eager_tokens_and_compiles_the_step_once() -> None:
    """A real torch.compile on the CPU: a cold compile takes 10-40 s, so one tiny model, one test."""
    from torch._dynamo.utils import counters

    model = tiny_model(seed=2, n_layer=1, pos="rope", n_kv_head=1)
    prompts = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    eager = generate_batch(model, prompts, 24, temperature=0.0)
    graphs = counters["stats"]["unique_graphs"]
    assert torch.equal(generate_batch(model, prompts, 24, temperature=0.0, compiled=True), eager)
    sampled = [generate_batch(model, prompts, 24, temperature=1.0, compiled=compiled,
                              generator=torch.Generator().manual_seed(0)) for compiled in (False, True)]
    assert torch.equal(*sampled)
    # 46 compiled steps over two calls, and one graph: no compile per token, nor per call
    assert counters["stats"]["unique_graphs"] - graphs == 1


@pytest.mark.parametrize("stop_at_end", [True, False])  # lm.sample's path, and the trainer's periodic samples'
def test_a_model_with_more_rows_than_its_tokenizer_has_ids_samples_only_the_tokenizers(tokenizer_jsons,
                                                                                        monkeypatch, stop_at_end):
    from lm.models.family import SampleOptions
    from lm.models.next_token import sample
    from lm.tokenizer import model_tokenizer

    tokenizer = model_tokenizer(str(tokenizer_jsons["eot"]), 500)  # 400 ids, as Qwen's files hold fewer than rows
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, block_size=32, vocab_size=500))
    real_logits = model.logits

    def logits_favouring_rows_past_the_tokenizer(h):
        logits = real_logits(h).clone()
        logits[..., 400:] = 100.0  # each decodes to nothing: drawn, they would vanish from the text
        return logits

    monkeypatch.setattr(model, "logits", logits_favouring_rows_past_the_tokenizer)
    drawn = []
    monkeypatch.setattr(tokenizer, "decode", lambda ids, decode=tokenizer.decode: drawn.extend(ids) or decode(ids))
    for temperature in (0.0, 1.0):
        sample(model, tokenizer, "The", SampleOptions(8, temperature, None, None, 0, stop_at_end=stop_at_end))
    assert drawn and max(drawn) < 400


@pytest.mark.parametrize("stop_at_end", [True, False])
def test_a_sample_ends_at_the_first_end_of_text_either_way(tokenizer_jsons, monkeypatch, stop_at_end):
    # greedy: the first new token is "x", every later one the end-of-text; a fixed-length batch (the trainer's
    # periodic samples) draws 8 tokens but shows only those before the end, as lm.sample's path stops there
    tokenizer = model_tokenizer(str(tokenizer_jsons["eot"]), 500)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, block_size=32, vocab_size=500))
    real_logits, calls = model.logits, []
    (x,) = tokenizer.encode_ordinary("x")
    assert x != tokenizer.eot_token

    def logits_x_then_end(h):
        logits = real_logits(h).clone()
        logits[..., x if not calls else tokenizer.eot_token] = 100.0
        calls.append(h.shape)
        return logits

    monkeypatch.setattr(model, "logits", logits_x_then_end)
    text = sample(model, tokenizer, "The", SampleOptions(8, 0.0, None, None, 0, stop_at_end=stop_at_end))
    assert text == "Thex"
