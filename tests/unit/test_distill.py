"""On-policy distillation's pure part: per-token advantages against the formula, masks (agent
loops), the planner's per-sequence summary, the tokenizer check and the config's refusals."""

from __future__ import annotations

import pytest
import torch

from megarl.algo.distill import (
    distill_token_advantages,
    reverse_kl_mean,
    sequence_summaries,
    tokenizer_mismatch,
)
from megarl.config.algorithm import DistillConfig
from megarl.train import compose_config


def _formula(student, teacher, seq_adv, mask, coef):
    """The advantage written out token by token: -(ls - lt) + coef * A on mask 1, else 0."""
    return [
        [
            -(student[b][t] - teacher[b][t]) + coef * seq_adv[b] if mask[b][t] else 0.0
            for t in range(len(student[b]))
        ]
        for b in range(len(student))
    ]


def test_advantages_match_the_formula_token_by_token():
    student = [[-1.0, -2.0, -0.5], [-0.3, -4.0, -1.5]]
    teacher = [[-1.5, -1.0, -0.5], [-0.2, -2.0, -9.0]]
    seq_adv = [0.7, -1.2]
    mask = [[1, 1, 0], [1, 0, 1]]  # row 1: an observation token in the middle (agent loop)
    got = distill_token_advantages(
        torch.tensor(student), torch.tensor(teacher), torch.tensor(seq_adv), torch.tensor(mask), 0.5
    )
    want = torch.tensor(_formula(student, teacher, seq_adv, mask, 0.5), dtype=torch.float64)
    assert torch.allclose(got, want, atol=1e-12)
    assert got[0].tolist() == pytest.approx([-0.5 + 0.35, 1.0 + 0.35, 0.0])
    assert got[1].tolist() == pytest.approx([0.1 - 0.6, 0.0, -7.5 - 0.6])


def test_teacher_equal_to_student_gives_exactly_zero_without_the_reward():
    logp = torch.randn(4, 7)
    adv = distill_token_advantages(logp, logp.clone(), torch.randn(4), torch.ones(4, 7), 0.0)
    assert torch.equal(adv, torch.zeros(4, 7, dtype=torch.float64))
    assert bool((sequence_summaries(adv, torch.ones(4, 7)) == 0).all())
    assert reverse_kl_mean(logp, logp.clone(), torch.ones(4, 7)) == 0.0


def test_unsampled_tokens_are_never_scored_whatever_the_teacher_says():
    """Agent loops: tool results are in the response but off the mask; a teacher that finds
    them very unlikely must change nothing."""
    student = torch.full((1, 6), -1.0)
    teacher = torch.full((1, 6), -1.0)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1]])
    teacher[0, 2:4] = -50.0  # observation tokens the teacher dislikes
    adv = distill_token_advantages(student, teacher, torch.tensor([2.0]), mask, 1.0)
    assert adv[0].tolist() == [2.0, 2.0, 0.0, 0.0, 2.0, 2.0]
    assert reverse_kl_mean(student, teacher, mask) == 0.0
    teacher[0, 0] = -3.0  # a sampled token: scored
    assert reverse_kl_mean(student, teacher, mask) == pytest.approx(2.0 / 4)


