"""Packed micro-batches (one row, attention and RoPE per sequence) equal right-padded ones.

Real Megatron ranks on CPU/gloo in fp32, tiny random Llama: logprobs of packed and padded
micro-batches agree to 1e-6 at TP=1 and TP=2; two Adam steps of packed training leave the
parameters within 1e-6 of padded training; and the rotary-embedded queries of each packed
sequence equal its padded row's (they would be rotated by the sequence's offset if positions did
not restart; a control run with one long "sequence" shows the check detects that).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers.batches import random_batch
from helpers.models import TINY_HF_CONFIG
from helpers.ranks import loss_settings, start_cpu_rank

from megarl.distributed.launcher import launch

pytestmark = pytest.mark.slow

TINY = dict(TINY_HF_CONFIG, num_hidden_layers=2)
SEQ_LENS = (7, 19, 4, 12, 9)
PROMPT_LENS = (3, 5, 2, 4, 3)
MICRO_BATCHES = ((0, 1, 2), (3, 4))


def _batch():
    advantages = torch.tensor([1.0, -0.5, 0.75, -1.0, 0.25])
    return random_batch(SEQ_LENS, PROMPT_LENS, TINY["vocab_size"], advantages, seed=5)


def _actor(spec, tp: int, state, packed: bool):
    from megarl.actor.megatron_actor import MegatronActor
    from megarl.config.actor import ActorConfig
    from megarl.distributed.execution import Environment, ExecutionRequest, decide_execution

    plan = decide_execution(
        ExecutionRequest(device="cpu", pack_sequences=packed),
        Environment(cuda_available=False, transformer_engine=False),
    )
    cfg = ActorConfig(tp=tp, lr=1e-4, logprob_chunk_tokens=16, pack_sequences=packed)
    return MegatronActor(
        spec,
        cfg,
        "cpu",
        torch.float32,
        state,
        pad_id=0,
        trainable=True,
        init_seed=0,
        execution=plan,
    )


def _captured_queries(actor, mb):
    """Layer-0 queries after RoPE, per sequence: ``[len_i, heads, dim]``."""
    from megarl.models.chunk import unwrap

    seen = []
    core = unwrap(actor.model).decoder.layers[0].self_attention.core_attention
    handle = core.register_forward_pre_hook(lambda _m, args, _kw=None: seen.append(args[0]))
    try:
        with torch.no_grad():
            actor._run_schedule(
                [mb],
                lambda _mb, logits: (logits.new_zeros(()), torch.tensor(1), {}),
                forward_only=True,
            )
    finally:
        handle.remove()
    query = seen[0]
    lens = [SEQ_LENS[i] for i in mb.seq_indices]
    if mb.is_packed:
        bounds = torch.tensor([0, *lens]).cumsum(0).tolist()
        return [query[a:b] for a, b in itertools.pairwise(bounds)]
    return [query[:n, row] for row, n in enumerate(lens)]


def _worker(ctx, tp: int, hf_config: dict, state):
    import dataclasses

    from megarl.distributed import parallel
    from megarl.models.spec import spec_from_hf_config
    from megarl.planner.step_plan import OptimizerStepPlan

    start_cpu_rank(ctx, tp)
    spec = spec_from_hf_config(hf_config)
    batch = _batch()
    padded, packed = _actor(spec, tp, state, False), _actor(spec, tp, state, True)

    groups = [list(g) for g in MICRO_BATCHES]
    lp_pad = padded.compute_logprobs(batch, groups, temperature=0.8)
    lp_pack = packed.compute_logprobs(batch, groups, temperature=0.8)
    logprob_diff = max((lp_pad[i] - lp_pack[i]).abs().max().item() for i in lp_pad)

    q_pad = _captured_queries(padded, padded._micro_batch(batch, MICRO_BATCHES[0]))
    mb_pack = packed._micro_batch(batch, MICRO_BATCHES[0])
    q_pack = _captured_queries(packed, mb_pack)
    query_diff = max((a - b).abs().max().item() for a, b in zip(q_pad, q_pack, strict=True))
    total = mb_pack.num_tokens  # control: the whole row as one sequence (positions 0..T-1)
    one_long = dataclasses.replace(
        mb_pack,
        cu_seqlens=(0, total),
        loss_mask_BL=torch.zeros(1, total),
        response_mask_BL=torch.zeros(1, total),
        advantages_B=torch.zeros(1),
    )
    q_wrong = _captured_queries(packed, one_long)
    no_restart_diff = (q_pad[1] - q_wrong[1]).abs().max().item()

    loss = loss_settings(entropy_coef=0.01)
    work = OptimizerStepPlan.by_hand(
        MICRO_BATCHES,
        SEQ_LENS,
        normaliser=sum(n - p for n, p in zip(SEQ_LENS, PROMPT_LENS, strict=True)),
    )
    before = [p.detach().clone() for p in padded.model.parameters()]
    losses = []
    for _ in range(2):
        s_pad = padded.train_step(batch, work, 0, None, None, loss)
        s_pack = packed.train_step(batch, work, 0, None, None, loss)
        losses.append(
            (s_pad.stats.pg_loss, s_pack.stats.pg_loss, s_pad.grad_norm, s_pack.grad_norm)
        )
    # GSPO's sequence ratio and seq-mean-token-mean's 1 / length are per sequence: the same
    # whether the sequences sit in padded rows or share one packed row
    gspo = dataclasses.replace(loss, agg="seq-mean-token-mean", policy_loss="gspo")
    work = dataclasses.replace(work, normaliser=float(len(SEQ_LENS)))
    for _ in range(2):
        s_pad = padded.train_step(batch, work, 0, None, None, gspo)
        s_pack = packed.train_step(batch, work, 0, None, None, gspo)
        losses.append(
            (s_pad.stats.pg_loss, s_pack.stats.pg_loss, s_pad.grad_norm, s_pack.grad_norm)
        )
    param_diff = max(
        (a - b).abs().max().item()
        for a, b in zip(padded.model.parameters(), packed.model.parameters(), strict=True)
    )
    moved = max(
        (a - b).abs().max().item() for a, b in zip(padded.model.parameters(), before, strict=True)
    )
    parallel.destroy()
    return {
        "logprob_diff": logprob_diff,
        "query_diff": query_diff,
        "no_restart_diff": no_restart_diff,
        "param_diff": param_diff,
        "moved": moved,
        "losses": losses,
    }


def _state(hf_config: dict):
    from megarl.models.random_init import build_random_hf_model

    model = build_random_hf_model(hf_config, 3)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_packed_equals_padded(tp):
    results = launch(_worker, tp, args=(tp, TINY, _state(TINY)), timeout_s=240)
    for r in results:
        assert r["logprob_diff"] <= 1e-6, r
        assert r["query_diff"] <= 1e-6, r
        assert r["no_restart_diff"] > 1e-2, r  # the RoPE check can fail
        assert r["moved"] > 1e-5, r  # training really changed the weights
        assert r["param_diff"] <= 1e-6, r
        for pg_pad, pg_pack, gn_pad, gn_pack in r["losses"]:
            assert abs(pg_pad - pg_pack) <= 1e-6 and abs(gn_pad - gn_pack) <= 1e-5, r
