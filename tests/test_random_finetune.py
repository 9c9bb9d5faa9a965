"""Seeded random labelled files and options through the real `lm.finetune` and `lm.predict`.

Each fine-tuning case writes a labelled file of a random format (csv, JSON lines, a JSON array, Parquet, or a
kind neither tool reads) whose rows are mostly well formed, some of them at a random rate awkward (a text or a
label of another type, out of range, not finite, a column missing), and runs `python -m lm.finetune`'s main on
the session's tiny pretrained encoder with random head, class count, pooling, columns, val fraction, window
length, batch and step count (1 or 2 steps: the contract is about input, not learning). Each prediction case
puts such a file and random options through `python -m lm.predict` on a fine-tuned run. The contract: exit 2
with exactly one `error:` line, no traceback and nothing written; or exit 0 with a run whose logged metrics are
finite (finetune) or one finite prediction per row (predict); and in both, the labelled file, the pretrained
encoder's run directory and every other input byte-identical. The seeds are fixed, so a failure replays.
"""

import csv
import io
import json
import math
import random
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lm import finetune, predict
from tests.test_bad_inputs import digest
from tests.test_random_inputs import assert_contract, call

RANDOM_FINETUNE_CASES = 20
RANDOM_PREDICT_CASES = 16
"""Random labelled files and options put through lm.finetune and lm.predict (README's figure counts them)."""

WORDS = ["ship", "wave", "sail", "storm", "king", "queen", "lord", "crown", "up", "down"]
ODD_TEXTS = ["", " ", "é, 漢字, 🙂", "word " * 400, 'a, "quoted"\nline', "<|endoftext|>", 0, 1.5, None, True, ["a"],
             {"t": "a"}]
ODD_LABELS = [-1, 1.5, "1", " 2 ", "one", "", None, True, [1], {"a": 1}, float("nan"), float("inf"), 10**30, 2]
SUFFIXES = ([".csv", ".jsonl", ".json", ".parquet"], [".tsv", ".txt", ""])
FINETUNE_OPTIONS = {
    "model.pooling": (["first", "mean"], ["max", ""]),
    "task.val_fraction": ([0.1, 0.25, 0.5], [0, 1, -0.1, "nan", "x"]),
    "data.seq_len": ([4, 16, 32], [0, 1, 33, -1]),
    "optim.lr": ([1e-3, 1e-2], [1e3, 1e9, 0]),
}
"""Options of lm.finetune with (plausible, awkward) values; head, classes, columns and batch are drawn apart."""
FT = ["--train.device=cpu", "--log.tensorboard=false", "--log.every=1", "--train.eval_every=1",
      "--checkpoint.every=1", "--train.eval_batches=2"]


def pick(rng: random.Random, choices: tuple[list, list], odd: float) -> object:
    """A plausible choice, or at rate `odd` an awkward one."""
    return rng.choice(choices[1] if rng.random() < odd else choices[0])


def random_rows(rng: random.Random, head: object, num_classes: object, odd: float) -> list[dict]:
    """4 to 40 rows of a few words and a label that fits `head`, each value awkward at rate `odd`, and at that
    rate a row with one column renamed; none at all at rate odd / 4."""
    if rng.random() < odd / 4:
        return []
    rows = []
    classes = num_classes if isinstance(num_classes, int) and 2 <= num_classes <= 4 else 2
    for i in range(rng.randint(4, 40)):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))
        label = i % classes if head != "regress" else round(rng.uniform(-1, 1), 3)  # every class occurs
        row = {"text": rng.choice(ODD_TEXTS) if rng.random() < odd else text,
               "label": rng.choice(ODD_LABELS) if rng.random() < odd else label}
        if rng.random() < odd / 2:
            row[rng.choice(["sentence", "target"])] = row.pop(rng.choice(["text", "label"]))
        rows.append(row)
    return rows


def write_labelled(rng: random.Random, path: Path, rows: list[dict], odd: float) -> None:
    """`rows` in the format `path`'s suffix names (csv for any other), or at rate odd / 4 an empty file or bytes
    that are no UTF-8."""
    if rng.random() < odd / 4:
        path.write_bytes(rng.choice([b"", b"text,label\n\xff\xfe,1\n", b"text,label\n"]))
        return
    columns = list(dict.fromkeys(key for row in rows for key in row)) or ["text", "label"]
    if path.suffix in (".jsonl", ".json"):
        lines = [json.dumps(row) for row in rows]
        path.write_text("[" + ",\n".join(lines) + "]" if path.suffix == ".json" else "".join(f"{x}\n" for x in lines))
    elif path.suffix == ".parquet":
        values = {key: [row.get(key) for row in rows] for key in columns}
        try:
            table = pa.table(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError):  # values no one Arrow type holds: each as its JSON text
            table = pa.table({key: [json.dumps(v) for v in vs] for key, vs in values.items()})
        pq.write_table(table, path)
    else:
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=columns, lineterminator=rng.choice(["\n", "\r\n"]))
        writer.writeheader()
        writer.writerows(rows)
        path.write_text(out.getvalue())


