"""Turn a step's prompts into a scored :class:`RolloutBatch`: generate, reward, advantages.

A plain class (no process groups), run by the rollout host (rank 0, or the rollout actor).
Sampling draws from its own seeded stream per step (:func:`sampling_seed`), one stream per
response (the engine's :class:`~megarl.engines.base.Request` seeds), so two runs with the same
seed and equal weights generate the same rollouts, whatever the planner or training did in
between, and whether the step's responses were generated in one call or (asynchronous
training, :mod:`megarl.trainer.async_rollout`) group by group in calls shared with other steps.

Where agent loops roll the prompts out (``rollout.agent.loop``, a row's ``agent_name``:
:mod:`megarl.trainer.agent_rollout`) a response is a trajectory, its observation tokens masked
out of training (:attr:`megarl.batch.RolloutBatch.response_masks`).

The synchronous loop calls :meth:`RolloutProducer.produce`; the asynchronous rollout side uses
its parts: :meth:`~RolloutProducer.draw` a step's prompts, :meth:`~RolloutProducer.score_groups`
as groups finish, :meth:`~RolloutProducer.assemble` the step when the trainer takes it.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from megarl.algo.advantages import (
    MULTI_REWARD_ESTIMATORS,
    gdpo_advantages,
    get_advantage_estimator,
)
from megarl.algo.dapo import FilterDecision, groups_with_signal, overlong_penalty
from megarl.algo.divergence import DivergenceError, nonfinite_sampling_message
from megarl.algo.length_penalty import LengthWeights, count_turns, linear_length_penalty
from megarl.algo.router_replay import input_routing
from megarl.batch import RolloutBatch
from megarl.data.loader import PromptStream
from megarl.data.problems import Problem
from megarl.data.rewards import RewardChoice, ScoredSamples, WeightedReward, score_samples
from megarl.engines.base import (
    Generation,
    NonFiniteLogitsError,
    Request,
    RolloutEngine,
    SamplingParams,
    request_seed,
)
from megarl.errors import BadInputError, MegarlError
from megarl.planner.pruning import CRITIC_ESTIMATORS
from megarl.trainer.agent_rollout import (
    AgentRollout,
    GeneratedBatch,
    trajectory_generation,
)
from megarl.trainer.progress import PhaseHook, no_progress
from megarl.trainer.scored_groups import ExtraBranch, ScoredGroups, branch_numbers

NONFINITE_SAMPLING = "probability tensor contains"
"""What torch's sampler says when the distribution it is given is not finite."""


def sampling_seed(run_seed: int, step: int, gen_batch: int = 0) -> int:
    """A per-step seed for the rollout stream, independent of every other RNG in the run.

    ``gen_batch`` numbers the extra generation batches of dynamic sampling; the first (0) is
    the seed every step uses without it, so turning the filter on changes no first batch."""
    return (run_seed * 1_000_003 + step * 7919 + gen_batch * 104_729 + 17) % (2**62)


def encode_prompt(tokenizer, problem: Problem, system_prompt: str | None) -> list[int]:
    """The token ids the engine is given for ``problem``: its chat messages through the
    tokenizer's chat template when it has one (start-up uses the same function to check that
    prompts fit the context). ``data.system_prompt`` is put first unless the dataset's
    messages bring their own system message."""
    messages = problem.chat_messages(system_prompt)
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = "\n\n".join(m["content"] for m in messages if m["role"] != "system")
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def step_requests(prompt_ids: Sequence[Sequence[int]], n: int, seed: int) -> list[Request]:
    """``n`` requests per prompt, group-major, response ``r`` seeded ``request_seed(seed, r)``
    (as ``engine.generate(prompts, SamplingParams(seed=seed))`` seeds prompt ``r``)."""
    return [
        Request(tuple(ids), request_seed(seed, g * n + k))
        for g, ids in enumerate(prompt_ids)
        for k in range(n)
    ]


