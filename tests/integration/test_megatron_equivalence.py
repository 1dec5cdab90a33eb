"""Megatron GPTModel (built + loaded by megarl) reproduces the transformers model, at TP/PP > 1.

Also proves the streaming exporter (the path runs use for weight sync and the final state)
returns the HF state dict bitwise, and that megarl's vocab-parallel logprobs equal log_softmax of
the HF logits.
"""

from __future__ import annotations

import pytest
import torch
from helpers.models import TINY_HF_CONFIG, TINY_MOE_HF_CONFIGS
from helpers.ranks import cpu_actor, start_cpu_rank

from megarl.distributed.launcher import launch
from megarl.models.random_init import build_random_hf_model

pytestmark = pytest.mark.slow

TINY = TINY_HF_CONFIG
BUCKET_BYTES = 64 * 1024  # the tiny model is ~0.6 MB: several buckets
PERTURBED = ("norm", "bias", "shared_expert_gate")
"""Parameters the reference moves away from their initial values."""


def _reference(hf_config: dict, seed: int, save_to=None):
    """Random ids, the HF model's logits for them, and its state dict: in memory, or as the
    checkpoint ``save_to`` holds it (per-expert tensors; transformers 5 fuses experts in memory)."""
    model = build_random_hf_model(hf_config, seed)
    gen = torch.Generator().manual_seed(1)
    # norms start at ones, biases at zeros, the shared expert's gate near zero (sigmoid ~ 0.5 for
    # every token): move them, so a mis-mapped one shows
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(part in name for part in PERTURBED):
                param.add_(0.1 * torch.randn(param.shape, generator=gen))
    ids = torch.randint(0, hf_config["vocab_size"], (3, 11), generator=gen)
    with torch.no_grad():
        logits = model(ids).logits
    if save_to is not None:
        from megarl.models.hf_io import load_hf_state_dict

        model.save_pretrained(save_to)
        return ids, logits, load_hf_state_dict(save_to)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if hf_config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    return ids, logits, state


def _worker(
    ctx, tp: int, pp: int, hf_config: dict, ids, ref_logits, state, ep: int = 1, trim: int = 0
):
    """``trim``: each data-parallel rank drops ``trim * rank`` trailing positions, so the ranks
    of an expert-parallel group hold different numbers of tokens (the HF logits of a prefix are
    the prefix of the logits: causal)."""
    from megarl.config.actor import ActorConfig
    from megarl.distributed import parallel
    from megarl.export.stream import collect_state_dict, open_stream

    start_cpu_rank(ctx, tp, pp, ep=ep)
    actor = cpu_actor(hf_config, ActorConfig(tp=tp, pp=pp, ep=ep), state, trainable=True)
    spec = actor.spec
    from logits_probe import full_logits, probe_batch
    from megatron.core import parallel_state as ps

    keep = ids.shape[1] - trim * ps.get_data_parallel_rank()
    ids, ref_logits = ids[:, :keep], ref_logits[:, :keep]
    num, batch = ids.shape[0], probe_batch(ids)
    got = full_logits(actor, batch, tp, hf_config["vocab_size"])
    logits_diff = None if got is None else (got - ref_logits).abs().max().item()
    logp = actor.compute_logprobs(batch, [list(range(num))], temperature=0.7)
    logp_diff = None
    if actor.is_last_stage:
        ref_logp = (
            torch.log_softmax(ref_logits.double() / 0.7, -1)
            .gather(-1, ids[:, 1:].unsqueeze(-1))
            .squeeze(-1)[:, 3:]
        )
        logp_diff = max((logp[i].double() - ref_logp[i]).abs().max().item() for i in range(num))
    exported = collect_state_dict(open_stream(actor.local_params(), spec, BUCKET_BYTES))
    export_equal = None
    if exported is not None:
        export_equal = sorted(exported) == sorted(state) and all(
            torch.equal(exported[k], state[k]) for k in state
        )
    parallel.destroy()
    return {"logits_diff": logits_diff, "logp_diff": logp_diff, "export_equal": export_equal}


def _assert_matches(results: list[dict], tolerance: float, every_rank: bool = False) -> None:
    """Logits and logprobs within ``tolerance`` on every last-stage rank (on every rank when
    each holds the last stage), and the export bitwise."""
    last = [r for r in results if r["logits_diff"] is not None]
    assert last, "no rank reported last-stage logits"
    if every_rank:
        assert len(last) == len(results), results
    for r in last:
        assert r["logits_diff"] <= tolerance, r
        assert r["logp_diff"] <= tolerance, r
    assert results[0]["export_equal"] is True


