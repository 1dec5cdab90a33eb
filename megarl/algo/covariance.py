"""Clip-Cov and KL-Cov's token selection, decided once over the whole batch.

Both losses of Cui et al. 2025 (The Entropy Mechanism of RL for Reasoning LMs,
arXiv:2505.22617v1, Sec. 4, eqs. 10-14) act on the tokens whose *centred covariance* between
log-prob and advantage is high, ``cov_t = (A_t - mean A) * (log pi(y_t) - mean log pi)``, the
means taken over every trained token of the batch:

* **clip_cov** detaches ``max(1, int(clip_cov_ratio * N))`` tokens drawn at random among those
  with ``clip_cov_lb < cov_t < clip_cov_ub``;
* **kl_cov** adds ``ppo_kl_coef * |log r|`` to the ``max(1, int(kl_cov_ratio * N))`` tokens of
  largest covariance.

The means, the count ``N`` and the ranking couple every token of the batch to every other, so a
selection made per micro-batch or per data-parallel rank (as peers compute it, inside the loss)
changes with how the batch is cut, and pruning zero-advantage sequences would change ``N`` and
the means. Here the coupling is computed **once, over the unpruned global batch, before the
split**, as a handful of numbers (:class:`CovarianceRule`: the two means, the covariance
threshold, the random-key threshold and the seed); a sequence's selected tokens are then a
function of its own tokens and that rule alone (:meth:`CovarianceRule.select`), so every
micro-batch and every rank reproduces exactly the tokens the whole batch would, and a pruned
sequence changes nothing.

Which log-probs. The papers (and verl) take the *current* policy's log-probs inside the loss.
At the start of a step those equal the log-probs of the weights that generated the batch; the
rule uses the rollout engine's log-probs of the sampled tokens, which every rank already holds
for its sequences and rank 0 for the whole batch, so no extra forward and no gather is needed.
They differ from the trainer's by the engine/trainer mismatch (``rollout/logprob_abs_diff``,
~1e-5 in fp32 here), and the selection is fixed for the whole step (verl re-selects in every
micro-batch from the moving policy). Stale sequences (asynchronous training) use the
behaviour policy's log-probs they were sampled with. verl also leaves out of clip_cov's
candidates the tokens PPO's clip already holds; at the start of a step every ratio is 1 and
none is clipped, so the rule has nothing to leave out (later in the step a selected token that
PPO clips has no gradient either way).

Random keys (clip_cov). Each trained token gets a key in [0, 1) from a generator seeded by
(step seed, sequence index), drawn in the order of the sequence's trained tokens; the rule keeps
the ``k``-th smallest key among the candidates, so the selected set is a uniformly random
``k``-subset of them (what verl's ``randperm`` gives) and any rank recomputes its own tokens'
keys. Zero-advantage tokens: kl_cov never selects one (its penalty would be the only loss such a
token has, which would make pruning inexact); clip_cov may (detaching a zero loss changes
nothing).

Pure torch: no distributed, model or engine imports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

COVARIANCE_KINDS: tuple[str, ...] = ("clip_cov", "kl_cov")


@dataclass(frozen=True)
class CovarianceSettings:
    """The selection keys (verl's names and defaults under ``actor.``)."""

    clip_cov_ratio: float = 0.0002
    """Fraction of the batch's trained tokens clip_cov detaches."""
    clip_cov_lb: float = 1.0
    """clip_cov's candidates have a covariance above this ..."""
    clip_cov_ub: float = 5.0
    """... and below this."""
    kl_cov_ratio: float = 0.0002
    """Fraction of the batch's trained tokens (those of largest covariance) kl_cov penalises."""


@dataclass(frozen=True)
class CovarianceRule:
    """The batch-level quantity every row shares: computed once by :func:`fit_rule` over the
    whole batch, it decides each sequence's selected tokens from that sequence alone."""

    kind: str
    """``clip_cov`` or ``kl_cov``."""
    mean_logp: float
    """Mean log-prob over the batch's trained tokens."""
    mean_adv: float
    """Mean advantage over the batch's trained tokens."""
    cov_low: float
    """A selected token's covariance is above this (clip_cov: ``clip_cov_lb``, exclusive;
    kl_cov: the ``k``-th largest covariance, inclusive)."""
    cov_high: float
    """... and below this (clip_cov: ``clip_cov_ub``; kl_cov: +inf)."""
    key_threshold: float
    """clip_cov: a candidate is selected when its random key is at most this (+inf: every
    candidate); kl_cov: +inf."""
    seed: int
    """Seeds the random keys with each sequence's index."""
    num_selected: int
    """How many tokens of the batch the rule selects (``actor/cov_selected`` counts them)."""

    def covariance(self, logp_L: Tensor, adv: float) -> Tensor:
        """The centred covariance of one sequence's tokens, in float64 (the same bits on every
        rank, and in :func:`fit_rule`, for the same inputs)."""
        return (float(adv) - self.mean_adv) * (logp_L.detach().double() - self.mean_logp)

    def select(self, index: int, logp_L: Tensor, trained_L: Tensor, adv: float) -> Tensor:
        """Sequence ``index``'s selected tokens (bool, like ``logp_L``): its engine log-probs
        ``logp_L`` of the response, its trained tokens ``trained_L`` (bool) and its advantage."""
        trained_L = trained_L.to(torch.bool)
        cov_L = self.covariance(logp_L, adv)
        if self.kind == "kl_cov":
            picked_L = trained_L & (cov_L >= self.cov_low)
            return picked_L & (adv != 0)
        candidate_L = trained_L & (cov_L > self.cov_low) & (cov_L < self.cov_high)
        keys_L = token_keys(self.seed, index, trained_L)
        return candidate_L & (keys_L <= self.key_threshold)


def token_keys(seed: int, index: int, trained_L: Tensor) -> Tensor:
    """Uniform keys in [0, 1) for sequence ``index``'s trained tokens (in order; +inf
    elsewhere), from a generator seeded by ``(seed, index)``: the same on every rank."""
    trained_L = trained_L.to(torch.bool)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    drawn = torch.rand(int(trained_L.sum()), generator=generator, dtype=torch.float64)
    keys_L = torch.full(trained_L.shape, float("inf"), dtype=torch.float64)
    keys_L[trained_L.cpu()] = drawn
    return keys_L.to(trained_L.device)


def fit_rule(
    kind: str,
    logps: Sequence[Tensor],
    trained: Sequence[Tensor],
    advantages: Sequence[float],
    settings: CovarianceSettings,
    seed: int,
) -> CovarianceRule:
    """The rule of ``kind`` over a whole batch, in the batch's order (the list position is the
    sequence index that seeds its keys): sequence ``i`` has engine log-probs
    ``logps[i]`` of its response, trained tokens ``trained[i]`` (bool) and advantage
    ``advantages[i]``; every sequence of the step, zero-advantage ones included."""
    if kind not in COVARIANCE_KINDS:
        raise ValueError(f"unknown covariance rule {kind!r}; valid: {', '.join(COVARIANCE_KINDS)}")
    masks = [t.to(torch.bool).cpu() for t in trained]
    values = [lp.detach().double().cpu()[m] for lp, m in zip(logps, masks, strict=True)]
    counts = [len(v) for v in values]
    num_tokens = sum(counts)
    if num_tokens == 0:
        return CovarianceRule(kind, 0.0, 0.0, float("inf"), float("inf"), float("inf"), seed, 0)
    mean_logp = float(torch.cat(values).sum() / num_tokens)
    mean_adv = float(
        sum(float(a) * n for a, n in zip(advantages, counts, strict=True)) / num_tokens
    )
    rule = CovarianceRule(kind, mean_logp, mean_adv, 0.0, 0.0, float("inf"), seed, 0)
    covs = [rule.covariance(lp.cpu(), a) for lp, a in zip(logps, advantages, strict=True)]
    if kind == "kl_cov":
        wanted = max(1, int(num_tokens * settings.kl_cov_ratio))
        eligible = [c[m] for c, m, a in zip(covs, masks, advantages, strict=True) if a != 0]
        pool = torch.cat(eligible) if eligible else torch.zeros(0, dtype=torch.float64)
        if len(pool) == 0:
            return _with(rule, cov_low=float("inf"))
        threshold = float(torch.topk(pool, min(wanted, len(pool))).values[-1])
        return _with(rule, cov_low=threshold, num_selected=int((pool >= threshold).sum()))
    wanted = max(1, int(settings.clip_cov_ratio * num_tokens))
    low, high = settings.clip_cov_lb, settings.clip_cov_ub
    keys = []
    for i, (cov, mask) in enumerate(zip(covs, masks, strict=True)):
        candidate = mask & (cov > low) & (cov < high)
        keys.append(token_keys(seed, i, mask)[candidate])
    pool = torch.cat(keys) if keys else torch.zeros(0, dtype=torch.float64)
    key_threshold = float("inf") if len(pool) <= wanted else float(pool.sort().values[wanted - 1])
    return _with(
        rule,
        cov_low=low,
        cov_high=high,
        key_threshold=key_threshold,
        num_selected=min(wanted, len(pool)),
    )


def _with(rule: CovarianceRule, **changes: float | int) -> CovarianceRule:
    return replace(rule, **changes)  # type: ignore[arg-type]
