"""Batch planner: the exact work of every data-parallel rank for one GRPO rollout batch.

:func:`plan_step` is pure (stdlib + numpy): it turns per-sequence lengths, advantages and the
actor's batching config (:class:`PlannerInputs`) into a frozen :class:`StepPlan` -- for each
optimizer step, which sequences each DP rank runs, grouped into micro-batches, with which loss
weight, and the normaliser every micro-batch divides its loss sum by. Workers only execute it.

Why prune. In GRPO a group whose rewards are all equal has advantage exactly 0 for every member.
With only the policy-gradient term active (``kl_coef == entropy_coef == 0``) such a sequence
contributes exactly zero gradient, yet costs a full forward+backward. Skipping it is exact as long
as the loss of a mini-batch keeps the denominator of the *unpruned* mini-batch: every
micro-batch divides by the whole mini-batch's count (see :func:`normaliser_of`: its response
tokens for ``token-mean``, its sequences for the ``seq-mean-*`` modes, times
``loss_scale_factor`` for ``seq-mean-token-sum-norm``) because gradients are summed across
micro-batches and DP ranks, so dropping zero terms from the numerator changes nothing. That
holds for every policy loss (``actor.policy_loss``): each gives a zero-advantage token exactly
zero loss and gradient, and weighs a token by its own sequence only (``seq-mean-token-mean``'s
``1 / length`` is the token's own sequence's length), so which sequences share a micro-batch
never matters.

Modes:

* ``off`` -- the baseline. Mini-batch ``m`` is the contiguous index block
  ``[m * N / M, (m + 1) * N / M)`` (``M = ppo_mini_batches``; contiguous so GRPO groups stay
  together), the same in every epoch; every sequence is trained; one optimizer step per
  mini-batch and epoch, normaliser = that mini-batch's count.
* ``match_loss_curve`` -- the same optimizer steps as ``off`` (epochs x mini-batches, same
  membership, same normaliser), but only sequences with a non-zero advantage are trained. A
  mini-batch with no kept sequence becomes a *ghost step*: no micro-batch on any rank, yet the
  trainer still calls ``optimizer.step()`` on zero gradients, so Adam's moments and step count
  (and weight decay and the LR schedule) advance exactly as in the baseline. With exact pruning
  this reproduces the baseline's parameters up to floating-point summation order.
* ``fast`` -- fewer, fuller optimizer steps. Each epoch, consecutive baseline mini-batches are
  merged greedily into *runs*: a run grows while its kept (seq) tokens stay within one average
  baseline mini-batch, ``total_seq_tokens / M`` (a run always takes at least one mini-batch with
  a kept sequence, so an over-full single mini-batch is still a valid run). Greedy next-fit gives
  the fewest such contiguous runs: one step per epoch whenever the kept tokens fit, never more
  than ``M``. Each run is trained as one optimizer step whose normaliser is the unpruned count of
  the union of its mini-batches. Only when every sequence is pruned is the single run a ghost
  step (so ``ppo_mini_batches == 1`` stays exact even then).

  What ``fast`` approximates. With ``ppo_mini_batches == 1`` there is one run per epoch with the
  unpruned batch's normaliser: identical to ``match_loss_curve`` and thus exact. With ``M > 1``
  and ``S < M`` runs, each step is *exactly* the baseline loss of a coarser mini-batch partition
  (the union of the merged mini-batches, pruned) -- i.e. it is the baseline with larger
  mini-batches, not with the same ones. The normaliser is the union's unpruned count rather
  than, say, one mini-batch's: this keeps the gradient of every step a per-token (per-sequence)
  mean at the baseline's scale, so Adam's second-moment estimates stay consistent from step to
  step and across modes. The cost is fewer Adam steps: per epoch the model moves ``S`` steps of
  the coarser mean gradient instead of ``M`` steps of finer ones (for SGD, ``S/M`` of the
  first-order displacement; for Adam, whose step size is set by the learning rate, roughly the
  same ratio). Matching the baseline's displacement would need the LR scaled by ``M / S``, which
  is left to the user; the plan reports ``S`` and ``M`` so it can be logged.

Exactness. Pruning is exact only when every active loss term vanishes at advantage 0, i.e.
``kl_coef == 0`` and ``entropy_coef == 0``. Otherwise a pruning mode raises :class:`PlannerError`
(see :func:`check_pruning_config`, which the trainer also calls at start-up) unless
``allow_approx`` is set; then zero-advantage sequences are pruned anyway and the plan is marked
``approximate=True`` with the reason. With a critic (``algo.adv_estimator=gae``) pruning is
never exact, whatever the coefficients (:func:`pruning_refusal`): ``auto`` resolves to ``off``,
a named pruning mode is refused, and the plan's summary says why. The same holds for a
mixture-of-experts router's load-balancing loss (``actor.moe_aux_loss_coef > 0``): it is a
function of every token routed in a micro-batch, not a sum of per-sequence terms that vanish at
advantage 0, so leaving a sequence out changes the gradient of all the others.

Sharding. Within each non-ghost step the trained sequences are split over ``dp_size`` ranks by
estimated cost ``t + attention_cost_coef * t**2`` (``t`` = prompt + response tokens; see
:mod:`megarl.planner.partition`: LPT in rounds plus a swap refinement), then packed per rank into
micro-batches of at most ``micro_batch_tokens`` tokens by first-fit-decreasing. Ranks must run
the same number of micro-batches: a rank short of micro-batches first splits its fullest
multi-sequence micro-batches (no extra compute), and only then is padded with *filler*
micro-batches. A rank with no trained sequence at all gets fillers too, so no rank is ever empty
in a non-ghost step. A filler is one sequence at loss weight 0: the shortest zero-advantage
sequence of the step's mini-batch(es), else of the whole batch, else the step's shortest trained
sequence (ties by index). Fillers never count in normalisers or kept fractions.

Invariants of every plan (``tests/unit/test_batch_planner.py::assert_invariants``):

1. Every kept sequence (every sequence in ``off``; advantage != 0 otherwise) is trained -- appears
   with loss weight 1 -- exactly once per epoch; nothing else ever has weight 1.
2. In ``off`` every sequence is trained exactly once per epoch; ``off`` never has a ghost step.
3. Within a step all ranks have the same number of micro-batches: zero for a ghost step, at
   least one otherwise.
4. Every micro-batch holds at most ``micro_batch_tokens`` tokens unless it is a single sequence
   longer than the budget; ``num_tokens`` is the sum of its sequences' ``seq_tokens``.
5. The normaliser of a step is :func:`normaliser_of` the unpruned baseline mini-batch(es) it
   covers (response tokens, sequences, or sequences x ``loss_scale_factor``); fillers and
   pruning never change it.
6. A step is a ghost step iff the mini-batch(es) it covers contain no kept sequence.
7. ``off`` and ``match_loss_curve`` have exactly ``ppo_epochs * ppo_mini_batches`` steps in
   (epoch, mini-batch) order; ``fast`` has between ``ppo_epochs`` and that many.
8. Deterministic: equal inputs give equal plans (all ties go to the lower index).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from megarl.planner.partition import (
    DEFAULT_ATTENTION_COST_COEF,
    balanced_partition,
    first_fit_decreasing,
    sequence_costs,
    split_in_two,
)

PLANNER_MODES: tuple[str, ...] = ("off", "match_loss_curve", "fast")
LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
"""The aggregations the planner normalises; ``megarl.algo.losses.AGG_MODES`` implements them
(kept apart so the planner stays torch-free; a unit test holds the two equal)."""

# Per-step reasons list at most this many padded ranks by number before summarising.
_MAX_RANKS_NAMED = 4


class PlannerError(ValueError):
    """The planner cannot produce a faithful plan for this configuration or batch."""


PRUNE_SETTINGS: tuple[str, ...] = ("auto", *PLANNER_MODES)
"""Values of ``planner.prune_zero_adv``: a planner mode, or ``auto`` (the default)."""


CRITIC_ESTIMATORS: tuple[str, ...] = ("gae",)
"""``algo.adv_estimator`` values whose advantages come per token from a learned critic."""


def pruning_refusal(adv_estimator: str, moe_aux_loss_coef: float = 0.0) -> str | None:
    """Why zero-advantage pruning can never be exact for this run, or None if it can be.

    With a critic (``gae``) a sequence's advantages are per token, from a learned value
    function and whitened over the batch: a zero is a float coincidence, never the structural
    zero of an all-equal group, and the critic's own loss (which trains on every sequence)
    does not vanish at advantage 0. With a router load-balancing loss
    (``moe_aux_loss_coef > 0``) every routed token counts, whatever its sequence's advantage:
    the loss multiplies each expert's share of a micro-batch's tokens by its mean router
    probability, so a pruned sequence's tokens change both factors, and with them the gradient
    the kept sequences get. No setting, ``allow_approx`` included, prunes then (an
    approximation of a term that is not a sum over sequences has no error bound to report).
    """
    if adv_estimator in CRITIC_ESTIMATORS:
        return (
            f"algo.adv_estimator={adv_estimator} has per-token advantages from a learned "
            "critic, and its value loss trains on every sequence"
        )
    if moe_aux_loss_coef > 0:
        return (
            f"actor.moe_aux_loss_coef={moe_aux_loss_coef} trains the router's load-balancing "
            "loss on every routed token, zero-advantage sequences included"
        )
    return None


def resolve_prune_mode(
    setting: str,
    kl_coef: float,
    entropy_coef: float,
    adv_estimator: str = "grpo",
    moe_aux_loss_coef: float = 0.0,
) -> tuple[str, str]:
    """``(mode, reason)`` for ``planner.prune_zero_adv``.

    ``auto`` prunes whenever pruning is exact -- ``match_loss_curve``, the same gradients as
    the unpruned baseline -- i.e. when no loss term survives at advantage 0 (``kl_coef == 0``
    and ``entropy_coef == 0``) and nothing else forbids it (a critic, a router load-balancing
    loss: see :func:`pruning_refusal`), and does not prune otherwise. It never picks an approximation:
    ``fast`` and ``allow_approx`` must be asked for by name. A named mode is returned as is;
    :func:`check_pruning_config` judges it.
    """
    if setting not in PRUNE_SETTINGS:
        raise PlannerError(
            f"planner.prune_zero_adv must be one of {PRUNE_SETTINGS}, got {setting!r}"
        )
    if setting != "auto":
        return setting, f"planner.prune_zero_adv={setting}"
    refusal = pruning_refusal(adv_estimator, moe_aux_loss_coef)
    if refusal is not None:
        return "off", f"auto: no pruning, {refusal}"
    if kl_coef == 0 and entropy_coef == 0:
        return "match_loss_curve", "auto: exact (kl_coef=0, entropy_coef=0)"
    return "off", (
        f"auto: no pruning, actor.kl_coef={kl_coef} / actor.entropy_coef="
        f"{entropy_coef} act on zero-advantage sequences"
    )


def check_pruning_config(
    mode: str,
    kl_coef: float,
    entropy_coef: float,
    allow_approx: bool,
    adv_estimator: str = "grpo",
    moe_aux_loss_coef: float = 0.0,
) -> str | None:
    """Fail fast when pruning zero-advantage sequences would silently change the loss.

    Returns ``None`` when the configuration is exact (``mode == "off"`` or both coefficients are
    0), the reason string when it is approximate but ``allow_approx`` permits it, and raises
    :class:`PlannerError` otherwise, and always for an estimator :func:`pruning_refusal`
    names. The trainer calls this at start-up so a bad config fails before any rollout;
    :func:`plan_step` calls it again on every batch.
    """
    if mode not in PLANNER_MODES:
        raise PlannerError(f"planner.prune_zero_adv must be one of {PLANNER_MODES}, got {mode!r}")
    refusal = pruning_refusal(adv_estimator, moe_aux_loss_coef)
    if mode != "off" and refusal is not None:
        raise PlannerError(
            f"planner.prune_zero_adv={mode} cannot prune: {refusal}. "
            "Set planner.prune_zero_adv=auto or off."
        )
    if mode == "off" or (kl_coef == 0 and entropy_coef == 0):
        return None
    terms = f"actor.kl_coef={kl_coef} and actor.entropy_coef={entropy_coef}"
    if not allow_approx:
        raise PlannerError(
            f"planner.prune_zero_adv={mode} is exact only when no loss term "
            f"survives at advantage 0, but {terms}: zero-advantage sequences still carry a "
            "KL/entropy gradient. Set both coefficients to 0, set planner.prune_zero_adv=off, "
            "or set planner.allow_approx=true to prune anyway."
        )
    return f"approximate: pruned zero-adv seqs although {terms} (planner.allow_approx=true)"


@dataclass(frozen=True)
class PlannerInputs:
    """Everything :func:`plan_step` needs about one rollout batch and the actor's batching.

    Per-sequence fields accept any sequence (lists, numpy or torch arrays), are stored as tuples
    of Python scalars and are left out of ``repr`` (they can hold 65k entries).
    """

    seq_tokens: tuple[int, ...] = field(repr=False)
    """Prompt + response length of each sequence; drives cost and the micro-batch budget."""
    response_tokens: tuple[int, ...] = field(repr=False)
    """Response length of each sequence (<= ``seq_tokens``); the ``token-mean`` normaliser."""
    advantages: tuple[float, ...] = field(repr=False)
    """Advantage of each sequence; exactly 0.0 marks a prunable sequence."""
    group_ids: tuple[int, ...] = field(repr=False)
    """GRPO group (prompt) of each sequence; only used for reporting."""
    loss_agg: str = "token-mean"
    """One of :data:`LOSS_AGG_MODES`; decides the normaliser (see :func:`normaliser_of`)."""
    loss_scale_factor: float = 1.0
    """``seq-mean-token-sum-norm``'s constant (``actor.loss_scale_factor``, by default
    ``rollout.max_new_tokens``); the normaliser is sequences x this. Unused by other modes."""
    kl_coef: float = 0.0
    """``actor.kl_coef``; pruning is exact only when it is 0."""
    entropy_coef: float = 0.0
    """``actor.entropy_coef``; pruning is exact only when it is 0."""
    dp_size: int = 1
    """Number of data-parallel ranks sharing each optimizer step."""
    ppo_mini_batches: int = 1
    """``actor.ppo_mini_batches``: optimizer steps per epoch in the baseline; divides N."""
    ppo_epochs: int = 1
    """``actor.ppo_epochs``: passes over the rollout batch."""
    micro_batch_tokens: int = 16384
    """Token budget of one micro-batch (sum of ``seq_tokens``)."""
    mode: str = "off"
    """``off`` | ``match_loss_curve`` | ``fast`` (see the module docstring)."""
    allow_approx: bool = False
    """Prune even when a KL/entropy term makes it inexact; the plan is marked approximate."""
    adv_estimator: str = "grpo"
    """``algo.adv_estimator``; a critic's (``gae``) is never pruned (:func:`pruning_refusal`)
    and its ``advantages`` only rank filler candidates."""
    moe_aux_loss_coef: float = 0.0
    """``actor.moe_aux_loss_coef``; > 0 (a router load-balancing loss) is never pruned
    (:func:`pruning_refusal`)."""
    attention_cost_coef: float = DEFAULT_ATTENTION_COST_COEF
    """Cost model ``t + coef * t**2``; ``1 / (12 * hidden)`` fits a transformer, 0 = tokens."""

    def __post_init__(self) -> None:
        for name in ("seq_tokens", "response_tokens", "advantages", "group_ids"):
            object.__setattr__(self, name, _as_tuple(getattr(self, name)))
        self._check_sizes()
        self._check_choices()
        self._check_lengths()
        self._check_per_sequence_values()

    @property
    def num_sequences(self) -> int:
        """N, the number of sequences in the rollout batch."""
        return len(self.seq_tokens)

    def _check_lengths(self) -> None:
        if self.num_sequences == 0:
            raise PlannerError("seq_tokens is empty: a rollout batch needs at least one sequence")
        for name in ("response_tokens", "advantages", "group_ids"):
            if len(getattr(self, name)) != self.num_sequences:
                raise PlannerError(
                    f"{name} has {len(getattr(self, name))} entries but seq_tokens has "
                    f"{self.num_sequences}"
                )
        if self.num_sequences % self.ppo_mini_batches:
            raise PlannerError(
                f"rollout batch of {self.num_sequences} sequences is not divisible by "
                f"actor.ppo_mini_batches={self.ppo_mini_batches}"
            )

    def _check_sizes(self) -> None:
        for name in ("dp_size", "ppo_mini_batches", "ppo_epochs", "micro_batch_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise PlannerError(f"{name} must be a positive int, got {value!r}")
        for name in (
            "kl_coef",
            "entropy_coef",
            "moe_aux_loss_coef",
            "attention_cost_coef",
            "loss_scale_factor",
        ):
            if not math.isfinite(getattr(self, name)):
                raise PlannerError(f"{name} must be finite, got {getattr(self, name)!r}")
        if self.loss_scale_factor <= 0:
            raise PlannerError(f"loss_scale_factor must be > 0, got {self.loss_scale_factor!r}")
        if self.attention_cost_coef < 0:
            raise PlannerError(
                f"attention_cost_coef must be >= 0, got {self.attention_cost_coef!r}"
            )

    def _check_choices(self) -> None:
        if self.loss_agg not in LOSS_AGG_MODES:
            raise PlannerError(f"loss_agg must be one of {LOSS_AGG_MODES}, got {self.loss_agg!r}")
        if self.mode not in PLANNER_MODES:
            raise PlannerError(f"mode must be one of {PLANNER_MODES}, got {self.mode!r}")

    def _check_per_sequence_values(self) -> None:
        seq_tokens = _int_array("seq_tokens", self.seq_tokens)
        response_tokens = _int_array("response_tokens", self.response_tokens)
        _int_array("group_ids", self.group_ids)
        _fail_at_first("seq_tokens", seq_tokens, seq_tokens < 1, "must be >= 1")
        _fail_at_first("response_tokens", response_tokens, response_tokens < 0, "must be >= 0")
        too_long = response_tokens > seq_tokens
        _fail_at_first("response_tokens", response_tokens, too_long, "exceeds seq_tokens")
        advantages = np.asarray(self.advantages, dtype=np.float64)
        _fail_at_first("advantages", advantages, ~np.isfinite(advantages), "must be finite")


def _as_tuple(values: Sequence | np.ndarray) -> tuple:
    """Store sequence fields immutably; arrays (numpy, torch) become tuples of Python scalars."""
    if isinstance(values, Sequence):
        return tuple(values)
    return tuple(values.tolist())


def _int_array(name: str, values: tuple) -> np.ndarray:
    """``values`` as int64; floats, strings and other non-integers are rejected."""
    array = np.asarray(values)
    if array.dtype.kind not in "iub":
        raise PlannerError(f"{name} must hold integers, got dtype {array.dtype}")
    return array.astype(np.int64, copy=False)


def _fail_at_first(name: str, values: np.ndarray, bad: np.ndarray, rule: str) -> None:
    """Raise naming the first offending index of a per-sequence field."""
    if bad.any():
        index = int(np.argmax(bad))
        raise PlannerError(f"{name}[{index}]={values[index].item()!r} {rule}")


@dataclass(frozen=True)
class MicroBatch:
    """One forward+backward pass on one rank."""

    seq_indices: tuple[int, ...]
    """Indices into the rollout batch (trained ones ascending, or a single filler)."""
    loss_weights: tuple[float, ...]
    """Per sequence: 1.0 = trained, 0.0 = filler (computed, contributes no gradient)."""
    num_tokens: int
    """Sum of ``seq_tokens`` over ``seq_indices``."""

    def __post_init__(self) -> None:
        if not self.seq_indices:
            raise ValueError("seq_indices is empty: a micro-batch holds at least one sequence")
        if len(self.loss_weights) != len(self.seq_indices):
            raise ValueError(
                f"loss_weights has {len(self.loss_weights)} entries but seq_indices has "
                f"{len(self.seq_indices)}"
            )
        if not set(self.loss_weights) <= {0.0, 1.0}:
            raise ValueError(f"loss_weights must be 0.0 or 1.0, got {set(self.loss_weights)}")
        if self.num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {self.num_tokens}")

    @property
    def num_trained(self) -> int:
        """Sequences at loss weight 1."""
        return sum(1 for weight in self.loss_weights if weight == 1.0)

    @property
    def num_fillers(self) -> int:
        """Sequences at loss weight 0."""
        return len(self.loss_weights) - self.num_trained


@dataclass(frozen=True)
class RankPlan:
    """The micro-batches one DP rank runs, in order, within one optimizer step."""

    micro_batches: tuple[MicroBatch, ...]
    """Empty only in a ghost step."""

    @property
    def num_micro_batches(self) -> int:
        """How many forward+backward passes this rank runs."""
        return len(self.micro_batches)

    @property
    def num_fillers(self) -> int:
        """Filler sequences (loss weight 0) on this rank."""
        return sum(micro_batch.num_fillers for micro_batch in self.micro_batches)


@dataclass(frozen=True)
class OptimizerStepPlan:
    """One ``optimizer.step()``: the micro-batches of every rank and their shared normaliser."""

    epoch: int
    """PPO epoch, 0-based."""
    mini_batch: int
    """Baseline mini-batch index (``off``/``match_loss_curve``) or merged run index (``fast``)."""
    source_mini_batches: tuple[int, ...]
    """The baseline mini-batches this step covers: ``(mini_batch,)`` unless ``fast`` merged."""
    ranks: tuple[RankPlan, ...]
    """One plan per DP rank (``len == dp_size``), all with the same micro-batch count."""
    normaliser: float
    """Every micro-batch divides its loss sum by this: :func:`normaliser_of` the unpruned
    covered mini-batches (response tokens, sequences, or sequences x loss_scale_factor)."""
    is_ghost: bool
    """No micro-batch anywhere; the trainer still steps the optimizer on zero gradients."""
    rank_costs: tuple[float, ...] = field(default=())
    """Estimated cost per rank (fillers included); empty for a ghost step."""
    trained_cost: float = 0.0
    """Estimated cost of the trained sequences summed over ranks (fillers excluded)."""

    def __post_init__(self) -> None:
        if not self.ranks:
            raise ValueError("ranks is empty: a step needs at least one DP rank")
        counts = {rank.num_micro_batches for rank in self.ranks}
        if len(counts) != 1:
            raise ValueError(f"ranks have unequal micro-batch counts {sorted(counts)}")
        if self.is_ghost != (counts == {0}):
            raise ValueError(
                f"is_ghost={self.is_ghost} but ranks have {counts.pop()} micro-batches each"
            )
        if not (math.isfinite(self.normaliser) and self.normaliser >= 0):
            raise ValueError(f"normaliser must be finite and >= 0, got {self.normaliser!r}")
        if self.rank_costs and len(self.rank_costs) != len(self.ranks):
            raise ValueError(
                f"rank_costs has {len(self.rank_costs)} entries for {len(self.ranks)} ranks"
            )

    @classmethod
    def by_hand(
        cls, groups: Sequence[Sequence[int]], seq_tokens: Sequence[int], normaliser: float
    ) -> OptimizerStepPlan:
        """One rank training every sequence of ``groups`` (one micro-batch each): for tests and
        benchmarks that drive the actor without the planner."""
        micro_batches = tuple(
            MicroBatch(tuple(g), (1.0,) * len(g), sum(seq_tokens[i] for i in g)) for g in groups
        )
        return cls(0, 0, (0,), (RankPlan(micro_batches),), float(normaliser), is_ghost=False)

    @property
    def num_micro_batches_per_rank(self) -> int:
        """Micro-batches each rank runs in this step (0 for a ghost step)."""
        return self.ranks[0].num_micro_batches


@dataclass(frozen=True)
class StepPlan:
    """The whole training step for one rollout batch: every optimizer step, in order."""

    optimizer_steps: tuple[OptimizerStepPlan, ...]
    """In execution order: epoch-major, then mini-batch (or merged run)."""
    approximate: bool
    """True when zero-advantage sequences were pruned although a KL/entropy term was active."""
    reasons: tuple[str, ...]
    """Short human-readable notes on what was pruned, merged, ghosted or padded."""
    num_sequences: int
    """N, sequences in the rollout batch."""
    num_kept_sequences: int
    """Sequences trained each epoch (all of them in ``off``)."""
    num_tokens: int
    """Sum of ``seq_tokens`` over the batch."""
    num_kept_tokens: int
    """Sum of ``seq_tokens`` over the kept sequences."""
    pruning_refused: str | None = None
    """Why this plan could not prune at all (:func:`pruning_refusal`); shown in the summary."""

    def __post_init__(self) -> None:
        if not self.optimizer_steps:
            raise ValueError("optimizer_steps is empty: a plan has at least one step")
        if not 0 <= self.num_kept_sequences <= self.num_sequences:
            raise ValueError(
                f"num_kept_sequences={self.num_kept_sequences} outside [0, {self.num_sequences}]"
            )
        if not 0 <= self.num_kept_tokens <= self.num_tokens:
            raise ValueError(f"num_kept_tokens={self.num_kept_tokens} outside [0, num_tokens]")

    @property
    def num_ghost_steps(self) -> int:
        """Optimizer steps with no micro-batch (over all epochs)."""
        return sum(step.is_ghost for step in self.optimizer_steps)

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches over all ranks and steps."""
        return sum(
            step.num_micro_batches_per_rank * len(step.ranks) for step in self.optimizer_steps
        )

    @property
    def num_filler_seqs(self) -> int:
        """Filler sequences over all ranks and steps."""
        return sum(rank.num_fillers for step in self.optimizer_steps for rank in step.ranks)

    @property
    def dp_imbalance(self) -> float:
        """Estimated wall time over ideal time across DP ranks, >= 1.0.

        Sum over non-ghost steps of the slowest rank's cost (fillers included -- they are real
        work) divided by the sum over those steps of the mean *trained* cost per rank. For one
        step this is ``max / mean``; over several it weighs each step by its cost, which is how
        the steps add up in wall time. 1.0 when there is no non-ghost step.
        """
        slowest = ideal = 0.0
        for step in self.optimizer_steps:
            if not step.is_ghost:
                slowest += max(step.rank_costs, default=0.0)
                ideal += step.trained_cost / len(step.ranks)
        return slowest / ideal if ideal > 0 else 1.0

    @property
    def metrics(self) -> dict[str, float]:
        """Scalars for the experiment logger (token fractions count prompt + response tokens)."""
        return {
            "planner/kept_seq_frac": self.num_kept_sequences / self.num_sequences,
            "planner/kept_token_frac": self.num_kept_tokens / self.num_tokens,
            "planner/dp_imbalance": self.dp_imbalance,
            "planner/num_micro_batches": float(self.num_micro_batches),
            "planner/ghost_steps": float(self.num_ghost_steps),
            "planner/filler_seqs": float(self.num_filler_seqs),
            "planner/optimizer_steps": float(len(self.optimizer_steps)),
        }

    def trained_sequences(self, dp_rank: int) -> tuple[int, ...]:
        """Sequences ``dp_rank`` trains (loss weight 1) anywhere in the plan, in first-use order.

        These are the sequences whose old/reference logprobs that rank needs.
        """
        seen: dict[int, None] = {}
        for step in self.optimizer_steps:
            for mb in step.ranks[dp_rank].micro_batches:
                for index, weight in zip(mb.seq_indices, mb.loss_weights, strict=True):
                    if weight > 0:
                        seen.setdefault(index, None)
        return tuple(seen)

    def sequences_on_rank(self, dp_rank: int) -> tuple[int, ...]:
        """Every sequence ``dp_rank`` runs anywhere in the plan, fillers included, ascending:
        the part of the rollout batch that rank must receive."""
        return tuple(
            sorted(
                {
                    index
                    for step in self.optimizer_steps
                    for mb in step.ranks[dp_rank].micro_batches
                    for index in mb.seq_indices
                }
            )
        )

    def summary(self) -> str:
        """One line, e.g. ``keep 4/16 seq (27% tok) | 2 steps (1 ghost) | 1 mb/rank | imb 1.01``."""
        per_rank = _span(
            {step.num_micro_batches_per_rank for step in self.optimizer_steps if not step.is_ghost}
        )
        approx = " | APPROX" if self.approximate else ""
        refused = f" | no pruning: {self.pruning_refused}" if self.pruning_refused else ""
        return (
            f"keep {self.num_kept_sequences}/{self.num_sequences} seq "
            f"({self.num_kept_tokens / self.num_tokens:.0%} tok) | "
            f"{len(self.optimizer_steps)} steps ({self.num_ghost_steps} ghost) | "
            f"{per_rank} mb/rank | imb {self.dp_imbalance:.2f}{approx}{refused}"
        )


