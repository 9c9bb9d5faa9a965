"""The Debian text mix as JSON lines: `python -m lm.bench.debian_corpus ROOT OUT`.

`launch/debian_corpus.sh` downloads five Debian packages and unpacks them under ROOT; this turns what
they hold into documents, one JSON object a line, `{"text": ..., "source": ...}`:

    gcide       every entry of the GNU Collaborative International Dictionary of English (dict-gcide)
    wordnet     every entry of WordNet 3.0 (dict-wn)
    linux-doc   every reStructuredText page of the Linux 6.1 documentation (linux-doc-6.1)
    python-doc  every reStructuredText page of the Python 3.11 documentation (python3.11-doc)
    perl-doc    every POD page of the Perl documentation (perl-doc)

Document i goes to file i mod `--files`, so every file is a like mix of the five sources and any k of
the n files are about k/n of the corpus (what a benchmark at a quarter, half and all of it needs). Bytes
that are not UTF-8 (gcide has 3) become U+FFFD. Reads and writes nothing else; downloads nothing.
"""

import argparse
import gzip
import json
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

# dictd's index writes offsets and lengths in base 64, most significant digit first
_B64 = {c: i for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}


def _b64_number(digits: str) -> int:
    value = 0
    for c in digits:
        value = value * 64 + _B64[c]
    return value


def dictd_entries(index: Path, dictionary: Path) -> Iterator[str]:
    """The entries of a dictd database in file order, each once (several headwords may point at one entry),
    without the database's own `00-database-*` notes; none where the package is not unpacked."""
    if not index.is_file():
        return
    spans = set()
    for line in index.read_text(encoding="utf-8", errors="replace").splitlines():
        headword, offset, length = line.split("\t")
        if not headword.startswith(("00-database-", "00database")):
            spans.add((_b64_number(offset), _b64_number(length)))
    data = gzip.open(dictionary).read()  # dictzip is gzip with a random-access table gzip ignores
    for offset, length in sorted(spans):
        text = data[offset:offset + length].decode("utf-8", errors="replace").strip("\n")
        if text.strip():
            yield text + "\n"


def _pages(root: Path, pattern: str) -> Iterator[str]:
    for path in sorted(root.glob(pattern)):
        text = path.read_bytes().decode("utf-8", errors="replace")
        if text.strip():
            yield text


SOURCES = {
    "gcide": lambda root: dictd_entries(root / "usr/share/dictd/gcide.index", root / "usr/share/dictd/gcide.dict.dz"),
    "wordnet": lambda root: dictd_entries(root / "usr/share/dictd/wn.index", root / "usr/share/dictd/wn.dict.dz"),
    "linux-doc": lambda root: _pages(root / "usr/share/doc/linux-doc-6.1/html/_sources", "**/*.rst.txt"),
    "python-doc": lambda root: _pages(root / "usr/share/doc/python3.11/html/_sources", "**/*.txt"),
    "perl-doc": lambda root: _pages(root / "usr/share/perl", "*/pod/*.pod"),
}


def write_corpus(root: Path, out: Path, files: int) -> dict[str, dict[str, int]]:
    """Write every source's documents under `root` into `out`/debian-NN.jsonl; returns documents and
    UTF-8 bytes of text per source."""
    out.mkdir(parents=True, exist_ok=True)
    counts: dict[str, dict[str, int]] = {}
    with ExitStack() as stack:
        sinks = [stack.enter_context(open(out / f"debian-{i:02d}.jsonl", "w", encoding="utf-8")) for i in range(files)]
        document = 0
        for name, read in SOURCES.items():
            counts[name] = {"documents": 0, "bytes": 0}
            for text in read(root):
                sinks[document % files].write(json.dumps({"text": text, "source": name}, ensure_ascii=False) + "\n")
                counts[name]["documents"] += 1
                counts[name]["bytes"] += len(text.encode())
                document += 1
            if counts[name]["documents"] == 0:
                raise SystemExit(f"error: {root}: no {name} documents; unpack its Debian package there first")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lm.bench.debian_corpus", description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="where the Debian packages were unpacked (dpkg-deb -x)")
    parser.add_argument("out", type=Path, help="directory to write debian-NN.jsonl into")
    parser.add_argument("--files", type=int, default=16, help="files to spread the documents over")
    args = parser.parse_args(argv)
    counts = write_corpus(args.root, args.out, args.files)
    for name, c in counts.items():
        print(f"{name:<11} {c['documents']:>9,} documents {c['bytes'] / 1e6:>8.1f} MB")
    total = sum(c["bytes"] for c in counts.values())
    print(f"{'total':<11} {sum(c['documents'] for c in counts.values()):>9,} documents {total / 1e6:>8.1f} MB "
          f"in {args.files} files under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
