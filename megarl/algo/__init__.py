"""RL algorithm math (advantages, losses): pure tensor code, no distributed or model imports."""

from megarl.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    get_advantage_estimator,
    group_relative_advantages,
    zero_advantage_mask,
)
from megarl.algo.losses import (
    AGG_MODES,
    KL_PENALTY_KINDS,
    PolicyLossOutput,
    aggregate,
    entropy_from_logits,
    kl_penalty,
    policy_loss,
    token_logprobs_from_logits,
)
from megarl.algo.policy_losses import POLICY_LOSS_NAMES, POLICY_LOSSES, get_policy_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "KL_PENALTY_KINDS",
    "POLICY_LOSSES",
    "POLICY_LOSS_NAMES",
    "PolicyLossOutput",
    "aggregate",
    "entropy_from_logits",
    "get_advantage_estimator",
    "get_policy_loss",
    "group_relative_advantages",
    "kl_penalty",
    "policy_loss",
    "token_logprobs_from_logits",
    "zero_advantage_mask",
]