def _span(values: set[int]) -> str:
    """``"2"`` or ``"2-3"`` for the smallest to largest value; ``"0"`` when empty."""
    if not values:
        return "0"
    low, high = min(values), max(values)
    return f"{low}" if low == high else f"{low}-{high}"


@dataclass(frozen=True)
class _BatchArrays:
    """The per-sequence inputs as numpy arrays, plus the derived masks."""

    seq_tokens: np.ndarray
    """int64 copy of ``PlannerInputs.seq_tokens``."""
    response_tokens: np.ndarray
    """int64 copy of ``PlannerInputs.response_tokens``."""
    costs: np.ndarray
    """Estimated cost per sequence (float64)."""
    zero_adv: np.ndarray
    """advantage == 0 (filler candidates; pruned unless mode is off)."""
    kept: np.ndarray
    """Trained sequences: all in ``off``, ``~zero_adv`` otherwise."""
    mini_batch_size: int
    """Sequences per baseline mini-batch, ``N / ppo_mini_batches``."""


def plan_step(inputs: PlannerInputs) -> StepPlan:
    """Decide every optimizer step of one rollout batch (see the module docstring)."""
    approx_reason = check_pruning_config(
        inputs.mode,
        inputs.kl_coef,
        inputs.entropy_coef,
        inputs.allow_approx,
        inputs.adv_estimator,
        inputs.moe_aux_loss_coef,
    )
    batch = _batch_arrays(inputs)
    runs = _optimizer_runs(inputs, batch)
    reasons = _pruning_reasons(inputs, batch, approx_reason, len(runs))
    first_epoch: list[OptimizerStepPlan] = []
    for run_index, run in enumerate(runs):
        step, step_reasons = _plan_run(run_index, run, inputs, batch)
        first_epoch.append(step)
        reasons.extend(step_reasons)
    kept_tokens = int(batch.seq_tokens[batch.kept].sum())
    return StepPlan(
        optimizer_steps=_repeat_for_epochs(first_epoch, inputs.ppo_epochs),
        approximate=approx_reason is not None,
        reasons=tuple(reasons),
        num_sequences=inputs.num_sequences,
        num_kept_sequences=int(batch.kept.sum()),
        num_tokens=int(batch.seq_tokens.sum()),
        num_kept_tokens=kept_tokens,
        pruning_refused=pruning_refusal(inputs.adv_estimator, inputs.moe_aux_loss_coef),
    )


