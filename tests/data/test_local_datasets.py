import json
import logging
import os

import pytest

from lm.data.corpora import iter_documents
from lm.data.labelled import read_labelled
from lm.data.local_datasets import check_json_rows, local_datasets
from lm.errors import DataError


@pytest.mark.parametrize("content, message", [
    ("null\n", "line 1 is null"),  # pyarrow's JSON reader ends the process on a block that starts with null
    ('\ufeff  null \r\n{"text": "a"}\n', "line 1 is null"),
    ('{"text": "a"}\n\nnull', "line 3 is null"),
    ('[{"text": "a"}, 5]', "row 1 is 5, not an object like the other rows"),  # a TypeError inside pandas
    ('[null, {"text": "a"}]', "row 0 is null, not an object like the other rows"),
])
def test_rows_datasets_cannot_take_are_refused_by_both_readers(content, message, tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=f"^{path}: {message}"):
        list(iter_documents(str(path), "text"))
    with pytest.raises(DataError, match=f"^{path}: {message}"):
        read_labelled(path, "text", "label", "regress")


def test_a_null_row_is_found_across_chunks_with_its_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    short = b'{"text": "a"}\n' * 1000
    rows = short + b'{"text": "' + b"x" * ((1 << 20) - 2 - len(short) - 13) + b'"}\n'  # 1 MiB less 2 bytes
    path.write_bytes(rows + b"  null\n" + rows)  # the first chunk ends inside line 1,002
    with pytest.raises(DataError, match="line 1002 is null"):
        check_json_rows(path)
    path.write_bytes(rows + b"  nullified\n" + b" null" * 30 + b"\n")  # "null" alone on no line
    check_json_rows(path)


@pytest.mark.parametrize("content", ['{"text": "null"}\n', '[{"text": "a"}, {"text": null}]', '["a", null]', "{\n}\n"])
def test_rows_that_only_mention_null_pass(content, tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(content)
    check_json_rows(path)


def test_a_column_of_mixed_types_is_refused_not_turned_into_json_texts(tmp_path):
    # datasets' default kept such a column by writing every value of it as JSON: the texts came out in quotes
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "a", "label": 1}\n{"text": 5, "label": 0}\n')
    message = rf"^{path}: column 'text' holds both string values \(row 0: 'a'\) and number values \(row 1: 5\); "
    with pytest.raises(DataError, match=message):
        list(iter_documents(str(path), "text"))
    with pytest.raises(DataError, match=message):
        read_labelled(path, "text", "label", "regress")
    rows = [{"text": f"row {i} " + "x" * 100} for i in range(30_000)]  # beyond the first block datasets reads
    rows[25_000]["text"] = ["a list"]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(DataError, match=r"and array values \(row 25000: \['a list'\]\)"):
        list(iter_documents(str(path), "text"))
    path.write_text('{"type": "user", "message": "hello", "text": "a"}\n')  # not read as an agent's trace
    assert list(iter_documents(str(path), "text")) == ["a"]


@pytest.mark.parametrize("content, kinds", [
    ('[{"text": "a"}, {"text": ["x"]}]', r"string values \(row 0: 'a'\) and array values \(row 1: \['x'\]\)"),
    ('[{"text": 1.5}, {"text": "a"}]', r"number values \(row 0: 1.5\) and string values \(row 1: 'a'\)"),
])
def test_an_array_of_mixed_types_is_one_error_naming_them(content, kinds, tmp_path):
    # datasets reads an array through pandas, whose ArrowTypeError was a traceback out of lm.prepare
    path = tmp_path / "rows.json"
    path.write_text(content.replace('"a"}', '"a", "label": 1}'))
    message = f"^{path}: column 'text' holds both {kinds}; a column holds values of one type$"
    with pytest.raises(DataError, match=message):
        list(iter_documents(str(path), "text"))
    with pytest.raises(DataError, match=message):
        read_labelled(path, "text", "label", "regress")


def test_local_datasets_silences_the_datasets_logger_only_for_its_block():
    # datasets' own log lines are hidden while lm reads a file, and the caller's level is back afterwards
    import datasets  # noqa: F401  (its first import sets its logger's level itself)

    logger = logging.getLogger("datasets")
    saved = logger.level
    try:
        logger.setLevel(logging.INFO)
        with local_datasets():
            assert logger.level == logging.CRITICAL
        assert logger.level == logging.INFO
    finally:
        logger.setLevel(saved)


def test_a_null_between_values_of_two_types_is_no_third_type(tmp_path):
    # null fits a column of any type: the error names the string and the number around it
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "a", "label": 1}\n{"text": null, "label": 1}\n{"text": 5, "label": 0}\n')
    message = rf"^{path}: column 'text' holds both string values \(row 0: 'a'\) and number values \(row 2: 5\); "
    with pytest.raises(DataError, match=message):
        read_labelled(path, "text", "label", "regress")


def test_local_datasets_keeps_datasets_and_the_hub_client_offline(monkeypatch):
    # a local file must never reach the Hub: both libraries' offline switches are on inside the block
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with local_datasets():
        assert os.environ["HF_DATASETS_OFFLINE"] == "1" and os.environ["HF_HUB_OFFLINE"] == "1"


def test_a_line_that_is_not_json_is_named_by_its_line_number(tmp_path):
    # pyarrow counts rows from the start of a block; the error names the line of the file, counted from 1
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b"}\nnot json\n')
    with pytest.raises(DataError, match=rf"^{path}: cannot read as json: line 3: Expecting value"):
        list(iter_documents(str(path), "text"))
