"""What a policy loss needs beyond the common arguments in the tests that run every registered
loss (the two rules, split == unsplit == pruned, the rollout correction's exactness)."""

from __future__ import annotations

import torch

from megarl.algo import m2po
from megarl.algo.covariance import CovarianceSettings, fit_rule
from megarl.algo.policy_losses import COVARIANCE_LOSSES

# Selection keys that select several tokens of the small test batches (the defaults pick one).
TEST_COV = CovarianceSettings(
    clip_cov_ratio=0.25, clip_cov_lb=-10.0, clip_cov_ub=10.0, kl_cov_ratio=0.25
)


def loss_extras(
    name: str,
    engine_logp_BT: torch.Tensor,
    adv_B: torch.Tensor,
    mask_BT: torch.Tensor,
    rows: list[int] | None = None,
) -> dict:
    """What a loss needs beyond the common arguments, for the batch rows ``rows`` (all if None):
    clip_cov / kl_cov / m2po their tokens, chosen by a rule fitted once over the *whole* batch
    (``engine_logp_BT`` stands in for the engine's log-probs; m2po's behaviour log-probs are
    those moved by a fixed staleness) and applied row by row; prime_dppo ``kl_tau=0``, without
    which its penalty breaks the zero-advantage rule (tested apart)."""
    if name == "prime_dppo":
        return {"loss_keys": {"kl_tau": 0.0}}
    rows = list(range(len(adv_B))) if rows is None else rows
    if name == "m2po":
        staleness = 0.4 * torch.sin(torch.arange(engine_logp_BT.numel(), dtype=torch.float64))
        behaviour_BT = engine_logp_BT + staleness.reshape(engine_logp_BT.shape)
        trained = [row != 0 for row in mask_BT]
        squared = [
            m2po.squared_log_weight(behaviour_BT[b], engine_logp_BT[b])[trained[b]]
            for b in range(len(adv_B))
            if adv_B[b] != 0
        ]
        rule = m2po.fit_rule(squared, 0.02)
        chosen = [
            rule.select(behaviour_BT[b], engine_logp_BT[b], trained[b], float(adv_B[b]))
            for b in rows
        ]
        return {"selected_BT": torch.stack(chosen)}
    if name not in COVARIANCE_LOSSES:
        return {}
    trained = [row != 0 for row in mask_BT]
    rule = fit_rule(name, list(engine_logp_BT), trained, adv_B.tolist(), TEST_COV, seed=5)
    selected = [rule.select(b, engine_logp_BT[b], trained[b], float(adv_B[b])) for b in rows]
    return {"selected_BT": torch.stack(selected)}
