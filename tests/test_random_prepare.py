"""Seeded random corpora and data settings through the real `lm.prepare`.

Each case writes 1 to 3 source files of random kinds and contents (text with odd line endings, empty,
undecodable or huge; JSON lines, JSON, Parquet and Arrow rows whose text column holds every JSON type or is
missing; a saved dataset with a damaged state.json; kinds prepare does not read), names them in a random
data.source (paths, globs, a directory, nothing), sets random values under the data keys prepare reads, and
runs `python -m lm.prepare`'s main. The contract: exit 2 with exactly one `error:` line, no traceback, and the
workspace byte-identical (no data.dir, no staging directory left); or exit 0 with data.dir holding exactly the
tokens the tokenizer gives for the documents written (read back from the shards, split by the documented
rule), and the inputs byte-identical. The seed is fixed, so a failure replays exactly.
"""

import glob
import json
import os
import random
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from lm.data.corpora import TEXT_CHUNK
from lm.data.prepare import is_val_document
from lm.data.shards import HEADER_BYTES, read_header, read_manifest, verify_hashes
from lm.data.staging import PARTIAL_SUFFIX
from lm.prepare import main as prepare_main
from lm.tokenizer import document_prefix, load_tokenizer
from tests.test_bad_inputs import digest
from tests.test_random_inputs import assert_contract, call

RANDOM_PREPARE_CASES = 60
"""Random corpora and settings put through lm.prepare (README's figure of inputs tried counts them)."""

HUGE = ("-" * 64 + " ") * 4100
"""One line longer than the 256 KiB that prepare reads at a time (lm.data.corpora.TEXT_CHUNK), of few tokens."""
# Text of every awkward shape: blank, line endings of three kinds, other scripts, special-token text, NUL, a BOM,
# blank-line runs, a form feed, separators
TEXTS = ["Fair is foul, and foul is fair.\n", "", " ", "\n", "\t \n", "one\r\ntwo\r\n", "one\rtwo", "é, 漢字, 🙂\n",
         "<|endoftext|> and </s> are text here", "a\x00b", "\ufeffa byte-order mark first",
         "first\n\nsecond\n \n\nthird\n", "x\fy\f", "<|doc|>"]
BAD_BYTES = [b"\xff", b"caf\xc3", b"\xed\xa0\x80", b"\x80abc", b"\xfe\xff\x00a"]
JSON_VALUES = ["a row of text", "", "é🙂\r\n", 0, 1.5, None, True, [], ["a"], {"t": "a"}]
DATA_VALUES = {
    "val_fraction": ([0, 0, 0.5, 0.25, 0.1, 0.999, 1e-9], [1, -0.1, float("nan"), "x", None]),
    "shard_tokens": ([1, 3, 64, 100_000_000], [0, -5, 1.5, "x", 2**63, None]),
    "num_workers": ([0, 1, 2], [-1, 1.5, "x"]),
    "tokenizer": (["gpt2", "cl100k_base", "{ws}/tok/tokenizer.json"], ["llama", "{ws}/none.json", "{ws}/a.json",
                                                                      "{ws}/dir.json", "", 5]),
    "text_column": (["text", "body"], ["", " ", "TEXT", 5, None]),
    "document_separator": (["", "\n\n", "\f", "<|doc|>"], ["\\n", 5, None]),
    "seq_len": ([16], [0, -1, "x"]),
    "verify_hashes": ([True, False], ["yes", 2]),
}
"""Each data key prepare reads, with (plausible, awkward) values ({ws}: the workspace)."""
ROW_SUFFIXES = [".jsonl", ".json", ".parquet", ".arrow"]
OTHER_SUFFIXES = [".csv", ".bin", ""]


def random_text(rng: random.Random) -> str:
    text = "".join(rng.choice(TEXTS) if rng.random() > 0.03 else HUGE for _ in range(rng.randint(1, 3)))
    return text.replace("\n", rng.choice(["\n", "\n", "\r\n", "\r"]))


def text_file(rng: random.Random, odd: float) -> tuple[bytes, str | None]:
    """A .txt/.md file's bytes and its text (None when it is not UTF-8); empty or undecodable at rate `odd`."""
    roll = rng.random()
    if roll < odd / 3:
        return b"", ""
    text = random_text(rng)
    if roll < odd:
        cut = rng.randint(0, len(text))
        return text[:cut].encode() + rng.choice(BAD_BYTES) + text[cut:].encode(), None
    return text.encode(), text


