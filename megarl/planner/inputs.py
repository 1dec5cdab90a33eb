"""The planner's inputs: one rollout batch and the actor's batching, checked once.

:class:`PlannerInputs` holds everything :func:`~megarl.planner.batch_planner.plan_step` reads,
and refuses, with a :class:`PlannerError` naming the field (and the first offending sequence),
anything that could not give a faithful plan: sizes below 1, a batch that ``ppo_mini_batches``
does not divide, non-finite coefficients, responses longer than their sequences, non-finite
advantages. The planning modules downstream therefore never validate again.
:class:`BatchArrays` is the same batch as numpy arrays with the derived per-sequence facts
(estimated cost, zero advantage, kept), computed once per plan.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from megarl.planner.partition import DEFAULT_ATTENTION_COST_COEF, sequence_costs

PLANNER_MODES: tuple[str, ...] = ("off", "match_loss_curve", "fast")
"""The modes of :mod:`megarl.planner.optimizer_steps` (``PlannerInputs.mode``)."""

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
"""The aggregations the planner normalises; ``megarl.algo.losses.AGG_MODES`` implements them
(kept apart so the planner stays torch-free; a unit test holds the two equal)."""


class PlannerError(ValueError):
    """The planner cannot produce a faithful plan for this configuration or batch."""


@dataclass(frozen=True)
class LossTerms:
    """Which terms the loss has besides the policy gradient: what decides whether leaving a
    zero-advantage sequence out of training is exact (:mod:`megarl.planner.pruning`).

    Built once from the config (``megarl.config.planning.loss_terms``), so the start-up check,
    ``auto``'s choice and every step's plan judge the same terms. The defaults are GRPO's
    plain policy gradient, where pruning is exact.
    """

    kl_coef: float = 0.0
    """``actor.kl_coef``; pruning is exact only when it is 0."""
    entropy_coef: float = 0.0
    """``actor.entropy_coef``; pruning is exact only when it is 0."""
    adv_estimator: str = "grpo"
    """``algo.adv_estimator``; a critic's (``gae``) is never pruned
    (:func:`~megarl.planner.pruning.pruning_refusal`) and its ``advantages`` only rank filler
    candidates."""
    moe_aux_loss_coef: float = 0.0
    """``actor.moe_aux_loss_coef``; > 0 (a router load-balancing loss) is never pruned
    (:func:`~megarl.planner.pruning.pruning_refusal`)."""
    echo_coef: float = 0.0
    """``actor.echo_coef``; > 0 (ECHO trains observation tokens whatever the advantage) is
    never pruned (:func:`~megarl.planner.pruning.pruning_refusal`)."""
    loss_term: str | None = None
    """Why the policy loss itself acts on zero-advantage tokens (e.g. prime_dppo's
    ``(log r)^2`` penalty, :func:`megarl.algo.policy_losses.zero_advantage_term`), None when it
    does not; like a KL/entropy term it makes pruning approximate."""

    def __post_init__(self) -> None:
        for name in ("kl_coef", "entropy_coef", "moe_aux_loss_coef", "echo_coef"):
            if not math.isfinite(getattr(self, name)):
                raise PlannerError(f"{name} must be finite, got {getattr(self, name)!r}")

    @property
    def kl_or_entropy(self) -> bool:
        """A KL or entropy term is on: both act on zero-advantage sequences."""
        return self.kl_coef != 0 or self.entropy_coef != 0


@dataclass(frozen=True)
class PlannerInputs:
    """Everything :func:`~megarl.planner.batch_planner.plan_step` needs about one rollout batch
    and the actor's batching.

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
    """One of :data:`LOSS_AGG_MODES`; decides the normaliser (see
    :func:`~megarl.planner.optimizer_steps.normaliser_of`)."""
    loss_scale_factor: float = 1.0
    """``seq-mean-token-sum-norm``'s constant (``actor.loss_scale_factor``, by default
    ``rollout.max_new_tokens``); the normaliser is sequences x this. Unused by other modes."""
    dp_size: int = 1
    """Number of data-parallel ranks sharing each optimizer step."""
    ppo_mini_batches: int = 1
    """``actor.ppo_mini_batches``: optimizer steps per epoch in the baseline; divides N."""
    ppo_epochs: int = 1
    """``actor.ppo_epochs``: passes over the rollout batch."""
    micro_batch_tokens: int = 16384
    """Token budget of one micro-batch (sum of ``seq_tokens``)."""
    mode: str = "off"
    """``off`` | ``match_loss_curve`` | ``fast`` (see :mod:`megarl.planner.optimizer_steps`)."""
    allow_approx: bool = False
    """Prune even when a loss term makes it inexact; the plan is marked approximate."""
    loss_terms: LossTerms = LossTerms()
    """Which terms the loss has besides the policy gradient: whether pruning is exact."""
    attention_cost_coef: float = DEFAULT_ATTENTION_COST_COEF
    """Cost model ``t + coef * t**2``; ``1 / (12 * hidden)`` fits a transformer, 0 = tokens."""
    micro_batch_multiple: int = 1
    """Every rank's micro-batch count is a multiple of this: ``actor.pp`` under the interleaved
    (virtual pipeline) schedule, which runs micro-batches in groups of one per stage."""

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
        for name in (
            "dp_size",
            "ppo_mini_batches",
            "ppo_epochs",
            "micro_batch_tokens",
            "micro_batch_multiple",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise PlannerError(f"{name} must be a positive int, got {value!r}")
        for name in ("attention_cost_coef", "loss_scale_factor"):
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
class BatchArrays:
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

    @classmethod
    def of(cls, inputs: PlannerInputs) -> BatchArrays:
        """The arrays of ``inputs``; ``kept`` is where the mode's pruning takes effect."""
        seq_tokens = np.asarray(inputs.seq_tokens, dtype=np.int64)
        zero_adv = np.asarray(inputs.advantages, dtype=np.float64) == 0.0
        return cls(
            seq_tokens=seq_tokens,
            response_tokens=np.asarray(inputs.response_tokens, dtype=np.int64),
            costs=sequence_costs(seq_tokens, inputs.attention_cost_coef),
            zero_adv=zero_adv,
            kept=np.ones_like(zero_adv) if inputs.mode == "off" else ~zero_adv,
            mini_batch_size=inputs.num_sequences // inputs.ppo_mini_batches,
        )
