"""The built-in arithmetic task: reproducible by seed, correct answers, validated config."""

from __future__ import annotations

import operator
import re

import pytest

from megarl.data.arithmetic import ArithmeticTask

_PROMPT = re.compile(r"What is (\d+) ([-+*]) (\d+)\? Answer with just the number\.")
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def test_same_seed_gives_same_problems() -> None:
    assert ArithmeticTask(seed=7).problems(0, 50) == ArithmeticTask(seed=7).problems(0, 50)


def test_different_seed_gives_different_problems() -> None:
    prompts_a = [p.prompt for p in ArithmeticTask(seed=1).problems(0, 50)]
    prompts_b = [p.prompt for p in ArithmeticTask(seed=2).problems(0, 50)]
    assert prompts_a != prompts_b


def test_problem_is_a_pure_function_of_the_index() -> None:
    task = ArithmeticTask(seed=3)
    later_first = task.problem(41)
    task.problems(0, 41)
    assert task.problem(41) == later_first
    assert later_first.source == "arithmetic#41"


@pytest.mark.parametrize("ops", [("+",), ("-",), ("*",), ("+", "-", "*")])
def test_answers_are_correct_arithmetic(ops: tuple[str, ...]) -> None:
    task = ArithmeticTask(seed=11, max_operand=20, ops=ops)
    seen_ops = set()
    for problem in task.problems(0, 200):
        match = _PROMPT.fullmatch(problem.prompt)
        assert match, problem.prompt
        left, op, right = int(match[1]), match[2], int(match[3])
        assert 1 <= left <= 20 and 1 <= right <= 20
        assert op in ops
        assert problem.answer == str(_OPS[op](left, right))
        seen_ops.add(op)
    assert seen_ops == set(ops)


def test_subtraction_answers_are_never_negative() -> None:
    answers = [int(p.answer) for p in ArithmeticTask(seed=5, ops=("-",)).problems(0, 200)]
    assert min(answers) >= 0


def test_max_operand_one_gives_one_plus_one() -> None:
    problem = ArithmeticTask(seed=0, max_operand=1).problem(0)
    assert problem.prompt.startswith("What is 1 + 1?")
    assert problem.answer == "2"


def test_ops_list_from_a_config_is_frozen_to_a_tuple() -> None:
    task = ArithmeticTask(seed=0, ops=["+", "*"])  # type: ignore[arg-type]
    assert task.ops == ("+", "*")
    hash(task)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_operand": 0}, "max_operand"),
        ({"max_operand": -5}, "max_operand"),
        ({"ops": ("/",)}, "ops"),
        ({"ops": ("+", "**")}, "ops"),
        ({"ops": ()}, "ops"),
        ({"ops": "+-"}, "ops"),
    ],
)
def test_bad_config_raises_value_error_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ArithmeticTask(seed=0, **kwargs)


def test_negative_index_is_rejected() -> None:
    with pytest.raises(ValueError, match="index"):
        ArithmeticTask(seed=0).problem(-1)


def test_held_out_problems_are_never_trained_on() -> None:
    task = ArithmeticTask(seed=1234, held_out=32)
    held_out = task.validation_problems()
    assert len({p.prompt for p in held_out}) == 32
    assert held_out == ArithmeticTask(seed=1234, held_out=32).validation_problems()
    trained = {p.prompt for p in task.problems(0, 5000)}
    assert not trained & {p.prompt for p in held_out}
    # without a held-out set the stream is the old one; with it only colliding draws change
    plain = ArithmeticTask(seed=1234).problems(0, 400)
    pairs = zip(plain, task.problems(0, 400), strict=True)
    changed = [i for i, (a, b) in enumerate(pairs) if a != b]
    assert changed and all(plain[i].prompt in {p.prompt for p in held_out} for i in changed)


def test_a_held_out_set_over_a_quarter_of_the_problems_is_refused() -> None:
    with pytest.raises(ValueError, match=r"data.val_problems=2: .* quarter of the 4 arithmetic"):
        ArithmeticTask(seed=0, max_operand=2, held_out=2)