def random_row(rng: random.Random, column: str, odd: float) -> object:
    """A row for a row file: an object with a text in `column`; at rate `odd` any JSON value there, no such
    column, or no object."""
    roll = rng.random()
    if roll >= odd:
        return {column: rng.choice(JSON_VALUES[:3]) if rng.random() > 0.03 else HUGE, "n": 1}
    if roll < odd / 2:
        return {column: rng.choice(JSON_VALUES), "n": 1}
    if roll < odd * 3 / 4:
        return {"other": "a row"}
    return rng.choice([5, "a row", [1, 2], None])


def row_file(rng: random.Random, suffix: str, column: str, odd: float) -> tuple[bytes, list | None]:
    """A row file's bytes and the texts of its rows (None when some row has no text string)."""
    rows = [random_row(rng, column, odd) for _ in range(rng.randint(0 if rng.random() < odd else 1, 4))]
    texts = [r[column] for r in rows if isinstance(r, dict) and isinstance(r.get(column), str)]
    valid = len(texts) == len(rows) > 0
    if suffix == ".jsonl":
        ending = rng.choice(["\n", "\r\n"])
        data = "".join(json.dumps(r, ensure_ascii=rng.random() < 0.5) + ending for r in rows)
        if rng.random() < odd / 2:
            data += rng.choice(["{", "\n\n", "[1,", "nan\n"])
            valid = False
        return data.encode(), texts if valid else None
    if suffix == ".json":
        if rng.random() < odd / 2:
            return json.dumps(rng.choice([{column: texts}, 5, "text", None])).encode(), None
        return json.dumps(rows).encode(), texts if valid else None
    objects = [r if isinstance(r, dict) else {"other": json.dumps(r)} for r in rows]
    columns = {key: [o.get(key) for o in objects] for o in objects for key in o}
    valid = valid and bool(objects)
    try:
        table = pa.table(columns) if columns else pa.table({column: pa.array([], pa.string())})
    except (pa.ArrowInvalid, pa.ArrowTypeError):  # values no one Arrow type holds: the column as their JSON
        table = pa.table({key: [json.dumps(v) for v in values] for key, values in columns.items()})
        valid = False
    sink = pa.BufferOutputStream()
    if suffix == ".parquet":
        pq.write_table(table, sink)
    else:
        with pa.ipc.new_stream(sink, table.schema) as writer:  # the Arrow stream files datasets writes
            writer.write_table(table)
    return sink.getvalue().to_pybytes(), texts if valid else None


def saved_dataset(rng: random.Random, directory: Path, column: str, odd: float) -> list | None:
    """A dataset that `datasets`' save_to_disk wrote into `directory`, its state.json sometimes damaged; its texts
    (None when damaged)."""
    from lm.data.local_datasets import local_datasets

    texts = [rng.choice(JSON_VALUES[:3]) for _ in range(rng.randint(1, 3))]
    with local_datasets() as datasets:
        datasets.Dataset.from_dict({column: texts}).save_to_disk(directory)
    if rng.random() >= odd:
        return texts
    state = directory / "state.json"
    value = rng.choice([None, 5, "x", [], [{"filename": None}], [{"filename": 5}], [{"file": "x"}], ["x"],
                        [{"filename": "../none.arrow"}], {"filename": "x"}])
    if rng.random() < 0.8:
        state.write_text(json.dumps({**json.loads(state.read_text()), "_data_files": value}))
    else:
        state.write_text(rng.choice(["", "{", "[]", "5"]))
    return None


def write_sources(
    rng: random.Random, ws: Path, column: str, odd: float
) -> tuple[list[str], dict[Path, str | list | None]]:
    """1 to 3 source entries in `ws`, and what each file they may name holds: its text (a text file), its rows'
    texts (a row file), or None (unreadable or not a corpus); awkward at rate `odd`."""
    entries, held = [], {}
    for i in range(rng.randint(1, 3)):
        roll = rng.random()
        if roll < 0.45:
            path = ws / f"src_{i}{rng.choice(['.txt', '.md'])}"
            data, held[path.resolve()] = text_file(rng, odd)
        elif roll < 0.9 - odd / 3:
            suffix = rng.choice(ROW_SUFFIXES)
            path = ws / f"src_{i}{suffix}"
            data, held[path.resolve()] = row_file(rng, suffix, column, odd)
        elif roll < 1 - odd / 3:
            path = ws / f"saved_{i}"
            texts = saved_dataset(rng, path, column, odd)
            held.update({p.resolve(): texts for p in path.glob("*.arrow")})
            entries.append(str(path))
            continue
        else:
            path = ws / f"src_{i}{rng.choice(OTHER_SUFFIXES)}"
            data, _ = text_file(rng, odd)
            held[path.resolve()] = None
        path.write_bytes(data)
        # the file, a glob (one from the working directory, led by "*", which YAML reads as an alias), none
        entries.append(rng.choices([str(path), f"{ws}/src_{i}*", f"*{ws.name[4:]}/src_{i}*", f"{ws}/src_{i}.nomatch",
                                    str(ws)], [3, 1, 1, odd, odd])[0])
    return entries, held


