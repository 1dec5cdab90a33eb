"""The ``algo`` section (verl's ``algorithm``): the advantage estimator and what shapes the
advantages, with its subsections ``algo.kl_ctrl`` (the KL penalty in the reward),
``algo.rollout_correction`` (the engine's and the trainer's policies reconciled),
``algo.filter_groups`` (DAPO's dynamic sampling) and ``algo.distill`` (on-policy distillation).

``algo.rollout_correction.rollout_is=auto`` depends on ``async_training``; it is resolved by
:class:`megarl.config.schema.RunConfig`, which sees both sections.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megarl.algo.advantages import ADVANTAGE_ESTIMATOR_NAMES, resolve_estimator_name
from megarl.algo.dapo import FILTER_GROUP_METRICS
from megarl.algo.kl_reward import KL_CTRL_TYPES
from megarl.algo.length_penalty import LENGTH_PENALTY_TYPES, LengthWeights
from megarl.algo.losses import KL_PENALTY_KINDS
from megarl.algo.rollout_correction import (
    DEFAULT_IS_THRESHOLD,
    ROLLOUT_IS_LEVELS,
    ROLLOUT_RS_LEVELS,
    CorrectionSettings,
)
from megarl.config.checks import (
    _choice,
    _optional_choice,
    _optional_number,
    _positive,
    _require,
)
from megarl.planner.pruning import CRITIC_ESTIMATORS

AUTO = "auto"
"""A key's value that the run's config resolves from other keys."""


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """``algo.rollout_correction``: correct the policy loss for the engine's sampling policy
    differing from the trainer's (:mod:`megarl.algo.rollout_correction`); verl's keys. All off
    by default; the ``rollout_corr/*`` mismatch metrics are reported either way."""

    rollout_is: str | None = "auto"
    """token | sequence | null | auto: truncated importance-sampling weight ``min(pi_old /
    pi_rollout, rollout_is_threshold)`` per token, or with the response's product of ratios.
    auto (the default) = null in synchronous training, token (verl's default) where
    ``async_training`` lets tokens be stale: there ``pi_old`` is the proximal policy (the
    trainer's weights before the step) and ``pi_rollout`` each token's behaviour policy, which
    makes the loss AReaL's decoupled PPO. Resolved when the run's config is built."""
    rollout_is_threshold: float = DEFAULT_IS_THRESHOLD
    """Truncation of the IS weight (verl's default 2.0)."""
    rollout_rs: str | None = None
    """token | sequence | geometric | null: reject (weight 0) a token, or a response by the
    product or geometric mean of its ratios, outside the bounds below."""
    rollout_rs_threshold: float | None = None
    """Upper rejection bound, >= 1; null = ``rollout_is_threshold`` (as verl)."""
    rollout_rs_threshold_lower: float | None = None
    """Lower rejection bound, in [0, 1]; null = ``1 / rollout_rs_threshold`` (as verl)."""
    rollout_token_veto_threshold: float | None = None
    """In (0, 1), or null (off, verl's default): a response in which any token's ratio
    ``pi_old / pi_rollout`` is below this gets weight 0 on every token, whatever
    ``rollout_is`` / ``rollout_rs`` say (verl suggests 1e-4 to 1e-6: a catastrophic outlier, not
    noise). At 1 or above it would drop nearly every response, so it is refused."""
    bypass_mode: bool = False
    """verl's key: the behaviour (engine) logprobs stand in as the old ones, so the PPO ratio
    is taken against the policy that sampled each token and no proximal forward runs: cheaper,
    and an approximation of decoupled PPO (its trust region is around stale policies). The same
    as ``planner.old_log_prob=rollout``; rollout_is / rollout_rs then have nothing to compare
    and are refused."""

    def __post_init__(self) -> None:
        key = "algo.rollout_correction"
        _optional_choice(f"{key}.rollout_is", self.rollout_is, (*ROLLOUT_IS_LEVELS, AUTO))
        _optional_choice(f"{key}.rollout_rs", self.rollout_rs, ROLLOUT_RS_LEVELS)
        _positive(f"{key}.rollout_is_threshold", self.rollout_is_threshold)
        _optional_number(f"{key}.rollout_rs_threshold", self.rollout_rs_threshold)
        _optional_number(f"{key}.rollout_rs_threshold_lower", self.rollout_rs_threshold_lower)
        veto = self.rollout_token_veto_threshold
        _optional_number(f"{key}.rollout_token_veto_threshold", veto)
        _require(
            veto is None or 0 < veto < 1,
            f"{key}.rollout_token_veto_threshold={veto!r}: must be in (0, 1), or null (off): a "
            "response with a token whose ratio pi_old / pi_rollout is below it is dropped",
        )
        if self.rollout_rs is None:
            return  # the bounds are unused
        upper, lower = self.rs_bounds
        _require(
            upper >= 1,
            f"{key}.rollout_rs_threshold={self.rollout_rs_threshold!r}: the upper rejection bound "
            f"({upper:g}) must be >= 1",
        )
        _require(
            0 <= lower <= 1 and lower < upper,
            f"{key}.rollout_rs_threshold_lower={self.rollout_rs_threshold_lower!r}: the lower "
            f"rejection bound ({lower:g}) must be in [0, 1] and below the upper ({upper:g})",
        )

    @property
    def enabled(self) -> bool:
        """Whether the loss changes (then the old log-probs must be the trainer's own)."""
        return self.settings.enabled

    @property
    def corrects(self) -> bool:
        """Whether the loss reweights (IS) or rejects (RS) tokens by ``pi_old / pi_rollout``:
        what makes stale tokens' gradient right (the veto alone only drops outliers)."""
        return self.settings.rollout_is is not None or self.rollout_rs is not None

    def resolved(self, stale: bool, bypass: bool) -> RolloutCorrectionConfig:
        """``rollout_is=auto`` made concrete: token where tokens may be ``stale`` and the old
        logprobs are the trainer's (the proximal policy), else null; ``bypass``: the behaviour
        logprobs are the old ones (``bypass_mode``, or ``planner.old_log_prob=rollout``)."""
        if self.rollout_is != AUTO:
            return self
        rollout_is = "token" if stale and not bypass else None
        return dataclasses.replace(self, rollout_is=rollout_is)

    @property
    def rs_bounds(self) -> tuple[float, float]:
        """(upper, lower) rejection bounds, nulls resolved as verl resolves them."""
        upper = self.rollout_rs_threshold
        upper = float(self.rollout_is_threshold if upper is None else upper)
        lower = self.rollout_rs_threshold_lower
        if lower is None:
            lower = 1 / upper if upper > 0 else 0.0
        return upper, float(lower)

    @property
    def settings(self) -> CorrectionSettings:
        """What :mod:`megarl.algo.rollout_correction` computes with."""
        upper, lower = self.rs_bounds
        return CorrectionSettings(
            rollout_is=None if self.rollout_is == AUTO else self.rollout_is,
            is_threshold=float(self.rollout_is_threshold),
            rollout_rs=self.rollout_rs,
            rs_upper=upper,
            rs_lower=lower,
            veto_threshold=(
                None
                if self.rollout_token_veto_threshold is None
                else float(self.rollout_token_veto_threshold)
            ),
        )


@dataclass(frozen=True)
class KLCtrlConfig:
    """``algo.kl_ctrl``: the coefficient ``beta`` of the KL penalty in the reward (verl's keys
    and defaults); read only with ``algo.use_kl_in_reward=true``."""

    type: str = "fixed"
    """fixed (``beta = kl_coef`` throughout) | adaptive (Ziegler et al.'s proportional
    controller, see :class:`megarl.algo.kl_reward.AdaptiveKLController`)."""
    kl_coef: float = 0.001
    """The (initial) ``beta``."""
    target_kl: float = 0.1
    """adaptive: the mean per-token KL (``critic/kl``) that ``beta`` steers toward."""
    horizon: int = 10000
    """adaptive: sequences over which a 20 % error changes ``beta`` by 20 %."""

    def __post_init__(self) -> None:
        _choice("algo.kl_ctrl.type", self.type, KL_CTRL_TYPES)
        _require(self.kl_coef >= 0, f"algo.kl_ctrl.kl_coef={self.kl_coef}: must be >= 0")
        _positive("algo.kl_ctrl.target_kl", self.target_kl)
        _positive("algo.kl_ctrl.horizon", self.horizon)


@dataclass(frozen=True)
class FilterGroupsConfig:
    """DAPO's dynamic sampling (verl's ``algorithm.filter_groups``): see
    :mod:`megarl.algo.dapo`."""

    enable: bool = False
    """Drop the groups whose ``metric`` is the same for every response and generate more
    prompts until the step is full."""
    metric: str = "score"
    """One of :data:`megarl.algo.dapo.FILTER_GROUP_METRICS`."""
    max_num_gen_batches: int = 10
    """Generation batches of ``data.prompts_per_step`` prompts a step may use to fill itself
    with groups whose scores differ; then the run stops with one line. 0 = no limit."""

    def __post_init__(self) -> None:
        _choice("algo.filter_groups.metric", self.metric, FILTER_GROUP_METRICS)
        _require(
            self.max_num_gen_batches >= 0,
            f"algo.filter_groups.max_num_gen_batches={self.max_num_gen_batches}: must be >= 0 "
            "(0 = no limit)",
        )


@dataclass(frozen=True)
class DistillConfig:
    """``algo.distill``: on-policy distillation (:mod:`megarl.algo.distill`). With a teacher,
    each sampled token's advantage is minus its reverse-KL estimate ``log pi_s - log pi_t``
    plus ``reward_coef`` times its sequence's outcome advantage."""

    teacher_path: str | None = None
    """The teacher: a Hugging Face folder, or a megarl run folder (its newest checkpoint) or
    checkpoint, as ``model.path`` takes; it must share the model's tokenizer (checked at
    start-up). null (default): no distillation. The teacher is a frozen Megatron model with
    the actor's TP/PP, run on every sequence before the advantages."""
    reward_coef: float = 1.0
    """The weight of the task reward's advantage added to the distillation advantage, >= 0;
    0 = pure distillation (``recipe=opd``)."""

    def __post_init__(self) -> None:
        _require(
            self.teacher_path is None
            or (isinstance(self.teacher_path, str) and self.teacher_path != ""),
            f"algo.distill.teacher_path={self.teacher_path!r}: a folder, or null (no teacher)",
        )
        _require(
            self.reward_coef >= 0, f"algo.distill.reward_coef={self.reward_coef}: must be >= 0"
        )

    @property
    def enabled(self) -> bool:
        """A teacher is set: the advantages are distillation advantages."""
        return self.teacher_path is not None


@dataclass(frozen=True)
class LengthPenaltyConfig:
    """``algo.length_penalty``: prime-rl's linear length penalty, subtracted from each reward
    before the advantages (:mod:`megarl.algo.length_penalty`): the group's pass rate times a
    weighted sum of the response's output tokens, input (context) tokens and turns, each as a
    fraction of its group's largest. Off by default."""

    type: str | None = None
    """null (off) | linear."""
    num_output_tokens_weight: float = 0.25
    """prime-rl's key and default: the weight of the generated tokens' fraction of the group's
    most; 0 = no such term."""
    num_input_tokens_weight: float = 0.1
    """prime-rl's key and default: the weight of the context tokens the model read but did not
    generate (prompt, tool observations), as a fraction of the group's most; 0 = no such term."""
    num_turns_weight: float = 0.1
    """prime-rl's key and default: the weight of the generated turns (1 for a single-turn
    response) as a fraction of the group's most; 0 = no such term."""

    def __post_init__(self) -> None:
        _optional_choice("algo.length_penalty.type", self.type, LENGTH_PENALTY_TYPES)
        for name in ("num_output_tokens_weight", "num_input_tokens_weight", "num_turns_weight"):
            value = getattr(self, name)
            _require(value >= 0, f"algo.length_penalty.{name}={value}: must be >= 0")

    @property
    def weights(self) -> LengthWeights | None:
        """The penalty's weights; None when it is off."""
        if self.type is None:
            return None
        return LengthWeights(
            float(self.num_output_tokens_weight),
            float(self.num_input_tokens_weight),
            float(self.num_turns_weight),
        )


OBJECTIVES: tuple[str, ...] = ("rl", "sft")
"""The values of ``algo.objective``."""


@dataclass(frozen=True)
class AlgoConfig:
    """``algo``: the advantage estimator and what shapes the advantages (verl's ``algorithm``
    keys)."""

    adv_estimator: str = "grpo"
    """One of :data:`megarl.algo.advantages.ADVANTAGE_ESTIMATOR_NAMES` (verl's names and
    math), or gae: PPO, which builds and trains a critic (``critic.*``)."""
    norm_adv_by_std_in_grpo: bool = True
    """verl's key: false makes grpo divide by nothing, i.e. grpo_no_std; other estimators
    ignore it. :attr:`estimator` names the estimator that runs."""
    use_kl_in_reward: bool = False
    """verl's key: subtract ``beta * KL(old || ref)`` per token from the reward before the
    advantages (:mod:`megarl.algo.kl_reward`); runs the reference and old-logprob forwards on
    every sequence first. Independent of the KL *loss* ``actor.kl_coef``."""
    kl_penalty: str = "k1"
    """verl's key: the estimator of the reward's KL, one of
    :data:`megarl.algo.losses.KL_PENALTY_KINDS`; the default ``k1`` is what verl's default
    ``kl`` computes (``logp - ref_logp``)."""
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Truncated IS and rejection between the engine's and the trainer's log-probs."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation from a teacher model (off by default)."""
    length_penalty: LengthPenaltyConfig = field(default_factory=LengthPenaltyConfig)
    """prime-rl's linear length penalty on the rewards (off by default)."""
    gamma: float = 1.0
    """verl's key: GAE's discount (``adv_estimator=gae`` only), in [0, 1]; 1 for outcome
    rewards."""
    lam: float = 1.0
    """verl's key: GAE's lambda (``adv_estimator=gae`` only), in [0, 1]: 0 = one-step TD
    error, 1 = Monte-Carlo return minus the critic's value."""
    objective: str = "rl"
    """rl: rollouts, rewards, advantages | sft: supervised fine-tuning on a dataset's assistant
    turns (``recipe=sft``, :mod:`megarl.sft`): no rollout engine, every assistant token trains
    with ``actor.policy_loss=sft`` (the token-mean negative log-likelihood)."""

    def __post_init__(self) -> None:
        _choice("algo.objective", self.objective, OBJECTIVES)
        _choice(
            "algo.adv_estimator",
            self.adv_estimator,
            (*ADVANTAGE_ESTIMATOR_NAMES, *CRITIC_ESTIMATORS),
        )
        _require(0 <= self.gamma <= 1, f"algo.gamma={self.gamma}: must be in [0, 1]")
        _require(0 <= self.lam <= 1, f"algo.lam={self.lam}: must be in [0, 1]")
        _choice("algo.kl_penalty", self.kl_penalty, KL_PENALTY_KINDS)
        _require(
            isinstance(self.norm_adv_by_std_in_grpo, bool),
            f"algo.norm_adv_by_std_in_grpo={self.norm_adv_by_std_in_grpo!r}: "
            "expected true or false",
        )

    @property
    def estimator(self) -> str:
        """The estimator that runs (``grpo`` without std normalisation is ``grpo_no_std``)."""
        return resolve_estimator_name(self.adv_estimator, self.norm_adv_by_std_in_grpo)

    @property
    def is_sft(self) -> bool:
        """Supervised fine-tuning: batches from a dataset, no rollout engine."""
        return self.objective == "sft"

    @property
    def uses_critic(self) -> bool:
        """``gae``: the advantages come from a learned critic, which the run then builds."""
        return self.adv_estimator in CRITIC_ESTIMATORS
