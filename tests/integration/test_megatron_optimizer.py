"""Megatron-Core's optimizer runs on the CPU (gloo) and equals torch's AdamW and itself.

The same three steps of gradients (random, a different stream on every data-parallel rank, so
the DP reduction matters) are applied by ``actor.optim.impl=torch`` (``torch.optim.AdamW``),
by Megatron's plain optimizer and by its distributed one (state sharded over DP, gradients
reduce-scattered, parameters all-gathered), each on a fresh actor built from the same weights.
Megatron's optimizer computes the gradient norm in fp32 and torch's path in fp64, so the clip
coefficients differ in their last bits: the weights agree to 1e-6 (the bound a GPU user can
rely on when moving between the two), and plain vs distributed to one fp32 rounding of the
largest weights (the norm weights, ~1: 1.2e-7).
"""

from __future__ import annotations

import pytest
import torch
from helpers.models import TINY_HF_CONFIG
from helpers.ranks import start_cpu_rank

from megarl.distributed.launcher import launch
from megarl.models.random_init import build_random_hf_model

pytestmark = pytest.mark.slow

STEPS = 3
IMPLS = (("torch", False), ("megatron", False), ("megatron", True))
"""(``actor.optim.impl``, ``actor.optim.distributed``), the first the reference."""
ONE_ROUNDING_AT_ONE = 2 * torch.finfo(torch.float32).eps


def _train(spec, state, tp: int, impl: str, distributed: bool):
    """A fresh actor, ``STEPS`` optimizer steps on seeded gradients: (weights, norms, plan,
    how far the weights moved)."""
    from megatron.core import parallel_state as ps

    from megarl.actor.megatron_actor import MegatronActor
    from megarl.config.actor import ActorConfig, OptimConfig

    optim = OptimConfig(impl=impl, distributed=distributed, grad_clip=1.0, weight_decay=0.0)
    cfg = ActorConfig(tp=tp, lr=1e-3, optim=optim)
    actor = MegatronActor(spec, cfg, "cpu", torch.float32, state, pad_id=0, trainable=True)
    assert actor.optimizer is not None
    dp_rank = ps.get_data_parallel_rank()
    before = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    norms = []
    for step in range(STEPS):
        actor.optimizer.zero_grad()
        for index, (_, param) in enumerate(actor.model.named_parameters()):
            gen = torch.Generator().manual_seed(10_000 * step + 100 * index + dp_rank)
            param.main_grad.copy_(torch.randn(param.shape, generator=gen))
        actor.model.finish_grad_sync()  # DP all-reduce, or reduce-scatter when distributed
        norms.append(actor.optimizer.step())
    weights = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    moved = max((w - before[n]).abs().max().item() for n, w in weights.items())
    return weights, norms, actor.execution.summary(), moved


def _worker(ctx, tp: int, state):
    from megarl.distributed import parallel
    from megarl.models.spec import spec_from_hf_config

    start_cpu_rank(ctx, tp)
    spec = spec_from_hf_config(TINY_HF_CONFIG)
    runs = {(impl, dist): _train(spec, state, tp, impl, dist) for impl, dist in IMPLS}
    parallel.destroy()

    def max_diff(a, b) -> float:
        return max((runs[a][0][n] - runs[b][0][n]).abs().max().item() for n in runs[a][0])

    return {
        "plans": [run[2] for run in runs.values()],
        "norms": [run[1] for run in runs.values()],
        "moved": min(run[3] for run in runs.values()),
        "megatron_vs_torch": max_diff(IMPLS[1], IMPLS[0]),
        "distributed_vs_torch": max_diff(IMPLS[2], IMPLS[0]),
        "distributed_vs_plain": max_diff(IMPLS[2], IMPLS[1]),
    }


@pytest.mark.parametrize(("tp", "world"), [(1, 2), (2, 4)], ids=["dp2", "tp2-dp2"])
def test_megatron_optimizer_on_cpu_matches_torch_adamw_plain_and_distributed(tp, world):
    state = {k: v.clone() for k, v in build_random_hf_model(TINY_HF_CONFIG, 3).state_dict().items()}
    results = launch(_worker, world, args=(tp, state), timeout_s=600)
    for result in results:
        plans = result["plans"]
        assert "optim torch_adamw" in plans[0], plans
        assert "optim megatron |" in plans[1], plans
        assert "optim megatron (distributed)" in plans[2], plans
        for norms in result["norms"][1:]:  # every step's norm reported, equal to torch's
            assert norms == pytest.approx(result["norms"][0], rel=1e-6)
        assert result["moved"] > 1e-3, result  # every optimizer applied its updates
        assert result["megatron_vs_torch"] <= 1e-6, result
        assert result["distributed_vs_torch"] <= 1e-6, result
        assert result["distributed_vs_plain"] <= ONE_ROUNDING_AT_ONE, result
