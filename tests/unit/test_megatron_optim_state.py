"""Megatron optimizer state <-> megarl's per-parameter checkpoint state, on stand-ins.

Megatron's optimizers assert CUDA tensors, so here each data-parallel rank's optimizer is a
stand-in with the attributes the module reads (``buffers``, ``model_param_gbuf_map``, the range
and group maps), holding a real ``torch.optim.AdamW`` over slices that cut parameters anywhere,
as the distributed optimizer's buckets do. The same code runs against Megatron on CUDA in
``tests/gpu/test_gpu_checkpoint.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megarl.actor.megatron_optim_state import gather_param_states, index_params, load_param_state
from megarl.actor.optim import CpuAdamW

SIZES = (6, 5, 9)  # 20 elements, 10 per rank: the middle parameter is cut at 4
DP = 2


def _full_state(seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "main_param": torch.randn(n, generator=g),
            "exp_avg": torch.randn(n, generator=g),
            "exp_avg_sq": torch.rand(n, generator=g),
        }
        for n in SIZES
    ]


def _distributed_rank(rank: int, dtype: torch.dtype, full=None):
    """Rank ``rank``'s stand-in DistributedOptimizer; with ``full``, its slices of that state
    (else no state yet). Model params are ``dtype`` (bf16: the optimizer has fp32 main copies)."""
    params = [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n in SIZES]
    per_rank = sum(SIZES) // DP
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    index_map, gbuf_map, ranges, group_index, mains = {}, {}, {}, {}, []
    start = 0
    for p, n in zip(params, SIZES, strict=True):
        index_map[p] = (start, start + n, 0)
        a, b = max(start, lo), min(start + n, hi)
        if b > a:
            gbuf_map[p] = (0, dtype, 0)
            ranges[p] = {"param": SimpleNamespace(start=a - start, end=b - start)}
            group_index[p] = (0, len(mains))
            if dtype == torch.float32:  # Megatron updates a view of the fp32 model param
                main = p.detach().view(-1)[a - start : b - start]
            else:
                main = torch.zeros(b - a)
            mains.append(main)
        start += n
    inner = torch.optim.AdamW(mains, lr=0.1)
    part = SimpleNamespace(
        buffers=[SimpleNamespace(params=params, param_index_map=index_map)],
        model_param_gbuf_map=gbuf_map,
        model_param_group_index_map=group_index,
        optimizer=inner,
        data_parallel_group=None,
        _get_model_param_range_map=lambda p: ranges[p],
    )
    part._get_main_param_and_optimizer_states = lambda p: {
        "param": inner.param_groups[0]["params"][group_index[p][1]],
        **inner.state[inner.param_groups[0]["params"][group_index[p][1]]],
    }
    if full is not None:
        for p, state in zip(params, full, strict=True):
            if p not in ranges:
                continue
            r = ranges[p]["param"]
            main = inner.param_groups[0]["params"][group_index[p][1]]
            with torch.no_grad():
                main.copy_(state["main_param"][r.start : r.end])
            inner.state[main] = {
                "exp_avg": state["exp_avg"][r.start : r.end].clone(),
                "exp_avg_sq": state["exp_avg_sq"][r.start : r.end].clone(),
                "step": torch.tensor(3.0),
            }
    return params, part


def _gather_over_two_ranks(parts, step: int):
    """Rank 1 contributes first, then rank 0 sums each collective's tensors (in call order)."""
    sent: list[torch.Tensor] = []

    def send(tensor, group):
        sent.append(tensor.clone())
        return False

    calls = iter(range(10**6))

    def receive(tensor, group):
        tensor += sent[next(calls)]
        return True

    assert gather_param_states(parts[1], step, reduce=send) == {}
    return gather_param_states(parts[0], step, reduce=receive)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_distributed_state_is_assembled_whole_on_the_writing_rank(dtype):
    full = _full_state(0)
    ranks = [_distributed_rank(r, dtype, full) for r in range(DP)]
    states = _gather_over_two_ranks([part for _, part in ranks], step=3)
    params0 = ranks[0][0]
    assert set(states) == set(params0)
    for p, expected in zip(params0, full, strict=True):
        got = states[p]
        assert got["exp_avg"].shape == p.shape
        assert torch.equal(got["exp_avg"], expected["exp_avg"])
        assert torch.equal(got["exp_avg_sq"], expected["exp_avg_sq"])
        assert got["step"].item() == 3.0
        if dtype == torch.float32:  # the model param is the main copy: nothing extra saved
            assert "main_param" not in got
        else:
            assert torch.equal(got["main_param"], expected["main_param"])