def random_file(rng: random.Random, directory: Path, name: str, head: object, num_classes: object,
                odd: float) -> Path:
    """A labelled file of random format and rows in `directory` (see `random_rows`, `write_labelled`)."""
    path = directory / f"{name}{pick(rng, SUFFIXES, odd / 2)}"
    write_labelled(rng, path, random_rows(rng, head, num_classes, odd), odd)
    return path


def without_usage(err: str) -> str:
    """stderr without the usage lines that argparse prints above its one error line."""
    lines = err.splitlines()
    if lines and lines[0].startswith("usage: "):
        lines = [line for line in lines if not line.startswith(("usage: ", " "))]
    return "\n".join(lines)


def finite_metrics(run_dir: Path) -> list[dict]:
    """The records of a run's metrics.jsonl, each value a finite number (or null: no MFU without a known peak,
    no Pearson r of constant values)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        for key, value in record.items():
            assert value is None or math.isfinite(value), (key, value)
    return records


@pytest.fixture(scope="module")
def finetune_workspace(encoder_run, tmp_path_factory) -> Path:
    """A workspace holding a copy of the session's pretrained encoder (`encoder/`), its digest checked after each
    case, and a file that is no checkpoint."""
    ws = tmp_path_factory.mktemp("finetune_workspace")
    shutil.copytree(encoder_run, ws / "encoder")
    (ws / "notes.txt").write_text("not a checkpoint\n")
    return ws


def random_finetune(rng: random.Random, ws: Path, i: int) -> tuple[list[str], Path]:
    """lm.finetune's arguments for case `i` (its labelled file written into `ws`), and its run directory."""
    odd = rng.choice([0.0, 0.05, 0.3])  # the rate of awkward choices: some cases are valid throughout
    head = pick(rng, (["classify", "regress"], ["mlm", "seq2seq", ""]), odd)
    num_classes = pick(rng, ([2, 3], [0, 1, -1, 1000, "x"]), odd) if head == "classify" else pick(
        rng, ([None], [2, -1]), odd)
    task = random_file(rng, ws, f"task_{i}", head, num_classes, odd)
    out = rng.choices([ws / f"ft_{i}", ws / "encoder", ws / "encoder" / "checkpoints", task, ws / "notes.txt" / "run"],
                      [1, odd / 4, odd / 4, odd / 4, odd / 4])[0]
    encoder = rng.choices([ws / "encoder", ws / "notes.txt", ws / "none", task], [1, odd / 4, odd / 4, odd / 4])[0]
    batch, micro = pick(rng, ([(2, 1), (2, 2), (4, 2)], [(3, 2), (0, 1), (2, 0)]), odd)
    argv = ["--encoder", str(encoder), f"--train.out_dir={out}", f"--task.file={task}", f"--model.head={head}",
            f"--train.batch_size={batch}", f"--train.micro_batch_size={micro}",
            f"--train.steps={pick(rng, ([1, 2], [0, -1]), odd)}", *FT]
    if num_classes is not None:
        argv.append(f"--model.num_classes={num_classes}")
    for key in rng.sample(sorted(FINETUNE_OPTIONS), rng.randint(0, 3)):
        argv.append(f"--{key}={pick(rng, FINETUNE_OPTIONS[key], odd)}")
    for key in ("task.text_column", "task.label_column"):
        if rng.random() < odd:
            argv.append(f"--{key}={rng.choice(['', 'Text', 'sentence', 'target', 'label', 'text'])}")
    return argv, out


@pytest.mark.slow
def test_random_finetunes_train_or_are_refused_in_one_line(finetune_workspace, capsys, monkeypatch):
    """Exit 2 with one error line and nothing written, or a new run directory with finite metrics and nothing
    else written; the encoder and the labelled file are byte-identical afterwards."""
    ws = finetune_workspace
    monkeypatch.chdir(ws)
    rng = random.Random(6)
    trained, memo = 0, {}  # memo: the runs of earlier cases stay in the workspace, hashed once
    for i in range(RANDOM_FINETUNE_CASES):
        argv, out = random_finetune(rng, ws, i)
        before = digest(ws, memo)
        code = call(finetune.main, argv)
        assert_contract(code, without_usage(capsys.readouterr().err), (i, argv))
        after = digest(ws, memo)
        if code == 2:
            assert after == before, (i, argv)
            continue
        trained += 1
        assert {k: v for k, v in after.items() if k in before} == before, (i, argv)
        assert all(k.split("/")[0] == out.name for k in after.keys() - before.keys()), (i, argv)
        records = finite_metrics(out)
        assert any("train/loss" in r for r in records) and any("val/loss" in r for r in records), (i, argv)
    assert trained >= RANDOM_FINETUNE_CASES // 4, trained  # enough cases are valid to test the results too


