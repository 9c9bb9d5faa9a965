import hashlib
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from lm.errors import DataError
from lm.io import (
    atomic_path,
    atomic_write_text,
    merge_dir,
    output_dir_problem,
    output_file_problem,
    publish_dir,
    read_utf8,
    read_utf8_chunks,
    sha256_file,
)


def test_sha256_file_streams_the_whole_file(tmp_path):
    data = os.urandom(3 * (1 << 20) + 17)  # several read chunks and a partial one
    (tmp_path / "blob").write_bytes(data)
    assert sha256_file(tmp_path / "blob") == hashlib.sha256(data).hexdigest()


def _ordinary_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def test_atomic_write_replaces_the_file_with_ordinary_permissions(tmp_path):
    path = tmp_path / "sub" / "out.txt"
    atomic_write_text(path, "first")
    atomic_write_text(path, "second")
    assert path.read_text() == "second"
    assert stat.S_IMODE(path.stat().st_mode) == _ordinary_mode()
    assert [p.name for p in path.parent.iterdir()] == ["out.txt"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "out.bin"
    path.write_bytes(b"good")
    with pytest.raises(OSError, match="disk full"), atomic_path(path) as tmp:
        tmp.write_bytes(b"half")
        raise OSError("disk full")
    assert path.read_bytes() == b"good"
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def test_a_failed_text_write_leaves_the_old_text(tmp_path, monkeypatch):
    import lm.io

    path = tmp_path / "results.md"
    path.write_text("old")

    def full_disk(tmp, target):
        raise OSError("disk full")

    monkeypatch.setattr(lm.io, "commit", full_disk)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_text(path, "new")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["results.md"]


def test_a_private_file_is_published_readable(tmp_path):
    # safetensors and mkstemp create 0600 files; what we publish must not stay private
    path = tmp_path / "weights"
    with atomic_path(path) as tmp:
        fd = os.open(tmp, os.O_CREAT | os.O_WRONLY, 0o600)
        os.close(fd)
    assert stat.S_IMODE(path.stat().st_mode) == _ordinary_mode()


def test_publish_dir_replaces_a_directory_whole(tmp_path):
    final, staging = tmp_path / "final", tmp_path / "staging"
    final.mkdir()
    (final / "old").write_text("old")
    staging.mkdir()
    (staging / "new").write_text("new")
    publish_dir(staging, final)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    assert [p.name for p in final.iterdir()] == ["new"]


def test_merge_dir_keeps_the_files_it_does_not_replace(tmp_path):
    final, staging = tmp_path / "final", tmp_path / "staging"
    final.mkdir()
    (final / "mine").write_text("mine")
    (final / "shared").write_text("old")
    staging.mkdir()
    (staging / "shared").write_text("new")
    merge_dir(staging, final)
    assert not staging.exists()
    assert {p.name: p.read_text() for p in final.iterdir()} == {"mine": "mine", "shared": "new"}


def test_read_utf8_names_the_file_and_the_bad_byte(tmp_path):
    (tmp_path / "ok.txt").write_text("héllo", encoding="utf-8")
    assert read_utf8(tmp_path / "ok.txt") == "héllo"
    (tmp_path / "bad.txt").write_bytes(b"abc\xffdef")
    with pytest.raises(DataError, match=r"bad.txt: not UTF-8: byte 0xff at offset 3"):
        read_utf8(tmp_path / "bad.txt")
    with pytest.raises(DataError, match=r"none.txt: cannot read: No such file or directory"):
        read_utf8(tmp_path / "none.txt")


def test_read_utf8_chunks_decodes_characters_cut_by_chunks(tmp_path):
    text = "héllo wörld, 日本語 🙂\n" * 50
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    for size in (1, 2, 3, 5, 1 << 20):
        chunks = list(read_utf8_chunks(tmp_path / "a.txt", size))
        assert "".join(chunks) == text and all(chunks)
    assert len(list(read_utf8_chunks(tmp_path / "a.txt", 7))) > 100


def test_a_byte_order_mark_opening_a_file_is_dropped(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"\xef\xbb\xbfh\xc3\xa9 \xef\xbb\xbf")  # a second mark is text: U+FEFF
    assert read_utf8(tmp_path / "a.txt") == "hé \ufeff"
    for size in (1, 2, 3, 4, 1 << 20):
        assert "".join(read_utf8_chunks(tmp_path / "a.txt", size)) == "hé \ufeff"
    (tmp_path / "bad.txt").write_bytes(b"\xef\xbb\xbfab\xff")
    for size in (1, 2, 1 << 20):  # the offset still counts the mark's bytes
        with pytest.raises(DataError, match=r"byte 0xff at offset 5"):
            list(read_utf8_chunks(tmp_path / "bad.txt", size))
    with pytest.raises(DataError, match=r"byte 0xff at offset 5"):
        read_utf8(tmp_path / "bad.txt")


@pytest.mark.parametrize("data, message", [
    (b"abc\xffdef", r"bad.txt: not UTF-8: byte 0xff at offset 3 cannot be decoded \(invalid start byte\)"),
    ("é".encode() * 40 + b"\xc3\x28" + b"x" * 40, r"bad.txt: not UTF-8: byte 0xc3 at offset 80 cannot be decoded"),
    (b"ok \xe6\x97", r"bad.txt: not UTF-8: byte 0xe6 at offset 3 cannot be decoded \(unexpected end of data\)"),
])
def test_read_utf8_chunks_gives_read_utf8s_error(tmp_path, data, message):
    (tmp_path / "bad.txt").write_bytes(data)
    with pytest.raises(DataError, match=message) as whole:
        read_utf8(tmp_path / "bad.txt")
    for size in (1, 3, 16, 1 << 20):
        with pytest.raises(DataError) as chunked:
            list(read_utf8_chunks(tmp_path / "bad.txt", size))
        assert str(chunked.value) == str(whole.value)
    with pytest.raises(DataError, match=r"none.txt: cannot read: No such file or directory"):
        list(read_utf8_chunks(tmp_path / "none.txt", 4))


def test_an_output_file_is_refused_where_it_cannot_be_written(tmp_path):
    source = tmp_path / "rows.csv"
    source.write_text("text\n")
    assert output_file_problem(tmp_path / "new" / "deeper" / "out.jsonl", [source]) is None  # parents are made
    assert output_file_problem(tmp_path / "out.jsonl", [source]) is None
    assert output_file_problem(tmp_path, [source]) == f"{tmp_path}: is a directory; name the file to write"
    below = source / "x" / "out.jsonl"
    assert output_file_problem(below) == f"{below}: {source} is a file, not a directory"
    assert output_file_problem(tmp_path / "." / "rows.csv", [source]) == (
        f"{tmp_path / 'rows.csv'}: is the input {source}; write the output to another file")


def test_an_output_whose_name_or_temporary_name_is_too_long_is_refused_before_any_stat(tmp_path):
    """A name of 255 bytes is a file the filesystem takes, but not its temporary sibling: refused up front, by the
    path the user gave, where the write at the end would fail naming the temporary file. A directory name past 255
    makes stat itself fail (ENAMETOOLONG), which the checks must not trip on."""
    fits = tmp_path / ("f" * (255 - 14))
    assert output_file_problem(fits) is None and output_dir_problem(fits, sibling=True) is None
    atomic_write_text(fits, "x")  # the longest name whose temporary name fits: written
    name = "é" * 120 + ".json"  # 245 bytes in UTF-8, though 125 characters
    assert output_file_problem(tmp_path / name) == (
        f"{tmp_path / name}: the name 'éééééééééééééééééééééééé...' is 245 bytes; its filesystem takes names of at "
        "most 255, and lm writes it first under a name 14 bytes longer")
    deep = tmp_path / ("d" * 300) / "out.json"
    for problem in (output_file_problem(deep), output_dir_problem(deep), output_dir_problem(deep, sibling=True)):
        assert problem == (f"{deep}: the name 'dddddddddddddddddddddddd...' is 300 bytes; its filesystem takes names "
                           "of at most 255")
    assert output_dir_problem(tmp_path / ("d" * 250)) is None  # made in place: no temporary name
    assert output_dir_problem(Path("/")) == "/: is the root directory; name a file or directory below it"


def test_an_output_in_a_directory_this_process_may_not_write_is_refused(tmp_path, monkeypatch):
    """Checked with os.access (root may write anywhere, so the test takes the permission away by patching it)."""
    locked = tmp_path / "locked"
    locked.mkdir()
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != locked)
    out = locked / "new" / "out.json"
    assert output_file_problem(out) == f"{out}: cannot write in {locked} (permission denied)"
    assert output_dir_problem(locked / "runs") == f"{locked / 'runs'}: cannot write in {locked} (permission denied)"
    assert output_dir_problem(locked) == f"{locked}: cannot write in it (permission denied)"
    assert output_dir_problem(tmp_path / "elsewhere") is None
    # a directory filled in place needs itself writable; one built beside itself, its parent too
    inside = locked / "existing"
    inside.mkdir()
    assert output_dir_problem(inside) is None
    assert output_dir_problem(inside, sibling=True) == f"{inside}: cannot write in {locked} (permission denied)"



