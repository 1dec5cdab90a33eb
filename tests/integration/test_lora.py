"""LoRA on the Megatron actor at TP=2 x PP=2: trains only adapters, exports what peft loads.

The proof: after one optimizer step (so ``lora_B != 0``), the Megatron model's logits equal a
``transformers`` model with a ``peft`` adapter loaded, via ``PeftModel.from_pretrained``, from
the folder the exporter wrote; the base weights are bitwise unchanged; the initial model (B = 0)
equals the base model; with its adapters disabled the trained actor gives the reference
model's logprobs bitwise (so a KL term needs no second model).
"""

from __future__ import annotations

import pytest
import torch
from helpers.models import TINY_HF_CONFIG
from helpers.ranks import loss_settings, start_cpu_rank

from megarl.distributed.launcher import launch
from megarl.models.random_init import build_random_hf_model

pytestmark = pytest.mark.slow

TINY = TINY_HF_CONFIG
RANK, ALPHA = 4, 8.0


def _batch(ids):
    from megarl.batch import RolloutBatch

    num, prompt = ids.shape[0], 4
    return RolloutBatch(
        tokens=tuple(ids),
        prompt_lens=(prompt,) * num,
        group_ids=torch.zeros(num),
        rewards=torch.zeros(num),
        advantages=torch.tensor([1.0, -1.0, 0.5]),
        engine_logprobs=tuple(torch.full((ids.shape[1] - prompt,), -2.0) for _ in range(num)),
    )


def _full_logits(actor, batch, tp: int):
    """Logits of every sequence through the pipeline, TP shards gathered (last stage only)."""
    from logits_probe import full_logits

    return full_logits(actor, batch, tp, TINY["vocab_size"])


def _worker(ctx, tp: int, pp: int, ids, state):
    from megarl.actor.megatron_actor import MegatronActor
    from megarl.actor.megatron_optim_state import optimizer_parts
    from megarl.config.actor import ActorConfig, LoraConfig
    from megarl.distributed import parallel
    from megarl.models.chunk import unwrap
    from megarl.models.lora import adapter_parameters
    from megarl.models.spec import spec_from_hf_config
    from megarl.planner.step_plan import OptimizerStepPlan

    start_cpu_rank(ctx, tp, pp)
    spec = spec_from_hf_config(TINY)
    cfg = ActorConfig(tp=tp, pp=pp, lr=1e-2, lora=LoraConfig(rank=RANK, alpha=ALPHA))
    actor = MegatronActor(spec, cfg, "cpu", torch.float32, state, pad_id=0, init_seed=5)
    batch = _batch(ids)
    base_before = {
        n: p.detach().clone()
        for n, p in unwrap(actor.model).named_parameters()
        if not p.requires_grad
    }
    trainable = [n for n, p in unwrap(actor.model).named_parameters() if p.requires_grad]
    initial_logits = _full_logits(actor, batch, tp)
    initial_adapter = actor.gather_lora_adapter()

    loss = loss_settings(kl_estimator="k1")
    work = OptimizerStepPlan.by_hand(
        [(0, 1, 2)], batch.seq_lens, normaliser=batch.num_seqs * (ids.shape[1] - 4)
    )
    actor.train_step(batch, work, 0, None, None, loss)

    base_after = {
        n: p.detach() for n, p in unwrap(actor.model).named_parameters() if not p.requires_grad
    }
    sharded = unwrap(actor.model).sharded_state_dict(metadata={})
    lora_shapes = {k: tuple(v.global_shape) for k, v in sharded.items() if ".lora." in k}
    base_unchanged = all(torch.equal(base_before[n], base_after[n]) for n in base_before)
    optim_params = {
        id(p) for part in optimizer_parts(actor.optimizer.inner) for p in part.get_parameters()
    }
    optim_is_adapters = optim_params == {id(p) for p in adapter_parameters(actor.model)}
    result = {
        "rank": ctx.rank,
        "base_unchanged": base_unchanged,
        "trainable": trainable,
        "optim_is_adapters": optim_is_adapters,
        "lora_shapes": lora_shapes,
        "initial_logits": initial_logits,
        "logits": _full_logits(actor, batch, tp),
        "initial_adapter": initial_adapter,
        "adapter": actor.gather_lora_adapter(),
        **_reference_vs_adapters_disabled(actor, batch, spec, cfg, state),
    }
    parallel.destroy()
    return result


