"""Zero-advantage pruning: when leaving a sequence out of training is exact, and what was left out.

Why prune. In GRPO a group whose rewards are all equal has advantage exactly 0 for every member.
With only the policy-gradient term active (``kl_coef == entropy_coef == 0``) such a sequence
contributes exactly zero gradient, yet costs a full forward+backward. Skipping it is exact as long
as the loss of a mini-batch keeps the denominator of the *unpruned* mini-batch: every
micro-batch divides by the whole mini-batch's count (see
:func:`~megarl.planner.optimizer_steps.normaliser_of`: its response tokens for ``token-mean``,
its sequences for the ``seq-mean-*`` modes, times ``loss_scale_factor`` for
``seq-mean-token-sum-norm``) because gradients are summed across micro-batches and DP ranks, so
dropping zero terms from the numerator changes nothing. That holds for every policy loss
(``actor.policy_loss``): each gives a zero-advantage token exactly zero loss and gradient, and
weighs a token by its own sequence only (``seq-mean-token-mean``'s ``1 / length`` is the
token's own sequence's length), so which sequences share a micro-batch never matters.

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

Which sequences a mode keeps is ``BatchArrays.kept`` (every sequence in ``off``, those with a
non-zero advantage otherwise); in which optimizer steps they are trained is
:mod:`megarl.planner.optimizer_steps`'s decision.
"""

from __future__ import annotations

import numpy as np

from megarl.planner.inputs import (
    PLANNER_MODES,
    BatchArrays,
    LossTerms,
    PlannerError,
    PlannerInputs,
)

PRUNE_SETTINGS: tuple[str, ...] = ("auto", *PLANNER_MODES)
"""Values of ``planner.prune_zero_adv``: a planner mode, or ``auto`` (the default)."""


CRITIC_ESTIMATORS: tuple[str, ...] = ("gae",)
"""``algo.adv_estimator`` values whose advantages come per token from a learned critic."""


def pruning_refusal(terms: LossTerms) -> str | None:
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
    With ECHO (``echo_coef > 0``) a sequence's observation tokens train whatever its advantage,
    so a zero-advantage agent trajectory still has a gradient: pruning it would drop that
    term, and ECHO's purpose is exactly those tokens, so it is never pruned either.
    """
    if terms.adv_estimator in CRITIC_ESTIMATORS:
        return (
            f"algo.adv_estimator={terms.adv_estimator} has per-token advantages from a learned "
            "critic, and its value loss trains on every sequence"
        )
    if terms.moe_aux_loss_coef > 0:
        return (
            f"actor.moe_aux_loss_coef={terms.moe_aux_loss_coef} trains the router's load-balancing "
            "loss on every routed token, zero-advantage sequences included"
        )
    if terms.echo_coef > 0:
        return (
            f"actor.echo_coef={terms.echo_coef} trains the observation tokens of every agent "
            "trajectory, zero-advantage ones included"
        )
    return None


def resolve_prune_mode(setting: str, terms: LossTerms) -> tuple[str, str]:
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
    refusal = pruning_refusal(terms)
    if refusal is not None:
        return "off", f"auto: no pruning, {refusal}"
    if terms.loss_term is not None:
        return "off", f"auto: no pruning, {terms.loss_term}, zero-advantage ones included"
    if not terms.kl_or_entropy:
        return "match_loss_curve", "auto: exact (kl_coef=0, entropy_coef=0)"
    return "off", (
        f"auto: no pruning, actor.kl_coef={terms.kl_coef} / actor.entropy_coef="
        f"{terms.entropy_coef} act on zero-advantage sequences"
    )


def check_pruning_config(mode: str, terms: LossTerms, allow_approx: bool) -> str | None:
    """Fail fast when pruning zero-advantage sequences would silently change the loss.

    Returns ``None`` when the configuration is exact (``mode == "off"`` or both coefficients are
    0), the reason string when it is approximate but ``allow_approx`` permits it, and raises
    :class:`PlannerError` otherwise, and always for an estimator :func:`pruning_refusal`
    names. The trainer calls this at start-up so a bad config fails before any rollout;
    :func:`~megarl.planner.batch_planner.plan_step` calls it again on every batch.
    """
    if mode not in PLANNER_MODES:
        raise PlannerError(f"planner.prune_zero_adv must be one of {PLANNER_MODES}, got {mode!r}")
    refusal = pruning_refusal(terms)
    if mode != "off" and refusal is not None:
        raise PlannerError(
            f"planner.prune_zero_adv={mode} cannot prune: {refusal}. "
            "Set planner.prune_zero_adv=auto or off."
        )
    if mode != "off" and terms.loss_term is not None:
        if not allow_approx:
            raise PlannerError(
                f"planner.prune_zero_adv={mode} is exact only when no loss term survives at "
                f"advantage 0, but {terms.loss_term}. Set planner.prune_zero_adv=off, or set "
                "planner.allow_approx=true to prune anyway."
            )
        return (
            f"approximate: pruned zero-adv seqs although {terms.loss_term} "
            "(planner.allow_approx=true)"
        )
    if mode == "off" or not terms.kl_or_entropy:
        return None
    coefs = f"actor.kl_coef={terms.kl_coef} and actor.entropy_coef={terms.entropy_coef}"
    if not allow_approx:
        raise PlannerError(
            f"planner.prune_zero_adv={mode} is exact only when no loss term "
            f"survives at advantage 0, but {coefs}: zero-advantage sequences still carry a "
            "KL/entropy gradient. Set both coefficients to 0, set planner.prune_zero_adv=off, "
            "or set planner.allow_approx=true to prune anyway."
        )
    return f"approximate: pruned zero-adv seqs although {coefs} (planner.allow_approx=true)"


def pruning_reasons(
    inputs: PlannerInputs, batch: BatchArrays, approx_reason: str | None, num_runs: int
) -> list[str]:
    """The plan's first reasons: what was pruned (and how many groups were all-equal), why the
    plan is approximate, and how many steps ``fast`` merged each epoch into."""
    num_sequences = inputs.num_sequences
    if inputs.mode == "off":
        refusal = pruning_refusal(inputs.loss_terms)
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