def _batch_arrays(inputs: PlannerInputs) -> _BatchArrays:
    seq_tokens = np.asarray(inputs.seq_tokens, dtype=np.int64)
    zero_adv = np.asarray(inputs.advantages, dtype=np.float64) == 0.0
    return _BatchArrays(
        seq_tokens=seq_tokens,
        response_tokens=np.asarray(inputs.response_tokens, dtype=np.int64),
        costs=sequence_costs(seq_tokens, inputs.attention_cost_coef),
        zero_adv=zero_adv,
        kept=np.ones_like(zero_adv) if inputs.mode == "off" else ~zero_adv,
        mini_batch_size=inputs.num_sequences // inputs.ppo_mini_batches,
    )


def _repeat_for_epochs(
    first_epoch: list[OptimizerStepPlan], num_epochs: int
) -> tuple[OptimizerStepPlan, ...]:
    """Every epoch runs the same steps; only the epoch number differs (rank plans are shared)."""
    return tuple(
        step if epoch == 0 else replace(step, epoch=epoch)
        for epoch in range(num_epochs)
        for step in first_epoch
    )


# ----------------------------------------------------------------------------- optimizer steps


def mini_batch_slices(num_sequences: int, ppo_mini_batches: int) -> tuple[tuple[int, ...], ...]:
    """The baseline mini-batches: contiguous index blocks, so GRPO groups stay together.

    The planner's ``off`` steps cover exactly these; the pass gates read the same slices.
    """
    size = num_sequences // ppo_mini_batches
    return tuple(tuple(range(m * size, (m + 1) * size)) for m in range(ppo_mini_batches))