def random_settings(rng: random.Random, ws: Path, odd: float) -> dict:
    """val_fraction and 0 to 3 more data keys besides the source at random values, awkward at rate `odd`."""
    data = {}
    for key in ["val_fraction", *rng.sample(sorted(DATA_VALUES.keys() - {"val_fraction"}), rng.randint(0, 3))]:
        plausible, awkward = DATA_VALUES[key]
        value = rng.choice(awkward if rng.random() < odd else plausible)
        data[key] = value.replace("{ws}", str(ws)) if isinstance(value, str) else value
    return data


def expected_documents(files: list[Path], held: dict, separator: str) -> list[str] | None:
    """The documents prepare reads from `files`, in order, by the documented rules; None where some file is not
    a readable corpus."""
    documents = []
    for path in files:
        content = held.get(path)
        if content is None:
            return None
        if isinstance(content, list):
            documents += [row for row in content if row and not row.isspace()]  # a blank row is no document
        elif not separator:
            documents.append(content)  # a file's one document, even blank
        elif separator == "\n\n":
            documents += _blank_line_documents(content)
        else:
            documents += [d for d in content.split(separator) if d and not d.isspace()]
    return documents


def _blank_line_documents(text: str) -> list[str]:
    """A text's documents between runs of blank lines: lines of only whitespace, each ended by a newline and
    following one (the text's first line follows none, so it stays with the first document)."""
    documents, current = [], ""
    for number, line in enumerate(re.split(r"(?<=\n)", text)):
        if number and line.endswith("\n") and line.isspace():
            documents.append(current)
            current = ""
        else:
            current += line
    documents.append(current)
    return [d for d in documents if d and not d.isspace()]


def named_files(entries: list[str]) -> list[Path]:
    """The files `entries` name, as data.source resolves them: each entry's matches sorted (a saved dataset's
    Arrow files), each file once."""
    files = [Path(p).resolve() for e in entries for p in sorted(glob.glob(f"{e}/*.arrow" if os.path.isdir(e) else e))
             if os.path.isfile(p)]
    return list(dict.fromkeys(files))


def _tokens(shard: Path) -> np.ndarray:
    """A shard's tokens, read whole (a memory map per shard would hold thousands of files open)."""
    dtype, count = read_header(shard)
    return np.fromfile(shard, dtype.newbyteorder("<"), count, offset=HEADER_BYTES)


def check_prepared(out: Path, documents: list[str] | None, tokenizer: str, val_fraction: float) -> None:
    """data.dir's manifest and shards agree, and hold exactly `documents`' tokens when they are known."""
    manifest = read_manifest(out)
    verify_hashes(out, manifest)
    splits = manifest["splits"]
    tokens = {split: np.concatenate([np.zeros(0, np.uint32), *(_tokens(out / s["file"]) for s in info["shards"])])
              for split, info in splits.items()}
    for split, info in splits.items():
        assert info["tokens"] == tokens[split].size == sum(s["tokens"] for s in info["shards"]), (split, info)
    assert splits["train"]["documents"] > 0 and splits["train"]["tokens"] > 0
    if documents is None:
        return
    enc = load_tokenizer(tokenizer)
    expected: dict[bool, list[int]] = {False: [], True: []}
    for i, document in enumerate(documents):
        expected[is_val_document(i, val_fraction)] += [*document_prefix(enc), *enc.encode_ordinary(document),
                                                       enc.eot_token]
    assert splits["val"]["documents"] == sum(is_val_document(i, val_fraction) for i in range(len(documents)))
    assert splits["train"]["documents"] + splits["val"]["documents"] == len(documents)
    assert tokens["train"].tolist() == expected[False]
    assert tokens["val"].tolist() == expected[True]


