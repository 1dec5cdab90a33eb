"""The DPPO, GMPO, SAPO, GPG, Clip-Cov, KL-Cov and M2PO losses against direct transcriptions of
their papers' formulas, value and gradient, on random data; clip_cov / kl_cov's and m2po's
batch-level selections against loops over the batch; what the planner's pruning and the gates
decide for each. (The two rules every loss keeps, and split == unsplit == pruned, are checked
for every registered loss in ``test_losses.py``.)"""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algo import m2po
from megarl.algo.covariance import CovarianceSettings, fit_rule, token_keys
from megarl.algo.losses import policy_loss
from megarl.algo.policy_losses import POLICY_LOSS_NAMES, ClipSettings, zero_advantage_term
from megarl.config import planning
from megarl.config.schema import ConfigError, build_run_config
from megarl.planner.batch_planner import plan_step
from megarl.planner.gates import (
    M2PO_PROXIMAL,
    GateConfigError,
    decide_gates,
    validate_gate_config,
)
from megarl.planner.inputs import LossTerms, PlannerError
from megarl.planner.pruning import check_pruning_config
from megarl.train import compose_config

B, T = 6, 5


def _batch(seed: int, spread: float = 0.4):
    """Six sequences of 5, 2, 4, 3, 5 and 1 tokens, per-token advantages broadcast from
    per-sequence ones (one of them 0), probabilities spread over (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 2, 4, 3, 5, 1])
    mask_BT = (torch.arange(T)[None, :] < lengths[:, None]).double()
    old_logp_BT = torch.log(torch.rand(B, T, generator=gen, dtype=torch.float64) * 0.9 + 0.05)
    logp_BT = old_logp_BT + spread * torch.randn(B, T, generator=gen, dtype=torch.float64)
    logp_BT = logp_BT.clamp(max=-1e-3)  # probabilities stay below 1
    adv_B = torch.tensor([1.3, -0.8, 0.0, 2.1, -1.7, 0.6], dtype=torch.float64)
    return logp_BT, old_logp_BT, adv_B, mask_BT


def _ours(name: str, logp_BT, old_logp_BT, adv_B, mask_BT, agg="token-mean", **kwargs):
    leaf_BT = logp_BT.clone().requires_grad_(True)
    out = policy_loss(leaf_BT, old_logp_BT, adv_B, mask_BT, agg=agg, loss=name, **kwargs)
    out.loss.backward()
    assert leaf_BT.grad is not None
    return out, leaf_BT.grad


def _check(ours, ours_grad, expected_loss, expected_grad) -> None:
    torch.testing.assert_close(ours.loss, expected_loss.detach())
    torch.testing.assert_close(ours_grad, expected_grad)


# ----------------------------------------------------------------------------- DPPO


def _dppo_by_hand(logp_BT, old_logp_BT, adv_B, mask_BT, low, high, c, divergence):
    """DPPO (arXiv:2602.04879) token by token: a token is masked when it moved, in the
    direction its advantage pushes, beyond the divergence bound; the rest get
    ``-A min(r, c) log pi`` with the ratio detached, so d/d log pi = -A min(r, c)."""
    loss, grad = torch.zeros(()), torch.zeros_like(logp_BT)
    n = mask_BT.sum()
    for b in range(B):
        a = float(adv_B[b])
        for t in range(int(mask_BT[b].sum())):
            lp, old = float(logp_BT[b, t]), float(old_logp_BT[b, t])
            p, q = math.exp(lp), math.exp(old)
            if divergence == "tv":
                inside = (p - q <= high) if a > 0 else (p - q >= -low)
            else:  # binary KL(pi_old || pi) of {token, rest}
                kl = q * math.log(q / p) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
                inside = (kl <= high or p <= q) if a > 0 else (kl <= low or p >= q)
            if inside:
                weight = min(math.exp(lp - old), c)
                loss = loss + (-a * weight * lp) / n
                grad[b, t] = -a * weight / n
    return loss, grad


@pytest.mark.parametrize(("name", "divergence"), [("dppo_tv", "tv"), ("dppo_kl", "kl")])
def test_dppo_matches_the_papers_masked_objective(name: str, divergence: str) -> None:
    batch = _batch(seed=1)
    low, high, c = (0.1, 0.12, 2.0) if divergence == "tv" else (0.02, 0.03, 2.0)
    ours, grad = _ours(name, *batch, clip_low=low, clip_high=high, clip_ratio_c=c)
    expected_loss, expected_grad = _dppo_by_hand(*batch, low, high, c, divergence)
    _check(ours, grad, expected_loss, expected_grad)
    assert 0 < ours.clipfrac.item() < 1, "the example masks some tokens, not all"
    # the paper's eq. 12 weighs r A (not detached): the same gradient wherever r < c
    logp_BT, old_logp_BT, adv_B, mask_BT = batch
    paper_BT = logp_BT.clone().requires_grad_(True)
    inside_BT = (expected_grad != 0) | (adv_B[:, None] == 0)
    objective = (torch.exp(paper_BT - old_logp_BT) * adv_B[:, None] * inside_BT * mask_BT).sum()
    (paper_grad_BT,) = torch.autograd.grad(-objective / mask_BT.sum(), paper_BT)
    below_c = (logp_BT - old_logp_BT).exp() < c
    assert below_c[mask_BT.bool()].float().mean() > 0.9
    torch.testing.assert_close(grad[below_c], paper_grad_BT[below_c])


def test_prime_dppo_matches_prime_rls_default_loss() -> None:
    """``-m adv_tau A r + kl_tau (log r)^2`` per token, ``m`` the binary-TV mask; r is not
    detached: d/d log pi = -m adv_tau A r + 2 kl_tau log r."""
    logp_BT, old_logp_BT, adv_B, mask_BT = _batch(seed=2)
    keys = {"kl_tau": 0.05, "adv_tau": 0.7}
    ours, grad = _ours(
        "prime_dppo",
        logp_BT,
        old_logp_BT,
        adv_B,
        mask_BT,
        clip_low=0.1,
        clip_high=0.15,
        loss_keys=keys,
    )
    a_BT = adv_B[:, None].expand(B, T)
    moved = logp_BT.exp() - old_logp_BT.exp()
    kept = torch.where(a_BT > 0, moved <= 0.15, moved >= -0.1).double()
    log_r, r = logp_BT - old_logp_BT, (logp_BT - old_logp_BT).exp()
    per_token = -kept * 0.7 * a_BT * r + 0.05 * log_r**2
    n = mask_BT.sum()
    expected_grad = (-kept * 0.7 * a_BT * r + 2 * 0.05 * log_r) * mask_BT / n
    _check(ours, grad, (per_token * mask_BT).sum() / n, expected_grad)
    assert (kept[mask_BT.bool()] == 0).any()


def test_prime_dppo_penalty_breaks_the_zero_advantage_rule_and_says_so() -> None:
    logp_BT, old_logp_BT, _, mask_BT = _batch(seed=3)
    zeros = torch.zeros(B, dtype=torch.float64)
    out, grad = _ours("prime_dppo", logp_BT, old_logp_BT, zeros, mask_BT)
    assert out.loss.item() > 0 and (grad != 0).any()
    assert "kl_tau=0.001" in str(zero_advantage_term("prime_dppo", ClipSettings()))
    assert zero_advantage_term("prime_dppo", ClipSettings(kl_tau=0.0)) is None
    assert zero_advantage_term("dppo_tv", ClipSettings()) is None


# ----------------------------------------------------------------------------- GMPO, SAPO, GPG


def test_geo_mean_matches_gmpo_product_form_and_its_gradient() -> None:
    """GMPO (arXiv:2507.20673): ``J = 1/G sum_i A_i (prod_t rho_t)^(1/|o_i|)``, ``rho_t`` the
    token ratio clipped pessimistically for the sign of A to ``[e^-low, e^high]`` (min for
    ``A > 0``, max for ``A < 0``), written as a product and differentiated by autograd."""
    logp_BT, old_logp_BT, adv_B, mask_BT = _batch(seed=4)
    low, high = 0.3, 0.25
    ref_BT = logp_BT.clone().requires_grad_(True)
    objective = torch.zeros((), dtype=torch.float64)
    for b in range(B):
        n = int(mask_BT[b].sum())
        r = torch.exp(ref_BT[b, :n] - old_logp_BT[b, :n])
        clipped = r.clamp(math.exp(-low), math.exp(high))
        rho = torch.minimum(r, clipped) if adv_B[b] > 0 else torch.maximum(r, clipped)
        objective = objective + adv_B[b] * torch.prod(rho) ** (1.0 / n)
    expected = -objective / B
    expected.backward()
    ours, grad = _ours(
        "geo_mean",
        logp_BT,
        old_logp_BT,
        adv_B,
        mask_BT,
        "seq-mean-token-mean",
        clip_low=low,
        clip_high=high,
    )
    _check(ours, grad, expected, ref_BT.grad)
    assert ours.clipfrac.item() > 0 and ours.clipfrac_lower.item() > 0


def test_sapo_matches_the_soft_gate_objective() -> None:
    """SAPO (arXiv:2511.20347): ``J = 1/G sum_i 1/|o_i| sum_t f(r_t) A_i``,
    ``f(r) = 4/tau sigmoid(tau (r - 1))``, ``tau`` by the sign of A; gradient by autograd of
    this form and, in closed form, ``-A 4 s (1 - s) r / (|o_i| G)``, ``s = sigmoid(tau (r-1))``."""
    logp_BT, old_logp_BT, adv_B, mask_BT = _batch(seed=5)
    keys = {"tau_pos": 1.3, "tau_neg": 2.0}
    ref_BT = logp_BT.clone().requires_grad_(True)
    objective = torch.zeros((), dtype=torch.float64)
    closed_form_grad = torch.zeros_like(logp_BT)
    for b in range(B):
        n = int(mask_BT[b].sum())
        tau = 1.3 if adv_B[b] > 0 else 2.0
        r = torch.exp(ref_BT[b, :n] - old_logp_BT[b, :n])
        objective = objective + (4 / tau * torch.sigmoid(tau * (r - 1)) * adv_B[b]).mean()
        s = torch.sigmoid(tau * (r.detach() - 1))
        closed_form_grad[b, :n] = -adv_B[b] * 4 * s * (1 - s) * r.detach() / (n * B)
    expected = -objective / B
    expected.backward()
    ours, grad = _ours(
        "sapo", logp_BT, old_logp_BT, adv_B, mask_BT, "seq-mean-token-mean", loss_keys=keys
    )
    _check(ours, grad, expected, ref_BT.grad)
    torch.testing.assert_close(grad, closed_form_grad)


def test_sapo_on_policy_gradient_is_the_policy_gradient() -> None:
    """At r = 1, f'(1) = 1 whatever tau: the same gradient as PPO on-policy."""
    _, old_logp_BT, adv_B, mask_BT = _batch(seed=6)
    _, sapo_grad = _ours("sapo", old_logp_BT, old_logp_BT, adv_B, mask_BT)
    _, ppo_grad = _ours("vanilla", old_logp_BT, old_logp_BT, adv_B, mask_BT)
    torch.testing.assert_close(sapo_grad, ppo_grad)