def plan_forward_micro_batches(
    seq_indices: Sequence[int], seq_tokens: Sequence[int], budget: int
) -> tuple[tuple[int, ...], ...]:
    """Micro-batches of a forward-only (logprob) pass: first-fit-decreasing under ``budget``."""
    bins = first_fit_decreasing([seq_tokens[i] for i in seq_indices], budget)
    return tuple(tuple(seq_indices[p] for p in b) for b in bins)


def _optimizer_runs(inputs: PlannerInputs, batch: _BatchArrays) -> list[tuple[int, ...]]:
    """The baseline mini-batches each optimizer step of one epoch covers."""
    num_mini_batches = inputs.ppo_mini_batches
    if inputs.mode != "fast":
        return [(m,) for m in range(num_mini_batches)]
    kept_seq_tokens = np.where(batch.kept, batch.seq_tokens, 0)
    kept_per_mini_batch = kept_seq_tokens.reshape(num_mini_batches, -1).sum(axis=1)
    return merge_into_runs(
        kept_per_mini_batch.tolist(), int(batch.seq_tokens.sum()), num_mini_batches
    )


def merge_into_runs(
    kept_tokens_per_mini_batch: Sequence[int], total_tokens: int, num_mini_batches: int
) -> list[tuple[int, ...]]:
    """Fewest runs of consecutive mini-batches whose kept tokens fit ``total / num_mini_batches``.

    Greedy next-fit, which is optimal for contiguous runs. A run is only closed by a mini-batch
    with kept tokens and only once it holds some itself, so mini-batches without kept tokens join
    the open run, a single over-full mini-batch is a valid run, and a run without kept tokens
    exists only when the whole batch has none.
    """
    runs: list[tuple[int, ...]] = []
    current: list[int] = []
    current_tokens = 0
    for mini_batch, tokens in enumerate(kept_tokens_per_mini_batch):
        overflows = (current_tokens + tokens) * num_mini_batches > total_tokens
        if current_tokens > 0 and tokens > 0 and overflows:
            runs.append(tuple(current))
            current, current_tokens = [], 0
        current.append(mini_batch)
        current_tokens += tokens
    runs.append(tuple(current))
    return runs


