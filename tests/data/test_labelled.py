import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lm.data.labelled import (
    ExampleLoader,
    encode_examples,
    example_batches,
    pad_examples,
    read_labelled,
    read_texts,
    split_examples,
)
from lm.data.mixture import sample_order
from lm.errors import DataError
from tests.conftest import write_rows

PAD = 99
ROWS = [("a fine day", 1), ("rain, and more rain", 0), ('"quoted" text', 2), ("", 1), ("x\ny", 0)]


def write(path, rows, columns=("text", "label")):
    """`rows` of values in `columns` as a csv, json(l) or parquet file, by the suffix of `path`."""
    records = [dict(zip(columns, row)) for row in rows]
    if path.suffix == ".csv":
        import csv
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(records)
    elif path.suffix in (".json", ".jsonl"):
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        pq.write_table(pa.Table.from_pylist(records), path)
    return path


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".json", ".parquet"])
def test_formats_read_the_same(tmp_path, suffix):
    texts, labels = read_labelled(write(tmp_path / f"train{suffix}", ROWS), "text", "label", "classify", 3)
    assert texts == [t for t, _ in ROWS]
    assert labels.dtype == np.int64 and labels.tolist() == [1, 0, 2, 1, 0]
    rows = [(t, float(y) / 4 - 0.1) for t, y in ROWS]
    texts, targets = read_labelled(write(tmp_path / f"reg{suffix}", rows), "text", "label", "regress")
    assert texts == [t for t, _ in ROWS]
    assert targets.dtype == np.float64 and targets.tolist() == [y for _, y in rows]


def test_other_column_names_and_extra_columns(tmp_path):
    rows = [(3, "b", 1), (4, "c", 0)]
    path = write(tmp_path / "t.parquet", rows, columns=("id", "sentence", "y"))
    assert read_labelled(path, "sentence", "y", "classify", 2)[0] == ["b", "c"]


def test_a_csv_text_of_numbers_alone_is_read_as_written(tmp_path):
    # pandas had made the column numbers (100000.0, 7.0, True), then refused as no text
    numbers, flags = tmp_path / "numbers.csv", tmp_path / "flags.csv"
    numbers.write_text("text,label\n1e5,0\n007,1\n")
    flags.write_text("text,label\nTrue,0\nFalse,1\n")
    assert read_labelled(numbers, "text", "label", "classify", 2)[0] == ["1e5", "007"]
    assert read_texts(numbers, "text") == ["1e5", "007"]
    assert read_labelled(flags, "text", "label", "classify", 2)[0] == ["True", "False"]


def refusal(path, kind="classify", num_classes=3, text="text", label="label") -> str:
    with pytest.raises(DataError) as error:
        read_labelled(path, text, label, kind, num_classes)
    return str(error.value)


