"""lm.prepare on a real corpus of JSON-lines files beside `datasets` (`load_dataset` + `map`, see
lm/bench/datasets_map.py): tokens per second with the same tokenizer, and lm.prepare's peak memory at a
quarter, a half, all and three times the corpus, for each tokenizer.

Every run is a fresh process (`python -m lm.prepare ...` as a user types it), timed from its start to its
exit, so both sides pay for starting Python, reading the files and writing their output (shards with their
sha256; datasets' Arrow cache). Its memory is sampled every 50 ms two ways: the peak resident set of the
process itself (the kernel's high-water mark, VmHWM, what `/usr/bin/time -v` prints as its maximum resident
set size), and the sum of the resident sets of its whole process tree (datasets' `num_proc` workers are
processes of their own). The kernel's rusage of a child cannot serve: it counts the parent it was forked
from, here a benchmark that holds torch.
"""

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tokenizers

from lm.errors import DataError
from lm.tokenizer import load_tokenizer

SCALES = (("1/4", 0.25), ("1/2", 0.5), ("all", 1.0), ("3 x", 3.0))
_SAMPLE_S = 0.05


def bench_corpus(patterns: list[str], num_proc: int, reps: int, work_root: str | None = None) -> dict:
    """Measure lm.prepare and datasets on the JSON-lines files `patterns` match, with GPT-2 through tiktoken and
    through a tokenizer.json, `reps` runs of each side in turns (the median run is kept); then lm.prepare with
    each tokenizer at each of SCALES. Both sides run `num_proc` workers (lm.prepare's threads, datasets'
    processes). Intermediate files go to a temporary directory in `work_root`."""
    files = sorted(dict.fromkeys(f for pattern in patterns for f in glob.glob(os.path.expanduser(pattern))))
    if not files:
        raise DataError(f"--corpus: {patterns} matches no files; expected JSON-lines files, e.g. those "
                        "launch/debian_corpus.sh writes")
    found: dict = {"files": len(files), "MB": sum(os.path.getsize(f) for f in files) / 1e6, "tokenizers": {},
                   "scales": {}}
    with tempfile.TemporaryDirectory(dir=work_root) as tmp:
        work = Path(tmp)
        gpt2_json = write_gpt2_tokenizer_json(work / "gpt2" / "tokenizer.json")
        names = {"gpt2": "gpt2", "tokenizer.json": str(gpt2_json)}
        runs: dict[str, dict[str, list[dict]]] = {name: {"ours": [], "datasets": []} for name in names}
        for _ in range(reps):  # in turns, so a slow spell of a shared machine touches each side alike
            for name, tokenizer in names.items():
                runs[name]["ours"].append(prepare_row(files, tokenizer, num_proc, work))
                runs[name]["datasets"].append(datasets_row(files, tokenizer, num_proc, work))
        for name, sides in runs.items():
            found["tokenizers"][name] = {side: _median_run(rows) for side, rows in sides.items()}
            ours, theirs = found["tokenizers"][name]["ours"], found["tokenizers"][name]["datasets"]
            if (ours["tokens"], ours["documents"]) != (theirs["tokens"], theirs["documents"]):
                raise RuntimeError(f"{name}: lm.prepare wrote {ours['tokens']} tokens of {ours['documents']} "
                                   f"documents, datasets {theirs['tokens']} of {theirs['documents']}")
        for name, tokenizer in names.items():
            found["scales"][name] = {}
            for label, scale in SCALES:
                scaled = scaled_files(files, scale, work)
                found["scales"][name][label] = {"files": len(scaled), **prepare_row(scaled, tokenizer, num_proc,
                                                                                     work)}
    found["documents"] = found["tokenizers"]["gpt2"]["ours"]["documents"]
    found["same shards"] = found["tokenizers"]["gpt2"]["ours"]["shards"] == found["tokenizers"]["tokenizer.json"][
        "ours"]["shards"]
    return found