def _plan_run(
    run_index: int, run: tuple[int, ...], inputs: PlannerInputs, batch: _BatchArrays
) -> tuple[OptimizerStepPlan, list[str]]:
    """The epoch-0 plan of one optimizer step covering the baseline mini-batches ``run``."""
    members = np.arange(run[0] * batch.mini_batch_size, (run[-1] + 1) * batch.mini_batch_size)
    trained = members[batch.kept[members]]
    label = _step_label(inputs.mode, run_index, run)
    normaliser = normaliser_of(
        batch.response_tokens[members].tolist(), inputs.loss_agg, inputs.loss_scale_factor
    )
    if len(trained) == 0:
        ghost = OptimizerStepPlan(
            epoch=0,
            mini_batch=run_index,
            source_mini_batches=run,
            ranks=(RankPlan(micro_batches=()),) * inputs.dp_size,
            normaliser=normaliser,
            is_ghost=True,
        )
        return ghost, [f"{label} has no kept sequence: ghost step"]
    ranks, rank_costs, fillers_per_rank = _plan_ranks(members, trained, inputs, batch)
    step = OptimizerStepPlan(
        epoch=0,
        mini_batch=run_index,
        source_mini_batches=run,
        ranks=ranks,
        normaliser=normaliser,
        is_ghost=False,
        rank_costs=rank_costs,
        trained_cost=float(batch.costs[trained].sum()),
    )
    return step, _padding_reasons(label, fillers_per_rank)


