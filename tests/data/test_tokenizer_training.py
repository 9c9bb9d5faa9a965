"""The corpus a tokenizer is trained on, and the compression it is measured by: the held-out documents are
lm.prepare's val documents, and compression counts UTF-8 bytes."""

from lm.data.corpora import TEXT_CHUNK, find_corpus
from lm.data.pieces import Piece
from lm.data.prepare import is_val_document
from lm.data.tokenizer_training import compression, corpus_pieces


def test_held_out_documents_are_prepares_val_documents_when_a_document_comes_in_pieces(tmp_path):
    """Documents are counted by their last piece: the first document, longer than TEXT_CHUNK, comes in several."""
    docs = ["long " * (TEXT_CHUNK // 2)] + [f"document {i} here\n" for i in range(1, 8)]
    for i, doc in enumerate(docs):
        (tmp_path / f"doc_{i}.txt").write_text(doc)
    corpus = find_corpus(str(tmp_path / "*.txt"))
    assert sum(1 for _ in corpus.pieces("text")) > len(docs)
    held_out = "".join(p.text for p in corpus_pieces(corpus, "text", 0.25, held_out=True))
    trained_on = "".join(p.text for p in corpus_pieces(corpus, "text", 0.25, held_out=False))
    assert [i for i in range(len(docs)) if is_val_document(i, 0.25)] == [3, 7]
    assert held_out == docs[3] + docs[7]
    assert trained_on == "".join(d for i, d in enumerate(docs) if i not in (3, 7))


def test_compression_counts_utf8_bytes_documents_and_every_batch():
    pieces = [Piece("café ", False), Piece("漢字", True), Piece("x" * (1 << 20), True), Piece("tail", True)]
    result = compression(pieces, {"chars": lambda texts: [list(t) for t in texts]})
    assert result.documents == 3
    assert result.bytes == len("café 漢字".encode()) + (1 << 20) + 4 == 12 + (1 << 20) + 4
    assert result.tokens == {"chars": len("café 漢字") + (1 << 20) + 4}  # the last, partial batch counted too