def test_gpg_is_reinforce_on_the_advantage() -> None:
    """GPG (arXiv:2504.02546): ``-1/N sum A log pi``; the old log-probs are not read."""
    logp_BT, old_logp_BT, adv_B, mask_BT = _batch(seed=7)
    ours, grad = _ours("gpg", logp_BT, old_logp_BT, adv_B, mask_BT)
    a_BT = adv_B[:, None].expand(B, T)
    n = mask_BT.sum()
    _check(ours, grad, -(a_BT * logp_BT * mask_BT).sum() / n, -a_BT * mask_BT / n)
    other, _ = _ours("gpg", logp_BT, old_logp_BT - 3.0, adv_B, mask_BT)
    assert other.loss.item() == ours.loss.item()


# ----------------------------------------------------------------------------- Clip-Cov, KL-Cov


def _covariances_by_hand(engine_logp_BT, adv_B, mask_BT):
    """Every trained token's centred covariance, the means over the whole batch (a loop)."""
    tokens = [(b, t) for b in range(engine_logp_BT.shape[0]) for t in range(T) if mask_BT[b, t] > 0]
    mean_logp = sum(float(engine_logp_BT[b, t]) for b, t in tokens) / len(tokens)
    mean_adv = sum(float(adv_B[b]) for b, _ in tokens) / len(tokens)
    return {
        (b, t): (float(adv_B[b]) - mean_adv) * (float(engine_logp_BT[b, t]) - mean_logp)
        for b, t in tokens
    }


