import random
import re

import pytest

from lm.data.corpora import find_corpus
from lm.data.pieces import BLANK_LINES, Piece, split_pieces
from lm.io import read_utf8, read_utf8_chunks
from lm.tokenizer import load_tokenizer

TOKENIZERS = ("gpt2", "cl100k_base")
# The places the module docstring says a piece may end: after a newline between two non-space characters,
# before a single space between two.
SAFE_ENDS = re.compile(r"(?<=\S\n)(?=\S)|(?<=\S)(?= \S)")
WORDS = ["word", "Word", "é", "日本語", "🙂", "'s", "'ll", "12345", "...", "-", "(", "<|endoftext|>"]
SPACES = [" ", "  ", "\n", "\n\n", "\n\n\n", "\r\n", "\r\n\r\n", "\t", " \n", "\n ", "\u00a0", "\u2028", "\f", "\r"]


def nasty_text(seed: int, words: int) -> str:
    """Words and runs of whitespace at random; safe ends are at most 329 characters apart for seeds 0 and 1."""
    rng = random.Random(seed)
    return "".join(rng.choice(WORDS) + rng.choice(SPACES) for _ in range(words))


def chunked(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def tokens(pieces, tokenizer: str) -> list[int]:
    """Each piece encoded on its own, the end-of-text token after each document's last piece."""
    enc = load_tokenizer(tokenizer)
    return [t for p in pieces for t in enc.encode_ordinary(p.text) + [enc.eot_token] * p.ends_document]


def documents(pieces) -> list[str]:
    docs, parts = [], []
    for piece in pieces:
        parts.append(piece.text)
        if piece.ends_document:
            docs.append("".join(parts))
            parts = []
    assert not parts  # the last piece ends its document
    return docs


@pytest.mark.parametrize("tokenizer", TOKENIZERS)
def test_safe_ends_do_not_change_tokens(tokenizer):
    enc = load_tokenizer(tokenizer)
    text = nasty_text(0, 2000)
    whole = enc.encode_ordinary(text)
    ends = [m.start() for m in SAFE_ENDS.finditer(text)]
    assert len(ends) > 200
    for end in ends:
        assert enc.encode_ordinary(text[:end]) + enc.encode_ordinary(text[end:]) == whole, repr(text[end - 5:end + 5])


def test_a_newline_after_whitespace_is_no_safe_end():
    gpt2 = load_tokenizer("gpt2")
    assert gpt2.encode_ordinary("x\n\ny") == [87, 198, 198, 88]  # "\n", "\n" before a non-space
    assert gpt2.encode_ordinary("x\n\n") + gpt2.encode_ordinary("y") == [87, 628, 88]  # "\n\n" at the end


@pytest.mark.parametrize("tokenizer", TOKENIZERS)
def test_shakespeare_in_small_pieces_gives_the_whole_files_tokens(tokenizer):
    plays = find_corpus("shakespeare").files[:4]
    for path in plays:  # the raw Markdown: hard-break spaces before newlines, blank lines, CRLF-free
        pieces = list(split_pieces(read_utf8_chunks(path, 1000), "", 2000))
        assert len(pieces) > 20 and all(not p.ends_document for p in pieces[:-1]) and pieces[-1].ends_document
        assert all(len(p.text) < 3000 for p in pieces)
        assert tokens(pieces, tokenizer) == tokens([Piece(read_utf8(path), True)], tokenizer)
    cleaned = "".join(find_corpus("shakespeare").documents("text"))[:400_000]  # as the built-in corpus reads
    crlf = cleaned.replace("\n", "\r\n")  # no newline is a safe end: pieces end before spaces
    for text in (cleaned, crlf):
        pieces = list(split_pieces(chunked(text, 333), "", 500))
        assert len(pieces) > 500
        assert tokens(pieces, tokenizer) == tokens([Piece(text, True)], tokenizer)


@pytest.mark.parametrize("tokenizer", TOKENIZERS)
@pytest.mark.parametrize("chunk, max_chars", [(1, 400), (7, 400), (64, 500), (1000, 1000)])
def test_nasty_text_in_pieces_gives_the_whole_texts_tokens(tokenizer, chunk, max_chars):
    text = nasty_text(1, 2000)
    pieces = list(split_pieces(chunked(text, chunk), "", max_chars))
    assert "".join(p.text for p in pieces) == text
    assert len(pieces) > 10
    assert tokens(pieces, tokenizer) == tokens([Piece(text, True)], tokenizer)


def test_a_stretch_without_a_safe_end_is_cut_at_the_bound():
    text = "x" * 100 + "\n\n" + "y" * 20  # no safe end anywhere
    pieces = list(split_pieces(chunked(text, 30), "", 50))
    assert [len(p.text) for p in pieces] == [60, 60, 2]  # held back no more than max_chars plus one chunk
    assert documents(pieces) == [text]


TEXT = "\n\n first doc\nline two\n\n \t\n\nsecond\r\n\r\nthird\n  \n\n"


@pytest.mark.parametrize("separator, text, expected", [
    ("", TEXT, [TEXT]),
    ("", " \n\n ", [" \n\n "]),  # one document per file, whatever it holds
    (BLANK_LINES, TEXT, [" first doc\nline two\n", "second\r\n", "third\n"]),
    (BLANK_LINES, "a\nb", ["a\nb"]),
    (BLANK_LINES, "a\n \nb  \n\n\n  c", ["a\n", "b  \n", "  c"]),
    ("\f", "one\ftwo\n\f\f  \fthree\f", ["one", "two\n", "three"]),
    ("<|doc|>", "<|doc|>a<|doc|>b <|doc|>", ["a", "b "]),
    ("==", "a===b====c", ["a", "=b", "c"]),  # as str.split: occurrences do not overlap
    ("\f", "one\f" + " \n" * 6 + "\f two", ["one", " two"]),  # a blank document longer than max_chars too
    ("\n", "l1\nl2\r\n\n\nl3", ["l1", "l2\r", "l3"]),
])
def test_separators_split_documents(separator, text, expected):
    assert documents(split_pieces([text], separator, 1000)) == expected
    for chunk, max_chars in ((1, 1000), (1, 4), (3, 5)):  # chunks and pieces may end anywhere
        assert documents(split_pieces(chunked(text, chunk), separator, max_chars)) == expected


def test_long_documents_between_separators_come_in_pieces():
    docs = [" ".join(f"w{d}.{i}" for i in range(200)) + "\n" for d in range(3)]
    text = "\n\n".join(docs) + "\f" + docs[0]
    splits = {BLANK_LINES: [*docs[:2], docs[2] + "\f" + docs[0]], "\f": [text[:-len(docs[0]) - 1], docs[0]]}
    for separator, expected in splits.items():
        pieces = list(split_pieces(chunked(text, 100), separator, 300))
        assert documents(pieces) == expected
        assert max(len(p.text) for p in pieces) <= 400
        assert sum(not p.ends_document for p in pieces) >= 4
        for tokenizer in TOKENIZERS:
            assert tokens(pieces, tokenizer) == tokens([Piece(d, True) for d in expected], tokenizer)
