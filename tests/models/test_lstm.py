import math

import pytest
import torch
import torch.nn.functional as F

from lm.config import load_config
from lm.errors import ConfigError
from lm.models.generate import generate, generate_batch
from lm.models.gpt.config import GPTConfig
from lm.models.lstm.config import LSTMConfig
from lm.models.lstm.model import LSTMLM
from lm.models.registry import get_family
from lm.plan.counts import num_params

LSTM = get_family("lstm")


def tiny_config(**overrides: object) -> LSTMConfig:
    fields = dict(vocab_size=100, block_size=32, n_layer=2, d_model=32)
    fields.update(overrides)
    return LSTMConfig(**fields)


def logits(model: LSTMLM, idx: torch.Tensor, **kw: object) -> torch.Tensor:
    return model.logits(model(idx, **kw))


def loss(model: LSTMLM, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return LSTM.training.loss(model, model, [idx, targets]).optimized


def tiny_model(seed: int = 0, **overrides: object) -> LSTMLM:
    torch.manual_seed(seed)
    return LSTMLM(tiny_config(**overrides)).eval()


def test_the_family_builds_stacked_single_layer_lstms() -> None:
    model = LSTM.build(tiny_config(n_layer=3))
    assert isinstance(model, LSTMLM) and len(model.layers) == 3
    assert LSTM.blocks(model) == list(model.layers)
    for layer in model.layers:  # one nn.LSTM per layer: the unit FSDP shards and checkpointing recomputes
        assert isinstance(layer, torch.nn.LSTM) and layer.num_layers == 1 and layer.batch_first
        assert (layer.input_size, layer.hidden_size) == (32, 32)


def test_logits_cover_the_padded_vocabulary_and_loss_is_float32_cross_entropy() -> None:
    model = tiny_model()
    idx, targets = torch.randint(0, 100, (2, 10)), torch.randint(0, 100, (2, 10))
    out, mean = logits(model, idx), loss(model, idx, targets)
    assert out.shape == (2, 10, 128)  # 100 rounded up to a multiple of 64
    assert mean.dtype == torch.float32 and mean.dim() == 0
    assert mean.item() == pytest.approx(F.cross_entropy(out.flatten(0, 1), targets.flatten()).item(), rel=1e-6)
    assert abs(mean.item() - math.log(128)) < 0.1  # small initial logits: close to uniform over the rows
    with pytest.raises(ValueError, match="positions must be None"):
        model(idx, torch.zeros_like(idx))


def test_changing_a_future_token_never_changes_earlier_logits() -> None:
    model = tiny_model()
    idx = torch.randint(0, 100, (1, 12))
    changed = idx.clone()
    changed[0, 7] = (idx[0, 7] + 1) % 100
    a = logits(model, idx)
    b = logits(model, changed)
    assert torch.equal(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_parameters_counted_by_hand_and_by_the_planner() -> None:
    v, c = 128, 32
    layer = 2 * 4 * c * c + 2 * 4 * c  # weight_ih, weight_hh (4c x c) and two 4c biases
    tied = tiny_model()
    assert tied.lm_head.weight is tied.wte.weight
    assert sum(p.numel() for p in tied.parameters()) == v * c + 2 * layer
    untied = tiny_model(tie_embeddings=False, bias=False)
    assert untied.lm_head.weight is not untied.wte.weight
    assert sum(p.numel() for p in untied.parameters()) == 2 * v * c + 2 * 2 * 4 * c * c
    for model in (tied, untied):  # no position table: nothing to leave out
        assert num_params(model.cfg) == num_params(model.cfg, non_embedding=True) == sum(
            p.numel() for p in model.parameters())


def test_init_draws_embedding_normal_and_lstm_weights_uniform() -> None:
    model = tiny_model(d_model=64, vocab_size=5000)
    assert model.wte.weight.std().item() == pytest.approx(0.02, rel=0.03)
    bound = 1 / math.sqrt(64)
    weights = torch.cat([p.flatten() for layer in model.layers for p in layer.parameters()])
    assert weights.abs().max().item() <= bound
    assert weights.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.03)  # std of U(-b, b)


def test_meta_build_then_init_weights_matches_normal_build() -> None:
    for cfg in (tiny_config(), tiny_config(tie_embeddings=False)):
        torch.manual_seed(123)
        reference = LSTMLM(cfg)
        with torch.device("meta"):
            model = LSTMLM(cfg)
        assert model.layers[0].weight_ih_l0.is_meta
        model.to_empty(device="cpu")
        torch.manual_seed(123)
        model.init_weights()
        assert (model.lm_head.weight is model.wte.weight) == cfg.tie_embeddings
        expected, actual = reference.state_dict(), model.state_dict()
        assert actual.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(actual[name], tensor), name
        idx = torch.randint(0, 100, (2, 6))
        assert torch.equal(logits(model, idx), logits(reference, idx))  # nn.LSTM's flat weights follow to_empty


def test_recurrent_state_in_pieces_gives_the_full_forward_logits() -> None:
    model = tiny_model()
    idx = torch.randint(0, 100, (2, 15))
    full = logits(model, idx)
    state = model.new_cache(batch_size=2, max_len=15)
    assert len(state.layers) == 2 and state.layers[0][0].shape == (1, 2, 32) and state.length == 0
    parts = [logits(model, idx[:, a:b], cache=state) for a, b in [(0, 5), (5, 9), (9, 10), (10, 15)]]
    assert state.length == 15
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="recurrent state overflow: 16 positions exceed its max_len=15"):
        model(idx[:, :1], cache=state)


