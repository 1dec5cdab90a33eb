"""ECHO through the Megatron actor (``actor.echo_coef``): real ranks on CPU/gloo, tiny random
Llama, fp32. With the coefficient at 0 an update is bitwise the update without the key; with it
on, ``actor/echo_loss`` is the observation tokens' negative log-likelihood (transcribed from
the actor's own logprobs) over the step's normaliser, a different micro-batch split and packed
micro-batches give the same weights, and a zero-advantage agent trajectory (which the policy loss leaves alone) still
moves the weights through its observation tokens."""

from __future__ import annotations

import pytest
import torch
from helpers.batches import random_batch
from helpers.models import TINY_HF_CONFIG
from helpers.ranks import loss_settings, start_cpu_rank

from megarl.distributed.launcher import launch

pytestmark = pytest.mark.slow

TINY = dict(TINY_HF_CONFIG, num_hidden_layers=2)
SEQ_LENS = (12, 10, 9, 14, 8)
PROMPT_LENS = (3, 4, 3, 5, 2)
ADVANTAGES = (1.0, 0.0, -0.5, 0.0, 0.25)
# 1 = generated, 0 = observation (tool output) for the agent trajectories 0, 1 and 3
MASKS = {
    0: (1, 1, 0, 0, 0, 1, 1, 1, 1),
    1: (1, 0, 0, 0, 1, 1),
    3: (1, 1, 0, 0, 0, 0, 1, 1, 1),
}


def _batch(rows=None):
    import dataclasses

    batch = random_batch(SEQ_LENS, PROMPT_LENS, TINY["vocab_size"], torch.tensor(ADVANTAGES), 5)
    masks = tuple(
        torch.tensor(MASKS[i], dtype=torch.float32) if i in MASKS else torch.ones(n - p)
        for i, (n, p) in enumerate(zip(SEQ_LENS, PROMPT_LENS, strict=True))
    )
    return dataclasses.replace(batch, response_masks=masks)


def _actor(spec, state, packed: bool = False):
    from megarl.actor.megatron_actor import MegatronActor
    from megarl.config.actor import ActorConfig
    from megarl.distributed.execution import Environment, ExecutionRequest, decide_execution

    plan = decide_execution(
        ExecutionRequest(device="cpu", pack_sequences=packed),
        Environment(cuda_available=False, transformer_engine=False),
    )
    cfg = ActorConfig(tp=1, lr=1e-4, logprob_chunk_tokens=16, pack_sequences=packed)
    return MegatronActor(
        spec, cfg, "cpu", torch.float32, state, pad_id=0, init_seed=0, execution=plan
    )


def _params(actor) -> list[torch.Tensor]:
    return [p.detach().clone() for p in actor.model.parameters()]


def _max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def _worker(ctx, hf_config: dict, state):
    import dataclasses

    from megarl.actor.training_loss import LossSettings
    from megarl.distributed import parallel
    from megarl.models.spec import spec_from_hf_config
    from megarl.planner.step_plan import OptimizerStepPlan

    start_cpu_rank(ctx, 1)
    spec = spec_from_hf_config(hf_config)
    batch = _batch()
    trained = [
        sum(MASKS.get(i, [1] * (n - p)))
        for i, (n, p) in enumerate(zip(SEQ_LENS, PROMPT_LENS, strict=True))
    ]
    normaliser = float(sum(trained))
    split_a = OptimizerStepPlan.by_hand(((0, 1, 2), (3, 4)), SEQ_LENS, normaliser)
    split_b = OptimizerStepPlan.by_hand(((0,), (1, 2, 3, 4)), SEQ_LENS, normaliser)
    plain = loss_settings()
    fields = {f.name: getattr(plain, f.name) for f in dataclasses.fields(LossSettings)}
    fields.pop("echo_coef")
    without_key = LossSettings(**fields)  # as before the key existed: its default
    echo = dataclasses.replace(plain, echo_coef=0.5)

    out = {}
    a, b = _actor(spec, state), _actor(spec, state)
    zero = a.train_step(batch, split_a, 0, None, None, dataclasses.replace(plain, echo_coef=0.0))
    none = b.train_step(batch, split_a, 0, None, None, without_key)
    out["coef0_bitwise"] = (
        all(
            torch.equal(x, y)
            for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True)
        )
        and zero.grad_norm == none.grad_norm
        and zero.stats == none.stats
    )

    c, d = _actor(spec, state), _actor(spec, state)
    logprobs = c.compute_logprobs(batch, [[0, 1, 2, 3, 4]], temperature=1.0)
    observation_nll = sum(
        -float(logprobs[i][j]) for i, mask in MASKS.items() for j, m in enumerate(mask) if m == 0
    )
    on_c = c.train_step(batch, split_a, 0, None, None, echo)
    on_d = d.train_step(batch, split_b, 0, None, None, echo)
    out["echo_loss"] = on_c.stats.echo_loss
    out["echo_tokens"] = on_c.stats.echo_tokens
    out["expected_echo_loss"] = observation_nll / normaliser
    out["expected_echo_tokens"] = float(sum(m == 0 for mask in MASKS.values() for m in mask))
    out["split_diff"] = _max_diff(_params(c), _params(d))
    out["split_grad_norms"] = (on_c.grad_norm, on_d.grad_norm)
    g = _actor(spec, state, packed=True)  # one packed row per micro-batch: the same update
    on_g = g.train_step(batch, split_a, 0, None, None, echo)
    out["packed_diff"] = _max_diff(_params(c), _params(g))
    out["packed_echo_loss"] = on_g.stats.echo_loss
    out["pg_equal"] = abs(on_c.stats.pg_loss - zero.stats.pg_loss) <= 1e-7
    out["echo_moved_vs_coef0"] = _max_diff(_params(c), _params(a))

    # only the zero-advantage trajectory 1: nothing moves without ECHO, ECHO moves it
    only_1 = OptimizerStepPlan.by_hand(((1,),), SEQ_LENS, float(trained[1]))
    e, f = _actor(spec, state), _actor(spec, state)
    start = _params(e)
    e.train_step(batch, only_1, 0, None, None, plain)
    f.train_step(batch, only_1, 0, None, None, echo)
    out["zero_adv_plain_moved"] = _max_diff(_params(e), start)
    out["zero_adv_echo_moved"] = _max_diff(_params(f), start)
    parallel.destroy()
    return out


def _state(hf_config: dict):
    from megarl.models.random_init import build_random_hf_model

    model = build_random_hf_model(hf_config, 3)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_echo_in_the_actor_is_exact_and_off_at_zero():
    [r] = launch(_worker, 1, args=(TINY, _state(TINY)), timeout_s=240)
    assert r["coef0_bitwise"], r
    assert r["echo_loss"] == pytest.approx(r["expected_echo_loss"], rel=1e-5), r
    assert r["echo_tokens"] == r["expected_echo_tokens"] == 10.0, r
    assert r["pg_equal"], r  # the policy loss itself is untouched
    assert r["split_diff"] <= 1e-6, r
    assert r["split_grad_norms"][0] == pytest.approx(r["split_grad_norms"][1], rel=1e-6), r
    assert r["packed_diff"] <= 1e-6, r
    assert r["packed_echo_loss"] == pytest.approx(r["echo_loss"], rel=1e-6), r
    assert r["echo_moved_vs_coef0"] > 1e-5, r
    assert r["zero_adv_plain_moved"] == 0.0, r
    assert r["zero_adv_echo_moved"] > 1e-5, r