@pytest.fixture(scope="module")
def finetuned_runs(finetune_workspace) -> dict[str, Path]:
    """A classifier of 3 classes and a regression head, each trained one step on the workspace's encoder."""
    from lm.cli import run
    from tests.conftest import write_rows

    ws = finetune_workspace
    runs = {}
    for head, extra in (("classify", ["--model.num_classes=3"]), ("regress", ["--model.pooling=mean"])):
        rows = [{"text": f"{WORDS[i % 10]} {WORDS[i % 7]}", "label": i % 3 if head == "classify" else i / 10}
                for i in range(12)]
        task = write_rows(ws / f"{head}.csv", rows)
        runs[head] = ws / f"run_{head}"
        assert run(finetune.main, ["--encoder", str(ws / "encoder"), f"--train.out_dir={runs[head]}",
                                   f"--task.file={task}", f"--model.head={head}", "--train.steps=1",
                                   "--train.batch_size=2", "--train.micro_batch_size=2", *FT, *extra]) == 0
    return runs


def random_predict(rng: random.Random, ws: Path, runs: dict[str, Path], i: int) -> tuple[list[str], str]:
    """lm.predict's arguments for case `i` (its file written into `ws`), and the head of the run it names."""
    odd = rng.choice([0.0, 0.05, 0.3])
    head = rng.choice(sorted(runs))
    checkpoint = rng.choices([runs[head], runs[head] / "checkpoints", ws / "encoder", ws / "notes.txt", ws / "none"],
                             [2, 1, odd / 2, odd / 2, odd / 2])[0]
    file = random_file(rng, ws, f"rows_{i}", head, 3, odd)
    argv = ["--checkpoint", str(checkpoint), "--file", str(file)]
    if rng.random() < 0.7:
        step = runs[head] / "checkpoints" / "step_00000001"  # the checkpoint read: never written
        argv += ["--out", str(rng.choices([ws / f"preds_{i}.jsonl", ws / "notes.txt", file, ws, step / "config.yaml"],
                                          [3, odd, odd, odd, odd])[0])]
    for flag, values in (("--batch-size", (["1", "3", "32"], ["0", "-1", "x"])),
                         ("--text-column", (["text"], ["", "sentence", "label"])),
                         ("--label-column", (["label", ""], ["text", "target", "none"])),
                         ("--device", (["cpu"], ["cuda", "tpu"]))):
        if rng.random() < 0.3:
            argv += [flag, pick(rng, values, odd)]
    return argv, head


@pytest.mark.slow
def test_random_predictions_are_made_or_refused_in_one_line(finetune_workspace, finetuned_runs, capsys, monkeypatch):
    """Exit 2 with one error line and nothing written, or one finite prediction per row (written to --out only);
    the runs, the encoder and the file are byte-identical afterwards."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a GPU machine too refuses --device cuda
    ws = finetune_workspace
    monkeypatch.chdir(ws)
    rng = random.Random(7)
    predicted, memo = 0, {}
    for i in range(RANDOM_PREDICT_CASES):
        argv, head = random_predict(rng, ws, finetuned_runs, i)
        before = digest(ws, memo)
        code = call(predict.main, argv)
        captured = capsys.readouterr()
        assert_contract(code, without_usage(captured.err), (i, argv))
        after = digest(ws, memo)
        out = Path(argv[argv.index("--out") + 1]) if "--out" in argv else None
        if code == 2:
            assert after == before, (i, argv)
            continue
        predicted += 1
        rows = int(captured.out.split(" | ")[1].split()[0].replace(",", ""))
        changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
        assert changed <= ({out.relative_to(ws).as_posix()} if out else set()), (i, argv, changed)
        for line in captured.out.splitlines():
            if line.split(":")[0] in ("loss", "accuracy", "f1", "mse", "pearson"):
                assert math.isfinite(float(line.split(": ")[1])), (i, argv, line)
        if out is not None:
            lines = [json.loads(line) for line in out.read_text().splitlines()]
            assert [line["row"] for line in lines] == list(range(rows)), (i, argv)
            for line in lines:
                if head == "classify":
                    assert len(line["probabilities"]) == 3 and math.isclose(sum(line["probabilities"]), 1, abs_tol=1e-4)
                    assert line["prediction"] in range(3)
                else:
                    assert math.isfinite(line["prediction"]), (i, argv, line)
    assert predicted >= RANDOM_PREDICT_CASES // 4, predicted
