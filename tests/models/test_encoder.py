import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lm.config import load_config
from lm.data.masking import IGNORE
from lm.errors import ConfigError
from lm.models.encdec.config import EncDecConfig
from lm.models.encoder.config import EncoderConfig
from lm.models.encoder.model import Encoder
from lm.models.layers import sinusoidal_positions
from lm.models.registry import get_family
from tests.models.test_encdec import randomised

ENCODER = get_family("encoder")
CFG = EncoderConfig(vocab_size=200, block_size=24, n_layer=2, n_head=4, d_model=32, pos="sinusoidal",
                    norm_position="post", mlp="relu")


def qkv(attn, p: str):
    """Our q, k and v stacked as torch's in_proj rows [q; k; v]."""
    return torch.cat([getattr(attn.q, p), getattr(attn.k, p), getattr(attn.v, p)])


def config(**changes) -> EncoderConfig:
    return EncoderConfig(**{**CFG.__dict__, **changes})


def reference_encoder(model: Encoder) -> nn.TransformerEncoder:
    """torch.nn.TransformerEncoder holding our blocks' weights: post-LN (the paper's) or pre-LN with our
    final norm as its `norm`."""
    cfg = model.cfg
    pre = cfg.norm_position == "pre"
    layer = nn.TransformerEncoderLayer(d_model=cfg.d_model, nhead=cfg.n_head, dim_feedforward=cfg.ff_dim,
                                       dropout=0.0, activation="relu", layer_norm_eps=cfg.norm_eps,
                                       batch_first=True, norm_first=pre)
    final = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps) if pre else None
    ref = nn.TransformerEncoder(layer, cfg.n_layer, norm=final, enable_nested_tensor=False)

    def copy(dst: nn.Module, src: nn.Module) -> None:
        dst.weight.copy_(src.weight)
        dst.bias.copy_(src.bias)

    with torch.no_grad():
        for ours, theirs in zip(model.blocks, ref.layers, strict=True):
            theirs.self_attn.in_proj_weight.copy_(qkv(ours.attn, "weight"))  # rows [q; k; v]
            theirs.self_attn.in_proj_bias.copy_(qkv(ours.attn, "bias"))
            copy(theirs.self_attn.out_proj, ours.attn.proj)
            copy(theirs.linear1, ours.mlp.fc), copy(theirs.linear2, ours.mlp.proj)
            copy(theirs.norm1, ours.ln_1), copy(theirs.norm2, ours.ln_2)
        if pre:
            copy(ref.norm, model.ln_f)
    return ref.eval()


def embedded(model: Encoder, ids: torch.Tensor) -> torch.Tensor:
    """What the blocks receive, computed by hand: token embedding plus sinusoids, normalised."""
    return model.emb_norm(model.wte(ids) + sinusoidal_positions(torch.arange(ids.size(1)), model.cfg.d_model))


@pytest.mark.parametrize("norm_position", ["post", "pre"])
@pytest.mark.parametrize("padded", [False, True], ids=["no-padding", "padding"])
def test_trunk_matches_torch_nn_transformer_encoder(norm_position: str, padded: bool) -> None:
    torch.manual_seed(0)
    model = randomised(Encoder(config(norm_position=norm_position)))
    ref = reference_encoder(model)
    ids = torch.randint(0, CFG.vocab_size, (3, 13))
    keep = None
    if padded:
        keep = torch.ones(3, 13, dtype=torch.bool)
        keep[1, 9:] = False
        keep[2, 4:] = False
        ids[~keep] = CFG.pad_id
    with torch.no_grad():
        ours = model(ids, keep)
        theirs = ref(embedded(model, ids), src_key_padding_mask=None if keep is None else ~keep)
    real = torch.ones(3, 13, dtype=torch.bool) if keep is None else keep
    assert (ours[real] - theirs[real]).abs().max() <= 1e-5
    assert ours.abs().mean() > 0.1  # a real signal, not two zeros


def test_the_key_padding_mask_is_what_hides_the_padding() -> None:
    torch.manual_seed(0)
    model = randomised(Encoder(CFG))
    ids = torch.randint(0, CFG.vocab_size, (1, 12))
    ids[0, 8:] = CFG.pad_id
    keep = ids != CFG.pad_id
    with torch.no_grad():
        alone = model(ids[:, :8])
        masked = model(ids, keep)[:, :8]
        unmasked = model(ids)[:, :8]
    assert (masked - alone).abs().max() <= 1e-5
    assert (unmasked - alone).abs().max() > 1e-2


