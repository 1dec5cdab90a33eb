"""GSM8K-style JSONL loading: normalised answers and file:line errors for every bad row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.data.errors import DatasetError
from megarl.data.jsonl import load_jsonl_problems, parse_final_answer

REPO_ROOT = Path(__file__).resolve().parents[2]
GOOD_ROW = json.dumps({"question": "What is 2 + 2?", "answer": "2 + 2 = 4\n#### 4"})


def _write(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_loads_rows_with_file_line_sources(tmp_path: Path) -> None:
    other = json.dumps({"question": "  Sum 1,000 and 234?  ", "answer": "... #### 1,234"})
    path = _write(tmp_path, GOOD_ROW, "", "   ", other)
    problems = load_jsonl_problems(path)
    assert [p.answer for p in problems] == ["4", "1234"]
    assert [p.source for p in problems] == [f"{path}:1", f"{path}:4"]
    assert problems[1].prompt == "Sum 1,000 and 234?"


def test_instruction_is_appended_after_a_space(tmp_path: Path) -> None:
    path = _write(tmp_path, GOOD_ROW)
    (problem,) = load_jsonl_problems(path, instruction=" Put the final answer after ####.")
    assert problem.prompt == "What is 2 + 2? Put the final answer after ####."


@pytest.mark.parametrize(
    ("answer_text", "expected"),
    [
        ("#### 72", "72"),
        ("reasoning\n#### 1,234", "1234"),
        ("#### $5", "5"),
        ("#### 5.0", "5"),
        ("#### -3", "-3"),
        ("#### 2.5", "2.5"),
        ("#### 1 000", "1000"),
        ("step #### 3 then #### 4", "4"),
        ("#### seven", None),
        ("no marker 72", None),
    ],
)
def test_parse_final_answer(answer_text: str, expected: str | None) -> None:
    assert parse_final_answer(answer_text) == expected


@pytest.mark.parametrize(
    ("bad_row", "message"),
    [
        ('{"question": "q", "answer": ', "invalid JSON"),
        ('["question", "answer"]', "row is a JSON list, expected an object"),
        ('"just a string"', "row is a JSON str, expected an object"),
        ('{"answer": "#### 1"}', "row has no 'question' field"),
        ('{"question": "q"}', "row has no 'answer' field"),
        ('{"question": 3, "answer": "#### 1"}', "'question' must be a string, got int"),
        ('{"question": "q", "answer": 72}', "'answer' must be a string, got int"),
        ('{"question": "  ", "answer": "#### 1"}', "empty 'question'"),
        ('{"question": "q", "answer": "it is 72"}', "no '#### <number>'"),
        ('{"question": "q", "answer": "#### lots"}', "not a number: 'lots'"),
    ],
)
def test_malformed_row_names_file_and_line(tmp_path: Path, bad_row: str, message: str) -> None:
    # The bad row sits on line 4, after a good row and two blank lines, so the reported
    # line must count blank lines too.
    path = _write(tmp_path, GOOD_ROW, "", "", bad_row, GOOD_ROW)
    with pytest.raises(DatasetError) as info:
        load_jsonl_problems(path)
    assert str(info.value).startswith(f"{path}:4: ")
    assert message in str(info.value)


def test_dataset_error_is_a_value_error() -> None:
    assert issubclass(DatasetError, ValueError)


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.jsonl"
    with pytest.raises(DatasetError, match=f"^{path}: dataset file does not exist"):
        load_jsonl_problems(path)


def test_directory_is_unreadable(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=f"^{tmp_path}: cannot read"):
        load_jsonl_problems(tmp_path)


def test_invalid_utf8_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"question": "caf\xe9", "answer": "#### 1"}\n')
    with pytest.raises(DatasetError, match=f"^{path}: dataset file is not valid UTF-8"):
        load_jsonl_problems(path)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_dataset_names_the_path(tmp_path: Path, content: str) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DatasetError, match=f"^{path}: dataset has no rows"):
        load_jsonl_problems(path)


def test_unicode_line_separator_inside_a_string_does_not_split_the_row(tmp_path: Path) -> None:
    row = json.dumps({"question": "a\u2028b", "answer": "#### 1"}, ensure_ascii=False)
    path = _write(tmp_path, row, '{"bad": 1}')
    with pytest.raises(DatasetError, match=f"^{path}:2: row has no 'question'"):
        load_jsonl_problems(path)


def test_crlf_and_bom_are_tolerated(tmp_path: Path) -> None:
    path = tmp_path / "windows.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD_ROW.encode() + b"\r\n" + GOOD_ROW.encode() + b"\r\n")
    assert [p.answer for p in load_jsonl_problems(path)] == ["4", "4"]


def test_shipped_fixture_and_example_load() -> None:
    tiny = load_jsonl_problems(REPO_ROOT / "tests/fixtures/gsm8k_tiny.jsonl")
    assert [p.answer for p in tiny] == ["7", "60", "12", "30000", "4.5"]
    sample = load_jsonl_problems(REPO_ROOT / "examples/data/gsm8k_sample.jsonl")
    assert len(sample) == 10
    assert len({p.prompt for p in sample}) == 10
