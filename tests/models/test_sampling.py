"""Prompts in, text out: a next-token model's prompt fitted to its context (`lm.models.generate`), an
encoder-decoder's `<mask>` prompts (`lm.models.encdec.sampling`)."""

import logging
from types import SimpleNamespace

import pytest

from lm.errors import ConfigError, PromptError
from lm.models.encdec import sampling
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


def chars(text: str) -> list[int]:
    return [ord(c) - 90 for c in text]  # "a" -> 7: ids below vocab_size 100


def test_the_masks_must_leave_a_sentinel_for_the_end_marker():
    cfg = EncDecConfig(vocab_size=100, block_size=32, n_sentinels=5)
    ids, pieces = encdec_source("a<mask>" * 4, chars, cfg)  # 4 spans, sentinel 4 left to end the output
    assert ids == [7, 100, 7, 101, 7, 102, 7, 103] and pieces == ["a"] * 4 + [""]
    with pytest.raises(PromptError, match="prompt has 5 <mask> markers; the model has 5 sentinels, so at most 4"):
        encdec_source("a<mask>" * 5, chars, cfg)


def test_a_prompt_as_long_as_the_encoders_positions_fits_and_one_more_is_refused():
    cfg = EncDecConfig(vocab_size=100, block_size=8, n_sentinels=5)
    assert encdec_source("abcdefg", chars, cfg)[0] == [7, 8, 9, 10, 11, 12, 13, 100]  # 7 ids and the mask: 8
    with pytest.raises(PromptError, match="prompt of 9 tokens is longer than the encoder's positions"):
        encdec_source("abcdefgh", chars, cfg)


def test_fill_masks_stops_at_the_end_marker_and_draws_only_decodable_ids(monkeypatch):
    """Two masks: sentinels 100 and 101 delimit the spans; 102 (the end marker) and every later sentinel stop the
    output; ids from the tokenizer's n_vocab (60) up to the sentinels are never drawn."""
    cfg = EncDecConfig(vocab_size=100, block_size=32, n_sentinels=5)
    asked = {}

    def generate(model, ids, max_new_tokens, **kw):
        asked.update(kw, ids=ids, max_new_tokens=max_new_tokens)
        return [100, 7, 8, 101, 9]

    monkeypatch.setattr(sampling, "generate_seq2seq", generate)
    tokenizer = SimpleNamespace(encode_ordinary=chars, decode=lambda ids: "".join(chr(i + 90) for i in ids),
                                n_vocab=60)
    text = fill_masks(SimpleNamespace(cfg=cfg), tokenizer, "x <mask>y<mask>z", SampleOptions(6, 0.5, 3, 0.9, 11))
    assert text == "xabycz"  # the spans decoded in place of the masks (the space before a mask is the span's)
    assert asked["ids"] == [*chars("x"), 100, *chars("y"), 101, *chars("z")]
    assert asked["stop_ids"] == {102, 103, 104}
    assert asked["text_ids"] == 60
    assert (asked["max_new_tokens"], asked["temperature"], asked["top_k"], asked["top_p"], asked["seed"]) == (
        6, 0.5, 3, 0.9, 11)
