"""Training rollouts through agent loops: a step's samples built as trajectories
(:mod:`megarl.agent`) and handed on as the engine's generations are, with a response mask.

Which steps come here: those where ``rollout.agent.loop`` is not ``single_turn`` or a row names
a loop of its own (verl's ``agent_name``). A run with neither never does, so its rollouts stay
the plain engine call, bitwise as they were.

What a trajectory becomes: one :class:`~megarl.engines.base.Generation` of prompt + response,
the response holding the generated turns and the observations between them, as sampled and
rendered (never decoded and re-encoded), with ``response_mask`` 1 on generated tokens and 0 on
observation tokens; only the former are trained (:attr:`megarl.batch.RolloutBatch.response_masks`).
The dataset's reward scores the decoded response (observations included, as verl's reward
managers see it) unless the loop set ``trajectory.reward``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from megarl.agent.driver import PartialRollouts, run_agent_loops
from megarl.agent.loop import SINGLE_TURN_NAMES, AgentSettings, LoopChooser, RunFacts, Sample
from megarl.agent.trajectory import Trajectory
from megarl.data.problems import Problem
from megarl.engines.base import Generation, RolloutEngine, SamplingParams, request_seed


def needs_agent_loops(loop: str, problems: Sequence[Problem]) -> bool:
    """Whether these problems are rolled out by agent loops: the configured loop is not the
    single-turn one, or a row names a loop other than it."""
    if loop not in SINGLE_TURN_NAMES:
        return True
    return any(p.agent_name and p.agent_name not in SINGLE_TURN_NAMES for p in problems)


def problem_row(problem: Problem, messages: Sequence[Mapping[str, str]]) -> dict[str, Any]:
    """The dataset row as a loop reads it (:attr:`megarl.agent.Sample.row`), in verl's schema."""
    row: dict[str, Any] = {
        "prompt": [dict(m) for m in messages],
        "data_source": problem.data_source,
        "reward_model": {"ground_truth": problem.answer, "style": "rule"},
        "extra_info": {"tools_kwargs": dict(problem.tools_kwargs), "source": problem.source},
    }
    if problem.agent_name:
        row["agent_name"] = problem.agent_name
    return row


def trajectory_generation(traj: Trajectory, limit: int | None = None) -> Generation:
    """A trajectory as the producer takes an engine's generation: the whole response, its
    logprobs (0.0 on observation tokens) and its mask, cut to ``limit`` tokens (the response
    budget, which a loop that builds its trajectory without it may overrun; the start-up
    context check counted on it). A cut response is not finished."""
    cut = limit is not None and len(traj.response_ids) > limit
    end = limit if cut else None
    return Generation(
        prompt_ids=traj.prompt_ids,
        response_ids=traj.response_ids[:end],
        response_logprobs=traj.response_logprobs[:end],
        finished=traj.finished and not cut,
        response_mask=traj.response_mask[:end],
    )


@dataclass(frozen=True)
class GeneratedBatch:
    """One generation batch's responses, in sample (group-major) order: an engine call's
    generations, or the agent loops' trajectories as generations (with their own rewards and
    ``agent/*`` metrics)."""

    gens: list[Generation]
    rewards: list[float | None]
    """Each trajectory's own reward (``trajectory.reward``); None: the dataset's reward."""
    metrics: dict[str, float]
    """``agent/*`` metrics of the batch (:func:`megarl.agent.driver.agent_metrics`)."""
    trajectories: list[Trajectory] = field(default_factory=list)
    """The trajectories themselves (empty for a plain engine call)."""
    answer_texts: list[str | None] = field(default_factory=list)
    """What the dataset's reward reads of each sample, where a loop chose it
    (``trajectory.answer_text``); None or empty: the decoded response."""
    branches: list[list[Trajectory]] = field(default_factory=list)
    """Each sample's further branches (a gateway session that forked); each trains with the
    sample's reward and advantage. Empty: none."""