def test_refusals(tmp_path):
    good = write(tmp_path / "good.csv", ROWS)
    assert refusal(good, label="class") == f"{good}: no column 'class'; the columns are ['label', 'text']"
    assert refusal(good, num_classes=4) == (
        f"{good}: column 'label' never holds class 3 of num_classes=4; the labels hold classes [0, 1, 2], so "
        "num_classes does not match the data")
    assert read_labelled(good, "text", "label", "classify", 4, every_class=False)[1].tolist() == [1, 0, 2, 1, 0]
    assert refusal(good, num_classes=2) == (
        f"{good}: row 2: column 'label' holds 2; a class label must be an integer in [0, 2)")
    assert refusal(good, num_classes=10**12) == (  # was a 7 TiB bincount; a huge count lists the first few
        f"{good}: column 'label' never holds class 3, 4, 5, 6, 7 (and 999,999,999,992 more) of "
        "num_classes=1000000000000; the labels hold classes [0, 1, 2], so num_classes does not match the data")
    folder = tmp_path / "folder.csv"
    folder.mkdir()
    assert refusal(folder) == f"{folder}: is a directory; expected a .csv, .json, .jsonl, .parquet file"  # no such file
    twice = tmp_path / "twice.csv"
    twice.write_text("text,label,label\na,0,1\nb,1,0\n")  # the second was renamed label.1 and dropped
    assert refusal(twice, num_classes=2) == f"{twice}: the header names column 'label' 2 times; rename all but one"
    # a comma left unquoted in every text: pandas had read the first field as an index and each text cut at it
    commas = tmp_path / "commas.csv"
    commas.write_text("text,label\nI love it, really,1\n\nawful, just awful,0\n")
    assert refusal(commas, num_classes=2) == (
        f"{commas}: line 2 has 3 fields and the header 2 (text, label); quote a text that holds a comma")
    short = tmp_path / "short.csv"
    short.write_text('text,label\n"two\nlines",1\n\nawful\n')  # a quoted text's lines and a blank line count
    assert refusal(short, num_classes=2) == (
        f"{short}: line 5 has 1 field and the header 2 (text, label); give every column a value")
    import pyarrow
    import pyarrow.parquet

    empty = tmp_path / "empty.parquet"
    pyarrow.parquet.write_table(pyarrow.table({"text": pyarrow.array([], pyarrow.string()),
                                               "label": pyarrow.array([], pyarrow.int64())}), empty)
    assert refusal(empty) == f"{empty}: no rows; expected labelled examples"  # was pyarrow's BatchSize message
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"text": "caf\xe9", "label": 0}\n{"text": "b", "label": 1}\n'.encode("latin-1"))
    assert refusal(latin, num_classes=2).startswith(f"{latin}: holds text that is not UTF-8")  # was a traceback

    words = write(tmp_path / "words.csv", [("a", 1), ("b", "positive"), ("c", 0)])
    assert refusal(words) == (
        f"{words}: row 1: column 'label' holds 'positive'; a class label must be an integer in [0, 3)")
    half = write(tmp_path / "half.jsonl", [("a", 1), ("b", 1.5), ("c", 0)])
    assert refusal(half) == f"{half}: row 1: column 'label' holds 1.5; a class label must be an integer in [0, 3)"
    negative = write(tmp_path / "neg.parquet", [("a", 1), ("b", 0), ("c", -1)])
    assert refusal(negative) == (
        f"{negative}: row 2: column 'label' holds -1; a class label must be an integer in [0, 3)")
    flag = write(tmp_path / "flag.jsonl", [("a", True), ("b", 0)])
    assert refusal(flag, num_classes=2) == (
        f"{flag}: column 'label' holds both boolean values (row 0: True) and number values (row 1: 0); a column "
        "holds values of one type")

    text = write(tmp_path / "text.csv", [("1.5", 1), ("b", "n/a")])
    assert refusal(text, kind="regress") == (
        f"{text}: row 1: column 'label' holds 'n/a'; a regression label must be a finite number")
    infinite = write(tmp_path / "inf.jsonl", [("a", 1.0), ("b", None)])
    assert refusal(infinite, kind="regress") == (
        f"{infinite}: row 1: column 'label' holds None; a regression label must be a finite number")
    huge = write(tmp_path / "huge.jsonl", [("a", 1.0), ("b", -1e20)])  # trained as inf: every step skipped
    assert refusal(huge, kind="regress") == (
        f"{huge}: row 1: column 'label' holds -1e+20; a regression label must be below 1.84e+19 in magnitude, where "
        "its squared error fits float32")
    numbers = write(tmp_path / "numbers.jsonl", [(5, 1), ("b", 0)])
    assert refusal(numbers, num_classes=2).startswith(f"{numbers}: ")  # a number as the text

    (tmp_path / "t.tsv").write_text("text\tlabel\n")
    assert refusal(tmp_path / "t.tsv") == (
        f"{tmp_path / 't.tsv'}: unsupported extension '.tsv'; expected one of .csv, .json, .jsonl, .parquet")
    (tmp_path / "empty.csv").write_text("")
    assert refusal(tmp_path / "empty.csv") == (
        f"{tmp_path / 'empty.csv'}: empty file; expected a header and labelled rows")
    (tmp_path / "header.csv").write_text("text,label\n")
    assert refusal(tmp_path / "header.csv") == f"{tmp_path / 'header.csv'}: no rows; expected labelled examples"
    assert refusal(tmp_path / "missing.csv") == f"{tmp_path / 'missing.csv'}: no such file"
    (tmp_path / "bad.jsonl").write_text('{"text": "a", "label": 1}\n{"text": \n')
    assert refusal(tmp_path / "bad.jsonl").startswith(f"{tmp_path / 'bad.jsonl'}: cannot read as json: ")


def test_split_examples():
    train, val = split_examples(20, 0.1)
    assert val.tolist() == [9, 19] and train.tolist() == [i for i in range(20) if i not in (9, 19)]
    assert train.dtype == val.dtype == np.int64
    assert split_examples(5, 0.0)[1].size == 0
    with pytest.raises(DataError, match=r"val_fraction=0.1 puts none of the 5 examples in the val split"):
        split_examples(5, 0.1)
    with pytest.raises(DataError, match=r"^task.val_fraction=0.5 puts none of the 1 examples in the val split; "
                                        r"raise it to at least 1 or add examples$"):
        split_examples(1, 0.5, "task.val_fraction")
    assert [a.tolist() for a in split_examples(2, 0.5)] == [[0], [1]]
    assert [a.tolist() for a in split_examples(4, 0.99)] == [[0], [1, 2, 3]]


def test_encode_examples():
    examples = encode_examples(["ab", "", "abcdef"], lambda text: [ord(c) - 97 for c in text], 50, 4)
    assert [e.tolist() for e in examples] == [[50, 0, 1], [50], [50, 0, 1, 2]]
    assert all(e.dtype == np.int64 for e in examples)


def toy(n=13):
    """n examples of lengths 1..5 whose tokens all equal their index, labels 100 + index."""
    return [np.full(1 + i % 5, i, dtype=np.int64) for i in range(n)], np.arange(100, 100 + n)