def test_clip_cov_matches_the_papers_selection_and_surrogate() -> None:
    """Clip-Cov (arXiv:2505.22617): among tokens with ``lb < cov < ub`` pick
    ``max(1, int(ratio N))`` at random (here: the smallest keys, a uniform subset) and detach
    them; the others keep PPO's clipped surrogate."""
    logp_BT, old_logp_BT, adv_B, mask_BT = _batch(seed=8)
    settings = CovarianceSettings(clip_cov_ratio=0.2, clip_cov_lb=0.05, clip_cov_ub=0.8)
    covs = _covariances_by_hand(old_logp_BT, adv_B, mask_BT)
    candidates = [bt for bt, c in covs.items() if 0.05 < c < 0.8]
    keys = {b: token_keys(9, b, mask_BT[b] > 0) for b in range(B)}
    wanted = max(1, int(0.2 * len(covs)))
    chosen = sorted(candidates, key=lambda bt: float(keys[bt[0]][bt[1]]))[:wanted]
    assert 1 < wanted < len(candidates)

    low, high = 0.15, 0.2
    ref_BT = logp_BT.clone().requires_grad_(True)
    r = torch.exp(ref_BT - old_logp_BT)
    a = adv_B[:, None]
    ppo = torch.maximum(-a * r, -a * r.clamp(1 - low, 1 + high))
    keep = torch.ones_like(mask_BT)
    for b, t in chosen:
        keep[b, t] = 0
    expected = (ppo * keep * mask_BT).sum() / mask_BT.sum()
    expected.backward()

    rule = fit_rule("clip_cov", list(old_logp_BT), list(mask_BT > 0), adv_B.tolist(), settings, 9)
    selected_BT = torch.stack(
        [rule.select(b, old_logp_BT[b], mask_BT[b] > 0, float(adv_B[b])) for b in range(B)]
    )
    assert sorted(map(tuple, selected_BT.nonzero().tolist())) == sorted(chosen)
    assert rule.num_selected == wanted
    ours, grad = _ours(
        "clip_cov",
        logp_BT,
        old_logp_BT,
        adv_B,
        mask_BT,
        clip_low=low,
        clip_high=high,
        selected_BT=selected_BT,
    )
    _check(ours, grad, expected, ref_BT.grad)
    assert ours.clipfrac.item() == pytest.approx(wanted / mask_BT.sum().item())