def test_sequence_longer_than_block_size_raises() -> None:
    model = tiny_model()
    with pytest.raises(ValueError, match="model.block_size=32"):
        model(torch.zeros(1, 33, dtype=torch.long))
    state = model.new_cache(batch_size=1, max_len=40)
    model(torch.zeros(1, 30, dtype=torch.long), cache=state)
    with pytest.raises(ValueError, match=r"33 tokens \(30 fed before \+ 3 new\) exceeds model.block_size=32"):
        model(torch.zeros(1, 3, dtype=torch.long), cache=state)


def test_greedy_decoding_with_the_state_equals_rerunning_the_sequence() -> None:
    model = tiny_model()
    prompts = torch.randint(0, 100, (3, 4), generator=torch.Generator().manual_seed(2))
    cached = generate_batch(model, prompts, 20, temperature=0.0)
    uncached = generate_batch(model, prompts, 20, temperature=0.0, use_cache=False)
    assert cached.shape == (3, 20) and torch.equal(cached, uncached)
    assert int(cached.max()) < 100  # padding rows of the embedding are never sampled
    # the single-prompt sampler: the same tokens as its row of the batch, and a seed fixes sampled text
    assert generate(model, prompts[1].tolist(), 20, temperature=0.0) == cached[1].tolist()
    assert generate(model, [1, 2], 10, seed=4) == generate(model, [1, 2], 10, seed=4)


def test_dropout_acts_in_training_only() -> None:
    model = tiny_model(dropout=0.5)
    idx = torch.randint(0, 100, (2, 8))
    assert torch.equal(model(idx), model(idx))
    model.train()
    assert not torch.equal(model(idx), model(idx))
    # after every layer too, the last one's output included: half its units dropped (an LSTM's own are never 0)
    assert (model(idx) == 0).float().mean().item() == pytest.approx(0.5, abs=0.1)


def test_an_untied_head_is_drawn_as_gpt_2s() -> None:
    torch.manual_seed(0)
    model = tiny_model(tie_embeddings=False, d_model=256)
    assert model.lm_head.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.lm_head.weight is not model.wte.weight


def test_overfits_one_batch() -> None:
    model = tiny_model()
    model.train()
    idx = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(1))
    inputs, targets = idx[:, :-1], idx[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.0)
    first_loss = loss(model, inputs, targets)
    for _ in range(80):
        step_loss = loss(model, inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        step_loss.backward()
        optimizer.step()
    last_loss = loss(model, inputs, targets)
    assert first_loss.item() > 4.0
    assert last_loss.item() < first_loss.item() / 3  # 32 random next tokens, memorised


def test_an_lstm_takes_none_of_the_attention_keys() -> None:
    # d_model 30 does not split into the default 12 heads: an error for a GPT, no matter for an LSTM
    with pytest.raises(ConfigError, match="model.d_model: 30 is not divisible by model.n_head=12"):
        GPTConfig(d_model=30)
    cfg = LSTMConfig(vocab_size=100, block_size=16, n_layer=1, d_model=30)
    assert sum(p.numel() for p in LSTMLM(cfg).parameters()) == 128 * 30 + 8 * 30 * 30 + 8 * 30
    # a key the LSTM does not read is refused by name, not ignored
    with pytest.raises(ConfigError, match=r"model.pos: not a key of an LSTM \(model.arch=lstm\); it takes \['arch', "):
        load_config(None, ["--model.arch=lstm", "--model.pos=rope"])
    with pytest.raises(ConfigError, match=r"model.arch: unknown model family 'rnn'; expected one of "
                                          r"\['gpt', 'encdec', 'encoder', 'lstm'"):
        load_config(None, ["--model.arch=rnn"])


@pytest.mark.parametrize("changes, message", [
    (dict(n_layer=0), "model.n_layer: must be positive, got 0"),
    (dict(d_model=0), "model.d_model: must be positive, got 0"),
    (dict(dropout=1.0), r"model.dropout: must be in \[0, 1\), got 1.0"),
])
def test_an_lstm_refuses_what_every_family_refuses(changes, message):
    with pytest.raises(ConfigError, match=f"^{message}$"):
        LSTMConfig(**changes)


def test_an_lstm_of_no_layers_is_refused_from_the_command_line():
    with pytest.raises(ConfigError, match=r"^model.n_layer: must be positive, got 0$"):
        load_config(None, ["--model.arch=lstm", "--model.n_layer=0"])


def test_the_edges_in_range_pass():
    cfg = LSTMConfig(n_layer=1, d_model=1, dropout=0.0, loss_chunk=0)
    assert (cfg.n_layer, cfg.d_model, cfg.dropout, cfg.loss_chunk) == (1, 1, 0.0, 0)


def test_an_lstm_takes_a_z_loss():
    cfg = load_config(None, ["--model.arch=lstm", "--optim.z_loss=0.0001"])
    assert (cfg.model.arch, cfg.optim.z_loss) == ("lstm", 0.0001)


def test_muon_is_refused_for_an_lstm_whose_gate_matrices_are_stacked():
    with pytest.raises(ConfigError, match=r"^optim.name: muon steps a model's hidden nn.Linear matrices, and an LSTM "
                                          r"\(model.arch=lstm\) has none; use optim.name=adamw$"):
        load_config(None, ["--model.arch=lstm", "--optim.name=muon"])