@pytest.fixture()
def prepare_workspace(tmp_path, tokenizer_jsons, monkeypatch) -> Path:
    """An empty workspace but for a tokenizer.json, a .json file that is no tokenizer and a directory named .json."""
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_bytes(tokenizer_jsons["eot"].read_bytes())
    (tmp_path / "a.json").write_text('{"not": "a tokenizer"}')
    (tmp_path / "dir.json").mkdir()
    monkeypatch.chdir(tmp_path)  # anything written by a relative path lands in the hashed tree
    return tmp_path


def random_case(rng: random.Random, root: Path, i: int) -> tuple[list[str], dict, list[str], dict]:
    """Case `i`: its sources and config written into `root/case_i`; returns (lm.prepare's arguments, the data
    section, the source entries, what each file holds)."""
    ws = root / f"case_{i}"
    ws.mkdir()
    odd = rng.choice([0.0, 0.1, 0.4])  # the rate of awkward choices: some cases are valid throughout
    data = random_settings(rng, root, odd)
    column = data.get("text_column") if isinstance(data.get("text_column"), str) else "text"
    entries, held = write_sources(rng, ws, column, odd)
    shards = data.get("shard_tokens")
    if isinstance(shards, int) and 0 < shards < 4096 and sum(f.stat().st_size for f in ws.rglob("*.*")) > TEXT_CHUNK:
        data["shard_tokens"] = 4096  # a long document in shards of a few tokens: thousands of files, slowly
    # data.dir: new, or at rate `odd` the workspace, a source file, below one, "" (the working directory), no name, a
    # name too long for the staging directory beside it
    out = rng.choices([ws / "data", ws, ws / "src_0.txt", ws / "src_0.txt" / "data", "", ws / "new" / "..",
                       ws / ("d" * 250)], [3, odd, odd, odd, odd, odd, odd])[0]
    if rng.random() < odd:  # a file named twice, an empty entry
        entries = [*entries, rng.choice(entries), " "]
    data.update(source=",".join(entries), dir=str(out))
    model = {"vocab_size": 100277} if data.get("tokenizer") == "cl100k_base" and rng.random() < 0.8 else {}
    written = {k: v for k, v in data.items() if k != "source"} if rng.random() < 0.5 else data  # or on the command line
    (ws / "config.yaml").write_text(yaml.safe_dump({"data": written, "model": model}))
    argv = ["--config", str(ws / "config.yaml"), *([] if "source" in written else [f"--data.source={data['source']}"])]
    return argv + (["--force"] if rng.random() < 0.2 else []), data, entries, held


@pytest.mark.slow
def test_random_corpora_prepare_exactly_or_are_refused_in_one_line(prepare_workspace, capsys):
    """Exit 2 with one error line and nothing written, or the exact tokens of the documents in data.dir and
    nothing else written; a second run of a success reuses its data and changes nothing."""
    rng = random.Random(5)
    prepared, memo = 0, {}  # memo: the files of earlier cases stay in the workspace, hashed once
    for i in range(RANDOM_PREPARE_CASES):
        argv, data, entries, held = random_case(rng, prepare_workspace, i)
        out = Path(data["dir"]).resolve()  # "" is the working directory, the workspace
        before = digest(prepare_workspace, memo)
        code = call(prepare_main, argv)
        assert_contract(code, capsys.readouterr().err, (i, data))
        after = digest(prepare_workspace, memo)
        assert not os.path.exists(out.with_name(out.name + PARTIAL_SUFFIX)), (i, data)  # False for a name too long
        if code == 2:
            assert after == before, (i, data)
            continue
        prepared += 1
        assert {k: v for k, v in after.items() if k in before} == before, (i, data)
        place = out.relative_to(prepare_workspace).parts  # new: data.dir, what it holds, directories made above it
        assert all(Path(k).parts[:len(place)] == place[:len(Path(k).parts)] for k in after.keys() - before.keys())
        separator = str(data.get("document_separator", ""))  # the config reads a number as its text
        documents = expected_documents(named_files(entries), held, separator)
        check_prepared(out, documents, str(data.get("tokenizer", "gpt2")), data.get("val_fraction", 0.05))
        made = out.stat().st_ino  # a rebuild writes the same bytes, but into a new directory swapped in
        assert call(prepare_main, [a for a in argv if a != "--force"]) == 0, (i, data)
        assert out.stat().st_ino == made and digest(prepare_workspace, memo) == after, (i, data)
    assert prepared >= RANDOM_PREPARE_CASES // 8, prepared  # enough cases are valid to test the results too