def normaliser_of(
    response_tokens: Sequence[int], loss_agg: str, loss_scale_factor: float = 1.0
) -> float:
    """The denominator of one optimizer step's loss over the sequences it covers, unpruned.

    The loss sums ``value * weight`` over every token of every micro-batch of every rank and
    divides by this, which equals the aggregation over the unsplit step:

    * ``token-mean``: the response tokens (weight 1 per token);
    * ``seq-mean-token-sum`` and ``seq-mean-token-mean`` (weight ``1 / own length``): the
      sequences;
    * ``seq-mean-token-sum-norm``: sequences x ``loss_scale_factor``, so the scale of a
      sequence's token sum never depends on how the step was cut into micro-batches.
    """
    if loss_agg not in LOSS_AGG_MODES:
        raise PlannerError(f"loss_agg must be one of {LOSS_AGG_MODES}, got {loss_agg!r}")
    if loss_agg == "token-mean":
        return float(sum(response_tokens))
    if loss_agg == "seq-mean-token-sum-norm":
        return float(len(response_tokens)) * loss_scale_factor
    return float(len(response_tokens))


def _step_label(mode: str, run_index: int, run: tuple[int, ...]) -> str:
    if mode != "fast":
        return f"mini-batch {run_index}"
    return f"merged step {run_index} (mini-batches {run[0]}-{run[-1]})"