@pytest.mark.parametrize(
    ("tp", "pp", "tied"),
    [(2, 1, False), (1, 2, False), (2, 2, True)],
    ids=["tp2", "pp2", "tp2pp2-tied"],
)
def test_tiny_llama_matches_hf(tp, pp, tied):
    cfg = dict(TINY, tie_word_embeddings=tied)
    ids, ref_logits, state = _reference(cfg, seed=3)
    results = launch(_worker, tp * pp, args=(tp, pp, cfg, ids, ref_logits, state), timeout_s=240)
    _assert_matches(results, 1e-4)


QWEN3 = dict(TINY, model_type="qwen3", head_dim=32)
"""Qwen3 block: per-head q/k RMSNorm and a head size (32) that is not hidden / heads (16)."""


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1)], ids=["tp1", "tp2"])
def test_tiny_qwen3_matches_hf(tp, pp):
    ids, ref_logits, state = _reference(QWEN3, seed=5)
    assert any(".self_attn.q_norm." in name for name in state)
    results = launch(_worker, tp * pp, args=(tp, pp, QWEN3, ids, ref_logits, state), timeout_s=240)
    _assert_matches(results, 1e-5)


@pytest.mark.parametrize(
    ("family", "tp", "pp", "ep"),
    [
        ("qwen3_moe", 1, 1, 2),
        ("mixtral", 1, 1, 2),
        ("qwen2_moe", 1, 1, 1),
        ("qwen2_moe", 1, 1, 2),
        ("qwen3_moe", 2, 1, 1),
        ("qwen2_moe", 2, 1, 2),
        ("qwen3_moe", 1, 2, 2),
        ("qwen2_moe", 2, 2, 1),
    ],
    ids=[
        "qwen3_moe-ep2",
        "mixtral-ep2",
        "qwen2_moe-ep1",
        "qwen2_moe-ep2",
        "qwen3_moe-tp2",
        "qwen2_moe-tp2-ep2",
        "qwen3_moe-pp2-ep2",
        "qwen2_moe-tp2-pp2",
    ],
)
def test_tiny_moe_matches_hf(family, tp, pp, ep, tmp_path):
    """Each rank of an EP group holds 1/ep of the experts; tokens are dispatched to them and
    back. The ranks of an EP group hold different numbers of tokens, as packed RL micro-batches
    do. Under TP the model runs sequence-parallel: each TP rank routes a slice of the sequence
    (11 positions, padded to 12) through experts whose intermediate size is split over TP. Under
    PP each stage holds one layer with its experts, and the exporter takes each stage's experts
    from that stage's expert ranks."""
    cfg = TINY_MOE_HF_CONFIGS[family]
    ids, ref_logits, state = _reference(cfg, 7, save_to=tmp_path)
    assert any(".experts.3." in name for name in state)
    args = (tp, pp, cfg, ids, ref_logits, state, ep, 3)
    results = launch(_worker, tp * pp * ep, args=args, timeout_s=240)  # DP = EP
    _assert_matches(results, 1e-5, every_rank=pp == 1)


@pytest.mark.parametrize(
    ("cfg", "name", "scale"),
    [
        (TINY, "model.layers.1.mlp.up_proj.weight", 1.01),
        # a zero gate is sigmoid = 1/2 for every token: what an ignored gate would compute
        (TINY_MOE_HF_CONFIGS["qwen2_moe"], "model.layers.1.mlp.shared_expert_gate.weight", 0.0),
    ],
    ids=["llama-up_proj", "qwen2_moe-shared_expert_gate"],
)
def test_loader_rejects_wrong_weights(cfg, name, scale, tmp_path):
    """The equivalence check can fail: a perturbed tensor breaks it."""
    ids, ref_logits, state = _reference(cfg, 3, save_to=tmp_path)
    state = dict(state)
    state[name] = state[name] * scale
    [result] = launch(_worker, 1, args=(1, 1, cfg, ids, ref_logits, state))
    assert result["logits_diff"] > 1e-4


def test_smollm2_tp1_matches_hf():
    """The real pretrained model: SmolLM2-135M-Instruct (tied embeddings, GQA 9/3) at TP=1."""
    from megarl.models.hf_io import load_hf_model

    model, _ = load_hf_model(None)
    cfg = model.config.to_dict()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg["vocab_size"], (2, 16), generator=gen)
    with torch.no_grad():
        ref_logits = model(ids).logits
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    [result] = launch(_worker, 1, args=(1, 1, cfg, ids, ref_logits, state))
    assert result["logits_diff"] <= 1e-4
    assert result["logp_diff"] <= 1e-4
    assert result["export_equal"] is True