def test_kl_cov_matches_the_papers_top_k_penalty() -> None:
    """KL-Cov (arXiv:2505.22617): the ``max(1, int(ratio N))`` tokens of largest covariance get
    ``ppo_kl_coef |log r|`` on top of the unclipped ``-A r``; zero-advantage tokens are never
    chosen (see megarl.algo.covariance)."""
    logp_BT, old_logp_BT, adv_B, mask_BT = _batch(seed=10)
    settings = CovarianceSettings(kl_cov_ratio=0.25)
    covs = _covariances_by_hand(old_logp_BT, adv_B, mask_BT)
    wanted = max(1, int(0.25 * len(covs)))
    eligible = [bt for bt in covs if adv_B[bt[0]] != 0]
    chosen = sorted(eligible, key=lambda bt: -covs[bt])[:wanted]

    ref_BT = logp_BT.clone().requires_grad_(True)
    log_r = ref_BT - old_logp_BT
    penalty = torch.zeros_like(mask_BT)
    for b, t in chosen:
        penalty[b, t] = 1
    per_token = -adv_B[:, None] * log_r.exp() + 0.3 * penalty * log_r.abs()
    expected = (per_token * mask_BT).sum() / mask_BT.sum()
    expected.backward()

    rule = fit_rule("kl_cov", list(old_logp_BT), list(mask_BT > 0), adv_B.tolist(), settings, 0)
    selected_BT = torch.stack(
        [rule.select(b, old_logp_BT[b], mask_BT[b] > 0, float(adv_B[b])) for b in range(B)]
    )
    assert sorted(map(tuple, selected_BT.nonzero().tolist())) == sorted(chosen)
    ours, grad = _ours(
        "kl_cov",
        logp_BT,
        old_logp_BT,
        adv_B,
        mask_BT,
        selected_BT=selected_BT,
        loss_keys={"ppo_kl_coef": 0.3},
    )
    _check(ours, grad, expected, ref_BT.grad)