@pytest.mark.parametrize("norm_position", ["post", "pre"])
@pytest.mark.parametrize("pooling", ["first", "mean"])
def test_padding_changes_no_real_output_nor_the_pooled_score(pooling: str, norm_position: str) -> None:
    cfg = config(head="classify", num_classes=3, pooling=pooling, norm_position=norm_position, pos="learned")
    torch.manual_seed(0)
    model = randomised(Encoder(cfg))
    example = torch.cat([torch.tensor([cfg.cls_id]), torch.randint(0, cfg.vocab_size, (6,))])  # (7,)
    other = torch.cat([torch.tensor([cfg.cls_id]), torch.randint(0, cfg.vocab_size, (10,))])  # (11,)
    batch = torch.stack([torch.cat([example, torch.full((4,), cfg.pad_id)]), other])  # (2, 11)
    keep = batch != cfg.pad_id
    with torch.no_grad():
        h_alone, h_batch = model(example[None]), model(batch, keep)
        out_alone = model.task_outputs(h_alone)
        out_batch = model.task_outputs(h_batch, keep)
    assert (h_batch[0, :7] - h_alone[0]).abs().max() <= 1e-5
    assert (out_batch[0] - out_alone[0]).abs().max() <= 1e-5
    assert out_batch.shape == (2, 3)
    if pooling == "mean":
        expected = model.score(h_batch[0, :7].mean(dim=0))
        assert (out_batch[0] - expected).abs().max() <= 1e-5


def test_mlm_loss_is_cross_entropy_over_the_masked_positions_of_the_full_logits() -> None:
    cfg = config(norm_position="pre", mlp="gelu", pos="learned")
    torch.manual_seed(0)
    model = randomised(Encoder(cfg))
    ids = torch.randint(0, cfg.vocab_size, (3, 10))
    labels = torch.full_like(ids, IGNORE)
    chosen = torch.rand(3, 10) < 0.3
    chosen[:, 0] = False
    chosen[0, 4] = True  # at least one position
    labels[chosen] = ids[chosen]
    ids[chosen] = cfg.mask_id
    with torch.no_grad():
        full = model.mlm_logits(model(ids))
        loss = ENCODER.training.loss(model, model, [ids, labels]).optimized
        scored = ENCODER.training.score(model, model, [ids, labels])
    n = int(chosen.sum())
    assert full.shape == (3, 10, cfg.padded_vocab_size) and scored.count == n
    expected = F.cross_entropy(full[chosen], labels[chosen])
    assert loss.dtype == torch.float32 and abs(loss.item() - expected.item()) <= 1e-5
    assert scored.loss.item() == loss.item()
    # weighted by the masked tokens it averages over, in a step of micro-batches and over the ranks
    assert ENCODER.training.loss(model, model, [ids, labels]).terms["loss"].weight == n
    assert scored.correct.item() == (full[chosen].argmax(-1) == labels[chosen]).sum().item()
    # the head by hand: dense, tanh-GELU, norm, the output layer tied to the embedding plus its bias
    h = model(ids)
    by_hand = model.mlm_norm(F.gelu(h @ model.mlm_dense.weight.T + model.mlm_dense.bias, approximate="tanh"))
    torch.testing.assert_close(full, by_hand @ model.wte.weight.T + model.lm_head.bias, atol=1e-5, rtol=1e-5)