def test_reverse_kl_mean_is_over_trained_tokens_only():
    student = torch.tensor([[-1.0, -1.0], [-2.0, -9.0]])
    teacher = torch.tensor([[-2.0, -1.5], [-1.0, -1.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    assert reverse_kl_mean(student, teacher, mask) == pytest.approx((1.0 + 0.5 - 1.0) / 3)
    assert reverse_kl_mean(student, teacher, torch.zeros(2, 2)) == 0.0


def test_a_sequence_whose_token_advantages_cancel_is_not_summarised_as_zero():
    """The planner prunes summary-0 sequences: one with +1 and -1 tokens still trains."""
    adv = torch.tensor([[1.0, -1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.5, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0]])
    summary = sequence_summaries(adv, mask)
    assert summary[0] != 0
    assert summary[1] == 0
    assert summary[2] == pytest.approx(0.5)  # the mean, the off-mask 9.0 left out
    tiny = torch.tensor([[1e-300, 0.0]], dtype=torch.float64)  # 0 in float32, yet not zero
    assert sequence_summaries(tiny, torch.ones(1, 2), torch.float32)[0] > 0


def test_shapes_must_agree():
    with pytest.raises(ValueError, match="one shape"):
        distill_token_advantages(
            torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3), 1.0
        )


def test_tokenizer_check_names_what_differs():
    vocab = {"a": 0, "b": 1, "c": 2}
    assert tokenizer_mismatch(vocab, dict(vocab)) == ""
    assert "4 tokens vs the model's 3" in tokenizer_mismatch(vocab, {**vocab, "d": 3})
    assert "2 tokens have other ids (e.g. 'b')" in tokenizer_mismatch(
        vocab, {"a": 0, "b": 2, "c": 1}
    )


def test_distill_config_defaults_and_refusals():
    assert not DistillConfig().enabled and DistillConfig().reward_coef == 1.0
    assert DistillConfig(teacher_path="t").enabled
    with pytest.raises(ValueError, match="reward_coef"):
        DistillConfig(teacher_path="t", reward_coef=-0.5)
    with pytest.raises(ValueError, match="teacher_path"):
        DistillConfig(teacher_path="")


@pytest.mark.parametrize(
    "extra",
    ["algo.adv_estimator=gae", "algo.use_kl_in_reward=true", "planner.old_log_prob=never"],
)
def test_distillation_refuses_what_would_rewrite_its_advantages(extra):
    with pytest.raises(Exception, match="algo.distill.teacher_path"):
        compose_config(["algo.distill.teacher_path=/t", "rollout.n=2", extra])


def _distill_gates(**run):
    from megarl.planner.gates import RunFacts, StepFacts, decide_gates

    facts = RunFacts(ppo_mini_batches=2, ppo_epochs=1, total_steps=3, **run)
    return decide_gates(StepFacts(run=facts, step=1, slices=((0, 1), (2, 3))))


def test_the_teacher_runs_on_every_sequence_and_moves_the_old_pass_before_the_plan():
    gates = _distill_gates(distill=True)
    assert gates.teacher_log_prob.run and gates.teacher_log_prob.seq_indices == (0, 1, 2, 3)
    # on-policy mb0 would take the training forward's logprobs; distillation needs them first
    assert gates.old_log_prob.seq_indices == (0, 1, 2, 3)
    assert "teacher: run (algo.distill)" in gates.summary()
    assert "teacher: algo.distill" in str(gates.metrics()["gates/reasons"])
    assert not gates.ref_log_prob.run  # the reference pass keeps its own gate


def test_without_a_teacher_nothing_changes():
    gates = _distill_gates()
    assert not gates.teacher_log_prob.run
    assert gates.old_log_prob.seq_indices == (2, 3)
    assert "teacher" not in gates.summary()


def test_engine_logprobs_stand_in_as_the_student_only_when_the_gates_say_so():
    from megarl.planner.gates import OldLogProbMode

    gates = _distill_gates(distill=True, old_log_prob=OldLogProbMode.ROLLOUT)
    assert gates.old_log_prob.source == "rollout" and gates.teacher_log_prob.run


def test_forced_never_is_refused_with_a_teacher():
    from megarl.planner.gates import GateConfigError, OldLogProbMode, RunFacts, validate_gate_config

    run = RunFacts(
        ppo_mini_batches=1, ppo_epochs=1, total_steps=1, old_log_prob=OldLogProbMode.NEVER
    )
    validate_gate_config(run)
    with pytest.raises(GateConfigError, match="algo.distill"):
        validate_gate_config(RunFacts(**{**run.__dict__, "distill": True}))


def test_recipe_opd_without_a_teacher_stops_in_one_line_before_anything_is_written(
    tmp_path, capsys
):
    from megarl.train import main

    run_dir = tmp_path / "run"
    assert main(["recipe=opd", f"trainer.run_dir={run_dir}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert "algo.distill.reward_coef=0 (recipe=opd) needs a teacher" in lines[0]
    assert "algo.distill.teacher_path=" in lines[0]
    assert not run_dir.exists()


def test_recipe_opd_with_a_teacher_composes_to_pure_distillation():
    cfg = compose_config(["recipe=opd", "algo.distill.teacher_path=/some/teacher"])
    assert cfg.algo.distill.enabled and cfg.algo.distill.reward_coef == 0.0
    assert cfg.actor.kl_coef == 0.0


def test_a_teacher_path_that_does_not_exist_is_named_by_its_key(tmp_path):
    from megarl.train import StartupError, resolve_teacher_dir

    missing = tmp_path / "no_teacher"
    cfg = compose_config(["algo.distill.teacher_path=" + str(missing), "rollout.n=2"])
    with pytest.raises(StartupError, match=r"^algo.distill.teacher_path=.*no_teacher: no such"):
        resolve_teacher_dir(cfg, tmp_path / "staging")
    assert resolve_teacher_dir(compose_config([]), tmp_path / "staging") is None


def test_a_multi_turn_batch_scores_only_its_sampled_tokens():
    """``distill_targets`` on a batch of two trajectories, one with a tool result (3 tokens
    off the mask) between its turns: those tokens get advantage 0 and no say in the metric
    or in the planner's summary, however unlikely the teacher finds them."""
    from megarl.batch import RolloutBatch
    from megarl.trainer.distill_step import REVERSE_KL_METRIC, distill_targets

    masks = (torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 1.0]), torch.tensor([1.0, 1.0]))
    batch = RolloutBatch(
        tokens=(torch.arange(10, 18), torch.arange(20, 25)),
        prompt_lens=(2, 3),
        group_ids=torch.tensor([0, 0]),
        rewards=torch.tensor([1.0, 0.0]),
        advantages=torch.tensor([0.5, -0.5]),
        engine_logprobs=(torch.zeros(6), torch.zeros(2)),
        response_masks=masks,
    )
    student = (torch.tensor([-1.0, -2.0, -1.0, -1.0, -1.0, -0.5]), torch.tensor([-0.25, -0.75]))
    teacher = (torch.tensor([-1.5, -2.0, -40.0, -40.0, -40.0, -0.5]), torch.tensor([-0.25, -0.5]))
    merged = {i: (student[i], None, teacher[i]) for i in range(2)}
    cfg = compose_config(["algo.distill.teacher_path=/t", "algo.distill.reward_coef=0"])
    token_advantages, summary_B, metrics = distill_targets(cfg, batch, merged)
    assert token_advantages[0].tolist() == [-0.5, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert token_advantages[1].tolist() == [0.0, 0.25]
    assert metrics[REVERSE_KL_METRIC] == pytest.approx((0.5 - 0.25) / 5)
    assert summary_B.tolist() == pytest.approx([-0.5 / 3, 0.25 / 2])
    assert metrics["critic/advantages/zero_adv_ratio"] == pytest.approx(3 / 5)


def test_the_policy_loss_on_distillation_advantages_lowers_the_exact_reverse_kl():
    """The sign and the formula, end to end on a toy: a categorical student over 16 tokens
    samples, the teacher scores, the clipped policy loss on ``distill_token_advantages`` takes
    SGD steps, and the exact ``KL(student || teacher)`` falls (and would rise with the sign
    flipped)."""
    from megarl.algo.losses import policy_loss

    def train(sign: float) -> tuple[float, float]:
        torch.manual_seed(0)
        teacher_logp = torch.log_softmax(torch.randn(16) * 2, dim=-1)
        logits = torch.zeros(16, requires_grad=True)

        def exact_kl() -> float:
            logp = torch.log_softmax(logits.detach(), dim=-1)
            return float((logp.exp() * (logp - teacher_logp)).sum())

        before = exact_kl()
        for _ in range(60):
            logp_all = torch.log_softmax(logits, dim=-1)
            tokens_BT = torch.multinomial(logp_all.detach().exp(), 64, replacement=True)[None]
            logp_BT = logp_all[tokens_BT]
            mask_BT = torch.ones_like(logp_BT)
            adv_BT = sign * distill_token_advantages(
                logp_BT.detach(), teacher_logp[tokens_BT], torch.zeros(1), mask_BT, 0.0
            )
            out = policy_loss(logp_BT, logp_BT.detach(), adv_BT.float(), mask_BT)
            (grad,) = torch.autograd.grad(out.loss, logits)
            with torch.no_grad():
                logits -= 0.5 * grad
        return before, exact_kl()

    before, after = train(1.0)
    assert after < 0.5 * before, (before, after)
    _, flipped = train(-1.0)
    assert flipped > before, (before, flipped)
