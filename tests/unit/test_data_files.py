"""Datasets in verl's row schema from parquet, JSONL and JSON: rows become problems with their
chat messages, answer and data source; the first bad row is named by file and row."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.config.schema import build_run_config
from megarl.data.errors import DatasetError
from megarl.data.files import load_problem_files
from megarl.data.problems import Problem
from megarl.data.rewards import choose_reward
from megarl.trainer.rollout import encode_prompt

VERL_ROWS = [
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "Tom has 3 apples and buys 4. How many?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "7"},
        "extra_info": {"split": "train", "index": 0},
    },
    {
        "data_source": "openai/gsm8k",
        "prompt": [
            {"role": "system", "content": "Answer after ####."},
            {"role": "user", "content": "What is 1,000 + 234?"},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "1,234"},
        "extra_info": {"split": "train", "index": 1},
    },
]


def _parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_verl_parquet_rows_become_problems(tmp_path):
    path = _parquet(tmp_path / "train.parquet", VERL_ROWS)
    first, second = load_problem_files(str(path))
    assert first == Problem(
        prompt="Tom has 3 apples and buys 4. How many?",
        answer="7",
        source=f"{path}:1",
        messages=(("user", "Tom has 3 apples and buys 4. How many?"),),
        data_source="openai/gsm8k",
    )
    assert second.answer == "1234" and second.messages[0] == ("system", "Answer after ####.")


def test_flat_jsonl_and_json_rows_with_named_columns(tmp_path):
    rows = [
        {"question": "2+2?", "solution": "It is 4.\n#### 4"},
        {"question": "3*3?", "solution": 9},
    ]
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    json_file = tmp_path / "train.json"
    json_file.write_text(json.dumps(rows))
    for path in (jsonl, json_file):
        got = load_problem_files([str(path)], "question", "solution", instruction="Be brief.")
        assert [(p.prompt, p.answer) for p in got] == [
            ("2+2? Be brief.", "4"),
            ("3*3? Be brief.", "9"),
        ]


def test_several_files_are_read_in_order(tmp_path):
    a = _parquet(tmp_path / "a.parquet", VERL_ROWS[:1])
    b = _parquet(tmp_path / "b.parquet", VERL_ROWS[1:])
    assert [p.source for p in load_problem_files([str(a), str(b)])] == [f"{a}:1", f"{b}:1"]


@pytest.mark.parametrize(
    ("row", "needle"),
    [
        ({"question": "x"}, "row has no 'prompt' field (data.prompt_key; the row has question)"),
        ({"prompt": "2+2?"}, "row has no reward_model.ground_truth (verl's schema); for flat"),
        ({"prompt": "2+2?", "reward_model": {"ground_truth": "x^2"}}, "'x^2' is not a number"),
        (
            {"prompt": [{"role": "bot", "content": "hi"}], "reward_model": {"ground_truth": "1"}},
            "prompt[0]: role must be one of",
        ),
        (
            {"prompt": [{"content": "hi"}], "reward_model": {"ground_truth": "1"}},
            "prompt[0] is not a {'role'",
        ),
        (
            {"prompt": [], "reward_model": {"ground_truth": "1"}},
            "must be a string or a non-empty list",
        ),
        (
            {"prompt": [{"role": "system", "content": "s"}], "reward_model": {"ground_truth": "1"}},
            "must end with a non-empty user message",
        ),
        (
            {"prompt": "2+2?", "reward_model": {"ground_truth": True}},
            "must be a string or a number",
        ),
        (
            {"prompt": "2+2?", "reward_model": {"ground_truth": "4"}, "agent_name": 3},
            "'agent_name' must be a string",
        ),
        (
            {
                "prompt": "2+2?",
                "reward_model": {"ground_truth": "4"},
                "extra_info": {"tools_kwargs": {"calculator": "yes"}},
            },
            "'extra_info.tools_kwargs' must map each tool name to a mapping",
        ),
    ],
)
def test_the_first_bad_row_is_named_by_file_and_row(tmp_path, row, needle):
    path = tmp_path / "train.jsonl"
    good = {"prompt": "1+1?", "reward_model": {"ground_truth": "2"}}
    path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DatasetError) as error:
        load_problem_files(str(path))
    assert str(error.value).startswith(f"{path}:2: ") and needle in str(error.value)


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        ("bad.parquet", b"not parquet at all", "not a readable parquet file"),
        ("rows.csv", b"a,b\n", "unsupported dataset file type '.csv'"),
        ("empty.jsonl", b"\n", "dataset has no rows"),
        ("list.json", b'{"prompt": "x"}', "expected a JSON list of row objects"),
        ("broken.jsonl", b'{"prompt": \n', "broken.jsonl:1: invalid JSON"),
        ("scalars.json", b"[1, 2]", "scalars.json:1: row is a int"),
    ],
)
def test_a_bad_file_is_one_line(tmp_path, name, content, needle):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DatasetError) as error:
        load_problem_files(str(path))
    assert needle in str(error.value) and "\n" not in str(error.value)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(DatasetError, match="nope.parquet: dataset file does not exist"):
        load_problem_files(str(tmp_path / "nope.parquet"))


def test_train_files_select_the_files_task():
    one = build_run_config({"data": {"train_files": "a.parquet"}})
    assert (one.data.task, one.data.train_files) == ("files", ("a.parquet",))
    by_source = one.data.reward_choice  # auto on a dataset: each row's data_source decides
    assert by_source.fixed is None and by_source.for_source("lighteval/MATH").name == "math"
    assert build_run_config(
        {"data": {"train_files": ["a.parquet", "b.jsonl"]}}
    ).data.train_files == ("a.parquet", "b.jsonl")
    assert build_run_config({}).data.task == "arithmetic"
    assert build_run_config({"data": {"path": "x.jsonl"}}).data.task == "jsonl"


class _Tokenizer:
    chat_template = "yes"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return "|".join(f"{m['role']}:{m['content']}" for m in messages) + "|assistant:"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def _decoded(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


def test_chat_messages_reach_the_template_and_the_system_prompt_defers_to_the_data():
    plain = Problem(prompt="hi", answer="1", source="s")
    with_system = Problem(
        prompt="hi", answer="1", source="s", messages=(("system", "data says"), ("user", "hi"))
    )
    tok = _Tokenizer()
    assert _decoded(encode_prompt(tok, plain, None)) == "user:hi|assistant:"
    assert _decoded(encode_prompt(tok, plain, "cfg")) == "system:cfg|user:hi|assistant:"
    assert _decoded(encode_prompt(tok, with_system, "cfg")) == "system:data says|user:hi|assistant:"


def test_math_rows_keep_their_latex_answer_and_gsm8k_rows_their_number(tmp_path):
    rows = [
        {
            "data_source": "HuggingFaceH4/MATH-500",
            "prompt": [{"role": "user", "content": "Compute 7/3 + 7/3."}],
            "reward_model": {"style": "rule", "ground_truth": "\\frac{14}{3}"},
        },
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": "How many?"}],
            "reward_model": {"style": "rule", "ground_truth": "1,234"},
        },
    ]
    path = _parquet(tmp_path / "mixed.parquet", rows)
    math_row, gsm8k_row = load_problem_files(str(path))
    assert math_row.answer == "\\frac{14}{3}" and math_row.data_source == "HuggingFaceH4/MATH-500"
    assert gsm8k_row.answer == "1234"


def test_a_row_whose_data_source_has_no_reward_is_refused_at_load(tmp_path):
    rows = [
        {"data_source": "openai/gsm8k", "prompt": "a?", "reward_model": {"ground_truth": "1"}},
        {"data_source": "acme/code", "prompt": "b?", "reward_model": {"ground_truth": "x"}},
    ]
    path = _parquet(tmp_path / "code.parquet", rows)
    with pytest.raises(DatasetError, match=r"code\.parquet:2: data_source 'acme/code' has no"):
        load_problem_files(str(path))
    named = load_problem_files(str(path), reward=choose_reward("exact_match", "files"))
    assert [p.answer for p in named] == ["1", "x"]  # a named reward takes every row as it is


def test_a_datasets_save_to_disk_folder_loads_like_a_file(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"What is {k} + {k}?"}],
            "reward_model": {"style": "rule", "ground_truth": str(2 * k)},
            "extra_info": {"index": k},
        }
        for k in range(3)
    ]
    folder = tmp_path / "gsm8k_train"
    datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    from_folder = load_problem_files(str(folder))
    from_parquet = load_problem_files(str(_parquet(tmp_path / "same.parquet", rows)))
    assert [(p.prompt, p.answer, p.data_source) for p in from_folder] == [
        (p.prompt, p.answer, p.data_source) for p in from_parquet
    ]
    assert from_folder[2].source == f"{folder}:3"

    splits = tmp_path / "with_splits"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(splits))
    with pytest.raises(DatasetError, match=r"holds the splits train; name one split's folder"):
        load_problem_files(str(splits))
    assert len(load_problem_files(str(splits / "train"))) == 3
    (tmp_path / "not_a_dataset").mkdir()
    with pytest.raises(DatasetError, match="not a dataset folder written by datasets' save_to"):
        load_problem_files(str(tmp_path / "not_a_dataset"))


def test_the_shipped_samples_load_and_each_row_gets_its_datasets_reward():
    examples = Path(__file__).resolve().parents[2] / "examples" / "data"
    auto = choose_reward("auto", task="files")
    for folder, reward, counts in (("gsm8k", "gsm8k", (64, 32)), ("math", "math", (48, 24))):
        train, test = (
            load_problem_files(str(examples / folder / f"{s}.parquet")) for s in ("train", "test")
        )
        assert (len(train), len(test)) == counts
        assert {auto.for_source(p.data_source).name for p in train + test} == {reward}
    fractions = [p.answer for p in load_problem_files(str(examples / "math" / "test.parquet"))]
    assert any("\\frac" in answer for answer in fractions)  # LaTeX answers kept as they are


def test_the_shipped_multi_turn_sample_names_its_loop_and_tool_state():
    """verl's multi-turn columns: ``agent_name`` and ``extra_info.tools_kwargs`` reach the
    problem (parquet structs read back as mappings)."""
    examples = Path(__file__).resolve().parents[2] / "examples" / "data" / "gsm8k_calculator"
    train = load_problem_files(str(examples / "train.parquet"))
    plain = load_problem_files(str(examples.parent / "gsm8k" / "train.parquet"))
    assert len(train) == 64 and {p.agent_name for p in train} == {"tool_agent"}
    first = train[0]
    assert first.tools_kwargs == {"calculator": {"create_kwargs": {"ground_truth": first.answer}}}
    assert [p.answer for p in train] == [p.answer for p in plain]
    assert "calculator tool" in first.prompt
    assert plain[0].agent_name == "" and plain[0].tools_kwargs == {}
