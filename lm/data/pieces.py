"""A text file as a stream of documents cut into pieces, in bounded memory, tokenized as if read whole.

A text file may be larger than memory, and so may one of its documents. `split_pieces` takes the file's
text in chunks and yields pieces, each marked with whether it ends its document, so the tokenizer puts the
end-of-text token after a document's last piece only. A document is the whole file, or the text between
separators (`data.document_separator`).

A piece ends only where tokenizing stops mattering: after a newline between two non-space characters
(`x\\n|y`) or before a single space between two (`x| y`). There the GPT-2 and cl100k pre-tokenizer regexes
end a pre-token whatever follows (no pre-token holds a non-space character followed by a space, and one
ending in a newline ends at `y`), and the next one starts there and depends only on the text from there on;
as BPE merges never cross pre-tokens, the pieces' tokens are exactly the whole document's. Not next to more
whitespace: `x\\n\\n` at the end of a piece is one GPT-2 pre-token `'\\n\\n'` (one token), but `'\\n'`, `'\\n'`
when `y` follows (two tokens). Only a stretch of `max_chars` characters holding no such place (a line of
tens of MB with no single space in it) is cut without one; the tokens at that cut may then differ from
whole-file tokenization.
"""

import re
from collections.abc import Generator, Iterable, Iterator
from typing import NamedTuple

__all__ = ["BLANK_LINES", "Piece", "split_pieces"]

BLANK_LINES = "\n\n"
"""The separator meaning: any run of blank lines (lines holding only whitespace) between documents."""

# Blank lines: the lines after a line's own newline that hold only whitespace, each with its newline. The
# document before keeps the newline that ends its last line.
_BLANK_RUN = re.compile(r"(?<=\n)(?:[^\S\n]*\n)+")
# Greedy, so it matches up to the last safe end of a piece (see the module docstring).
_LAST_SAFE_END = re.compile(r"(?s).*(?:\S\n(?=\S)|\S(?= \S))")


class Piece(NamedTuple):
    text: str
    ends_document: bool
    """Whether this is its document's last piece (the end-of-text token follows it)."""


def split_pieces(chunks: Iterable[str], separator: str, max_chars: int) -> Iterator[Piece]:
    """Cut the consecutive text `chunks` of one file into pieces of documents.

    `separator` "" makes the whole text one document; `BLANK_LINES` splits at each run of blank lines;
    any other string splits at each occurrence of itself, which is dropped. Documents that are empty or
    whitespace only are skipped, except the one document of a file. Once `max_chars` characters are held
    back, the document so far is yielded as a piece, so at most `max_chars` plus one chunk are held (more
    only for whitespace: that a run of blank lines could still take, or a document's start that is blank so far).
    """
    rest, started = "", False  # started: a piece of the document in `rest` was yielded already
    for chunk in chunks:
        rest, started = yield from _complete_documents(rest + chunk, separator, started, final=False)
        if len(rest) >= max_chars:
            end = _piece_end(rest, _piece_reach(rest, separator))
            if end and (started or not rest[:end].isspace()):  # a blank start may be a blank document, skipped
                yield Piece(rest[:end], False)
                rest, started = rest[end:], True
    rest, started = yield from _complete_documents(rest, separator, started, final=True)
    if not separator or _keep(rest, started):
        yield Piece(rest, True)


def _complete_documents(
    text: str, separator: str, started: bool, final: bool
) -> Generator[Piece, None, tuple[str, bool]]:
    """Yield the last piece of each document in `text` whose separator is certain (no more text can
    change it); return the text after the last such separator and whether a piece of it was yielded."""
    pos = 0
    for start, end in _separators(text, separator, final):
        if _keep(text[pos:start], started):
            yield Piece(text[pos:start], True)
        pos, started = end, False
    return text[pos:], started


def _separators(text: str, separator: str, final: bool) -> Iterator[tuple[int, int]]:
    """(start, end) of each certain separator in `text`, in order."""
    if separator == BLANK_LINES:
        # More text could lengthen a run of blank lines that reaches the trailing whitespace.
        yield from (m.span() for m in _BLANK_RUN.finditer(text, 0, len(text) if final else len(text.rstrip())))
    elif separator:
        start = text.find(separator)
        while start >= 0:
            yield start, start + len(separator)
            start = text.find(separator, start + len(separator))


def _piece_reach(text: str, separator: str) -> int:
    """How far into `text` a piece may end: not into a separator that more text could complete."""
    if separator == BLANK_LINES:
        return len(text.rstrip())
    return max(len(text) - max(len(separator) - 1, 0), 0)


def _piece_end(text: str, reach: int) -> int:
    """Where a piece of `text` ends: its last safe end before `reach`, or `reach` itself when it has none."""
    match = _LAST_SAFE_END.match(text, 0, reach)
    return match.end() if match else reach


def _keep(text: str, started: bool) -> bool:
    """Whether the (rest of a) document is yielded: one already begun is, an empty or blank one is not."""
    return started or (bool(text) and not text.isspace())