def _median_run(rows: list[dict]) -> dict:
    """The run of median wall time (the lower middle one of an even number)."""
    return sorted(rows, key=lambda r: r["wall s"])[(len(rows) - 1) // 2]


def run_measured(argv: list[str], log: Path) -> dict:
    """Run `argv` (output to `log`) and return its wall seconds, the peak resident set of its own process
    ("max RSS MiB") and the peak of its process tree's summed resident sets ("tree MiB"), both sampled."""
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    peak = tree = 0
    while proc.poll() is None:
        # the high-water mark only rises, so the last sample before the exit misses at most its last 50 ms
        peak = max(peak, _status_bytes(proc.pid, "VmHWM"))
        tree = max(tree, _tree_rss(proc.pid))
        time.sleep(_SAMPLE_S)
    seconds = time.perf_counter() - start
    output = log.read_text()
    if proc.returncode == 2:  # bad input (the corpus): the tool's own error line, as this tool's
        errors = [line.removeprefix("error: ") for line in output.splitlines() if line.startswith("error: ")]
        raise DataError(f"--corpus: {errors[-1] if errors else output[-2000:]}")
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited with {proc.returncode}:\n{output[-2000:]}")
    return {"wall s": seconds, "max RSS MiB": peak / 2**20, "tree MiB": tree / 2**20, "output": output}


def _status_bytes(pid: int, field: str) -> int:
    """A size field (VmHWM, VmRSS) of /proc/<pid>/status in bytes; 0 once the process has ended."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def _tree_rss(root: int) -> int:
    """Bytes resident in process `root` and all its descendants now (0 for those that just ended)."""
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += _status_bytes(pid, "VmRSS")
        try:
            for task in Path(f"/proc/{pid}/task").iterdir():
                stack.extend(int(child) for child in (task / "children").read_text().split())
        except (OSError, ValueError):
            continue
    return total


def prepare_row(files: list[str], tokenizer: str, num_workers: int, work: Path) -> dict:
    """`python -m lm.prepare` on `files` with `num_workers` tokenizer threads into a fresh directory under `work`:
    run_measured's figures plus the documents and tokens it wrote and its shards' sha256."""
    out = work / "prepared"
    shutil.rmtree(out, ignore_errors=True)
    row = run_measured([sys.executable, "-m", "lm.prepare", f"--data.source={','.join(files)}", f"--data.dir={out}",
                        f"--data.tokenizer={tokenizer}", f"--data.num_workers={num_workers}"], work / "prepare.log")
    manifest = json.loads((out / "manifest.json").read_text())
    splits = manifest["splits"].values()
    row.update(documents=sum(s["documents"] for s in splits), tokens=sum(s["tokens"] for s in splits),
               shards=[shard["sha256"] for s in splits for shard in s["shards"]])
    shutil.rmtree(out)
    return row


def datasets_row(files: list[str], tokenizer: str, num_proc: int, work: Path) -> dict:
    """`python -m lm.bench.datasets_map` on `files` with a fresh cache under `work`: run_measured's figures
    plus what it printed (documents, tokens, load s, map s)."""
    cache = work / "datasets-cache"
    shutil.rmtree(cache, ignore_errors=True)
    row = run_measured([sys.executable, "-m", "lm.bench.datasets_map", "--tokenizer", tokenizer, "--num-proc",
                        str(num_proc), "--cache", str(cache), *files], work / "datasets.log")
    row.update(json.loads(row["output"].strip().splitlines()[-1]))
    shutil.rmtree(cache)
    return row


def scaled_files(files: list[str], scale: float, work: Path) -> list[str]:
    """The first `scale` of `files` (their documents are spread evenly over the files), or for a scale above
    1 that many copies of them as hard links under `work` (no more disk; each copy another input)."""
    if scale <= 1:
        return files[:max(1, round(len(files) * scale))]
    copies = []
    for copy in range(int(scale)):
        directory = work / "copies" / str(copy)
        directory.mkdir(parents=True, exist_ok=True)
        for name in files:
            link = directory / Path(name).name
            if not link.exists():
                os.link(name, link)
            copies.append(str(link))
    return copies


def write_gpt2_tokenizer_json(path: Path) -> Path:
    """GPT-2's tokenizer (tiktoken's r50k_base, as lm loads it) written as a Hugging Face tokenizer.json: the
    same pre-tokenizer regex, byte-level alphabet and ranks, so it gives the same ids, through `tokenizers`.

    A merge for each way of splitting a token into two tokens, ordered by the rank of the token they make:
    tiktoken merges the adjacent pair whose concatenation ranks lowest, and so does a BPE whose merges are
    ranked by what they make.
    """
    enc = load_tokenizer("gpt2")
    ranks: dict[bytes, int] = enc._mergeable_ranks
    alphabet = _byte_alphabet()

    def chars(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    merges = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], chars(left), chars(right)))
    merges.sort()
    model = tokenizers.models.BPE({chars(t): r for t, r in ranks.items()}, [(m[3], m[4]) for m in merges])
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Split(tokenizers.Regex(enc._pat_str), behavior="isolated"),
        tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens([tokenizers.AddedToken("<|endoftext|>", special=True)])
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def _byte_alphabet() -> list[str]:
    """The character byte-level BPE shows for each byte: printable Latin-1 bytes as themselves, the other 68
    bytes as the characters from U+0100 on, in byte order (GPT-2's convention)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shown, extra = {}, 0
    for b in range(256):
        if b in printable:
            shown[b] = chr(b)
        else:
            shown[b] = chr(256 + extra)
            extra += 1
    return [shown[b] for b in range(256)]
