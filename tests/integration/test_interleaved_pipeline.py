"""Training through Megatron's interleaved pipeline (``actor.vpp=2``) equals the plain pipeline.

Real Megatron ranks on CPU/gloo in fp32, a tiny random Llama of 4 layers over PP=2: with VPP=2
each rank holds two chunks of one layer each and runs the interleaved 1F1B schedule, whose
stages exchange one activation shape (every packed micro-batch is widened to the longest with a
padding tail no sequence reads). Two Adam steps over four micro-batches of uneven lengths give
the same losses, gradient norms and weights as the same steps at VPP=1.
"""

from __future__ import annotations

import pytest
import torch
from helpers.batches import random_batch
from helpers.models import TINY_HF_CONFIG
from helpers.ranks import cpu_actor, loss_settings, start_cpu_rank

from megarl.distributed.launcher import launch
from megarl.models.random_init import build_random_hf_model

pytestmark = pytest.mark.slow

SEQ_LENS = (7, 19, 4, 12, 9, 15, 6, 11)
PROMPT_LENS = (3, 5, 2, 4, 3, 6, 2, 5)
MICRO_BATCHES = ((0, 1), (2, 3, 4), (5,), (6, 7))  # a multiple of PP, of uneven widths


def _worker(ctx, vpp: int, state: dict) -> dict | None:
    from megarl.config.actor import ActorConfig
    from megarl.distributed import parallel
    from megarl.export.stream import collect_state_dict, open_stream
    from megarl.planner.step_plan import OptimizerStepPlan

    start_cpu_rank(ctx, 1, 2, vpp if vpp > 1 else None)
    cfg = ActorConfig(pp=2, vpp=vpp, lr=1e-3, pack_sequences=True)
    actor = cpu_actor(TINY_HF_CONFIG, cfg, state, trainable=True)
    spec = actor.spec
    advantages = torch.linspace(-1.0, 1.0, len(SEQ_LENS))
    batch = random_batch(SEQ_LENS, PROMPT_LENS, TINY_HF_CONFIG["vocab_size"], advantages, seed=7)
    work = OptimizerStepPlan.by_hand(
        MICRO_BATCHES,
        SEQ_LENS,
        normaliser=sum(n - p for n, p in zip(SEQ_LENS, PROMPT_LENS, strict=True)),
    )
    steps = []
    for _ in range(2):
        result = actor.train_step(batch, work, 0, None, None, loss_settings(entropy_coef=0.01))
        steps.append((result.stats.pg_loss, result.grad_norm))
    logprobs = actor.compute_logprobs(batch, [list(g) for g in MICRO_BATCHES], temperature=1.0)
    weights = collect_state_dict(open_stream(actor.local_params(), spec, 1 << 20, vpp=vpp))
    out = {
        "chunks": len(actor.chunks),
        "steps": steps,
        "logprobs": logprobs,
        "weights": weights,
    }
    parallel.destroy()
    return out


def _run(vpp: int, state: dict) -> dict:
    results = launch(_worker, 2, args=(vpp, state), timeout_s=300)
    assert [r["chunks"] for r in results] == [vpp, vpp]
    return {
        "steps": results[1]["steps"],  # the last stage computes the loss
        "logprobs": results[1]["logprobs"],
        "weights": results[0]["weights"],  # gathered on rank 0
    }


def test_interleaved_training_equals_the_plain_pipeline():
    state = build_random_hf_model(TINY_HF_CONFIG, seed=3).state_dict()
    plain, interleaved = _run(1, state), _run(2, state)
    for (loss_a, norm_a), (loss_b, norm_b) in zip(
        plain["steps"], interleaved["steps"], strict=True
    ):
        assert norm_a > 0
        assert abs(loss_a - loss_b) <= 1e-6 * max(1.0, abs(loss_a)), (loss_a, loss_b)
        assert abs(norm_a - norm_b) <= 1e-5 * norm_a, (norm_a, norm_b)
    assert sorted(plain["logprobs"]) == sorted(interleaved["logprobs"]) == list(range(8))
    for i, lp in plain["logprobs"].items():
        assert torch.allclose(lp, interleaved["logprobs"][i], atol=1e-5), i
    assert plain["weights"] is not None and sorted(plain["weights"]) == sorted(
        interleaved["weights"]
    )
    moved = max((plain["weights"][k] - state[k]).abs().max().item() for k in state)
    diff = max((plain["weights"][k] - interleaved["weights"][k]).abs().max().item() for k in state)
    assert moved > 1e-4 and diff <= 1e-6, (moved, diff)