def test_classify_and_regress_heads_give_cross_entropy_and_mean_squared_error() -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, CFG.vocab_size, (4, 9))
    keep = torch.ones_like(ids, dtype=torch.bool)
    classifier = randomised(Encoder(config(head="classify", num_classes=5)))
    classes = torch.tensor([0, 4, 2, 2])
    out = ENCODER.training.head.outputs(classifier, classifier, ids, keep)
    loss = ENCODER.training.loss(classifier, classifier, [ids, classes, keep]).optimized
    assert out.shape == (4, 5)
    h0 = classifier(ids)[:, 0]  # pooling first: the [CLS] position
    torch.testing.assert_close(out, h0 @ classifier.score.weight.T + classifier.score.bias)
    manual = -torch.log_softmax(out, dim=-1)[torch.arange(4), classes].mean()
    assert abs(loss.item() - manual.item()) <= 1e-6
    assert ENCODER.training.loss(classifier, classifier, [ids, classes, keep]).terms["loss"].weight == 4  # the rows

    regressor = randomised(Encoder(config(head="regress", pooling="mean")))
    targets = torch.tensor([0.5, -1.0, 2.0, 0.0])
    out = ENCODER.training.head.outputs(regressor, regressor, ids, keep)
    loss = ENCODER.training.loss(regressor, regressor, [ids, targets, keep]).optimized
    assert out.shape == (4,)
    assert abs(loss.item() - ((out - targets) ** 2).mean().item()) <= 1e-6


def test_mlm_overfits_one_batch() -> None:
    cfg = EncoderConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, d_model=32, dropout=0.0)
    torch.manual_seed(0)
    model = Encoder(cfg)
    ids = torch.randint(0, cfg.vocab_size, (4, 16))
    ids[:, 0] = cfg.cls_id
    labels = torch.full_like(ids, IGNORE)
    chosen = torch.zeros(4, 16, dtype=torch.bool)
    for row in range(4):
        chosen[row, 1 + torch.randperm(15)[:5]] = True  # 5 of the 15 positions after [CLS]
    labels[chosen] = ids[chosen]
    ids[chosen] = cfg.mask_id
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for _ in range(150):
        loss = ENCODER.training.loss(model, model, [ids, labels]).optimized
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert abs(losses[0] - math.log(cfg.padded_vocab_size)) < 0.5  # starts near uniform
    assert losses[-1] < 0.1


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("pos", ["learned", "sinusoidal", "rope"])
def test_every_position_and_norm_runs_forward_and_backward(pos: str, norm: str) -> None:
    cfg = config(pos=pos, norm=norm, norm_position="pre", mlp="swiglu", n_kv_head=2, dropout=0.1)
    torch.manual_seed(0)
    model = ENCODER.build(cfg)
    assert isinstance(model, Encoder) and hasattr(model, "wpe") == (pos == "learned")
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    labels = torch.where(torch.rand(2, 12) < 0.3, ids, IGNORE)
    labels[:, 1] = ids[:, 1]
    loss = ENCODER.training.loss(model, model, [ids, labels]).optimized
    loss.backward()
    assert torch.isfinite(loss) and loss.item() > 1.0
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert model.blocks[0].attn.q.weight.grad.abs().sum() > 0


def test_rope_positions_make_the_encoder_order_aware() -> None:
    torch.manual_seed(0)
    model = randomised(Encoder(config(pos="rope")))
    ids = torch.randint(0, CFG.vocab_size, (1, 8))
    with torch.no_grad():
        h = model(ids)
        swapped = model(ids[:, [1, 0, *range(2, 8)]])
    assert (h[0, 0] - swapped[0, 1]).abs().max() > 1e-2  # without positions attention is order-blind


def test_trunk_names_are_the_same_under_every_head_and_the_head_is_tied() -> None:
    torch.manual_seed(0)
    mlm = Encoder(config(norm_position="pre"))
    classifier = Encoder(config(norm_position="pre", head="classify", num_classes=2))
    regressor = Encoder(config(norm_position="pre", head="regress"))
    head = ("mlm_dense.", "mlm_norm.", "lm_head.", "score.")
    trunks = [{k for k in m.state_dict() if not k.startswith(head)} for m in (mlm, classifier, regressor)]
    assert [k for k in classifier.state_dict() if ENCODER.training.head.is_param(k)] == ["score.weight", "score.bias"]
    assert trunks[0] == trunks[1] == trunks[2]
    assert {"wte.weight", "emb_norm.weight", "ln_f.weight", "blocks.1.mlp.proj.weight"} <= trunks[0]
    assert {k for k in classifier.state_dict() if k.startswith(head)} == {"score.weight", "score.bias"}
    assert mlm.lm_head.weight is mlm.wte.weight
    assert torch.equal(mlm.lm_head.bias, torch.zeros(mlm.cfg.padded_vocab_size))
    untied = Encoder(config(tie_embeddings=False))
    assert untied.lm_head.weight is not untied.wte.weight