# ----------------------------------------------------------------------------- DP ranks


def _plan_ranks(
    members: np.ndarray, trained: np.ndarray, inputs: PlannerInputs, batch: _BatchArrays
) -> tuple[tuple[RankPlan, ...], tuple[float, ...], list[int]]:
    """Balance ``trained`` over ranks, pack micro-batches, equalise their counts with fillers.

    Returns the rank plans, the estimated cost per rank and the number of fillers per rank.
    """
    trained_costs = batch.costs[trained]
    parts = balanced_partition(trained_costs, inputs.dp_size)
    rank_seqs = [trained[part].tolist() for part in parts]
    rank_bins = [
        _pack_micro_batches(seqs, inputs.seq_tokens, inputs.micro_batch_tokens)
        for seqs in rank_seqs
    ]
    num_per_rank = max(len(bins) for bins in rank_bins)
    rank_bins = [_split_to_count(bins, num_per_rank, inputs.seq_tokens) for bins in rank_bins]
    fillers_per_rank = [num_per_rank - len(bins) for bins in rank_bins]
    filler = _filler_index(members, trained, batch) if any(fillers_per_rank) else -1
    ranks = tuple(
        RankPlan(_micro_batches(bins, num_fillers, filler, inputs.seq_tokens))
        for bins, num_fillers in zip(rank_bins, fillers_per_rank, strict=True)
    )
    filler_cost = float(batch.costs[filler]) if filler >= 0 else 0.0
    rank_costs = tuple(
        float(trained_costs[part].sum()) + num_fillers * filler_cost
        for part, num_fillers in zip(parts, fillers_per_rank, strict=True)
    )
    return ranks, rank_costs, fillers_per_rank


