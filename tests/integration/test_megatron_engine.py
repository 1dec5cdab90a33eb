"""The Megatron engine across the actor's ranks: TP=2, PP=2, two data-parallel replicas (DP=2)
and expert parallelism (EP=2).

Rank 0 drives, the other ranks of its generation group follow its calls (with DP=2 each replica
generates its share of the requests, a call of one request leaving a replica idle); what rank 0 returns
must be what the engines sample on one process: the HF engine's greedy tokens, and logprobs of
one plain forward of the same weights. An interrupted and resumed call across the ranks gives
the uninterrupted responses.
"""

from __future__ import annotations

import pytest
import torch
from helpers.engines import InterruptAfter, reference_logprobs, sample_with_interruptions
from helpers.models import TINY_HF_CONFIG, TINY_MOE_HF_CONFIGS
from helpers.ranks import start_cpu_rank

from megarl.distributed.launcher import launch
from megarl.engines.base import Request, SamplingParams, request_seed
from megarl.models.random_init import build_random_hf_model

pytestmark = pytest.mark.slow

EOS = 2
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23], [40]] * 2
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)
UNEVEN = [Request(tuple(PROMPTS[0]), 1)] * 4
UNEVEN += [Request(tuple(PROMPTS[1]), 2, max_new_tokens=2)] * 4
"""Two groups of which one ends 6 tokens before the other: with DP=2 on replicas of their own
(a replica with nothing left waits, under expert parallelism on a filler row)."""
SAMPLED = SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=8, seed=7)


def _worker(ctx, tp: int, pp: int, ep: int, hf_config: dict, state: dict):
    from megarl.actor.megatron_actor import MegatronActor
    from megarl.config.actor import ActorConfig
    from megarl.distributed import parallel
    from megarl.engines.megatron import MegatronEngine, follows_driver
    from megarl.models.spec import spec_from_hf_config

    start_cpu_rank(ctx, tp, pp, ep=ep)
    spec = spec_from_hf_config(hf_config)
    actor = MegatronActor(
        spec, ActorConfig(tp=tp, pp=pp, ep=ep), "cpu", torch.float32, state, pad_id=0
    )
    engine = MegatronEngine([EOS], 0, spec.vocab_size)
    engine.bind_model(actor.chunks)
    result = None
    if ctx.rank == 0:
        requests = [Request(tuple(p), request_seed(SAMPLED.seed, i)) for i, p in enumerate(PROMPTS)]
        result = {
            "greedy": engine.generate(PROMPTS, GREEDY),
            "single": engine.generate(PROMPTS[:1], GREEDY),
            "uneven": engine.generate_requests(UNEVEN, GREEDY),
            "sampled": engine.generate(PROMPTS, SAMPLED),
            "resumed": sample_with_interruptions(
                engine, requests, SAMPLED, lambda: InterruptAfter(3)
            )[0],
        }
        engine.release_followers()
    elif follows_driver():
        engine.serve()
        result = "followed"
    parallel.destroy()
    return result


@pytest.mark.parametrize(
    ("hf_config", "tp", "pp", "ep", "world"),
    [
        (TINY_HF_CONFIG, 2, 1, 1, 2),
        (TINY_HF_CONFIG, 1, 2, 1, 2),
        (TINY_HF_CONFIG, 1, 1, 1, 2),
        (TINY_MOE_HF_CONFIGS["qwen3_moe"], 1, 1, 2, 2),
    ],
    ids=["tp2", "pp2", "dp2", "qwen3_moe-ep2"],
)
def test_rank_zero_samples_what_one_process_samples(hf_config, tp, pp, ep, world, tmp_path):
    from megarl.engines.hf import HFEngine
    from megarl.models.hf_io import load_hf_state_dict

    model = build_random_hf_model(hf_config, 3)
    model.save_pretrained(tmp_path)  # per-expert tensors (transformers 5 fuses them in memory)
    state = load_hf_state_dict(tmp_path)
    results = launch(_worker, world, args=(tp, pp, ep, hf_config, state), timeout_s=300)
    assert results[1:] == ["followed"] * (len(results) - 1)
    got = results[0]
    hf = HFEngine(model, eos_token_ids=[EOS], pad_token_id=0)
    assert [g.response_ids for g in got["greedy"]] == [
        g.response_ids for g in hf.generate(PROMPTS, GREEDY)
    ]
    assert [g.response_ids for g in got["sampled"]] == [
        g.response_ids for g in hf.generate(PROMPTS, SAMPLED)
    ]
    assert [g.response_ids for g in got["resumed"]] == [g.response_ids for g in got["sampled"]]
    assert got["single"][0].response_ids == got["greedy"][0].response_ids
    assert [g.response_ids for g in got["uneven"]] == [
        g.response_ids for g in hf.generate_requests(UNEVEN, GREEDY)
    ]
    assert [len(g.response_ids) for g in got["uneven"]] == [8] * 4 + [2] * 4
    for name, temperature in (("greedy", 1.0), ("sampled", 0.9), ("resumed", 0.9)):
        for generation in got[name]:
            expected = reference_logprobs(model, generation, temperature)
            got_lp = torch.tensor(generation.response_logprobs)
            torch.testing.assert_close(got_lp, expected, atol=1e-5, rtol=0)


def _rows(run_dir) -> list[dict]:
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "overrides",
    [
        {
            "actor.tp": 2,
            "actor.lora.rank": 4,
            "actor.lora.alpha": 8,
            "trainer.val_before_train": "true",
            "trainer.val_interval": 1,
            "data.val_problems": 4,
        },
        {"model": "tiny_qwen3_moe", "actor.ep": 2},
        {
            "rollout.batch_invariant": "true",
            "trainer.val_before_train": "true",
            "data.val_problems": 4,
        },
    ],
    ids=["tp2-lora-validation", "qwen3_moe-ep2", "dp2-batch-invariant-validation"],
)
def test_a_run_generates_with_the_actor_and_never_syncs(overrides, tmp_path):
    """Two steps on two ranks; lr 5e-2 moves the policy in step 1, so step 2's logprobs match
    the trainer's only because the engine generates with the updated actor itself."""
    from helpers.runs import tiny_overrides

    from megarl.train import run

    run_dir = tmp_path / "run"
    settings = {
        "rollout.engine": "megatron",
        "trainer.n_gpus_per_node": 2,
        "actor.lr": 5e-2,
        **overrides,
    }
    run(tiny_overrides(run_dir, steps=2, **settings))
    rows = [row for row in _rows(run_dir) if row["step"] >= 1]
    assert [row["step"] for row in rows] == [1, 2]
    exact = "rollout.batch_invariant" in overrides  # the replicas' shares decoded apart
    for row in rows:
        assert row["rollout/logprob_abs_diff"] <= (0.0 if exact else 1e-5), row
        assert row["timing_s/update_weights"] == 0.0
        assert "sync: skip (the engine is the actor's model)" in row["gates/summary"]
        assert row["gates/base_weight_sync"] == 0
    if "trainer.val_interval" in overrides:
        assert all("val-core/unknown/reward/mean@1" in row for row in rows)
    if "trainer.val_before_train" in overrides:  # validation generates with the engine too
        assert "val-core/unknown/reward/mean@1" in _rows(run_dir)[0]