def test_same_seed_same_weights() -> None:
    torch.manual_seed(3)
    a = Encoder(CFG)
    torch.manual_seed(3)
    b = Encoder(CFG)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert abs(a.wte.weight.std().item() - 0.02) < 0.002


def test_vocabulary_holds_mask_cls_and_padding() -> None:
    assert (CFG.mask_id, CFG.cls_id, CFG.pad_id, CFG.total_vocab_size, CFG.padded_vocab_size) == (200, 201, 202, 203,
                                                                                                  256)
    encdec = EncDecConfig(vocab_size=200, n_sentinels=5, pos="sinusoidal")
    assert (encdec.pad_id, encdec.total_vocab_size) == (205, 206)  # unchanged


def test_sequences_longer_than_block_size_are_refused() -> None:
    with pytest.raises(ValueError, match=r"sequence of 25 tokens exceeds model.block_size=24"):
        Encoder(CFG)(torch.zeros(1, 25, dtype=torch.long))


@pytest.mark.parametrize("changes, message", [
    (["--model.head=classify"], r"model.head: not a key of a decoder-only GPT \(model.arch=gpt\)"),
    (["--model.arch=encdec", "--model.num_classes=3"], r"model.num_classes: not a key of an encoder-decoder"),
    (["--model.arch=lstm", "--model.pooling=mean"], r"model.pooling: not a key of an LSTM \(model.arch=lstm\)"),
    (["--model.arch=encoder", "--model.head=classify"], r"model.num_classes: head classify needs at least 2 classes"),
    (["--model.arch=encoder", "--model.head=classify", "--model.num_classes=1048577"],
     r"model.num_classes: 1,048,577 is more than 1,048,576, a head's largest"),
    (["--model.arch=encoder", "--model.head=classify", "--model.num_classes=1"],
     r"model.num_classes: .* at least 2 classes, got 1"),
    (["--model.arch=encoder", "--model.num_classes=3"], r"model.num_classes: only head classify has classes; head "
                                                        r"mlm needs model.num_classes=0, got 3"),
    (["--model.arch=encoder", "--model.head=regress", "--model.num_classes=2"],
     r"model.num_classes: .* head regress needs"),
    (["--model.arch=encoder", "--model.head=classify", "--model.num_classes=2", "--model.pooling=max"],
     r"model.pooling: unknown value 'max'; expected one of \['first', 'mean'\]"),
    (["--model.arch=encoder", "--model.head=ner"], r"model.head: unknown value 'ner'; expected one of \['mlm', "),
    (["--model.arch=encoder", "--model.loss_chunk=64"], r"model.loss_chunk: not a key of an encoder \(model.arch="
                                                        r"encoder\); it takes \[.*'head'"),
    (["--model.arch=encoder", "--model.qk_norm=true"], r"model.qk_norm: not a key of an encoder"),
    (["--model.arch=encoder", "--model.logit_softcap=30"], r"model.logit_softcap: not a key of an encoder"),
])
def test_config_refusals_name_the_key(changes: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, changes)


def test_the_fine_tuning_head_mean_pools_the_real_tokens_only() -> None:
    # the family's head outputs (what fine-tuning trains and predicts with) give a padded example the
    # outputs it gets alone: the mean pooling divides by its real tokens, not by the padded length
    cfg = config(head="regress", pooling="mean", pos="learned")
    torch.manual_seed(0)
    model = randomised(Encoder(cfg))
    example = torch.cat([torch.tensor([cfg.cls_id]), torch.randint(0, cfg.vocab_size, (5,))])  # (6,)
    other = torch.cat([torch.tensor([cfg.cls_id]), torch.randint(0, cfg.vocab_size, (9,))])  # (10,)
    batch = torch.stack([torch.cat([example, torch.full((4,), cfg.pad_id)]), other])  # (2, 10)
    keep = batch != cfg.pad_id
    with torch.no_grad():
        out = ENCODER.training.head.outputs(model, model, batch, keep)
        alone = ENCODER.training.head.outputs(model, model, example[None], torch.ones(1, 6, dtype=torch.bool))
        expected = model.score(model(example[None]).mean(dim=1))[:, 0]
    torch.testing.assert_close(out[:1], alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(alone, expected, atol=1e-5, rtol=1e-5)
