"""model.loss_chunk: the head and loss computed chunk by chunk give the plain loss and gradients."""

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from lm.checkpoint.resume import model_diff
from lm.config import load_config
from lm.distributed.env import init_distributed
from lm.errors import ConfigError
from lm.models.config import ModelConfig
from lm.models.family import PlainLoss
from lm.models.loss import chunked_cross_entropy, head_loss
from lm.models.registry import config_class, get_family
from lm.models.terms import Losses
from lm.training.trainer import Trainer

# B * T = 2 * 9 = 18 positions: 1 and 6 divide it, 5 and 7 do not, 64 is more than all of them
B, T = 2, 9
CHUNKS = [1, 5, 6, 7, 64]


def tiny(arch: str = "gpt", **overrides: object) -> ModelConfig:
    """A tiny next-token model of `arch` (gpt or lstm)."""
    fields = dict(vocab_size=100, block_size=32, n_layer=2, d_model=32, **({"n_head": 2} if arch == "gpt" else {}))
    fields.update(overrides)
    return config_class(arch)(**fields)


def build(cfg: ModelConfig) -> torch.nn.Module:
    return get_family(cfg.arch).build(cfg)


def family_loss(model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0) -> Losses:
    """The loss's named terms, whose objective the trainer backpropagates."""
    return get_family(model.cfg.arch).training.loss(model, model, [idx, targets], PlainLoss(z_loss))


def loss_and_grads(cfg: ModelConfig, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(0)
    model = build(cfg)
    loss = family_loss(model, idx, targets).optimized
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ["gpt", "lstm"])
@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("chunk", CHUNKS)
def test_chunked_loss_and_gradients_equal_the_plain_ones(arch, tie, chunk) -> None:
    cfg = tiny(arch=arch, tie_embeddings=tie)
    idx, targets = torch.randint(0, 100, (B, T)), torch.randint(0, 100, (B, T))
    loss, grads = loss_and_grads(cfg, idx, targets)
    chunked_loss, chunked_grads = loss_and_grads(replace(cfg, loss_chunk=chunk), idx, targets)
    torch.testing.assert_close(chunked_loss, loss, rtol=0, atol=1e-6)
    assert chunked_grads.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=0, atol=1e-6, msg=name)


def test_the_helper_is_the_mean_over_all_positions() -> None:
    head = torch.nn.Linear(8, 50, bias=False)
    h, targets = torch.randn(3, 5, 8), torch.randint(0, 50, (3, 5))
    plain = torch.nn.functional.cross_entropy(head(h).view(15, 50), targets.view(15))
    for chunk in (1, 4, 15, 16):
        torch.testing.assert_close(chunked_cross_entropy(head, h, targets, chunk), plain, rtol=0, atol=1e-6)


def test_loss_chunk_0_is_the_plain_path_bit_for_bit() -> None:
    # the default must not touch today's computation: the loss is exactly the unchunked F.cross_entropy
    torch.manual_seed(0)
    model = build(tiny())
    idx, targets = torch.randint(0, 100, (B, T)), torch.randint(0, 100, (B, T))
    logits, loss = model.logits(model(idx)), family_loss(model, idx, targets).optimized
    plain = torch.nn.functional.cross_entropy(logits.float().view(B * T, -1), targets.reshape(B * T))
    assert tiny().loss_chunk == 0 and logits.shape == (B, T, 128)
    assert torch.equal(loss, plain)


def test_the_logits_are_the_same_with_loss_chunk() -> None:
    torch.manual_seed(0)
    chunked = build(tiny(loss_chunk=4))
    torch.manual_seed(0)
    plain = build(tiny())
    idx = torch.randint(0, 100, (B, T))
    assert torch.equal(chunked.logits(chunked(idx)), plain.logits(plain(idx)))


def test_bad_loss_chunk_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"model.loss_chunk: must be >= 0"):
        tiny(loss_chunk=-1)
    with pytest.raises(ConfigError, match=r"model.loss_chunk: not a key of an encoder-decoder"):
        load_config(None, ["--model.arch=encdec", "--model.loss_chunk=8"])


def train_losses(data_dir, out, *extra: str) -> list[float]:
    cfg = load_config(None, [
        "--model.n_layer=2", "--model.n_head=2", "--model.d_model=32", "--model.block_size=32",
        "--data.seq_len=16", f"--data.dir={data_dir}", "--train.steps=4", "--train.batch_size=4",
        "--train.micro_batch_size=2", "--train.device=cpu", "--train.eval_every=1000", "--log.every=1",
        "--log.tensorboard=false", "--log.sample_every=0", "--checkpoint.every=1000", f"--train.out_dir={out}",
        *extra,
    ])
    Trainer(cfg, init_distributed("cpu")).fit()
    rows = [line for line in (out / "metrics.jsonl").read_text().splitlines() if '"train/loss"' in line]
    return [json.loads(row)["train/loss"] for row in rows]