def _reference_vs_adapters_disabled(actor, batch, spec, cfg, state) -> dict:
    """Logprobs of the trained LoRA actor with its adapters disabled, vs a separately built
    frozen reference model and vs the adapters on (last stage only; {} elsewhere)."""
    from megarl.actor.megatron_actor import MegatronActor

    reference = MegatronActor(spec, cfg, "cpu", torch.float32, state, pad_id=0, trainable=False)
    groups = [(0, 1, 2)]
    disabled = actor.compute_logprobs(batch, groups, 1.0, without_adapters=True)
    separate = reference.compute_logprobs(batch, groups, 1.0)
    enabled = actor.compute_logprobs(batch, groups, 1.0)
    if not disabled:
        return {}

    def gap(a, b):
        return max((a[i] - b[i]).abs().max().item() for i in a)

    return {"ref_gap": gap(disabled, separate), "adapter_effect": gap(enabled, disabled)}


def test_lora_tp2_pp2_trains_adapters_and_exports_what_peft_loads(tmp_path):
    from peft import PeftModel

    from megarl.export.lora import save_peft_adapter
    from megarl.models.lora import LoraSettings, is_adapter_param_name
    from megarl.models.spec import spec_from_hf_config

    tp, pp = 2, 2
    base_model = build_random_hf_model(TINY, 3)
    state = {k: v.clone() for k, v in base_model.state_dict().items()}
    ids = torch.randint(0, TINY["vocab_size"], (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base_logits = base_model(ids).logits
    results = launch(_worker, tp * pp, args=(tp, pp, ids, state), timeout_s=300)

    for r in results:
        assert r["base_unchanged"], f"rank {r['rank']}: a base weight changed"
        assert r["trainable"] and all(is_adapter_param_name(n) for n in r["trainable"])
        assert r["optim_is_adapters"]
    # checkpoints see the full adapter factors (TP-split ones sharded, not saved as replicas)
    shapes = {k: v for r in results for k, v in r["lora_shapes"].items()}
    qkv_out = (TINY["num_attention_heads"] + 2 * TINY["num_key_value_heads"]) * 16
    qkv_b = [v for k, v in shapes.items() if k.endswith("linear_qkv.lora.lora_B")]
    fc2_a = [v for k, v in shapes.items() if k.endswith("linear_fc2.lora.lora_A")]
    assert qkv_b and all(v[-2:] == (qkv_out, RANK) for v in qkv_b), qkv_b
    assert fc2_a and all(v[-2:] == (RANK, 96) for v in fc2_a), fc2_a
    last = [r for r in results if r["logits"] is not None]
    assert last
    for r in last:  # B = 0: the initial LoRA model is the base model
        assert (r["initial_logits"] - base_logits).abs().max().item() < 1e-5
    for r in last:  # trained, adapters disabled: exactly the reference model (a KL term's ref)
        assert r["ref_gap"] == 0.0, r["ref_gap"]
        assert r["adapter_effect"] > 1e-4, "the adapters did not change the logprobs"

    adapter = results[0]["adapter"]
    num_layers = TINY["num_hidden_layers"]
    assert len(adapter) == num_layers * 7 * 2  # q k v o gate up down, A and B each
    q_b = "base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight"
    assert results[0]["initial_adapter"][q_b].abs().max() == 0
    assert adapter[q_b].abs().max() > 1e-4, "lora_B did not train"

    settings = LoraSettings(rank=RANK, alpha=ALPHA)
    folder = save_peft_adapter(tmp_path / "adapter", adapter, settings, spec_from_hf_config(TINY))
    peft_model = PeftModel.from_pretrained(build_random_hf_model(TINY, 3), str(folder)).eval()
    loaded = {k: v for k, v in peft_model.state_dict().items() if "lora_" in k}
    assert len(loaded) == len(adapter)
    with torch.no_grad():
        peft_logits = peft_model(ids).logits
    assert (peft_logits - base_logits).abs().max().item() > 1e-4  # the adapter matters
    for r in last:
        diff = (r["logits"] - peft_logits).abs().max().item()
        assert diff <= 1e-5, f"Megatron LoRA vs transformers+peft logits differ by {diff:.2e}"