def rollout_prompt_ids(
    tokenizer, problem: Problem, system_prompt: str | None, agents: AgentRollout | None
) -> list[int]:
    """The ids a training rollout starts from: the agent loop's rendering when one rolls the
    problem out (the tool loop describes its tools), else :func:`encode_prompt`. Start-up's
    context check and ``data.filter_overlong_prompts`` measure these."""
    if agents is not None and agents.applies([problem]):
        return agents.prompt_ids(problem)
    return encode_prompt(tokenizer, problem, system_prompt)


def engine_input_routing(gens: Sequence[Generation]) -> tuple[torch.Tensor, ...] | None:
    """Every generation's ``[S, layers, top_k]`` experts of every input position (prompt and
    response, the last filled: :func:`megarl.algo.router_replay.input_routing`) when the engine
    reported them for all, else None."""
    joined = []
    for g in gens:
        if g.routed_experts is None or g.prompt_routed_experts is None:
            return None
        joined.append(input_routing(g.prompt_routed_experts, g.routed_experts))
    return tuple(joined) or None


def engine_routing(gens: Sequence[Generation]) -> tuple[torch.Tensor, ...] | None:
    """Every generation's expert ids when the engine reported them for all (a mixture-of-experts
    model on an engine that exposes routing), else None: the check needs both sides."""
    routed = [g.routed_experts for g in gens]
    if not routed or any(r is None for r in routed):
        return None
    return tuple(r for r in routed if r is not None)


@dataclass(frozen=True)
class RolloutSettings:
    group_size: int
    max_new_tokens: int
    temperature: float
    top_p: float
    adv_estimator: str
    system_prompt: str | None = None
    reward_error: str = "raise"
    """``data.reward_error``: ``raise`` | ``zero`` (see :func:`megarl.data.rewards.score_samples`)."""
    reward_timeout_s: float | None = None
    """``data.reward_timeout_s``: the limit of one call of a user's reward function."""
    overlong_buffer_len: int | None = None
    """DAPO's overlong shaping: the buffer in tokens, None = off."""
    overlong_penalty_factor: float = 1.0
    length_penalty: LengthWeights | None = None
    """``algo.length_penalty``: prime-rl's linear penalty on output tokens, context and turns;
    None = off."""
    filter_groups: bool = False
    """DAPO's dynamic sampling: keep only groups whose scores differ, generate more to refill."""
    max_num_gen_batches: int = 10
    """Generation batches a step may use with ``filter_groups`` (0 = no limit)."""
    input_routing: bool = False
    """``actor.router_replay.mode=R3``: the batch carries the engine's experts of every input
    position (:attr:`RolloutBatch.engine_input_routing`), not only of the response tokens."""


class RewardMixError(BadInputError):
    """An agent loop's own reward met an estimator that reads several reward functions apart."""


class FilterGroupsExhausted(MegarlError):
    """Dynamic sampling found too few groups with differing scores within its limit."""


@dataclass(frozen=True)
class StepPrompts:
    """One generation batch of a step's prompts, as the engine is given them."""

    step: int
    problems: list[Problem]
    prompt_ids: list[list[int]]
    """Each problem's encoded prompt (chat template applied)."""
    seed: int
    """The batch's sampling seed (:func:`sampling_seed`); response ``r`` (group-major) is
    seeded ``request_seed(seed, r)``."""

    def requests(self, group_size: int) -> list[Request]:
        """Every response to sample, group-major: the order and seeds of a synchronous step."""
        return step_requests(self.prompt_ids, group_size, self.seed)


@dataclass(frozen=True)
class StepTexts:
    """What the console and the generations dump show of a step (kept until it is recorded)."""

    samples: list[tuple[str, str, float]]
    """(prompt, response, reward) of each group's first sample."""
    texts: list[tuple[str, str, str]]
    """(prompt, response, answer) of every sequence."""
    turns: list[list[tuple[str, bool]]] | None = None
    """Multi-turn trajectories: each sequence's response as (text, trained) pieces, generated
    turns and observations in order, special tokens shown; None for single-turn steps."""
    branches: list[int] | None = None
    """Steps with gateway sessions that forked: each sequence's branch number within its sample
    (0: the sample's first); None when every sample is one sequence."""


