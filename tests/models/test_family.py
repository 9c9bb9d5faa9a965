"""The family spec's pure choices: which linear layers train.float8 converts (no torchao needed)."""

from lm.models.family import float8_except
from lm.models.registry import get_family


def test_float8_keeps_the_named_layers_and_dimensions_that_are_not_multiples_of_16():
    choose = float8_except("lm_head", "router.gate")
    assert choose("blocks.0.attn.q", 768, 768) and choose("blocks.11.mlp.fc", 768, 3072)
    assert not choose("lm_head", 768, 50304)
    assert not choose("blocks.3.mlp.router.gate", 768, 64)  # a name's last dotted parts
    assert choose("blocks.3.mlp.gate", 768, 2048)  # SwiGLU's gate is no router's
    assert choose("blocks.0.xlm_head", 64, 64)  # only whole dotted parts match
    assert not choose("blocks.0.attn.q", 768, 40) and not choose("blocks.0.attn.q", 24, 768)


def test_each_family_keeps_its_heads_out_of_float8():
    gpt, encoder, lstm = (get_family(name).float8_linears for name in ("gpt", "encoder", "lstm"))
    assert not gpt("lm_head", 64, 128) and not gpt("blocks.0.mlp.router.gate", 64, 16)
    assert gpt("blocks.0.mlp.shared.fc", 64, 256)
    assert not any(encoder(name, 64, 64) for name in ("lm_head", "mlm_dense", "score"))
    assert encoder("blocks.0.attn.proj", 64, 64)
    assert not lstm("lm_head", 64, 128)
