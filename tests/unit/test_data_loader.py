"""The resumable prompt stream and the config-driven prompt source factory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.data.arithmetic import ArithmeticTask
from megarl.data.errors import DatasetError
from megarl.data.loader import PromptStream, build_prompt_source, epoch_order
from megarl.data.problems import Problem

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "gsm8k_tiny.jsonl"


def _problems(num_problems: int) -> list[Problem]:
    return [Problem(prompt=f"q{i}", answer=str(i), source=f"list#{i}") for i in range(num_problems)]


def _take(stream: PromptStream, num_batches: int) -> list[list[Problem]]:
    return [stream.next_batch() for _ in range(num_batches)]


@pytest.mark.parametrize(
    "make_source", [lambda: ArithmeticTask(seed=4), lambda: _problems(7)], ids=["arith", "list"]
)
def test_resume_continues_exactly_where_it_stopped(make_source) -> None:
    stream = PromptStream(make_source(), prompts_per_step=3, seed=9)
    _take(stream, 3)
    state = json.loads(json.dumps(stream.state_dict()))  # as a checkpoint would store it
    expected = _take(stream, 3)

    resumed = PromptStream(make_source(), prompts_per_step=3, seed=9)
    resumed.load_state_dict(state)
    assert _take(resumed, 3) == expected


def test_state_is_plain_ints() -> None:
    stream = PromptStream(_problems(5), prompts_per_step=2, seed=0)
    _take(stream, 4)  # 8 problems: one full epoch and 3 into the second
    state = stream.state_dict()
    assert state == {"epoch": 1, "position": 3, "num_problems": 5, "seed": 0}
    assert all(type(value) is int for value in state.values())


def test_each_epoch_visits_every_problem_once_and_wraps_around() -> None:
    problems = _problems(6)
    stream = PromptStream(problems, prompts_per_step=4, seed=1)
    flat = [p.source for batch in _take(stream, 6) for p in batch]  # exactly four epochs
    epochs = [flat[i : i + 6] for i in range(0, 24, 6)]
    for epoch in epochs:
        assert sorted(epoch) == sorted(p.source for p in problems)
    assert len({tuple(epoch) for epoch in epochs}) > 1, "epochs should be reshuffled"


def test_batch_larger_than_dataset_spans_epochs() -> None:
    stream = PromptStream(_problems(2), prompts_per_step=5, seed=0, shuffle=False)
    assert [p.answer for p in stream.next_batch()] == ["0", "1", "0", "1", "0"]
    assert stream.state_dict()["epoch"] == 2


def test_without_shuffle_order_is_the_file_order() -> None:
    stream = PromptStream(_problems(3), prompts_per_step=2, seed=0, shuffle=False)
    assert [p.answer for batch in _take(stream, 3) for p in batch] == ["0", "1", "2"] * 2


def test_shuffle_order_depends_on_seed_and_epoch_only() -> None:
    assert epoch_order(3, 2, 50, shuffle=True) == epoch_order(3, 2, 50, shuffle=True)
    assert epoch_order(3, 2, 50, shuffle=True) != epoch_order(4, 2, 50, shuffle=True)
    assert epoch_order(3, 2, 50, shuffle=True) != epoch_order(3, 3, 50, shuffle=True)
    assert epoch_order(3, 2, 5, shuffle=False) == [0, 1, 2, 3, 4]


def test_same_seed_same_stream_different_seed_different_stream() -> None:
    def first_batches(seed: int) -> list[list[Problem]]:
        return _take(PromptStream(_problems(20), prompts_per_step=5, seed=seed), 2)

    assert first_batches(1) == first_batches(1)
    assert first_batches(1) != first_batches(2)


def test_arithmetic_stream_reads_the_task_in_index_order() -> None:
    stream = PromptStream(ArithmeticTask(seed=2), prompts_per_step=4, seed=2)
    _take(stream, 2)
    assert [p.source for p in stream.next_batch()] == [f"arithmetic#{i}" for i in range(8, 12)]
    assert stream.state_dict() == {"epoch": 0, "position": 12, "num_problems": 0, "seed": 2}


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"position": 0}, "'epoch'"),
        ({"epoch": 0}, "'position'"),
        ({"epoch": -1, "position": 0}, "'epoch' must be an int >= 0"),
        ({"epoch": 0, "position": "2"}, "'position' must be an int >= 0"),
        ({"epoch": 0, "position": 6}, "beyond the 5 problems"),
        ({"epoch": 0, "position": 0, "num_problems": 9}, "num_problems=9"),
        ({"epoch": 0, "position": 0, "seed": 8}, "seed=8"),
    ],
)
def test_bad_or_mismatched_state_is_rejected(state: dict, message: str) -> None:
    stream = PromptStream(_problems(5), prompts_per_step=2, seed=0)
    with pytest.raises(ValueError, match=message):
        stream.load_state_dict(state)


def test_stream_validates_its_arguments() -> None:
    with pytest.raises(ValueError, match="prompts_per_step"):
        PromptStream(_problems(3), prompts_per_step=0, seed=0)
    with pytest.raises(ValueError, match="no problems"):
        PromptStream([], prompts_per_step=1, seed=0)


def test_build_arithmetic_source() -> None:
    source = build_prompt_source("arithmetic", None, seed=5, max_operand=9, instruction="x")
    assert source == ArithmeticTask(seed=5, max_operand=9)


def test_build_jsonl_source_applies_the_instruction() -> None:
    source = build_prompt_source("jsonl", str(FIXTURE), seed=0, max_operand=20, instruction="Go.")
    assert isinstance(source, list)
    assert len(source) == 5
    assert all(p.prompt.endswith("? Go.") for p in source)


def test_build_jsonl_without_path_names_data_path() -> None:
    with pytest.raises(ValueError, match="data.path"):
        build_prompt_source("jsonl", None, seed=0, max_operand=20, instruction="")


def test_build_jsonl_with_missing_file_is_a_dataset_error(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        build_prompt_source(
            "jsonl", str(tmp_path / "x.jsonl"), seed=0, max_operand=20, instruction=""
        )


def test_build_unknown_task_names_data_task() -> None:
    with pytest.raises(ValueError, match="data.task must be one of arithmetic, jsonl"):
        build_prompt_source("math", None, seed=0, max_operand=20, instruction="")
