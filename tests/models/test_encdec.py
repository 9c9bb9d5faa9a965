import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lm.config import load_config
from lm.errors import ConfigError, PromptError
from lm.models.encdec.config import EncDecConfig
from lm.models.encdec.model import EncoderDecoder, padding_mask
from lm.models.encdec.sampling import generate_seq2seq
from lm.models.family import SampleOptions
from lm.models.layers import sinusoidal_positions
from lm.models.registry import get_family
from lm.plan.counts import num_params

ENCDEC = get_family("encdec")
CFG = EncDecConfig(vocab_size=200, block_size=24, n_layer=2, n_head=4, d_model=32, pos="sinusoidal", n_sentinels=5,
                   norm_position="post", mlp="relu")


def qkv(attn, p: str):
    """Our q, k and v stacked as torch's in_proj rows [q; k; v]."""
    return torch.cat([getattr(attn.q, p), getattr(attn.k, p), getattr(attn.v, p)])


def logits(model: EncoderDecoder, *args: torch.Tensor, **kw: object) -> torch.Tensor:
    return model.logits(model(*args, **kw))


def randomised(model: nn.Module, seed: int = 0) -> nn.Module:
    """Every parameter redrawn (biases and norm gains too), so no zero or one can hide a wrong mapping."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            gain = 1.0 if p.dim() == 1 and p.numel() == model.cfg.d_model else 0.0  # norm weights around 1
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + gain)
    return model.eval()


def reference_transformer(model: EncoderDecoder) -> nn.Transformer:
    """torch.nn.Transformer in the paper's post-LN form (no final norms), holding our model's weights."""
    cfg = model.cfg
    layer_args = dict(d_model=cfg.d_model, nhead=cfg.n_head, dim_feedforward=cfg.ff_dim, dropout=0.0,
                      activation="relu", layer_norm_eps=cfg.norm_eps, batch_first=True, norm_first=False)
    ref = nn.Transformer(
        d_model=cfg.d_model, nhead=cfg.n_head, batch_first=True,
        custom_encoder=nn.TransformerEncoder(nn.TransformerEncoderLayer(**layer_args), cfg.n_layer, norm=None,
                                             enable_nested_tensor=False),
        custom_decoder=nn.TransformerDecoder(nn.TransformerDecoderLayer(**layer_args), cfg.n_layer, norm=None),
    )

    def copy(dst: nn.Module, src: nn.Module) -> None:
        dst.weight.copy_(src.weight)
        dst.bias.copy_(src.bias)

    with torch.no_grad():
        for ours, theirs in zip(model.encoder, ref.encoder.layers):
            theirs.self_attn.in_proj_weight.copy_(qkv(ours.attn, "weight"))
            theirs.self_attn.in_proj_bias.copy_(qkv(ours.attn, "bias"))
            copy(theirs.self_attn.out_proj, ours.attn.proj)
            copy(theirs.linear1, ours.mlp.fc), copy(theirs.linear2, ours.mlp.proj)
            copy(theirs.norm1, ours.ln_1), copy(theirs.norm2, ours.ln_2)
        for ours, theirs in zip(model.decoder, ref.decoder.layers):
            theirs.self_attn.in_proj_weight.copy_(qkv(ours.attn, "weight"))
            theirs.self_attn.in_proj_bias.copy_(qkv(ours.attn, "bias"))
            copy(theirs.self_attn.out_proj, ours.attn.proj)
            theirs.multihead_attn.in_proj_weight.copy_(torch.cat([ours.cross.q.weight, ours.cross.kv.weight]))
            theirs.multihead_attn.in_proj_bias.copy_(torch.cat([ours.cross.q.bias, ours.cross.kv.bias]))
            copy(theirs.multihead_attn.out_proj, ours.cross.proj)
            copy(theirs.linear1, ours.mlp.fc), copy(theirs.linear2, ours.mlp.proj)
            copy(theirs.norm1, ours.ln_1), copy(theirs.norm2, ours.ln_cross), copy(theirs.norm3, ours.ln_2)
    return ref.eval()


def test_post_ln_matches_torch_nn_transformer_with_our_embeddings_and_head() -> None:
    torch.manual_seed(0)
    model = randomised(EncoderDecoder(CFG))
    ref = reference_transformer(model)
    src = torch.randint(0, CFG.vocab_size, (3, 11))
    src[1, 8:] = CFG.pad_id  # one padded source, so the key-padding masks are compared too
    tgt = torch.randint(0, CFG.vocab_size, (3, 7))
    keep = padding_mask(src, CFG.pad_id)
    with torch.no_grad():
        ours = logits(model, src, tgt, src_mask=keep)
        src_x = model._embed(src, model.source_embedding, None, 0)  # our embeddings and positions ...
        tgt_x = model._embed(tgt, model.tgt_embed, None, 0)
        out = ref(src_x, tgt_x, tgt_mask=nn.Transformer.generate_square_subsequent_mask(7), tgt_is_causal=True,
                  src_key_padding_mask=~keep, memory_key_padding_mask=~keep)
        theirs = model.lm_head(out)  # ... and our head around torch's layers
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_embeddings_are_scaled_by_sqrt_d_model_plus_sinusoids() -> None:
    torch.manual_seed(0)
    model = EncoderDecoder(CFG).eval()
    ids = torch.tensor([[3, 7, 9]])
    pe = torch.tensor([[math.sin(p / 10000 ** (2 * (i // 2) / CFG.d_model)) if i % 2 == 0 else
                        math.cos(p / 10000 ** (2 * (i // 2) / CFG.d_model)) for i in range(CFG.d_model)]
                       for p in range(3)])
    torch.testing.assert_close(sinusoidal_positions(torch.arange(3), CFG.d_model), pe)
    expected = model.tgt_embed(ids) * math.sqrt(CFG.d_model) + pe
    torch.testing.assert_close(model._embed(ids, model.tgt_embed, None, 0), expected)


@pytest.mark.parametrize("norm_position", ["pre", "post"])
def test_extra_source_padding_changes_no_output(norm_position: str) -> None:
    cfg = EncDecConfig(**{**CFG.__dict__, "norm_position": norm_position})
    torch.manual_seed(0)
    model = randomised(EncoderDecoder(cfg))
    src = torch.randint(0, cfg.vocab_size, (2, 9))
    tgt = torch.randint(0, cfg.vocab_size, (2, 6))
    padded = torch.cat([src, torch.full((2, 5), cfg.pad_id)], dim=1)  # (2, 14)
    with torch.no_grad():
        plain = logits(model, src, tgt)
        masked = logits(model, padded, tgt, src_mask=padding_mask(padded, cfg.pad_id))
        unmasked = logits(model, padded, tgt)
    torch.testing.assert_close(masked, plain, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(unmasked, plain, atol=1e-3)  # the mask is what makes the padding invisible


def test_padding_mask_is_none_without_padding() -> None:
    assert padding_mask(torch.tensor([[1, 2, 3]]), CFG.pad_id) is None
    assert padding_mask(torch.tensor([[1, CFG.pad_id]]), CFG.pad_id).tolist() == [[True, False]]


def test_kv_cache_decoding_equals_full_recomputation() -> None:
    torch.manual_seed(0)
    model = randomised(EncoderDecoder(EncDecConfig(**{**CFG.__dict__, "norm_position": "pre", "n_kv_head": 2})))
    src = torch.randint(0, CFG.vocab_size, (2, 10))
    tgt = torch.randint(0, CFG.vocab_size, (2, 8))
    with torch.no_grad():
        full = logits(model, src, tgt)
        memory_kv = model.memory_kv(model.encode(src))
        cache = model.new_cache(2, 8)
        steps = [model.logits(model.decode(tgt[:, :3], memory_kv, cache=cache))]  # a chunk, then one at a time
        steps += [model.logits(model.decode(tgt[:, t:t + 1], memory_kv, cache=cache)) for t in range(3, 8)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_generate_seq2seq_greedy_equals_recomputing_everything_each_step() -> None:
    torch.manual_seed(0)
    model = randomised(EncoderDecoder(EncDecConfig(**{**CFG.__dict__, "norm_position": "pre"})), seed=3)
    source = torch.randint(0, CFG.vocab_size, (10,)).tolist()
    fast = generate_seq2seq(model, source, max_new_tokens=12, temperature=0.0)
    tokens = [CFG.pad_id]
    with torch.no_grad():
        for _ in range(12):
            out = logits(model, torch.tensor([source]), torch.tensor([tokens]))
            tokens.append(int(out[0, -1, :CFG.pad_id].argmax()))
    assert fast == tokens[1:] and len(fast) == 12
    stop = fast[4]
    assert generate_seq2seq(model, source, 12, temperature=0.0, stop_ids={stop}) == fast[:fast.index(stop)]
    sampled = generate_seq2seq(model, source, 12, temperature=1.0, seed=5)
    assert sampled == generate_seq2seq(model, source, 12, temperature=1.0, seed=5)
    assert all(t < CFG.pad_id for t in sampled)


def test_ids_past_the_tokenizers_are_never_sampled() -> None:
    # model.vocab_size above a tokenizer.json's id count: the rows between decode to nothing
    model = randomised(EncoderDecoder(CFG), seed=4)
    source = torch.randint(0, 50, (10,)).tolist()
    sampled = [t for seed in range(4) for t in generate_seq2seq(model, source, 24, temperature=3.0, seed=seed,
                                                                text_ids=50)]
    assert all(t < 50 or CFG.sentinel_start <= t < CFG.pad_id for t in sampled)
    assert any(t >= CFG.sentinel_start for t in sampled)  # the sentinels stay drawable


def test_source_longer_than_the_encoder_positions_is_refused() -> None:
    model = EncoderDecoder(CFG)
    with pytest.raises(ValueError,
                       match=r"source of 25 tokens is longer than the encoder's positions \(model.block_size=24\)"):
        model(torch.zeros(1, 25, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="source of 30 tokens"):
        generate_seq2seq(model, [1] * 30, 4)


def test_vocabulary_holds_sentinels_and_padding() -> None:
    assert (CFG.sentinel_start, CFG.pad_id, CFG.total_vocab_size, CFG.padded_vocab_size) == (200, 205, 206, 256)
    with pytest.raises(ConfigError, match="model.n_sentinels: encdec needs at least 1"):
        EncDecConfig(n_sentinels=0)
    with pytest.raises(ConfigError, match="model.pos: rope is for arch gpt"):
        EncDecConfig(pos="rope")
    with pytest.raises(ConfigError, match=r"model.rope_theta: not a key of an encoder-decoder \(model.arch=encdec\)"):
        load_config(None, ["--model.arch=encdec", "--model.rope_theta=500"])


@pytest.mark.parametrize("share", [True, False])
def test_shared_or_separate_embeddings_and_tied_head(share: bool) -> None:
    torch.manual_seed(0)
    model = ENCDEC.build(EncDecConfig(**{**CFG.__dict__, "share_embeddings": share}))
    assert isinstance(model, EncoderDecoder)
    assert model.lm_head.weight is model.tgt_embed.weight
    assert (model.source_embedding is model.tgt_embed) == share
    emb = CFG.padded_vocab_size * CFG.d_model
    n = sum(p.numel() for p in model.parameters())  # a shared or tied tensor counted once
    assert n - (0 if share else emb) == sum(p.numel() for p in EncoderDecoder(CFG).parameters())
    assert n == num_params(model.cfg)


def test_same_seed_same_weights_and_loss_falls_when_fitting_one_batch() -> None:
    cfg = EncDecConfig(**{**CFG.__dict__, "norm_position": "pre"})
    torch.manual_seed(1)
    a = EncoderDecoder(cfg)
    torch.manual_seed(1)
    b = EncoderDecoder(cfg)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    src = torch.randint(0, 200, (4, 12))
    tgt = torch.randint(0, 200, (4, 6))
    tgt_in = torch.cat([torch.full((4, 1), cfg.pad_id), tgt[:, :-1]], dim=1)
    opt = torch.optim.AdamW(a.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = ENCDEC.training.loss(a, a, [src, tgt_in, tgt]).optimized
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > math.log(200) - 1 and losses[-1] < 0.5 * losses[0]


def test_init_statistics() -> None:
    # the tied embedding d_model^-0.5 (unit variance once scaled by sqrt(d_model)), drawn once, not again as a head;
    # every projection into the residual stream, cross-attention's too, 0.02 / sqrt(2 * blocks); others 0.02
    torch.manual_seed(0)
    cfg = EncDecConfig(**{**CFG.__dict__, "d_model": 256, "n_head": 4})
    model = EncoderDecoder(cfg)
    assert model.tgt_embed.weight.std().item() == pytest.approx(256 ** -0.5, rel=0.03)
    assert model.lm_head.weight is model.tgt_embed.weight
    residual = 0.02 / math.sqrt(2 * 2 * cfg.n_layer)
    for block in [*model.encoder, *model.decoder]:
        assert block.attn.proj.weight.std().item() == pytest.approx(residual, rel=0.05)
        assert block.attn.q.weight.std().item() == pytest.approx(0.02, rel=0.05)
    for block in model.decoder:
        assert block.cross.proj.weight.std().item() == pytest.approx(residual, rel=0.05)
        assert block.cross.q.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_decoder_inputs_longer_than_block_size_are_refused() -> None:
    # sinusoidal positions exist for any index, so only the explicit check keeps the decoder within block_size
    model = EncoderDecoder(CFG).eval()
    src = torch.randint(0, CFG.vocab_size, (1, 5))
    with torch.no_grad():
        model(src, torch.zeros(1, 24, dtype=torch.long))  # exactly block_size fits
        with pytest.raises(ValueError, match=r"sequence of 25 tokens exceeds model.block_size=24"):
            model(src, torch.zeros(1, 25, dtype=torch.long))
        # with a cache, the positions already decoded count too
        memory_kv = model.memory_kv(model.encode(src))
        cache = model.new_cache(1, 25)
        model.decode(torch.zeros(1, 24, dtype=torch.long), memory_kv, cache=cache)
        with pytest.raises(ValueError, match=r"sequence of 25 tokens exceeds model.block_size=24"):
            model.decode(torch.zeros(1, 1, dtype=torch.long), memory_kv, cache=cache)


def test_pre_norm_stacks_end_in_a_final_norm() -> None:
    # pre-norm blocks leave the residual stream unnormalised; the encoder's and decoder's final LayerNorms
    # (gain 1, bias 0 at init) give every position zero mean and unit variance over d_model
    torch.manual_seed(0)
    model = EncoderDecoder(EncDecConfig(**{**CFG.__dict__, "norm_position": "pre"})).eval()
    src = torch.randint(0, CFG.vocab_size, (2, 9))
    tgt = torch.randint(0, CFG.vocab_size, (2, 6))
    with torch.no_grad():
        for h in (model.encode(src), model(src, tgt)):
            torch.testing.assert_close(h.mean(-1), torch.zeros(h.shape[:-1]), atol=1e-5, rtol=0)
            torch.testing.assert_close(h.var(-1, unbiased=False), torch.ones(h.shape[:-1]), atol=1e-3, rtol=0)


def test_loss_is_the_mean_over_the_non_padding_targets() -> None:
    # a shorter target padded with pad_id must not be scored at its padding
    torch.manual_seed(0)
    model = randomised(EncoderDecoder(EncDecConfig(**{**CFG.__dict__, "norm_position": "pre"})))
    src = torch.randint(0, CFG.vocab_size, (2, 8))
    tgt_out = torch.randint(0, CFG.vocab_size, (2, 6))
    tgt_out[1, 3:] = CFG.pad_id
    tgt_in = torch.cat([torch.full((2, 1), CFG.pad_id), tgt_out[:, :-1]], dim=1)
    with torch.no_grad():
        loss = ENCDEC.training.loss(model, model, [src, tgt_in, tgt_out]).optimized
        full = logits(model, src, tgt_in)
    real = tgt_out != CFG.pad_id
    expected = F.cross_entropy(full[real], tgt_out[real])
    assert abs(loss.item() - expected.item()) <= 1e-5


def test_generate_seq2seq_refuses_a_negative_temperature_and_too_many_new_tokens() -> None:
    model = randomised(EncoderDecoder(CFG))
    with pytest.raises(ValueError, match=r"temperature must be >= 0, got -1.0"):
        generate_seq2seq(model, [1, 2, 3], 4, temperature=-1.0)
    with pytest.raises(ValueError, match=r"max_new_tokens must be in \[0, 24\], got 25"):
        generate_seq2seq(model, [1, 2, 3], 25, temperature=0.0)


def test_generate_seq2seq_leaves_the_model_in_its_mode() -> None:
    # decoding runs in eval mode (no dropout) and hands the model back as it found it
    model = EncoderDecoder(EncDecConfig(**{**CFG.__dict__, "dropout": 0.1}))
    model.train()
    generate_seq2seq(model, [1, 2, 3], 3, temperature=0.0)
    assert model.training
    model.eval()
    generate_seq2seq(model, [1, 2, 3], 3, temperature=0.0)
    assert not model.training


def test_top_k_one_samples_the_greedy_tokens() -> None:
    # top_k=1 leaves only the most likely token, whatever the temperature and seed
    torch.manual_seed(0)
    model = randomised(EncoderDecoder(EncDecConfig(**{**CFG.__dict__, "norm_position": "pre"})), seed=3)
    source = torch.randint(0, CFG.vocab_size, (10,)).tolist()
    greedy = generate_seq2seq(model, source, 12, temperature=0.0)
    for seed in range(3):
        assert generate_seq2seq(model, source, 12, temperature=2.0, top_k=1, seed=seed) == greedy


def test_sampling_refuses_more_new_tokens_than_the_decoder_positions() -> None:
    model = randomised(EncoderDecoder(CFG))
    tokenizer = SimpleNamespace(encode_ordinary=lambda s: [ord(c) - 90 for c in s],
                                decode=lambda ids: "".join(chr(i + 90) for i in ids), n_vocab=100)
    assert isinstance(ENCDEC.sampler.sample(model, tokenizer, "ab<mask>c", SampleOptions(24, 0.0)), str)
    too_many = r"--max-new-tokens: 25 exceeds the decoder's positions \(model.block_size=24\)"
    with pytest.raises(PromptError, match=too_many):
        ENCDEC.sampler.sample(model, tokenizer, "ab<mask>c", SampleOptions(25, 0.0))


def test_learned_position_tables_are_drawn_with_gpt2s_std() -> None:
    # both position tables are parameters built on the meta device: each must be drawn (std 0.02), not
    # left as the uninitialised memory `to_empty` gives
    torch.manual_seed(0)
    model = EncoderDecoder(EncDecConfig(**{**CFG.__dict__, "pos": "learned", "d_model": 256, "block_size": 64}))
    for table in (model.src_pos, model.tgt_pos):
        assert table.weight.mean().abs().item() < 0.002
        assert table.weight.std().item() == pytest.approx(0.02, rel=0.05)
