"""M2PO's token mask: a trust region on the second moment of the staleness, fitted once per step.

M2PO (Zheng et al. 2025, "Prosperity before Collapse: How Far Can Off-Policy RL Reach with
Stale Data on LLMs?", arXiv:2510.01161v2, Sec. 5: eq. 4 and Algorithm 1; AReaL's
``m2_threshold``) trains on very stale data by bounding the second moment
``M2 = mean_t (log pi_prox(y_t) - log pi_behav(y_t))^2`` of the
tokens' log importance weights between the *proximal* policy (the trainer's weights the step
starts from: the old log-probs) and the *behaviour* policy that sampled them (the engine's
log-probs, of whatever version). The tokens of largest ``(log pi_prox - log pi_behav)^2`` are
masked, fewest first, until the mean over the remaining ones is below ``m2_threshold`` (the
paper uses 0.04 in every experiment, the default here); the rest train with PPO's clipped
surrogate as usual (``actor.policy_loss=m2po``). The paper's eq. 4 takes the ratio of the
*current* policy to the behaviour one; at the start of a step that is the proximal policy, and
AReaL (whose form this is) fixes it there, which is what lets the mask be fitted once. Unlike a clip
on each token's weight, the budget is shared: a batch of mildly stale tokens keeps all of them,
a few extreme ones are dropped.

Like clip_cov's selection (:mod:`megarl.algo.covariance`) the mask couples every token of the
batch, so it is fitted **once over the global batch before the split** (:func:`fit_rule`,
after the old-logprob pass, from every rank's share) and shipped as one number, the cut on
``(log pi_prox - log pi_behav)^2``; a sequence's masked tokens are then a function of its own
tokens and that cut (:meth:`SecondMomentRule.select`), the same for any DP or micro-batch split.

Where this differs from AReaL's per-micro-batch mask (the first two for exactness):

* the statistic is taken over the tokens of sequences with a non-zero advantage only: a
  zero-advantage token contributes nothing to the gradient whose variance M2 bounds, and
  leaving it out makes the mask (and so the loss) the same whether the planner prunes those
  sequences or not;
* a masked token keeps its place in the planner's normaliser (its loss is 0), as the paper
  averages (its footnote to eq. 5), where AReaL drops it from the token count;
* tokens tied with the largest value kept stay (the cut is shipped as one number): with every
  token equally stale AReaL would keep a single one, here all stay;
* like AReaL, every counted token is subject to the mask; the paper constrains only the tokens
  PPO's clip could act on (``A > 0, r > 1`` or ``A < 0, r < 1``).

At staleness 0 the behaviour policy is the proximal one, every weight is 1 (up to the
engine/trainer mismatch, ~1e-5 here), ``M2 ~ 0`` is below any threshold, nothing is masked and
the loss is the on-policy PPO loss.

Pure torch: no distributed, model or engine imports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SecondMomentRule:
    """The batch-level quantity of M2PO: the cut on a token's squared log weight."""

    cut: float
    """A trained token of a non-zero-advantage sequence is masked when its
    ``(log pi_prox - log pi_behav)^2`` is above this (+inf: nothing is masked). It is the
    largest value kept, so tokens tied with it stay (at least one token always does)."""
    num_masked: int
    """How many tokens of the batch the rule masks."""
    second_moment: float
    """``M2`` over the batch's counted tokens before masking (0 when there are none)."""

    def select(
        self, behaviour_L: Tensor, proximal_L: Tensor, trained_L: Tensor, adv: float
    ) -> Tensor:
        """One sequence's masked tokens (bool, like ``behaviour_L``)."""
        if adv == 0:
            return torch.zeros_like(trained_L, dtype=torch.bool)
        squared_L = squared_log_weight(behaviour_L, proximal_L)
        return trained_L.to(torch.bool) & (squared_L > self.cut)


def squared_log_weight(behaviour_L: Tensor, proximal_L: Tensor) -> Tensor:
    """``(log pi_prox - log pi_behav)^2`` per token, in float64 (the same bits wherever it is
    computed from the same inputs)."""
    return (proximal_L.detach().double() - behaviour_L.detach().double()).square()


def fit_rule(squared: Sequence[Tensor], m2_threshold: float) -> SecondMomentRule:
    """The cut over a whole batch's counted tokens (``squared``: each sequence's
    :func:`squared_log_weight` over its trained tokens, non-zero-advantage sequences only, in
    any order): mask the largest values, fewest first, until the mean of the rest is below
    ``m2_threshold``; at least one token always stays."""
    values = torch.cat([s.reshape(-1).double().cpu() for s in squared]) if squared else None
    if values is None or len(values) == 0:
        return SecondMomentRule(cut=float("inf"), num_masked=0, second_moment=0.0)
    ordered = values.sort(descending=True).values
    n = len(ordered)
    suffix_means = ordered.flip(0).cumsum(0).flip(0) / torch.arange(n, 0, -1, dtype=torch.float64)
    below = (suffix_means < m2_threshold).nonzero().flatten()
    num_masked = int(below[0]) if len(below) else n - 1
    cut = float("inf") if num_masked == 0 else float(ordered[num_masked])
    masked = int((values > cut).sum())
    return SecondMomentRule(cut=cut, num_masked=masked, second_moment=float(values.mean()))
