"""A step's scored groups: the unit rollouts are produced, filtered and buffered in.

Generation batches are scored group by group (:meth:`megarl.trainer.rollout.RolloutProducer.
score_groups`); dynamic sampling keeps some groups of a batch (:meth:`ScoredGroups.groups`),
the asynchronous rollout buffers them as they finish and joins a step's from several calls
(:meth:`ScoredGroups.join`), and only then are they assembled into a training batch. Both the
synchronous producer and the asynchronous rollout side build and combine these values, so the
type and its algebra (including a sample's further branches, :class:`ExtraBranch`) live here,
apart from the producer's generate-and-reward pipeline.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from megarl.data.problems import Problem
from megarl.engines.base import Generation
from megarl.trainer.agent_rollout import join_agent_metrics


@dataclass(frozen=True)
class ExtraBranch:
    """A further branch of one sample (a gateway session that forked or restarted its
    conversation): a sequence of its own in the step's batch, with its sample's reward and
    advantage, its group's id, and its own mask (only its sampled tokens train)."""

    gen: Generation
    versions: list[int]
    """The policy version that sampled each response token."""

    @classmethod
    def of(cls, gen: Generation, version: int) -> ExtraBranch:
        """A branch every token of which policy ``version`` sampled."""
        return cls(gen, [version] * len(gen.response_ids))


@dataclass(frozen=True)
class ScoredGroups:
    """Whole groups of one or more generation batches, scored, in prompt order."""

    problems: list[Problem]
    gens: list[Generation]
    texts: list[str]
    rewards: torch.Tensor
    overlong: torch.Tensor
    """The overlong penalty included in ``rewards`` (0 where shaping is off)."""
    length_penalty: torch.Tensor
    """The length penalty subtracted from ``rewards`` (0 where it is off)."""
    versions: list[list[int]]
    """Per sequence, the policy version that sampled each response token."""
    failures: int = 0
    """Samples whose reward function failed (``data.reward_error=zero`` scored them 0)."""
    agent_metrics: dict[str, float] = field(default_factory=dict)
    """The agent loops' ``agent/*`` metrics when the batch was rolled out through them."""
    branches: list[list[ExtraBranch]] = field(default_factory=list)
    """Per sequence, its further branches (empty: none anywhere); the group statistics and
    advantages are the samples', each branch takes its sample's."""
    components: torch.Tensor | None = None
    """``[B, K]``: each of several ``data.reward`` functions' score (``rewards`` holds their
    weighted sum, shaped); None with one function."""

    def branches_of(self, seq: int) -> list[ExtraBranch]:
        return self.branches[seq] if self.branches else []

    def sequences(self) -> tuple[list[Generation], list[list[int]], torch.Tensor]:
        """Every sequence of the step: each sample's generation followed by its further
        branches (:class:`ExtraBranch`), their versions, and the index of the sample each one
        belongs to (to take its group, reward and advantage)."""
        gens, versions, owner = [], [], []
        for i, gen in enumerate(self.gens):
            gens.append(gen)
            versions.append(self.versions[i])
            owner.append(i)
            for branch in self.branches_of(i):
                gens.append(branch.gen)
                versions.append(branch.versions)
                owner.append(i)
        return gens, versions, torch.tensor(owner, dtype=torch.long)

    def groups(self, keep: torch.Tensor, n: int) -> ScoredGroups:
        """Only the groups where ``keep`` (one bool per group) is true."""
        groups = [g for g in range(len(self.problems)) if bool(keep[g])]
        seqs = [g * n + i for g in groups for i in range(n)]
        return ScoredGroups(
            problems=[self.problems[g] for g in groups],
            gens=[self.gens[i] for i in seqs],
            texts=[self.texts[i] for i in seqs],
            rewards=self.rewards[seqs],
            overlong=self.overlong[seqs],
            length_penalty=self.length_penalty[seqs],
            versions=[self.versions[i] for i in seqs],
            failures=self.failures,
            agent_metrics=self.agent_metrics,
            branches=[self.branches[i] for i in seqs] if self.branches else [],
            components=None if self.components is None else self.components[seqs],
        )

    @staticmethod
    def join(parts: Sequence[ScoredGroups], num_groups: int, n: int) -> ScoredGroups:
        """The first ``num_groups`` groups of ``parts`` in order."""
        problems = [p for part in parts for p in part.problems][:num_groups]
        branched = any(part.branches for part in parts)
        branches = [part.branches_of(i) for part in parts for i in range(len(part.gens))]
        return ScoredGroups(
            problems=problems,
            gens=[g for part in parts for g in part.gens][: num_groups * n],
            texts=[t for part in parts for t in part.texts][: num_groups * n],
            rewards=torch.cat([part.rewards for part in parts])[: num_groups * n],
            overlong=torch.cat([part.overlong for part in parts])[: num_groups * n],
            length_penalty=torch.cat([p.length_penalty for p in parts])[: num_groups * n],
            versions=[v for part in parts for v in part.versions][: num_groups * n],
            failures=sum(part.failures for part in parts),
            agent_metrics=join_agent_metrics([p.agent_metrics for p in parts if p.agent_metrics]),
            branches=branches[: num_groups * n] if branched else [],
            components=(
                None
                if parts[0].components is None
                else torch.cat([p.components for p in parts if p.components is not None])[
                    : num_groups * n
                ]
            ),
        )


def branch_numbers(owners: Sequence[int]) -> list[int]:
    """Each sequence's number among its sample's sequences (0, 1, ... in order)."""
    seen: dict[int, int] = {}
    numbers = []
    for owner in owners:
        numbers.append(seen.get(owner, 0))
        seen[owner] = numbers[-1] + 1
    return numbers
