"""The resumable prompt stream the trainer draws one batch of problems from per step."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from megarl.data.arithmetic import ArithmeticTask
from megarl.data.files import load_problem_files
from megarl.data.jsonl import load_jsonl_problems
from megarl.data.problems import Problem
from megarl.data.rewards import RewardChoice

PromptSource = ArithmeticTask | list[Problem]

PROMPT_TASKS: tuple[str, ...] = ("arithmetic", "jsonl", "files")
"""``data.task`` once resolved (``auto`` picks one of these from the other ``data.*`` keys)."""


class PromptStream:
    """Yields ``prompts_per_step`` problems per call, resumable from a tiny state dict.

    The source is either an :class:`ArithmeticTask` (an infinite stream, read in index order)
    or a finite list of problems, read in epochs. Each epoch visits every problem once, in an
    order that depends only on ``(seed, epoch)``, and a batch that runs past the end of an
    epoch continues into the next one. Because the order is a pure function of the seed,
    the whole position is two ints, and ``load_state_dict`` resumes *exactly* where a
    checkpointed run stopped, with no problem skipped or repeated.
    """

    def __init__(
        self,
        source: PromptSource,
        prompts_per_step: int,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        """Validate the arguments; no problem is drawn until :meth:`next_batch`."""
        if isinstance(prompts_per_step, bool) or not isinstance(prompts_per_step, int):
            raise ValueError(f"prompts_per_step must be an int, got {prompts_per_step!r}")
        if prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1, got {prompts_per_step}")
        if not isinstance(source, ArithmeticTask):
            source = list(source)
            if not source:
                raise ValueError("prompt source has no problems")
        self._source = source
        self._prompts_per_step = prompts_per_step
        self._seed = seed
        self._shuffle = shuffle
        self._epoch = 0
        self._position = 0
        self._epoch_order: list[int] = []
        self._epoch_order_for = -1

    @property
    def prompts_per_step(self) -> int:
        """How many problems each :meth:`next_batch` returns."""
        return self._prompts_per_step

    @property
    def num_problems(self) -> int | None:
        """Problems per epoch, or None for an infinite (arithmetic) source."""
        return None if isinstance(self._source, ArithmeticTask) else len(self._source)

    def next_batch(self) -> list[Problem]:
        """Return the next ``prompts_per_step`` problems and advance the stream."""
        if isinstance(self._source, ArithmeticTask):
            batch = self._source.problems(self._position, self._prompts_per_step)
            self._position += self._prompts_per_step
            return batch
        return [self._next_listed_problem(self._source) for _ in range(self._prompts_per_step)]

    def state_dict(self) -> dict[str, int]:
        """Return the stream position as plain ints, safe to JSON-serialise into a checkpoint.

        ``num_problems`` (0 for an infinite source) and ``seed`` are saved alongside so that
        resuming against a different dataset or seed fails loudly instead of silently
        replaying a different prompt order.
        """
        return {
            "epoch": self._epoch,
            "position": self._position,
            "num_problems": self.num_problems or 0,
            "seed": self._seed,
        }

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Restore a position saved by :meth:`state_dict`; the next batch continues from it."""
        epoch = _non_negative_int(state, "epoch")
        position = _non_negative_int(state, "position")
        self._check_matches_saved(state, "num_problems", self.num_problems or 0)
        self._check_matches_saved(state, "seed", self._seed)
        num_problems = self.num_problems
        if num_problems is not None and position > num_problems:
            raise ValueError(
                f"prompt stream state has position {position} beyond the {num_problems} "
                "problems of an epoch"
            )
        if num_problems is None and epoch != 0:
            raise ValueError(f"prompt stream state for an infinite source has epoch {epoch}")
        self._epoch = epoch
        self._position = position

    def _next_listed_problem(self, problems: Sequence[Problem]) -> Problem:
        """Return the next problem of a finite source, rolling over to a new epoch at the end."""
        if self._position >= len(problems):
            self._epoch += 1
            self._position = 0
        order = self._order_for_epoch(self._epoch, len(problems))
        problem = problems[order[self._position]]
        self._position += 1
        return problem

    def _order_for_epoch(self, epoch: int, num_problems: int) -> list[int]:
        """The visiting order of one epoch: a pure function of ``(seed, epoch)``, cached."""
        if self._epoch_order_for != epoch:
            self._epoch_order = epoch_order(self._seed, epoch, num_problems, self._shuffle)
            self._epoch_order_for = epoch
        return self._epoch_order

    def _check_matches_saved(self, state: Mapping[str, int], key: str, current: int) -> None:
        """Reject a saved state taken from a differently configured stream (key optional)."""
        if key in state and state[key] != current:
            raise ValueError(
                f"prompt stream state was saved with {key}={state[key]!r} but this stream has "
                f"{key}={current!r}; resume with the same data and seed"
            )


def epoch_order(seed: int, epoch: int, num_problems: int, shuffle: bool) -> list[int]:
    """Return the order in which one epoch visits problem indices ``0..num_problems-1``.

    Seeded from the string ``"{seed}:epoch:{epoch}"`` so each epoch is reshuffled
    differently yet reproducibly, independent of how many batches were drawn before.
    """
    order = list(range(num_problems))
    if shuffle:
        random.Random(f"{seed}:epoch:{epoch}").shuffle(order)
    return order


def build_prompt_source(
    task: str,
    path: str | None,
    seed: int,
    max_operand: int,
    instruction: str,
    ops: Sequence[str] = ("+",),
    train_files: Sequence[str] = (),
    prompt_key: str = "prompt",
    answer_key: str | None = None,
    reward: RewardChoice | None = None,
    held_out: int = 0,
) -> PromptSource:
    """Build the prompt source named by the ``data.*`` config.

    Args:
        task: ``"arithmetic"`` (built-in, seeded) or ``"jsonl"`` (GSM8K-style file).
        path: The JSONL file; required for ``"jsonl"``, ignored for ``"arithmetic"``.
        seed: Seed of the arithmetic stream (the JSONL order is seeded by PromptStream).
        max_operand: Largest arithmetic operand.
        instruction: Suffix appended to each JSONL question; the arithmetic prompts already
            say how to answer.
        ops: Arithmetic operators, a subset of ``("+", "-", "*")``.
        held_out: Arithmetic problems kept out of training for validation.
        train_files, prompt_key, answer_key, reward: ``data.task=files``: the files, their
            columns and how they are scored (see :func:`megarl.data.files.load_problem_files`).

    Raises:
        ValueError: Unknown ``data.task``, or ``data.path`` missing for ``jsonl``; the
            message names the config key. A bad file raises DatasetError (a ValueError).
    """
    if task == "arithmetic":
        return ArithmeticTask(seed, max_operand, tuple(ops), held_out=held_out)
    if task == "jsonl":
        if not path:
            raise ValueError("data.path must name a JSONL file when data.task=jsonl")
        return load_jsonl_problems(path, instruction=instruction)
    if task == "files":
        return load_problem_files(train_files, prompt_key, answer_key, instruction, reward)
    valid = ", ".join(PROMPT_TASKS)
    raise ValueError(f"data.task must be one of {valid}, got {task!r}")


def _non_negative_int(state: Mapping[str, int], key: str) -> int:
    """Read a required non-negative int from a saved state, naming the key if it is bad."""
    if key not in state:
        raise ValueError(f"prompt stream state has no {key!r}")
    value = state[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"prompt stream state {key!r} must be an int >= 0, got {value!r}")
    return value