@pytest.mark.parametrize("kind", ["clip_cov", "kl_cov"])
def test_a_selection_per_micro_batch_would_differ_from_the_batchs(kind: str) -> None:
    """Why the rule is fitted once over the batch: fitted per half, it picks other tokens."""
    _, old_logp_BT, adv_B, mask_BT = _batch(seed=11)
    settings = CovarianceSettings(0.2, 0.05, 0.8, 0.2)
    trained = list(mask_BT > 0)

    def chosen(rows: list[int]) -> set[tuple[int, int]]:
        rule = fit_rule(
            kind,
            [old_logp_BT[b] for b in rows],
            [trained[b] for b in rows],
            [float(adv_B[b]) for b in rows],
            settings,
            3,
        )
        return {
            (rows[i], t)
            for i, b in enumerate(rows)
            for t in rule.select(i, old_logp_BT[b], trained[b], float(adv_B[b]))
            .nonzero()
            .flatten()
            .tolist()
        }

    assert chosen([0, 1, 2]) | chosen([3, 4, 5]) != chosen(list(range(B)))


def test_covariance_losses_refuse_to_run_without_a_selection() -> None:
    logp_BT, old_logp_BT, adv_B, mask_BT = _batch(seed=12)
    with pytest.raises(ValueError, match="kl_cov needs the tokens"):
        policy_loss(logp_BT, old_logp_BT, adv_B, mask_BT, loss="kl_cov")


# ----------------------------------------------------------------------------- pruning, gates


@pytest.mark.parametrize("name", POLICY_LOSS_NAMES)
def test_auto_prunes_for_every_loss_but_prime_dppos_penalty(name: str) -> None:
    """Pruning is exact for every loss that keeps the zero-advantage rule; prime_dppo's
    ``(log r)^2`` acts on every token, so auto does not prune and says why."""
    if name == "sft":
        return  # algo.objective=sft has no rollout to prune
    mode, reason = planning.prune_mode(build_run_config({"actor": {"policy_loss": name}}))
    if name == "prime_dppo":
        assert mode == "off"
        assert "actor.policy_loss=prime_dppo penalises kl_tau=0.001" in reason
        no_penalty = build_run_config({"actor": {"policy_loss": name, "kl_tau": 0.0}})
        assert planning.prune_mode(no_penalty)[0] == "match_loss_curve"
    else:
        assert (mode, reason) == ("match_loss_curve", "auto: exact (kl_coef=0, entropy_coef=0)")


def test_a_named_pruning_mode_with_prime_dppo_needs_allow_approx() -> None:
    term = zero_advantage_term("prime_dppo", ClipSettings(kl_tau=0.01))
    with pytest.raises(PlannerError, match="prime_dppo penalises kl_tau=0.01"):
        check_pruning_config("match_loss_curve", LossTerms(loss_term=term), False)
    reason = check_pruning_config("match_loss_curve", LossTerms(loss_term=term), True)
    assert reason is not None and reason.startswith("approximate:")
    cfg = build_run_config(
        {"actor": {"policy_loss": "prime_dppo"}, "planner": {"prune_zero_adv": "fast"}}
    )
    inputs = planning.planner_inputs(cfg, [10] * 4, [6] * 4, [0.0, 0.0, 1.0, -1.0], [0, 0, 1, 1])
    with pytest.raises(PlannerError, match="prime_dppo"):
        plan_step(inputs)


@pytest.mark.parametrize("name", [n for n in POLICY_LOSS_NAMES if n not in ("sft", "m2po")])
@pytest.mark.parametrize("versions", [None, [6, 6, 5, 6]])
def test_the_gates_decide_the_same_passes_for_every_loss(
    name: str, versions: list[int] | None
) -> None:
    """No loss but m2po (below) needs old log-probs beyond what the gates already give: the first slice's
    training forward *is* the old (proximal) policy for every one of them, and clip_cov /
    kl_cov's selection reads the engine's log-probs, not an extra pass. So the gates (and
    their reasons) are vanilla's, on-policy and with a stale sequence alike."""
    tree: dict = {"actor": {"ppo_mini_batches": 2}}
    if versions is not None:  # asynchronous: the engine on a device of its own
        tree["async_training"] = {"mode": "one_step_off"}
        tree["rollout"] = {"n_gpus": 1}
        tree["trainer"] = {"launcher": "ray"}

    def gates(loss: str):
        cfg = build_run_config({**tree, "actor": {**tree["actor"], "policy_loss": loss}})
        return decide_gates(planning.step_facts(cfg, 7, 4, behaviour_versions=versions))

    ours, vanilla = gates(name), gates("vanilla")
    assert ours == vanilla
    assert ours.old_log_prob.seq_indices == (2, 3)  # the second slice only
    assert "recompute" in ours.summary()


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
@pytest.mark.parametrize(
    "tree", [{"algo": {"adv_estimator": "gae"}}, {"algo": {"distill": {"teacher_path": "t"}}}]
)
def test_covariance_losses_refuse_per_token_advantages(name: str, tree: dict) -> None:
    with pytest.raises(ConfigError, match=f"actor.policy_loss={name} selects tokens") as info:
        build_run_config({**tree, "actor": {"policy_loss": name}})
    assert "\n" not in str(info.value)