@pytest.mark.slow
def test_a_training_run_with_loss_chunk_has_the_same_losses(tiny_data_dir, tmp_path) -> None:
    plain = train_losses(tiny_data_dir, tmp_path / "plain")
    # 2 x 16 = 32 positions per micro-batch: chunks of 12 leave a shorter last one
    chunked = train_losses(tiny_data_dir, tmp_path / "chunked", "--model.loss_chunk=12")
    assert len(plain) == 4
    assert chunked == pytest.approx(plain, rel=1e-5)
    # compiled blocks feed the eager chunked head; compiled kernels round differently, hence the looser match
    compiled = train_losses(tiny_data_dir, tmp_path / "compiled", "--model.loss_chunk=12", "--train.compile=true")
    assert compiled == pytest.approx(plain, rel=1e-4)


def test_a_run_resumes_or_starts_from_weights_with_another_loss_chunk() -> None:
    # chunking changes how the loss is computed, not the model: a run that runs out of memory can turn it on
    saved = load_config(None, ["--model.d_model=48"]).model
    assert model_diff(saved, load_config(None, ["--model.d_model=48", "--model.loss_chunk=256"]).model) == ""
    assert model_diff(saved, load_config(None, ["--model.d_model=36"]).model) == "model.d_model: 48 -> 36"


def bf16_logits():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 8, 16, generator=g)
    weight = torch.randn(16, 5000, generator=g)
    targets = torch.randint(0, 5000, (2, 8), generator=g)
    return h, weight, targets


def reference(logits: torch.Tensor, targets: torch.Tensor) -> tuple[float, float]:
    """The float32 cross-entropy and mean log Z^2 of the (bf16) logits as given."""
    logits = logits.float().reshape(-1, logits.shape[-1])
    return (F.cross_entropy(logits, targets.reshape(-1)).item(),
            torch.logsumexp(logits, -1).square().mean().item())


@pytest.mark.parametrize("with_z", [False, True])
def test_bf16_logits_get_a_float32_loss_whole(with_z):
    h, weight, targets = bf16_logits()
    logits = (h @ weight).bfloat16()
    loss = head_loss(logits, targets, with_z)
    assert loss.dtype == torch.float32
    ce, z = reference(logits, targets)
    if with_z:
        assert loss.tolist() == pytest.approx([ce, z], rel=1e-6)
    else:
        assert loss.item() == pytest.approx(ce, rel=1e-6)


@pytest.mark.parametrize("with_z", [False, True])
def test_bf16_logits_get_a_float32_loss_chunked(with_z):
    h, weight, targets = bf16_logits()
    loss = chunked_cross_entropy(lambda x: (x @ weight).bfloat16(), h, targets, chunk=5, with_z=with_z)
    assert loss.dtype == torch.float32
    ce, z = reference((h @ weight).bfloat16(), targets)
    if with_z:
        assert loss.tolist() == pytest.approx([ce, z], rel=1e-5)
    else:
        assert loss.item() == pytest.approx(ce, rel=1e-5)


def test_the_family_loss_runs_the_head_a_chunk_at_a_time() -> None:
    # model.loss_chunk exists to keep the (B*T, V) logits from ever being built: the family's loss must hand the
    # head at most `chunk` positions per call (18 positions in chunks of 5: 5, 5, 5, 3), not all 18 at once
    torch.manual_seed(0)
    model = build(tiny(loss_chunk=5))
    rows = []
    model.lm_head.register_forward_hook(lambda module, args, out: rows.append(args[0].reshape(-1, 32).shape[0]))
    idx, targets = torch.randint(0, 100, (B, T)), torch.randint(0, 100, (B, T))
    assert torch.isfinite(family_loss(model, idx, targets).optimized)
    assert rows == [5, 5, 5, 3]


def test_loss_chunk_1_runs_the_head_one_position_at_a_time() -> None:
    # 1 is the smallest chunk and still a chunked loss: the head sees single rows, never all 2 x 3 positions
    cfg = config_class("gpt")(vocab_size=100, block_size=32, n_layer=1, n_head=2, d_model=32, loss_chunk=1)
    torch.manual_seed(0)
    model = get_family("gpt").build(cfg)
    rows = []
    model.lm_head.register_forward_hook(lambda module, args, out: rows.append(args[0].reshape(-1, 32).shape[0]))
    idx, targets = torch.randint(0, 100, (2, 3)), torch.randint(0, 100, (2, 3))
    loss = get_family("gpt").training.loss(model, model, [idx, targets]).optimized
    assert rows == [1] * 6
    logits = model.logits(model(idx)).float().view(6, -1)
    torch.testing.assert_close(loss, F.cross_entropy(logits, targets.view(6)), rtol=0, atol=1e-6)


def test_a_chunked_head_gets_its_gradient_from_inputs_that_need_none() -> None:
    # a frozen body hands the head hidden states that require no gradient: the head's own weight still trains
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    h, targets = torch.randn(3, 5, 8), torch.randint(0, 50, (3, 5))
    chunked_cross_entropy(head, h, targets, chunk=4).backward()
    chunked = head.weight.grad.clone()
    head.weight.grad = None
    F.cross_entropy(h.view(15, 8) @ head.weight.T, targets.view(15)).backward()
    torch.testing.assert_close(chunked, head.weight.grad, rtol=0, atol=1e-6)
