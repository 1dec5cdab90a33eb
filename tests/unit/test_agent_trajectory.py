"""Trajectory: ids, mask, logprobs and versions built as turns are appended, and checked inputs.

Pure data (a character-level fake tokenizer where text matters); the same properties on real
SmolLM2 ids and rendered tool observations are in test_agent_render.py.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

from megarl.agent import GenerateOutput, Tool, ToolError, Trajectory


def _out(ids, finish="stop", versions=None, logprob=-0.5) -> GenerateOutput:
    return GenerateOutput(list(ids), [logprob] * len(ids), finish, versions)


class CharTokenizer:
    """One id per character (its code point): decoding is exact, nothing merges."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(i) for i in ids)


@dataclass
class FakeContext:
    """The ``ctx`` a loop sees: ``generate`` answers canned turns, ``tokenizer`` encodes."""

    replies: list[str]
    tokenizer: CharTokenizer

    async def generate(self, token_ids, max_new_tokens: int) -> GenerateOutput:
        assert token_ids, "generate continues the trajectory so far"
        text = self.replies.pop(0)[:max_new_tokens]
        return _out(self.tokenizer.encode(text), finish="length")


def test_the_documented_two_turn_loop_builds_mask_and_logprobs_as_appended():
    """The user-facing example's body, with a fake context: generated tokens are trained,
    the observation is not, and the mask==1 tokens decode to the model's text only."""
    tokenizer = CharTokenizer()
    ctx = FakeContext(["Let me look.", "It is 42."], tokenizer)
    prompt = tokenizer.encode("Q: what?\nA:")

    async def run(prompt_ids, ctx):
        traj = Trajectory(prompt_ids)
        traj.add_generated(await ctx.generate(traj.token_ids, max_new_tokens=16))
        traj.add_observation(ctx.tokenizer.encode("\nObservation: 42\n", add_special_tokens=False))
        traj.add_generated(await ctx.generate(traj.token_ids, max_new_tokens=16))
        return traj

    traj = asyncio.run(run(prompt, ctx))
    text = tokenizer.decode(traj.response_ids)
    assert text == "Let me look.\nObservation: 42\nIt is 42."
    assert traj.token_ids == tuple(prompt) + traj.response_ids
    assert traj.prompt_ids == tuple(prompt)
    trained = [t for t, m in zip(traj.response_ids, traj.response_mask, strict=True) if m]
    assert tokenizer.decode(trained) == "Let me look.It is 42."
    assert "Observation" not in tokenizer.decode(trained)
    observed = len("\nObservation: 42\n")
    assert traj.response_mask == (1,) * 12 + (0,) * observed + (1,) * 9
    assert traj.response_logprobs == (-0.5,) * 12 + (0.0,) * observed + (-0.5,) * 9
    assert (traj.num_turns, traj.observation_tokens, traj.generated_tokens) == (2, observed, 21)
    assert traj.finish_reason == "length"
    assert traj.response_versions is None
    assert (traj.reward, traj.tool_calls, traj.tool_errors) == (None, 0, 0)


def test_generate_output_converts_lists_and_accepts_integer_scalars():
    class IntLike:  # e.g. a NumPy integer: has __index__
        def __index__(self) -> int:
            return 7

    out = GenerateOutput([IntLike(), 8], [-0.1, 0.0], "stop", [3, 3])
    assert out.token_ids == (7, 8)
    assert out.logprobs == (-0.1, 0.0)
    assert out.versions == (3, 3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"token_ids": [1, 2], "logprobs": [-0.1]}, "2 token ids but 1 logprobs"),
        ({"token_ids": [1, True], "logprobs": [-0.1, -0.1]}, "token_ids[1] is a bool"),
        ({"token_ids": [1.0], "logprobs": [-0.1]}, "token_ids[0] is a float"),
        ({"token_ids": [-1], "logprobs": [-0.1]}, "token_ids[0] = -1"),
        ({"token_ids": [1], "logprobs": [float("nan")]}, "logprobs[0] = nan"),
        ({"token_ids": [1], "logprobs": [0.5]}, "a logprob is a number <= 0"),
        ({"token_ids": [1], "logprobs": ["x"]}, "logprobs[0] is a str"),
        ({"token_ids": [1], "logprobs": [-1.0], "finish_reason": "eos"}, "finish_reason='eos'"),
        ({"token_ids": [1], "logprobs": [-1.0], "versions": [1, 2]}, "1 token ids but 2 vers"),
    ],
)
def test_generate_output_refuses_inconsistent_input(kwargs, message):
    kwargs = {"finish_reason": "stop", **kwargs}
    with pytest.raises(ValueError, match=re.escape(message)):
        GenerateOutput(**kwargs)


