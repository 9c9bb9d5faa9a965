"""Prompts in, text out: a next-token model's prompt fitted to its context (`lm.models.generate`), an
encoder-decoder's `<mask>` prompts (`lm.models.encdec.sampling`)."""

import logging
from types import SimpleNamespace

import pytest

from lm.errors import ConfigError, PromptError
from lm.models.encdec.config import EncDecConfig
from lm.models.encdec.sampling import encdec_source, fill_masks, split_spans
from lm.models.family import SampleOptions
from lm.models.generate import fit_prompt


def test_split_spans_and_source_ids():
    cfg = EncDecConfig(vocab_size=100, block_size=16, n_sentinels=5)
    ids, pieces = encdec_source("ab<mask>cd", lambda s: [ord(c) - 90 for c in s], cfg)
    assert ids == [7, 8, 100, 9, 10] and pieces == ["ab", "cd"]
    assert encdec_source("ab", lambda s: [1] * len(s), cfg) == ([1, 1, 100], ["ab", ""])
    assert split_spans([100, 5, 6, 101, 7], 2, 100) == [[5, 6], [7]]
    assert split_spans([9, 101, 7], 3, 100) == [[], [7], []]


def test_the_space_before_a_mask_is_the_spans_as_in_span_corruption():
    from lm.tokenizer import load_tokenizer

    encode = load_tokenizer("gpt2").encode_ordinary
    cfg = EncDecConfig(vocab_size=50257, block_size=64, n_sentinels=5)
    # the words of a text carry their space: span corruption hides " discontent", so "our" meets the sentinel
    assert encode("winter of our discontent, made") == encode("winter of our") + encode(" discontent, made")
    ids, pieces = encdec_source("winter of our <mask>, made <mask>", encode, cfg)
    assert ids == [*encode("winter of our"), 50257, *encode(", made"), 50258]  # not encode(" ") == [220] before each
    assert pieces == ["winter of our", ", made", ""]
    assert encdec_source("our <mask> ", encode, cfg)[1] == ["our", " "]  # text after the last mask keeps its own


def test_long_prompt_keeps_its_tail(caplog):
    with caplog.at_level(logging.WARNING):
        assert fit_prompt(list(range(40)), max_new_tokens=8, block_size=32) == list(range(16, 40))
    assert "keeping its last 24" in caplog.text
    assert fit_prompt([1, 2], 8, 32) == [1, 2]
    with pytest.raises(PromptError, match="--max-new-tokens: 32 leaves no room"):
        fit_prompt([1], 32, 32)


def test_the_encoder_decoder_refuses_compiled_decoding():
    model = SimpleNamespace(cfg=EncDecConfig(vocab_size=100, block_size=16))  # refused before it computes
    with pytest.raises(ConfigError, match=r"^--compile: an encoder-decoder \(model.arch=encdec\) decodes eagerly "
                                          "only; sample without --compile$"):
        fill_masks(model, None, "ab<mask>", SampleOptions(4, compiled=True))