def _pack_micro_batches(
    seqs: list[int], seq_tokens: tuple[int, ...], budget: int
) -> list[list[int]]:
    """First-fit-decreasing of one rank's sequences into micro-batches of ``budget`` tokens."""
    bins = first_fit_decreasing(list(map(seq_tokens.__getitem__, seqs)), budget)
    return [[seqs[position] for position in positions] for positions in bins]


def _split_to_count(
    bins: list[list[int]], num_wanted: int, seq_tokens: tuple[int, ...]
) -> list[list[int]]:
    """Split the most crowded micro-batches until there are ``num_wanted`` (or none splits).

    Splitting costs no extra compute, unlike a filler micro-batch.
    """
    bins = list(bins)
    while len(bins) < num_wanted:
        splittable = [b for b, seqs in enumerate(bins) if len(seqs) >= 2]
        if not splittable:
            break
        crowded = max(splittable, key=lambda b: (len(bins[b]), -b))
        bins[crowded : crowded + 1] = split_in_two(bins[crowded], seq_tokens)
    return bins


def _micro_batches(
    bins: list[list[int]], num_fillers: int, filler: int, seq_tokens: tuple[int, ...]
) -> tuple[MicroBatch, ...]:
    trained = [
        MicroBatch(
            seq_indices=tuple(sorted(seqs)),
            loss_weights=(1.0,) * len(seqs),
            num_tokens=sum(map(seq_tokens.__getitem__, seqs)),
        )
        for seqs in bins
    ]
    if num_fillers == 0:
        return tuple(trained)
    padding = MicroBatch(seq_indices=(filler,), loss_weights=(0.0,), num_tokens=seq_tokens[filler])
    return (*trained, *(padding,) * num_fillers)


def _filler_index(members: np.ndarray, trained: np.ndarray, batch: _BatchArrays) -> int:
    """Shortest zero-adv sequence of the step's mini-batches, else of the batch, else trained."""
    for pool in (members, np.arange(len(batch.zero_adv))):
        zero_adv = pool[batch.zero_adv[pool]]
        if len(zero_adv):
            return _shortest(zero_adv, batch.seq_tokens)
    return _shortest(trained, batch.seq_tokens)


def _shortest(ascending_indices: np.ndarray, seq_tokens: np.ndarray) -> int:
    """The index with the fewest tokens; ``argmin`` takes the first, i.e. the lowest index."""
    return int(ascending_indices[np.argmin(seq_tokens[ascending_indices])])


# ----------------------------------------------------------------------------- reasons


def _pruning_reasons(
    inputs: PlannerInputs, batch: _BatchArrays, approx_reason: str | None, num_runs: int
) -> list[str]:
    num_sequences = inputs.num_sequences
    if inputs.mode == "off":
        refusal = pruning_refusal(inputs.adv_estimator, inputs.moe_aux_loss_coef)
        because = f" ({refusal})" if refusal else ""
        return [f"planner off: training all {num_sequences} seqs{because}"]
    _, group_of_seq = np.unique(np.asarray(inputs.group_ids), return_inverse=True)
    nonzero_per_group = np.bincount(group_of_seq, weights=~batch.zero_adv)
    num_all_equal = int((nonzero_per_group == 0).sum())
    reasons = [
        (
            f"pruned {int(batch.zero_adv.sum())}/{num_sequences} zero-adv seqs "
            f"({num_all_equal} of {len(nonzero_per_group)} groups all-equal)"
        )
    ]
    if approx_reason is not None:
        reasons.append(approx_reason)
    if inputs.mode == "fast" and inputs.ppo_mini_batches > 1:
        reasons.append(
            f"fast: merged {inputs.ppo_mini_batches} mini-batches into {num_runs} step(s) per epoch"
        )
    return reasons


def _padding_reasons(label: str, fillers_per_rank: list[int]) -> list[str]:
    padded = [(rank, count) for rank, count in enumerate(fillers_per_rank) if count]
    if not padded:
        return []
    num_fillers = sum(count for _, count in padded)
    noun = "filler" if num_fillers == 1 else "fillers"
    if len(padded) == 1:
        return [f"{label}: rank {padded[0][0]} padded with {num_fillers} {noun}"]
    if len(padded) <= _MAX_RANKS_NAMED:
        names = ", ".join(str(rank) for rank, _ in padded)
        return [f"{label}: ranks {names} padded with {num_fillers} {noun}"]
    return [f"{label}: {len(padded)} ranks padded with {num_fillers} {noun}"]