def test_trajectory_refuses_bad_prompts_and_appends():
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        Trajectory([])
    with pytest.raises(ValueError, match=r"prompt_ids\[1\] is a str"):
        Trajectory([1, "2"])
    with pytest.raises(ValueError, match="max_response_tokens=0"):
        Trajectory([1], max_response_tokens=0)
    traj = Trajectory([1])
    with pytest.raises(TypeError, match="takes a GenerateOutput, got list"):
        traj.add_generated([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"observation token_ids\[0\] is a bool"):
        traj.add_observation([False])
    assert traj.response_ids == ()


def test_budget_refuses_overlong_generation_cuts_observations_and_then_closes():
    traj = Trajectory([1, 2], max_response_tokens=6)
    traj.add_generated(_out([10, 11, 12]))
    assert (traj.remaining, traj.truncated, traj.finished) == (3, False, True)
    with pytest.raises(ValueError, match="4 generated tokens but only 3 left"):
        traj.add_generated(_out([1, 2, 3, 4]))
    assert traj.add_observation([20, 21, 22, 23, 24]) == 3
    assert traj.response_ids == (10, 11, 12, 20, 21, 22)
    assert (traj.remaining, traj.truncated, traj.finished) == (0, True, False)
    with pytest.raises(ValueError, match="add_generated on a truncated trajectory"):
        traj.add_generated(_out([]))
    with pytest.raises(ValueError, match="add_observation on a truncated trajectory"):
        traj.add_observation([1])


def test_a_cut_observation_truncates_even_with_room_left_for_nothing_else():
    traj = Trajectory([1], max_response_tokens=3)
    traj.add_generated(_out([5], finish="length"))
    traj.add_observation([6, 7, 8])
    assert traj.truncated and traj.response_ids == (5, 6, 7)
    unbounded = Trajectory([1])
    unbounded.add_observation(list(range(1000)))
    assert unbounded.remaining is None and not unbounded.truncated and not unbounded.finished


def test_observation_tokens_carry_the_version_of_the_generated_token_before_them():
    traj = Trajectory([1])
    traj.add_observation([2])  # before any generated turn: takes the first generated version
    traj.add_generated(_out([3, 4], versions=[5, 6]))
    traj.add_observation([7, 8])
    traj.add_generated(_out([9], versions=[7]))
    assert traj.response_versions == (5, 5, 6, 6, 6, 7)
    assert min(traj.response_versions) == 5  # the oldest is a trained token's


def test_generated_turns_carry_versions_all_or_none():
    traj = Trajectory([1])
    traj.add_generated(_out([2]))
    with pytest.raises(ValueError, match="turn 2 carries versions but earlier turns lack"):
        traj.add_generated(_out([3], versions=[1]))
    tagged = Trajectory([1])
    tagged.add_generated(_out([2], versions=[0]))
    with pytest.raises(ValueError, match="turn 2 lacks versions but earlier turns carry"):
        tagged.add_generated(_out([3]))


def test_views_are_snapshots_and_the_loop_may_set_reward_and_counters():
    traj = Trajectory((1, 2))
    ids = traj.token_ids
    traj.add_generated(_out([3], finish="abort"))
    assert ids == (1, 2) and traj.token_ids == (1, 2, 3)
    assert traj.finish_reason == "abort" and not traj.finished
    traj.reward, traj.tool_calls, traj.tool_errors = 1.0, 2, 1
    assert "turns=1" in repr(traj)


def test_package_exports_and_imports_no_torch():
    assert issubclass(ToolError, Exception) and Tool.__abstractmethods__ == {"execute"}
    code = (
        "import sys, megarl.agent, megarl.agent.render, megarl.agent.tool_calls, "
        "megarl.agent.tool_config; "
        "bad = [m for m in ('torch', 'transformers', 'megatron') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