# ----------------------------------------------------------------------------- M2PO


def _areal_m2_mask(values: list[float], threshold: float) -> set[int]:
    """AReaL's M2PO procedure as a loop: drop the largest squared log weights, one at a time,
    until the mean of the rest is below the threshold (one always stays)."""
    order = sorted(range(len(values)), key=lambda k: -values[k])
    for dropped in range(len(values)):
        rest = [values[k] for k in order[dropped:]]
        if sum(rest) / len(rest) < threshold:
            return set(order[:dropped])
    return set(order[:-1])


def _stale(seed: int, scale: float):
    """A batch and behaviour log-probs ``scale``-stale around its old (proximal) ones."""
    logp_BT, old_logp_BT, adv_B, mask_BT = _batch(seed)
    gen = torch.Generator().manual_seed(seed + 100)
    behaviour_BT = old_logp_BT + scale * torch.randn(B, T, generator=gen, dtype=torch.float64)
    return logp_BT, old_logp_BT, adv_B, mask_BT, behaviour_BT


def _m2po_selection(old_logp_BT, adv_B, mask_BT, behaviour_BT, threshold):
    trained = list(mask_BT > 0)
    squared = [
        m2po.squared_log_weight(behaviour_BT[b], old_logp_BT[b])[trained[b]]
        for b in range(B)
        if adv_B[b] != 0
    ]
    rule = m2po.fit_rule(squared, threshold)
    chosen = [
        rule.select(behaviour_BT[b], old_logp_BT[b], trained[b], float(adv_B[b])) for b in range(B)
    ]
    return rule, torch.stack(chosen)


def test_m2po_masks_what_areals_procedure_masks_and_trains_the_rest_with_ppo() -> None:
    """M2PO (arXiv:2510.01161): the tokens of largest (log pi_prox - log pi_behav)^2 are masked
    until the mean of the rest is below m2_threshold; the others get vanilla's surrogate."""
    logp_BT, old_logp_BT, adv_B, mask_BT, behaviour_BT = _stale(seed=20, scale=0.3)
    tokens = [(b, t) for b in range(B) if adv_B[b] != 0 for t in range(T) if mask_BT[b, t] > 0]
    squared = [float((old_logp_BT[b, t] - behaviour_BT[b, t]) ** 2) for b, t in tokens]
    expected_masked = {tokens[k] for k in _areal_m2_mask(squared, 0.03)}
    assert 0 < len(expected_masked) < len(tokens)

    rule, selected_BT = _m2po_selection(old_logp_BT, adv_B, mask_BT, behaviour_BT, 0.03)
    assert set(map(tuple, selected_BT.nonzero().tolist())) == expected_masked
    assert rule.num_masked == len(expected_masked)
    assert rule.second_moment == pytest.approx(sum(squared) / len(squared))

    vanilla_BT = logp_BT.clone().requires_grad_(True)
    r = torch.exp(vanilla_BT - old_logp_BT)
    a = adv_B[:, None]
    ppo = torch.maximum(-a * r, -a * r.clamp(0.8, 1.2))
    ppo = torch.where(a < 0, torch.minimum(ppo, -a * 3.0), ppo)
    expected = (ppo * (~selected_BT) * mask_BT).sum() / mask_BT.sum()
    expected.backward()
    ours, grad = _ours("m2po", logp_BT, old_logp_BT, adv_B, mask_BT, selected_BT=selected_BT)
    _check(ours, grad, expected, vanilla_BT.grad)
    assert (grad[selected_BT] == 0).all()