HELD = """
import os, subprocess, sys
from lm.io import held_output

def talk(tag):  # three ways a library talks: print, a write to the raw descriptor, a child process
    print(tag, "print")
    os.write(2, f"{tag} fd2\\n".encode())
    subprocess.run([sys.executable, "-c", f"print('{tag} child')"], check=True)

print("before", flush=True)
stdout = os.dup(1)  # the real stdout, past the hold: what reaches it inside the block shows the order
with held_output():
    talk("ok")
    os.write(stdout, b"end of block\\n")
try:
    with held_output():
        talk("failed")
        raise RuntimeError
except RuntimeError:
    print("after")
"""


@pytest.mark.process
def test_held_output_shows_after_success_and_drops_on_error():
    done = subprocess.run([sys.executable, "-c", HELD], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert done.stdout.splitlines() == ["before", "end of block", "ok print", "ok child", "after"]
    assert done.stderr.splitlines() == ["ok fd2"]


def test_the_temporary_file_is_written_beside_its_destination(tmp_path):
    # a rename is atomic only within one filesystem: the temporary file must sit in the destination's directory
    path = tmp_path / "sub" / "out.bin"
    with atomic_path(path) as tmp:
        assert tmp.parent == path.parent and tmp.name != path.name
        tmp.write_bytes(b"data")
    assert path.read_bytes() == b"data"


def test_publish_dir_clears_a_replaced_copy_left_by_a_killed_publish(tmp_path):
    # a publish killed after its last rename leaves <final>.replaced; the next one must still go through
    final, staging, aside = tmp_path / "final", tmp_path / "staging", tmp_path / "final.replaced"
    for d, name in ((final, "old"), (staging, "new"), (aside, "stale")):
        d.mkdir()
        (d / name).write_text(name)
    publish_dir(staging, final)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    assert [p.read_text() for p in final.iterdir()] == ["new"]


def test_an_output_anywhere_below_an_input_directory_is_refused(tmp_path):
    # writing into the tree being read would feed the output back in, however deep it lies
    source = tmp_path / "rows"
    source.mkdir()
    deep = source / "a" / "b" / "out.jsonl"
    assert output_file_problem(deep, [source]) == f"{deep}: is inside the input {source}; write the output elsewhere"
    assert output_file_problem(tmp_path / "out.jsonl", [source]) is None