def test_pad_examples():
    ids, keep = pad_examples([np.array([5, 6]), np.array([7]), np.array([1, 2, 3])], PAD)
    assert ids.tolist() == [[5, 6, PAD], [7, PAD, PAD], [1, 2, 3]]
    assert keep.tolist() == [[True, True, False], [True, False, False], [True, True, True]]


def check_batch(batch, examples, labels):
    """A padded micro-batch: returns the example ids it holds, checked against their tokens and labels."""
    ids, y, keep = batch
    assert ids.dtype == np.int64 and keep.dtype == bool and y.dtype == np.int64
    assert keep.shape == ids.shape and ids.shape[1] == keep.sum(axis=1).max()  # padded to the longest
    assert (ids[~keep] == PAD).all()
    which = ids[:, 0].tolist()
    for row, i in enumerate(which):
        assert ids[row][keep[row]].tolist() == examples[i].tolist() and y[row] == labels[i]
    return which


def test_example_loader_at_two_world_sizes():
    examples, labels = toy()
    alone = ExampleLoader(examples, labels, 5, 0, 1, 6, 3, PAD)
    ranks = [ExampleLoader(examples, labels, 5, r, 2, 6, 1, PAD) for r in range(2)]
    seen = []
    for _ in range(7):  # 42 positions: over 3 epochs of 13
        batches = alone.next_batch()
        one = [i for b in batches for i in check_batch(b, examples, labels)]
        per_rank = [loader.next_batch() for loader in ranks]
        two = [i for rank in per_rank for b in rank for i in check_batch(b, examples, labels)]
        assert one == two
        # the step's token positions over every rank, each micro-batch as long as its longest example
        assert alone.step_tokens == sum(b[0].size for b in batches)
        assert [loader.step_tokens for loader in ranks] == [sum(b[0].size for rank in per_rank for b in rank)] * 2
        seen += one
    expected = np.concatenate([sample_order(5, e, 13) for e in range(4)])[:42]
    assert seen == expected.tolist()
    assert alone.state_dict() == {"position": 42}


def test_example_loader_resumes():
    examples, labels = toy()
    run = ExampleLoader(examples, labels, 0, 1, 2, 8, 2, PAD)
    for _ in range(3):
        run.next_batch()
    resumed = ExampleLoader(examples, labels, 0, 1, 2, 8, 2, PAD)
    resumed.load_state_dict(run.state_dict())
    for _ in range(4):
        for a, b in zip(run.next_batch(), resumed.next_batch()):
            assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_example_loader_regression_labels_are_float32():
    examples, _ = toy(4)
    (batch,) = ExampleLoader(examples, np.array([0.5, 1.5, 2.5, 3.5]), 0, 0, 1, 4, 4, PAD).next_batch()
    assert batch[1].dtype == np.float32 and sorted(batch[1].tolist()) == [0.5, 1.5, 2.5, 3.5]
    with pytest.raises(ValueError, match=r"train.batch_size: 6 is not a multiple of train.micro_batch_size \(2\) x "
                                         r"world size \(2\)"):
        ExampleLoader(examples, np.zeros(4), 0, 0, 2, 6, 2, PAD)


@pytest.mark.parametrize(("n", "micro", "world"), [(13, 4, 1), (13, 4, 2), (13, 4, 3), (8, 4, 2), (3, 4, 4)])
def test_example_batches_cover_every_example_once(n, micro, world):
    examples, labels = toy(n)
    counts = np.zeros(n)
    lengths = set()
    for rank in range(world):
        batches = list(example_batches(examples, labels, micro, rank, world, PAD))
        lengths.add(len(batches))
        for ids, y, keep, weight in batches:
            assert weight.dtype == np.float32 and ids.shape[0] == micro
            which = check_batch((ids, y, keep), examples, labels)
            np.add.at(counts, which, weight)
            assert all(i == 0 for i, w in zip(which, weight) if w == 0)  # fillers repeat example 0
    assert counts.tolist() == [1.0] * n
    assert lengths == {math.ceil(math.ceil(n / micro) / world)}  # every rank the same number of batches


def test_read_texts(tmp_path):
    path = write(tmp_path / "unlabelled.jsonl", [("a",), ("b",)], columns=("text",))
    assert read_texts(path, "text") == ["a", "b"]
    with pytest.raises(DataError, match=r"no column 'sentence'; the columns are \['text'\]"):
        read_texts(path, "sentence")


@pytest.mark.parametrize("kind, num_classes", [("classify", 2), ("regress", 0)])
def test_a_boolean_label_is_no_class_and_no_number(tmp_path, kind, num_classes):
    # JSON true/false are not the classes 1/0 (nor the numbers 1.0/0.0): a column of booleans is refused
    path = write_rows(tmp_path / "rows.jsonl", [{"text": "a", "label": True}, {"text": "b", "label": False}])
    with pytest.raises(DataError, match=r"rows.jsonl: row 0: column 'label' holds True; a (class|regression) label "
                                        r"must be"):
        read_labelled(path, "text", "label", kind, num_classes)
