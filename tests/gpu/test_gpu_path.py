"""The CUDA path of the Megatron actor: bf16 numerics, packing (THD), chunked logprobs, a GRPO run.

Skipped without CUDA, with the reason; the transformer-engine cases also without TE. Each test
runs one Megatron rank (NCCL, world of one, in-process) and destroys its process groups.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from helpers.batches import random_batch
from helpers.models import TINY_HF_CONFIG
from helpers.ranks import start_rank

pytestmark = pytest.mark.gpu

NO_CUDA = "needs a CUDA device (torch.cuda.is_available() is False)"
NO_TE = "needs transformer-engine (pip install -e '.[gpu]')"


def require_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip(NO_CUDA)
    if importlib.util.find_spec("megatron") is None:
        pytest.skip("needs megatron-core")


def require_transformer_engine() -> None:
    require_cuda()
    if importlib.util.find_spec("transformer_engine") is None:
        pytest.skip(NO_TE)


BF16_MEAN_LOGP_TOL = 2e-2
BF16_MAX_LOGP_TOL = 0.25
TINY = dict(
    TINY_HF_CONFIG,
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    max_position_embeddings=512,
)
SEQ_LENS = (37, 120, 9, 64, 200)


def _plan(packed: bool, te: bool, dtype: str):
    from megarl.distributed.execution import Environment, ExecutionRequest, decide_execution

    env = Environment(
        cuda_available=True, transformer_engine=te, device_name=torch.cuda.get_device_name()
    )
    return decide_execution(
        ExecutionRequest(device="cuda", pack_sequences=packed, model_dtype=dtype), env
    )


def _batch(vocab: int):
    prompts = tuple(max(1, n // 3) for n in SEQ_LENS)
    return random_batch(SEQ_LENS, prompts, vocab, torch.linspace(-1, 1, len(SEQ_LENS)), seed=0)


def _actor(spec, state, plan):
    from megarl.actor.megatron_actor import MegatronActor
    from megarl.config.actor import ActorConfig

    cfg = ActorConfig(lr=1e-4, pack_sequences=plan.pack_sequences, logprob_chunk_tokens=128)
    return MegatronActor(
        spec, cfg, "cuda", getattr(torch, plan.params_dtype), state, pad_id=0, execution=plan
    )


# --- Megatron vs HF in bf16 ----------------------------------------------------------------


def _megatron_vs_hf_worker(ctx, te: bool):
    from megarl.distributed import parallel
    from megarl.models.hf_io import load_hf_model
    from megarl.models.spec import spec_from_hf_config

    start_rank(ctx, "cuda")
    hf, _ = load_hf_model(None)
    hf = hf.to("cuda", torch.bfloat16).eval()
    spec = spec_from_hf_config(hf.config.to_dict())
    state = {k: v.float().cpu() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    batch = _batch(spec.vocab_size)
    actor = _actor(spec, state, _plan(packed=True, te=te, dtype="bfloat16"))
    diffs = _logprob_diffs_vs_hf(actor, hf, batch)
    parallel.destroy()
    return diffs


def _logprob_diffs_vs_hf(actor, hf, batch) -> dict[str, float]:
    """Mean and max |actor - HF| over the response tokens' logprobs (HF's logits in fp32)."""
    got = actor.compute_logprobs(batch, [list(range(batch.num_seqs))], temperature=1.0)
    diffs = []
    with torch.no_grad():
        for i, toks in enumerate(batch.tokens):
            logits = hf(toks.unsqueeze(0).cuda()).logits.float()[0]
            ref = (
                torch.log_softmax(logits, -1)[:-1]
                .gather(-1, toks[1:].cuda().unsqueeze(-1))
                .squeeze(-1)[batch.prompt_lens[i] - 1 :]
            )
            diffs.append((got[i].cuda().float() - ref).abs())
    flat = torch.cat(diffs)
    return {"mean": flat.mean().item(), "max": flat.max().item()}


@pytest.mark.parametrize("te", [False, True], ids=["local-sdpa", "transformer-engine"])
def test_megatron_matches_hf_in_bf16(te):
    (require_transformer_engine if te else require_cuda)()
    from megarl.distributed.launcher import launch

    [r] = launch(_megatron_vs_hf_worker, 1, args=(te,), timeout_s=600)
    assert r["mean"] <= BF16_MEAN_LOGP_TOL and r["max"] <= BF16_MAX_LOGP_TOL, r


def _tiny_qwen3_vs_hf_worker(ctx, te: bool):
    """A random-init Qwen3 (q/k norms, head size apart from hidden / heads) in bf16 against its
    HF model in fp32: the per-head norms on the local and the transformer-engine layer specs."""
    from megarl.distributed import parallel
    from megarl.models.random_init import build_random_hf_model
    from megarl.models.spec import spec_from_hf_config

    start_rank(ctx, "cuda")
    config = dict(TINY, model_type="qwen3", head_dim=128)
    hf = build_random_hf_model(config, 3)
    with torch.no_grad():  # norms start at ones: make them differ, so a mis-mapped norm shows
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    hf = hf.cuda().eval()
    batch = _batch(config["vocab_size"])
    actor = _actor(spec_from_hf_config(config), state, _plan(packed=te, te=te, dtype="bfloat16"))
    diffs = _logprob_diffs_vs_hf(actor, hf, batch)
    parallel.destroy()
    return diffs


@pytest.mark.parametrize("te", [False, True], ids=["local-sdpa", "transformer-engine"])
def test_tiny_qwen3_matches_hf_in_bf16(te):
    (require_transformer_engine if te else require_cuda)()
    from megarl.distributed.launcher import launch

    [r] = launch(_tiny_qwen3_vs_hf_worker, 1, args=(te,), timeout_s=600)
    assert r["mean"] <= BF16_MEAN_LOGP_TOL and r["max"] <= BF16_MAX_LOGP_TOL, r


# --- packed == padded ----------------------------------------------------------------------


def _packing_worker(ctx, te: bool, dtype: str):
    from megarl.distributed import parallel
    from megarl.models.random_init import build_random_hf_model
    from megarl.models.spec import spec_from_hf_config

    start_rank(ctx, "cuda")
    spec = spec_from_hf_config(TINY)
    state = {k: v.clone() for k, v in build_random_hf_model(TINY, 3).state_dict().items()}
    batch = _batch(spec.vocab_size)
    groups = [[0, 1, 2], [3, 4]]
    out = {}
    for packed in (False, True):
        actor = _actor(spec, state, _plan(packed, te, dtype))
        out[packed] = actor.compute_logprobs(batch, groups, temperature=1.0)
        if packed:
            out["plan"] = actor.execution.packed_attention
    parallel.destroy()
    diffs = torch.cat([(out[False][i].float() - out[True][i].float()).abs() for i in out[False]])
    return {"mean": diffs.mean().item(), "max": diffs.max().item(), "plan": out["plan"]}


def test_packed_equals_padded_thd_transformer_engine():
    require_transformer_engine()
    from megarl.distributed.launcher import launch

    [r] = launch(_packing_worker, 1, args=(True, "bfloat16"), timeout_s=600)
    assert r["plan"] == "te_thd"
    assert r["mean"] <= 5e-3 and r["max"] <= 5e-2, r  # bf16, different kernels per layout


def test_packed_equals_padded_sdpa_blocks_fp32_on_cuda():
    require_cuda()
    from megarl.distributed.launcher import launch

    [r] = launch(_packing_worker, 1, args=(False, "float32"), timeout_s=600)
    assert r["plan"] == "sdpa_blocks"
    assert r["max"] <= 1e-4, r  # fp32 (TF32 matmuls may be on)


# --- chunked logprobs on CUDA ----------------------------------------------------------------


def test_chunked_logprobs_equal_unchunked_and_bound_memory_on_cuda():
    require_cuda()
    from megarl.models.vocab_parallel import VocabShard, token_logprobs_and_entropy

    tokens, vocab, chunk = 8192, 49152, 1024
    shard = VocabShard(start=0, real_vocab_size=vocab)
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(1, tokens, vocab, device="cuda", generator=gen).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (1, tokens), device="cuda", generator=gen)
    results = {}
    for size in (tokens, chunk):
        x = logits.detach().requires_grad_(True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        logp, ent = token_logprobs_and_entropy(x, targets, shard, chunk_tokens=size)
        (logp.sum() + ent.sum()).backward()
        torch.cuda.synchronize()
        results[size] = (
            logp.detach(),
            ent.detach(),
            x.grad,
            torch.cuda.max_memory_allocated() - base,
        )
    (lp_full, ent_full, g_full, peak_full), (lp_c, ent_c, g_c, peak_c) = results.values()
    assert torch.allclose(lp_full, lp_c, atol=1e-5) and torch.allclose(ent_full, ent_c, atol=1e-5)
    assert torch.allclose(g_full.float(), g_c.float(), atol=1e-6)
    full_fp32 = tokens * vocab * 4
    grad_bf16 = tokens * vocab * 2  # the logits' own gradient (and its concatenation) is needed
    assert peak_c <= 2 * grad_bf16 + 8 * chunk * vocab * 4, (peak_c, peak_full)
    assert peak_full >= 4 * full_fp32 and peak_c < peak_full / 2, (peak_c, peak_full)


# --- a 3-step GRPO run ---------------------------------------------------------------------


def test_grpo_smollm2_three_steps_on_one_gpu(tmp_path):
    require_cuda()
    from megarl.train import run

    result = run(
        [
            "trainer.device=cuda",
            "trainer.total_steps=3",
            f"trainer.run_dir={tmp_path}",
            "trainer.log_console=false",
            "trainer.tensorboard=false",
            "rollout.engine=hf",
            "rollout.n=8",
            "data.prompts_per_step=4",
            "rollout.max_new_tokens=32",
            "planner.prune_zero_adv=off",  # every step trains, so every step has the checks below
        ]
    )
    history = result.history
    assert len(history) == 3
    for m in history:
        assert math.isfinite(m["actor/pg_loss"]) and math.isfinite(m["actor/grad_norm"])
        assert m["rollout/logprob_abs_diff"] < 0.1, m  # bf16 trainer vs fp32/bf16 engine
        assert m["perf/throughput"] > 0
        if "not computed" not in m["perf/mfu_note"]:
            assert 0 < m["perf/mfu/actor"] < 1, m
