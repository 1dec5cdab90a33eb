"""KL to the reference policy folded into the reward (verl's ``algo.use_kl_in_reward``).

Two ways keep a policy near its reference: a KL *loss* term (``actor.kl_coef``, added to the
policy loss and differentiated) and a KL *penalty in the reward* (this module), which changes
what the advantage estimator sees and adds no loss term.  As in verl's ``apply_kl_penalty``
and Ziegler et al. (2019), the token-level reward is the sequence's outcome reward on its last
response token minus ``beta * kl_t`` on every response token, with ``kl_t`` an estimate of
``KL(old policy || reference)`` at token ``t`` from the sampled tokens' log-probs (the
estimators of :func:`megarl.algo.losses.kl_penalty`).  The outcome estimators here read one
score per sequence, the sum of those token rewards: ``reward - beta * sum_t kl_t`` (verl's
GRPO, RLOO and REINFORCE++-baseline sum the same way; its REINFORCE++ takes a return-to-go per
token, which megarl's per-sequence advantages do not have).

When the actor still equals the reference (step 1, recomputed old logprobs) at ``actor.tp=1``
every ``kl_t`` is exactly 0, the scores are the rewards bit for bit, and a group whose rewards
are all equal keeps its exactly-zero advantage, so zero-advantage pruning still applies there.
At ``actor.tp > 1`` the actor and the separately built reference reduce across TP ranks in
orders that differ in the last bits (measured: a step-1 ``critic/kl`` of ~6e-8), so such a group
already gets a tiny signal and is trained.  Later, any KL difference within a group gives it a
(small) signal, and it is trained.

``beta`` comes from a controller: fixed, or verl's adaptive (proportional) controller, which
moves ``beta`` so that the observed mean KL tracks a target.  Its one number of state is saved
in the training checkpoint so that a resumed run uses the same ``beta`` as an unbroken one.

Pure tensor code on ``[B, T]`` response tensors with a mask, like :mod:`megarl.algo.losses`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megarl.algo.losses import kl_penalty

KL_CTRL_TYPES: tuple[str, ...] = ("fixed", "adaptive")
"""``algo.kl_ctrl.type``: verl's two controllers."""

ADAPTIVE_KL_ERROR_CLIP = 0.2
"""Bound on the adaptive controller's proportional error (Ziegler et al., verl): one step moves
``beta`` by at most ``0.2 * n_steps / horizon`` of itself."""


def token_kl(old_logp_BT: Tensor, ref_logp_BT: Tensor, mask_BT: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate ``kl_t`` (``kind`` one of ``KL_PENALTY_KINDS``), 0 off the mask, so
    padding never enters a sum."""
    kl_BT = kl_penalty(old_logp_BT, ref_logp_BT, kind)
    return kl_BT * mask_BT.to(kl_BT.dtype)


def last_token_index(mask_BT: Tensor) -> Tensor:
    """Index of each row's last response token; 0 for an empty row, which then keeps its
    reward there, so its score is still the reward (it has no token to train anyway)."""
    positions_BT = torch.arange(mask_BT.shape[1], device=mask_BT.device).expand_as(mask_BT)
    return torch.where(mask_BT != 0, positions_BT, torch.zeros_like(positions_BT)).amax(dim=1)


def penalised_token_rewards(
    rewards_B: Tensor, kl_BT: Tensor, mask_BT: Tensor, beta: float
) -> Tensor:
    """verl's ``token_level_rewards``: the outcome reward on the last response token, minus
    ``beta * kl_t`` on every response token (``kl_BT`` already masked, see :func:`token_kl`,
    so padding gets nothing but an empty row's reward)."""
    scores_BT = torch.zeros_like(kl_BT)
    scores_BT[torch.arange(kl_BT.shape[0]), last_token_index(mask_BT)] = rewards_B.to(kl_BT.dtype)
    return scores_BT - beta * kl_BT


def sequence_scores(token_rewards_BT: Tensor) -> Tensor:
    """The outcome estimators' input: each row's token rewards summed (verl's ``scores``)."""
    return token_rewards_BT.sum(dim=-1)


def mean_sequence_kl(kl_BT: Tensor, mask_BT: Tensor) -> float:
    """verl's ``current_kl`` (``critic/kl``): each sequence's token-mean KL, averaged over
    sequences; what the adaptive controller tracks."""
    num_tokens_B = (mask_BT != 0).sum(dim=-1).clamp_min(1)
    per_seq_B = kl_BT.double().sum(dim=-1) / num_tokens_B
    return float(per_seq_B.mean()) if per_seq_B.numel() else 0.0


@dataclass(frozen=True)
class KLPenaltyResult:
    """One step's KL in the reward."""

    scores_B: Tensor
    """What the advantage estimator reads: ``reward - beta * sum_t kl_t`` per sequence."""
    token_rewards_BT: Tensor
    """verl's ``token_level_rewards``."""
    current_kl: float
    """``critic/kl``: mean over sequences of each one's token-mean KL."""
    beta: float
    """``critic/kl_coef``: the coefficient these rewards used (before the controller's update)."""


@dataclass
class FixedKLController:
    """``algo.kl_ctrl.type=fixed``: ``beta`` never changes."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt; the signature matches :class:`AdaptiveKLController`."""
        del current_kl, n_steps

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


@dataclass
class AdaptiveKLController:
    """``algo.kl_ctrl.type=adaptive``: the proportional controller of Ziegler et al. (2019),
    as verl runs it.  After each step,
    ``e = clip(current_kl / target_kl - 1, -0.2, 0.2)`` and ``beta *= 1 + e * n_steps / horizon``
    with ``n_steps`` the step's number of sequences: too much KL raises ``beta``, too little
    lowers it, by at most 20 % of ``n_steps / horizon`` per step.  ``value`` is mutable state
    (checkpointed); the step's rewards use it *before* the update, as verl does."""

    value: float
    target_kl: float
    horizon: int

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(
            max(current_kl / self.target_kl - 1, -ADAPTIVE_KL_ERROR_CLIP), ADAPTIVE_KL_ERROR_CLIP
        )
        self.value *= 1 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


KLController = FixedKLController | AdaptiveKLController


def build_kl_controller(kind: str, kl_coef: float, target_kl: float, horizon: int) -> KLController:
    """The controller ``algo.kl_ctrl`` names (its fields validated by the config already)."""
    if kind == "fixed":
        return FixedKLController(value=kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(value=kl_coef, target_kl=target_kl, horizon=horizon)
    raise ValueError(f"unknown KL controller {kind!r}; valid types: {', '.join(KL_CTRL_TYPES)}")


def apply_kl_penalty(
    rewards_B: Tensor,
    old_logp_BT: Tensor,
    ref_logp_BT: Tensor,
    mask_BT: Tensor,
    kind: str,
    controller: KLController,
) -> KLPenaltyResult:
    """Penalise one step's rewards with the controller's current ``beta``, then update the
    controller from the observed KL with ``n_steps`` = the number of sequences (as verl)."""
    kl_BT = token_kl(old_logp_BT.double(), ref_logp_BT.double(), mask_BT, kind)
    beta = controller.value
    token_rewards_BT = penalised_token_rewards(rewards_B.double(), kl_BT, mask_BT, beta)
    current_kl = mean_sequence_kl(kl_BT, mask_BT)
    controller.update(current_kl, n_steps=int(rewards_B.shape[0]))
    return KLPenaltyResult(
        scores_B=sequence_scores(token_rewards_BT).to(rewards_B.dtype),
        token_rewards_BT=token_rewards_BT,
        current_kl=current_kl,
        beta=beta,
    )
