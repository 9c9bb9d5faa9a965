#!/usr/bin/env bash
# Assemble the Debian text mix, the largest real corpus a machine with only package registries can get
# (115 MB of text, 277,433 documents, 42.8 M GPT-2 tokens), as 16 JSON-lines files under OUT/jsonl:
# two dictionaries (GCIDE, WordNet) entry by entry, and the Linux, Python and Perl documentation page by page
# (see lm/bench/debian_corpus.py). Downloads five Debian packages (~83 MB) with `apt-get download` into
# OUT/debs and unpacks them with `dpkg-deb -x` into OUT/root; installs nothing. Needs apt-get and dpkg-deb (a
# Debian or Ubuntu machine whose sources list Debian 12's packages).
#   bash launch/debian_corpus.sh OUT
#   python -m lm.prepare --data.source='OUT/jsonl/*.jsonl' --data.dir=data/debian
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: bash launch/debian_corpus.sh OUT" >&2; exit 2; }
out="$(mkdir -p "$1" && cd "$1" && pwd)"
cd "$(dirname "$0")/.."
py="${PYTHON:-python}"
packages=(dict-gcide dict-wn linux-doc-6.1 python3.11-doc perl-doc)

mkdir -p "$out/debs" "$out/root"
(cd "$out/debs" && apt-get download "${packages[@]}")
for deb in "$out"/debs/*.deb; do
  dpkg-deb -x "$deb" "$out/root"
  echo "$(dpkg-deb -f "$deb" Package) $(dpkg-deb -f "$deb" Version)"
done | tee "$out/packages.txt"
"$py" -m lm.bench.debian_corpus "$out/root" "$out/jsonl"