@pytest.mark.parametrize("mismatch", [0.0, 1e-5])
def test_m2po_at_staleness_zero_is_the_on_policy_loss(mismatch: float) -> None:
    """Staleness 0: the behaviour policy is the proximal one (up to the engine/trainer
    mismatch), M2 ~ 0 is below the threshold, nothing is masked, and the loss and gradient
    are vanilla PPO's, bit for bit."""
    logp_BT, old_logp_BT, adv_B, mask_BT, behaviour_BT = _stale(seed=21, scale=mismatch)
    rule, selected_BT = _m2po_selection(old_logp_BT, adv_B, mask_BT, behaviour_BT, 0.04)
    assert rule.cut == math.inf and not selected_BT.any()
    assert rule.second_moment < 1e-9
    ours, ours_grad = _ours("m2po", logp_BT, old_logp_BT, adv_B, mask_BT, selected_BT=selected_BT)
    on_policy, on_policy_grad = _ours("vanilla", logp_BT, old_logp_BT, adv_B, mask_BT)
    assert ours.loss.item() == on_policy.loss.item()
    assert torch.equal(ours_grad, on_policy_grad)
    # the check can tell: stale behaviour log-probs do mask tokens and change the loss
    stale_behaviour_BT = _stale(seed=21, scale=0.5)[4]
    _, stale_BT = _m2po_selection(old_logp_BT, adv_B, mask_BT, stale_behaviour_BT, 0.04)
    stale, _ = _ours("m2po", logp_BT, old_logp_BT, adv_B, mask_BT, selected_BT=stale_BT)
    assert stale_BT.any() and stale.loss.item() != on_policy.loss.item()


def test_m2po_leaves_zero_advantage_sequences_out_of_the_statistic() -> None:
    """A zero-advantage sequence, however stale, neither counts in M2 nor is masked: the mask
    is the same whether the planner prunes it or not."""
    _, old_logp_BT, adv_B, mask_BT, behaviour_BT = _stale(seed=22, scale=0.2)
    assert adv_B[2] == 0
    very_stale_BT = behaviour_BT.clone()
    very_stale_BT[2] += 5.0
    rule, selected_BT = _m2po_selection(old_logp_BT, adv_B, mask_BT, behaviour_BT, 0.02)
    moved_rule, moved_BT = _m2po_selection(old_logp_BT, adv_B, mask_BT, very_stale_BT, 0.02)
    assert rule == moved_rule and torch.equal(selected_BT, moved_BT)
    assert not selected_BT[2].any()


def test_m2po_recomputes_every_sequence_and_refuses_engine_or_forward_logprobs() -> None:
    """The gates' reason: m2po needs every token's proximal log-probs before the split, the
    on-policy first slice's included; rollout (engine = proximal) or never are refused."""
    cfg = build_run_config({"actor": {"policy_loss": "m2po"}})
    gates = decide_gates(planning.step_facts(cfg, 1, 8))
    assert gates.old_log_prob.seq_indices == tuple(range(8))
    assert gates.old_log_prob.reason == M2PO_PROXIMAL
    assert "m2po" in gates.summary()
    for mode, needle in (("rollout", "would measure no staleness"), ("never", "contradicts")):
        with pytest.raises(GateConfigError, match=needle):
            validate_gate_config(
                planning.run_facts(
                    build_run_config(
                        {"actor": {"policy_loss": "m2po"}, "planner": {"old_log_prob": mode}}
                    )
                )
            )


def test_every_loss_key_is_a_command_line_override() -> None:
    """The keys are in configs/config.yaml, so ``actor.tau_pos=...`` works without a ``+``."""
    values = {
        "tau_pos": 1.5,
        "tau_neg": 2.5,
        "clip_cov_ratio": 0.01,
        "clip_cov_lb": 0.5,
        "clip_cov_ub": 4.0,
        "kl_cov_ratio": 0.02,
        "ppo_kl_coef": 0.3,
        "kl_tau": 0.002,
        "adv_tau": 0.5,
        "m2_threshold": 0.08,
    }
    cfg = compose_config([f"actor.{key}={value}" for key, value in values.items()])
    assert {key: getattr(cfg.actor, key) for key in values} == values
    assert cfg.actor.loss_keys == {
        "tau_pos": 1.5,
        "tau_neg": 2.5,
        "ppo_kl_coef": 0.3,
        "kl_tau": 0.002,
        "adv_tau": 0.5,
    }