class AgentRollout:
    """The run's loops (built once, tools loaded once) and the prompts they expect."""

    def __init__(
        self,
        settings: AgentSettings,
        tokenizer: Any,
        system_prompt: str | None,
        facts: RunFacts | None = None,
    ):
        self.settings, self.tokenizer, self.system_prompt = settings, tokenizer, system_prompt
        self.chooser = LoopChooser(settings, tokenizer, facts)
        self._warned_overrun = False
        if needs_agent_loops(settings.loop, []):  # a bad loop or tool YAML fails at start-up
            self.chooser(Sample(0, (0,)))

    def applies(self, problems: Sequence[Problem]) -> bool:
        return needs_agent_loops(self.settings.loop, problems)

    def prompt_ids(self, problem: Problem) -> list[int]:
        """The prompt ids the problem's loop expects (the tool loop describes its tools)."""
        messages = problem.chat_messages(self.system_prompt)
        sample = Sample(0, (0,), problem_row(problem, messages), messages=tuple(messages))
        return self.chooser(sample).prompt_ids(messages)

    def generate(
        self,
        engine: RolloutEngine,
        problems: Sequence[Problem],
        prompt_ids: Sequence[Sequence[int]],
        group_size: int,
        seed: int,
        params: SamplingParams,
    ) -> GeneratedBatch:
        """``group_size`` trajectories per problem, sample ``g * group_size + k`` seeded
        ``request_seed(seed, g * group_size + k)`` as the plain rollout seeds that response."""
        order = [g for g in range(len(problems)) for _ in range(group_size)]
        return self.generate_samples(
            engine,
            [problems[g] for g in order],
            [prompt_ids[g] for g in order],
            [request_seed(seed, i) for i in range(len(order))],
            params,
        )

    def generate_samples(
        self,
        engine: RolloutEngine,
        problems: Sequence[Problem],
        prompt_ids: Sequence[Sequence[int]],
        seeds: Sequence[int],
        params: SamplingParams,
        partial: PartialRollouts | None = None,
    ) -> GeneratedBatch:
        """One trajectory per sample (its problem, prompt ids and seed: the asynchronous
        rollout's requests carry their own), in sample order; ``partial``: newer weights may
        interrupt the engine calls (asynchronous partial rollouts)."""
        samples = []
        for index, (problem, ids, seed) in enumerate(zip(problems, prompt_ids, seeds, strict=True)):
            messages = problem.chat_messages(self.system_prompt)
            row = problem_row(problem, messages)
            samples.append(Sample(index, tuple(ids), row, seed, tuple(messages)))
        result = run_agent_loops(
            engine, self.chooser, samples, params, self.tokenizer, partial=partial
        )
        limit = params.max_new_tokens
        over = [t for t in result.trajectories if len(t.response_ids) > limit]
        if over and not self._warned_overrun:
            self._warned_overrun = True
            warnings.warn(
                f"an agent loop built a response of {len(over[0].response_ids)} tokens, over "
                f"rollout.max_new_tokens={limit}; such responses are cut to it (build "
                "Trajectory(sample.prompt_ids, ctx.max_response_tokens) to stay within it)",
                stacklevel=1,
            )
        return GeneratedBatch(
            gens=[trajectory_generation(t, limit) for t in result.trajectories],
            rewards=[t.reward for t in result.trajectories],
            metrics=result.metrics,
            trajectories=result.trajectories,
            answer_texts=[t.answer_text for t in result.trajectories],
            branches=result.branches,
        )


def join_agent_metrics(parts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Several generation batches' ``agent/*`` metrics as one step's: means, fractions and
    per-turn times averaged, maxima maximised, counts and seconds summed."""
    keys = sorted({key for part in parts for key in part})
    joined = {}
    for key in keys:
        values = [part[key] for part in parts if key in part]
        if key.endswith(("/mean", "_frac", "_per_call")):
            joined[key] = sum(values) / len(values)
        elif key.endswith("/max"):
            joined[key] = max(values)
        else:
            joined[key] = sum(values)
    return joined