def test_distributed_load_gives_each_rank_its_slice_bitwise():
    full = _full_state(1)
    before = [{k: v.clone() for k, v in state.items()} for state in full]
    for rank in range(DP):
        params, part = _distributed_rank(rank, torch.bfloat16)
        index = index_params(part)
        assert set(index) == set(params)
        for p, state in zip(params, full, strict=True):
            load_param_state(index[p], p, {**state, "step": torch.tensor([7.0])})
        reference_params, reference = _distributed_rank(rank, torch.bfloat16, full)
        for p, q in zip(params, reference_params, strict=True):
            if p not in part.model_param_gbuf_map:
                assert index[p].main is None  # held by the other rank
                continue
            main = index[p].main
            expected_main = reference._get_main_param_and_optimizer_states(q)
            assert torch.equal(main, expected_main["param"])
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(part.optimizer.state[main][key], expected_main[key])
            assert part.optimizer.state[main]["step"].item() == 7.0
    for kept, state in zip(before, full, strict=True):  # loading leaves the read tensors alone
        assert all(torch.equal(kept[k], state[k]) for k in state)


class FusedAdamStandIn(torch.optim.Optimizer):
    """Counts steps per parameter group, as TE's and apex's FusedAdam do."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})


FusedAdamStandIn.__module__ = "transformer_engine.pytorch.optimizers"


def test_float16_optimizer_round_trip_with_main_copies_and_group_step():
    models = [torch.nn.Parameter(torch.randn(4, 3).bfloat16()) for _ in range(2)]
    router = torch.nn.Parameter(torch.randn(5))  # an fp32 param: updated in place
    mains = [m.detach().float().clone() for m in models]
    inner = FusedAdamStandIn([*mains, router])
    for t in [*mains, router]:
        inner.state[t] = {"exp_avg": torch.randn_like(t), "exp_avg_sq": torch.rand_like(t)}
    part = SimpleNamespace(
        float16_groups=[models],
        fp32_from_float16_groups=[mains],
        fp32_from_fp32_groups=[[router]],
        optimizer=inner,
    )
    states = gather_param_states(part, step=5)
    assert set(states) == {*models, router}
    assert torch.equal(states[models[1]]["main_param"], mains[1])
    assert "main_param" not in states[router]
    assert states[router]["step"].item() == 5.0

    fresh_models = [torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.bfloat16)) for _ in range(2)]
    fresh_router = torch.nn.Parameter(torch.zeros(5))
    fresh_mains = [torch.zeros(4, 3) for _ in range(2)]
    fresh = SimpleNamespace(
        float16_groups=[fresh_models],
        fp32_from_float16_groups=[fresh_mains],
        fp32_from_fp32_groups=[[fresh_router]],
        optimizer=FusedAdamStandIn([*fresh_mains, fresh_router]),
    )
    index = index_params(fresh)
    for new, old in zip([*fresh_models, fresh_router], [*models, router], strict=True):
        load_param_state(index[new], new, states[old])
    for new_main, old_main in zip(fresh_mains, mains, strict=True):
        assert torch.equal(new_main, old_main)
        assert torch.equal(
            fresh.optimizer.state[new_main]["exp_avg"], inner.state[old_main]["exp_avg"]
        )
    assert torch.equal(
        fresh.optimizer.state[fresh_router]["exp_avg_sq"], inner.state[router]["exp_avg_sq"]
    )
    assert fresh.optimizer.param_groups[0]["step"] == 5
    assert "step" not in fresh.optimizer.state[fresh_mains[0]]


def test_nothing_is_gathered_before_the_first_step():
    _, part = _distributed_rank(0, torch.bfloat16)
    assert gather_param_states(part, step=0) == {}


def test_cpu_adamw_takes_a_saved_main_copy_as_the_weight():
    model = torch.nn.Linear(3, 2, bias=False)
    model.weight.main_grad = torch.zeros_like(model.weight)
    cfg = SimpleNamespace(
        lr=0.1, optim=SimpleNamespace(betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0, grad_clip=0.0)
    )
    opt = CpuAdamW([model], cfg)  # pyright: ignore[reportArgumentType]
    exact = torch.randn(2, 3)
    state = {"exp_avg": torch.ones(2, 3), "exp_avg_sq": torch.ones(2, 3), "step": torch.tensor(2.0)}
    opt.load_param_state(model.weight, {**state, "main_param": exact})
    assert torch.equal(model.weight.detach(), exact)
    assert set(opt.param_states()[model.weight]) == {"exp_avg", "exp_avg_sq", "step"}