class RolloutProducer:
    """Prompts -> engine samples -> rewards -> group-relative advantages."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer,
        stream: PromptStream,
        reward: RewardChoice,
        settings: RolloutSettings,
        run_seed: int,
        progress: PhaseHook = no_progress,
        agents: AgentRollout | None = None,
        components: Sequence[WeightedReward] | None = None,
    ):
        self.engine, self.tokenizer, self.stream = engine, tokenizer, stream
        self.components = tuple(components) if components else None
        """``data.reward``'s several functions; None: ``reward`` alone scores."""
        self.agents = agents
        """The run's agent loops; None: every rollout is one engine generation."""
        self.reward, self.settings, self.run_seed = reward, settings, run_seed
        self.progress = progress
        """Told the sequences kept of those the step needs, before and after each batch."""
        self.advantage_fn = _advantage_fn(settings.adv_estimator)
        self.texts: dict[int, StepTexts] = {}
        """Each produced step's texts, until the step is recorded (:meth:`pop_texts`)."""
        self._warned_reward_failure = False

    def encode_prompt(self, problem: Problem) -> list[int]:
        return rollout_prompt_ids(self.tokenizer, problem, self.settings.system_prompt, self.agents)

    def produce(
        self, step: int, version: int = 0
    ) -> tuple[RolloutBatch, dict[str, float], dict[str, float]]:
        """The step's scored batch, its rollout metrics, and seconds spent per phase; every
        token is tagged as sampled by policy ``version`` (the engine's weights).

        ``gen`` covers prompt encoding and sampling; ``adv`` covers decoding, rewards and
        advantages. With dynamic sampling a step may generate several batches of prompts and
        keeps the first ``data.prompts_per_step`` groups whose scores differ.
        """
        settings, n = self.settings, self.settings.group_size
        needed = self.stream.prompts_per_step
        parts: list[ScoredGroups] = []
        seconds = {"gen": 0.0, "adv": 0.0}
        kept = dropped = gen_batches = 0
        self.progress("gen", 0, needed * n, "sequences")
        while True:
            part = self._generate_and_score(step, gen_batches, version, seconds)
            gen_batches += 1
            if settings.filter_groups:
                group_ids = torch.arange(len(part.problems)).repeat_interleave(n)
                keep = self._groups_with_signal(part, group_ids)
                dropped += int((~keep).sum())
                part = part.groups(keep, n)
            parts.append(part)
            kept += len(part.problems)
            decision = FilterDecision(kept, needed, gen_batches, settings.max_num_gen_batches)
            self.progress("gen", min(kept, needed) * n, needed * n, "sequences")
            if not settings.filter_groups or decision.enough:
                break
            if decision.give_up:
                raise FilterGroupsExhausted(decision.message(step))
        t_adv = time.perf_counter()
        scored = ScoredGroups.join(parts, needed, n)
        batch, metrics = self.assemble(step, scored)
        if settings.filter_groups:
            metrics["train/num_gen_batches"] = float(gen_batches)
            metrics["train/filtered_groups"] = float(dropped)
        seconds["adv"] += time.perf_counter() - t_adv
        return batch, metrics, seconds

    def draw(self, step: int, gen_batch: int = 0) -> StepPrompts:
        """The next ``data.prompts_per_step`` prompts of the stream, for step ``step``."""
        problems = self.stream.next_batch()
        return StepPrompts(
            step=step,
            problems=problems,
            prompt_ids=[self.encode_prompt(p) for p in problems],
            seed=sampling_seed(self.run_seed, step, gen_batch),
        )

    def generate(
        self,
        problems: Sequence[Problem],
        prompt_ids: Sequence[Sequence[int]],
        n: int,
        seed: int,
        params: SamplingParams,
    ) -> GeneratedBatch:
        """``n`` responses per problem, group-major, response ``r`` seeded ``request_seed(seed,
        r)``: through the agent loops when they roll these problems out, else one engine call
        (then no own rewards and no ``agent/*`` metrics)."""
        if self.agents is not None and self.agents.applies(problems):
            return self.agents.generate(self.engine, problems, prompt_ids, n, seed, params)
        gens = self.engine.generate_requests(step_requests(prompt_ids, n, seed), params)
        return GeneratedBatch(gens=list(gens), rewards=[None] * len(gens), metrics={})

    def sampling_params(self) -> SamplingParams:
        """The training rollouts' sampling (each request brings its own seed)."""
        s = self.settings
        return SamplingParams(
            temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens
        )

    def _generate_and_score(
        self, step: int, gen_batch: int, version: int, seconds: dict[str, float]
    ) -> ScoredGroups:
        """The next ``data.prompts_per_step`` prompts, ``rollout.n`` responses each, scored
        (overlong shaping included); adds its time to ``seconds``."""
        t_start = time.perf_counter()
        prompts = self.draw(step, gen_batch)
        try:
            generated = self.generate(
                prompts.problems,
                prompts.prompt_ids,
                self.settings.group_size,
                prompts.seed,
                self.sampling_params(),
            )
        except RuntimeError as exc:  # inf/NaN logits (the HF engine's check, torch's sampler)
            if not isinstance(exc, NonFiniteLogitsError) and NONFINITE_SAMPLING not in str(exc):
                raise
            detail = " ".join(str(exc).split())[:120]
            raise DivergenceError(nonfinite_sampling_message(step, version, detail)) from exc
        gens = generated.gens
        t_generated = time.perf_counter()
        versions = [[version] * len(g.response_ids) for g in gens]
        limit = self.settings.max_new_tokens
        branches = [
            [ExtraBranch.of(trajectory_generation(t, limit), version) for t in more]
            for more in generated.branches
        ]
        scored = self.score_groups(
            prompts.problems,
            gens,
            versions,
            step,
            generated.rewards,
            generated.answer_texts or None,
            branches,
        )
        scored = dataclasses.replace(scored, agent_metrics=generated.metrics)
        seconds["gen"] += t_generated - t_start
        seconds["adv"] += time.perf_counter() - t_generated
        return scored

    def score_groups(
        self,
        problems: Sequence[Problem],
        gens: Sequence[Generation],
        versions: Sequence[Sequence[int]],
        step: int,
        own_rewards: Sequence[float | None] | None = None,
        own_texts: Sequence[str | None] | None = None,
        branches: Sequence[Sequence[ExtraBranch]] | None = None,
        first_group: int = 0,
    ) -> ScoredGroups:
        """Whole groups (``rollout.n`` generations per problem, in order) decoded and scored,
        the overlong penalty included; ``versions``: each generation's tokens' versions;
        ``own_rewards``: a reward per generation that replaces the dataset's where not None
        (an agent loop's ``trajectory.reward``); ``own_texts``: what the dataset's reward
        reads instead of the decoded response, where not None (``trajectory.answer_text``);
        ``branches``: each generation's further branches (:class:`ExtraBranch`);
        ``first_group``: the step's number of the first group (groups scored apart from their
        step's others are numbered as in it)."""
        n = self.settings.group_size
        texts = [self.tokenizer.decode(g.response_ids, skip_special_tokens=True) for g in gens]
        if own_texts is not None:
            texts = [
                own if own is not None else text for own, text in zip(own_texts, texts, strict=True)
            ]
        answers = [p.answer for p in problems for _ in range(n)]
        sources = [p.data_source for p in problems for _ in range(n)]
        scores, failures, components = self._score(texts, answers, sources, step, first_group * n)
        if own_rewards is not None:
            self._check_own_rewards(own_rewards, components is not None, step)
            scores = tuple(
                float(own) if own is not None else score
                for own, score in zip(own_rewards, scores, strict=True)
            )
        rewards = torch.tensor(scores, dtype=torch.float32)
        overlong = torch.zeros_like(rewards)
        if self.settings.overlong_buffer_len is not None:
            overlong = overlong_penalty(
                [len(g.response_ids) for g in gens],
                self.settings.max_new_tokens,
                self.settings.overlong_buffer_len,
                self.settings.overlong_penalty_factor,
            )
        length = self._length_penalty(gens, rewards)
        return ScoredGroups(
            list(problems),
            list(gens),
            texts,
            rewards + overlong - length,
            overlong,
            length,
            [list(v) for v in versions],
            failures,
            branches=[list(b) for b in branches] if branches and any(branches) else [],
            components=components,
        )

    def _check_own_rewards(
        self, own_rewards: Sequence[float | None], several: bool, step: int
    ) -> None:
        """An agent loop's own ``trajectory.reward`` replaces the weighted sum of several reward
        functions; GDPO, which reads each function's score, cannot take it."""
        if not several or self.settings.adv_estimator not in MULTI_REWARD_ESTIMATORS:
            return
        own = [i for i, r in enumerate(own_rewards) if r is not None]
        if own:
            raise RewardMixError(
                f"step {step}: the agent loop set trajectory.reward for sample {own[0]}, but "
                f"algo.adv_estimator={self.settings.adv_estimator} reads each of the several "
                "data.reward functions' scores; let the dataset's functions score, or use one "
                "data.reward or another estimator"
            )

    def _length_penalty(self, gens: Sequence[Generation], rewards: torch.Tensor) -> torch.Tensor:
        """``algo.length_penalty`` of each generation (whole groups, in order), from its task
        reward: generated tokens, the rest of its context, its generated turns; zeros when off."""
        weights = self.settings.length_penalty
        if weights is None:
            return torch.zeros_like(rewards)
        output = [sum(g.response_mask) if g.response_mask else len(g.response_ids) for g in gens]
        total = [len(g.prompt_ids) + len(g.response_ids) for g in gens]
        group_ids = torch.arange(len(gens)) // self.settings.group_size
        return linear_length_penalty(
            rewards,
            group_ids,
            torch.tensor(output),
            torch.tensor([t - o for t, o in zip(total, output, strict=True)]),
            torch.tensor([count_turns(g.response_mask) for g in gens]),
            weights,
        ).to(rewards.dtype)

    def assemble(self, step: int, scored: ScoredGroups) -> tuple[RolloutBatch, dict[str, float]]:
        """A step's batch from its scored groups (in prompt order): advantages over the step,
        the rollout metrics, and the step's texts kept for its record."""
        settings, n = self.settings, self.settings.group_size
        group_ids = torch.arange(len(scored.problems)).repeat_interleave(n)
        advantages = self._advantages(scored, group_ids)
        gens, versions, owner = scored.sequences()
        masked = any(g.response_mask is not None for g in gens)
        batch = RolloutBatch(
            tokens=tuple(
                torch.tensor(list(g.prompt_ids) + list(g.response_ids), dtype=torch.long)
                for g in gens
            ),
            prompt_lens=tuple(len(g.prompt_ids) for g in gens),
            group_ids=group_ids[owner],
            rewards=scored.rewards[owner],
            advantages=advantages[owner],
            engine_logprobs=tuple(
                torch.tensor(g.response_logprobs, dtype=torch.float32) for g in gens
            ),
            engine_routing=engine_routing(gens),
            engine_input_routing=(engine_input_routing(gens) if settings.input_routing else None),
            behaviour_versions=tuple(torch.tensor(v, dtype=torch.long) for v in versions),
            response_masks=tuple(_mask_of(g) for g in gens) if masked else None,
        )
        rows = [int(i) for i in owner]
        self.texts[step] = StepTexts(
            samples=[
                (scored.problems[i // n].prompt, scored.texts[i], float(scored.rewards[i]))
                for i in range(0, len(scored.gens), n)
            ],
            texts=[
                (scored.problems[i // n].prompt, scored.texts[i], scored.problems[i // n].answer)
                for i in rows
            ],
            turns=[self._turns(g) for g in gens] if masked else None,
            branches=branch_numbers(rows) if len(rows) > len(scored.gens) else None,
        )
        metrics = rollout_metrics(batch, [g.finished for g in gens], settings.max_new_tokens)
        metrics["critic/rewards/failed"] = float(scored.failures)
        metrics.update(scored.agent_metrics)
        if settings.overlong_buffer_len is not None:
            metrics["critic/rewards/overlong_penalty"] = float(scored.overlong.mean())
            metrics["critic/rewards/overlong_frac"] = float((scored.overlong < 0).float().mean())
        if self.components is not None and scored.components is not None:
            for k, component in enumerate(self.components):
                metrics[f"reward/{component.name}/mean"] = float(scored.components[:, k].mean())
        if settings.length_penalty is not None:
            metrics["critic/rewards/length_penalty"] = float(-scored.length_penalty.mean())
            metrics["critic/rewards/length_penalty_frac"] = float(
                (scored.length_penalty > 0).float().mean()
            )
        return batch, metrics

    def _groups_with_signal(self, scored: ScoredGroups, group_ids: torch.Tensor) -> torch.Tensor:
        """DAPO's filter: the groups whose rewards differ; for GDPO with several reward
        functions, the groups where its advantage is not 0 everywhere (GDPO weighs each
        function's normalised scores, so equal weighted sums can still differ, and differing
        scores can cancel): exactly the groups that are not all zero-advantage."""
        if not self._reads_components(scored):
            return groups_with_signal(scored.rewards, group_ids)
        nonzero_B = self._advantages(scored, group_ids) != 0
        num_groups = int(group_ids.max()) + 1 if group_ids.numel() else 0
        return torch.zeros(num_groups, dtype=torch.bool).index_put_(
            (group_ids,), nonzero_B, accumulate=True
        )

    def _reads_components(self, scored: ScoredGroups) -> bool:
        """The estimator reads each of several reward functions' scores apart (GDPO)."""
        return (
            self.settings.adv_estimator in MULTI_REWARD_ESTIMATORS
            and self.components is not None
            and scored.components is not None
        )

    def _advantages(self, scored: ScoredGroups, group_ids: torch.Tensor) -> torch.Tensor:
        """The estimator's advantages of the samples: of their (shaped) rewards, or, for GDPO
        with several reward functions, of each function's scores, the shaping (overlong and
        length penalties) as one more reward of weight 1 when there is any."""
        components = self.components
        if not self._reads_components(scored) or components is None or scored.components is None:
            return self.advantage_fn(scored.rewards, group_ids)
        columns_BK = scored.components
        weights = [c.weight for c in components]
        shaping_B = scored.overlong - scored.length_penalty
        if bool((shaping_B != 0).any()):
            columns_BK = torch.cat([columns_BK, shaping_B[:, None]], dim=1)
            weights.append(1.0)
        return gdpo_advantages(columns_BK, group_ids, torch.tensor(weights, dtype=torch.float64))

    def _turns(self, gen: Generation) -> list[tuple[str, bool]]:
        """The response as (text, trained) pieces: what the generations dump shows."""
        return [
            (self.tokenizer.decode(ids, skip_special_tokens=False), trained)
            for ids, trained in mask_runs(gen.response_ids, gen.response_mask)
        ]

    def pop_texts(self, step: int) -> StepTexts:
        """Step ``step``'s texts, forgotten afterwards (the step is being recorded)."""
        return self.texts.pop(step, StepTexts(samples=[], texts=[]))

    def score(
        self, texts: list[str], answers: list[str], data_sources: list[str], step: int
    ) -> tuple[float, ...]:
        """Each sample's reward (by its ``data_source`` under ``data.reward=auto``), checked; a
        failure raises (one line, exit 2) or, with ``data.reward_error=zero``, scores 0.0, is
        counted and is warned about once."""
        return self._score(texts, answers, data_sources, step)[0]

    def _score(
        self,
        texts: list[str],
        answers: list[str],
        data_sources: list[str],
        step: int,
        first_index: int = 0,
    ) -> tuple[tuple[float, ...], int, torch.Tensor | None]:
        """:meth:`score`, how many calls failed (``first_index``: the step's number of the first
        sample, for messages), and with several reward functions each one's scores ``[B, K]``
        (the rewards are then their weighted sum)."""
        if self.components is None:
            scored = self._score_with(self.reward, texts, answers, data_sources, step, first_index)
            return scored.rewards, scored.failures, None
        columns, failures = [], 0
        for component in self.components:
            scored = self._score_with(
                component.choice, texts, answers, data_sources, step, first_index
            )
            columns.append(scored.rewards)
            failures += scored.failures
        scores_BK = torch.tensor(columns, dtype=torch.float64).T.reshape(len(texts), -1)
        weights_K = torch.tensor([c.weight for c in self.components], dtype=torch.float64)
        return tuple((scores_BK @ weights_K).tolist()), failures, scores_BK.float()

    def _score_with(
        self,
        choice: RewardChoice,
        texts: list[str],
        answers: list[str],
        data_sources: list[str],
        step: int,
        first_index: int,
    ) -> ScoredSamples:
        """Every sample scored by ``choice``; the first failure under ``data.reward_error=zero``
        is warned about once a run."""
        scored = score_samples(
            choice,
            texts,
            answers,
            data_sources,
            self.settings.reward_error,
            step,
            self.settings.reward_timeout_s,
            first_index,
        )
        if scored.first_failure and not self._warned_reward_failure:
            self._warned_reward_failure = True
            print(
                f"megarl-train: warning: {scored.first_failure}; scored 0 "
                "(data.reward_error=zero; critic/rewards/failed counts them per step)",
                file=sys.stderr,
                flush=True,
            )
        return scored


def _mask_of(gen: Generation) -> torch.Tensor:
    mask = gen.response_mask if gen.response_mask is not None else [1] * len(gen.response_ids)
    return torch.tensor(mask, dtype=torch.float32)


def mask_runs(ids: Sequence[int], mask: Sequence[int] | None) -> list[tuple[list[int], bool]]:
    """``ids`` cut where ``mask`` changes: each run of generated (True) or observation (False)
    tokens, in order."""
    runs: list[tuple[list[int], bool]] = []
    for i, token in enumerate(ids):
        trained = mask is None or bool(mask[i])
        if runs and runs[-1][1] == trained:
            runs[-1][0].append(int(token))
        else:
            runs.append(([int(token)], trained))
    return runs


def _advantage_fn(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The outcome estimator ``name``; for a critic's (``gae``) a placeholder of zeros: its
    per-token advantages need the critic's values, which the rank loop computes after the
    rollout (and which replace these, with their metrics)."""
    if name in CRITIC_ESTIMATORS:
        return lambda rewards_B, group_ids_B: torch.zeros_like(rewards_B, dtype=torch.float32)
    return get_advantage_estimator(name)


def advantage_metrics(adv: torch.Tensor) -> dict[str, float]:
    """The ``critic/advantages/*`` metrics (recomputed when the KL in the reward replaces the
    advantages after the rollout)."""
    return {
        "critic/advantages/mean": float(adv.mean()),
        "critic/advantages/max": float(adv.max()),
        "critic/advantages/min": float(adv.min()),
        "critic/advantages/zero_adv_ratio": float((adv == 0).float().mean()),
    }


def rollout_metrics(
    batch: RolloutBatch, finished: Sequence[bool], max_new_tokens: int
) -> dict[str, float]:
    """The ``critic/rewards/*``, ``critic/advantages/*`` and length metrics of a step.

    ``response_length/*`` count the tokens the model generated (a multi-turn trajectory's
    observations are not counted, as verl counts them; ``agent/observation_tokens/mean`` has
    those); the clip ratio reads the whole response, whose budget is ``max_new_tokens``."""
    rewards = batch.rewards
    lengths = torch.tensor(batch.trained_lens, dtype=torch.float32)
    return {
        "critic/rewards/mean": float(rewards.mean()),
        "critic/rewards/max": float(rewards.max()),
        "critic/rewards/min": float(rewards.min()),
        **advantage_metrics(batch.advantages),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float(
            sum(
                1
                for f, n in zip(finished, batch.response_lens, strict=True)
                if not f and n >= max_new_tokens
            )
            / max(1, batch.num_seqs)
        ),
        "prompt_length/mean": float(sum(batch.prompt_lens) / batch.num_seqs),
    }
