"""LoRA wiring on plain data: config -> gate facts, engine report -> base-weight gate, the
adapter layout maths (Megatron shards <-> peft names), merging, and the console summary."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.models import TWO_LAYER_HF_CONFIG

from megarl.config import planning
from megarl.config.schema import build_run_config
from megarl.engines.base import EngineMemoryState, LoraAdapter
from megarl.export.lora import adapter_from_hf, adapter_to_hf, merge_adapter_into_hf, peft_name
from megarl.models import mapping
from megarl.models.lora import LoraSettings, hf_target_modules, is_adapter_param_name
from megarl.models.spec import spec_from_hf_config
from megarl.planner.gates import decide_gates
from megarl.trainer.summary import SAVED, summarize

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")

HF = TWO_LAYER_HF_CONFIG
SPEC = spec_from_hf_config(HF)


def _cfg(rank: int):
    return build_run_config({"actor": {"lora": {"rank": rank}}})


def _gates(rank: int, report: EngineMemoryState | None):
    resident = None if report is None else report.base_weights_resident
    return decide_gates(
        planning.step_facts(_cfg(rank), 0, 8, engine_base_weights_resident=resident)
    )


# --- config + engine report -> gate ----------------------------------------------------------


def test_lora_config_turns_the_gate_on_and_requires_the_engines_report():
    assert planning.step_facts(_cfg(4), 0, 8, True).run.lora_enabled
    assert not planning.step_facts(_cfg(0), 0, 8).run.lora_enabled
    with pytest.raises(ValueError, match="engine's report"):
        _gates(4, None)


@pytest.mark.parametrize(
    ("resident", "base", "action"), [(True, 0.0, "adapter only"), (False, 1.0, "base + adapter")]
)
def test_engine_report_decides_base_sync(resident, base, action):
    gates = _gates(4, EngineMemoryState(base_weights_resident=resident, adapter_resident=True))
    assert gates.adapter_sync.run
    assert gates.metrics()["gates/base_weight_sync"] == base
    assert f"sync: {action}" in gates.summary()


def test_without_lora_full_weights_whatever_the_engine_says():
    gates = _gates(0, EngineMemoryState(base_weights_resident=True, adapter_resident=False))
    assert gates.base_weight_sync.run and not gates.adapter_sync.run
    assert "sync: full weights" in gates.summary()


@pytest.mark.parametrize(("sleep_level", "base_sync"), [(0, False), (1, False), (2, True)])
def test_hf_engine_report_after_sleep_drives_the_gate(sleep_level, base_sync):
    """The driver's sleep -> report -> gate path with the real transformers engine."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megarl.engines.hf import HFEngine

    torch.manual_seed(0)
    config = LlamaConfig(**{k: v for k, v in HF.items() if k != "model_type"}, eos_token_id=2)
    engine = HFEngine(LlamaForCausalLM(config), eos_token_ids=[2], pad_token_id=0)
    if sleep_level:
        engine.sleep(sleep_level)
    gates = _gates(4, engine.memory_state())
    assert gates.base_weight_sync.run is base_sync
    woke = engine.wake_up()
    assert woke.base_weights_resident is not base_sync


def test_wake_report_contradicting_the_gate_is_an_error():
    pytest.importorskip("megatron.core")
    from megarl.trainer.rollout_source import check_wake_report

    kept = _gates(4, EngineMemoryState(True, True))
    with pytest.raises(RuntimeError, match="freed base weights"):
        check_wake_report(EngineMemoryState(False, False), kept)
    check_wake_report(EngineMemoryState(True, True), kept)
    check_wake_report(EngineMemoryState(False, False), _gates(4, EngineMemoryState(False, False)))


def test_run_summary_shows_the_sync_decisions():
    row = {
        "critic/rewards/mean": 0.5,
        "timing_s/step": 1.0,
        "perf/throughput": 10.0,
        "timing_s/update_weights": 0.25,
    }
    history = [{**row, "gates/base_weight_sync": b} for b in (1.0, 0.0, 0.0)]
    saved = summarize(history).facts(SAVED)
    assert saved["weight sync"] == "base/full weights on 1 of 3 steps, adapter only on 2 (0.75s)"


# --- names and layouts -----------------------------------------------------------------------


def test_hf_target_modules_and_names():
    assert hf_target_modules(SPEC, ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]) == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]
    assert (
        peft_name("model.layers.1.mlp.up_proj.weight", "lora_B")
        == "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    )
    assert is_adapter_param_name("decoder.layers.0.mlp.linear_fc1.lora.lora_A")
    assert not is_adapter_param_name("decoder.layers.0.mlp.linear_fc1.weight")


def _rule(target: str) -> mapping.ParamRule:
    block = "self_attention" if target in ("linear_qkv", "linear_proj") else "mlp"
    return mapping.rule_index(SPEC)[f"decoder.layers.{{layer}}.{block}.{target}.weight"]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("target", ["linear_qkv", "linear_fc1"])
def test_column_parallel_adapter_shards_reassemble_to_peft_tensors(target, tp):
    """lora_B is sharded like the fused base weight; lora_A is shared by q/k/v (gate/up)."""
    rule, r = _rule(target), 4
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(r, SPEC.hidden_size, generator=gen)
    b_parts = [torch.randn(n, r, generator=gen) for n in _hf_out_sizes(rule)]
    b_shards = [mapping.to_mcore_shard(rule, b_parts, SPEC, k, tp) for k in range(tp)]
    got = adapter_to_hf(rule, 1, "column", [a], b_shards, SPEC)
    for name, b in zip(rule.hf_names(1), b_parts, strict=True):
        assert torch.equal(got[peft_name(name, "lora_A")], a)
        assert torch.equal(got[peft_name(name, "lora_B")], b)
    # the fused delta B_fused @ A equals the fused base layout of the per-module deltas
    fused_delta = torch.cat(b_shards, 0) @ a
    per_module = [b @ a for b in b_parts]
    expected = torch.cat(
        [mapping.to_mcore_shard(rule, per_module, SPEC, k, tp) for k in range(tp)], 0
    )
    assert torch.allclose(fused_delta, expected)


@pytest.mark.parametrize("target", ["linear_proj", "linear_fc2"])
def test_row_parallel_adapter_concatenates_lora_A(target):
    rule, r, tp = _rule(target), 4, 2
    gen = torch.Generator().manual_seed(1)
    in_features = SPEC.hidden_size if target == "linear_proj" else SPEC.ffn_hidden_size
    a = torch.randn(r, in_features, generator=gen)
    b = torch.randn(SPEC.hidden_size, r, generator=gen)
    got = adapter_to_hf(rule, 0, "row", list(a.chunk(tp, dim=1)), [b], SPEC)
    [name] = rule.hf_names(0)
    assert torch.equal(got[peft_name(name, "lora_A")], a)
    assert torch.equal(got[peft_name(name, "lora_B")], b)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("target", ["linear_qkv", "linear_fc1", "linear_proj", "linear_fc2"])
def test_a_peft_adapter_reads_back_into_one_tp1_linear_bitwise(target, tp):
    """What a rollout-side Megatron engine loads: the peft tensors of a TP=``tp`` trainer's
    adapter, read back at TP=1, are the whole ``A`` and ``B`` (the column ``B`` in the fused
    layout of the TP=1 base weight)."""
    rule, r = _rule(target), 4
    parallel = "column" if target in ("linear_qkv", "linear_fc1") else "row"
    gen = torch.Generator().manual_seed(2)
    out_f, in_f = mapping.to_mcore_shard(
        rule,
        [torch.zeros(s) for s in mapping.hf_shapes(rule, SPEC)],
        SPEC,
        0,
        1,
    ).shape
    a = torch.randn(r, in_f, generator=gen)
    b = torch.randn(out_f, r, generator=gen)
    if parallel == "column":
        hf_b = mapping.to_hf(rule, [b], SPEC)
        b_shards = [mapping.to_mcore_shard(rule, hf_b, SPEC, k, tp) for k in range(tp)]
        peft = adapter_to_hf(rule, 1, parallel, [a], b_shards, SPEC)
    else:
        peft = adapter_to_hf(rule, 1, parallel, list(a.chunk(tp, dim=1)), [b], SPEC)
    got_a, got_b = adapter_from_hf(rule, 1, parallel, peft, SPEC)
    assert torch.equal(got_a, a) and torch.equal(got_b, b)


def _hf_out_sizes(rule: mapping.ParamRule) -> list[int]:
    if rule.layout == "qkv":
        return [SPEC.num_heads * SPEC.head_dim] + [SPEC.num_kv_heads * SPEC.head_dim] * 2
    return [SPEC.ffn_hidden_size] * 2


def test_merge_adapter_equals_peft_merge_and_unload():
    """What the converter's --merge-lora needs: W + s*B@A, as peft merges it."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in HF.items() if k != "model_type"}))
    peft_model = get_peft_model(
        copy.deepcopy(base),
        LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], init_lora_weights=False
        ),
    )
    adapter = {k: v.detach().clone() for k, v in get_peft_model_state_dict(peft_model).items()}
    expected = peft_model.merge_and_unload().state_dict()
    merged = merge_adapter_into_hf(base.state_dict(), adapter, LoraSettings(4, 8.0).scaling)
    assert sorted(merged) == sorted(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(merged[name], tensor, atol=1e-6, rtol=0)
    assert not torch.equal(
        merged["model.layers.0.self_attn.q_proj.weight"],
        base.state_dict()["model.layers.0.self_attn.q_proj.weight"],
    )


def test_hf_engine_second_load_is_an_adapter_only_update():
    """Same layout: the peft layers stay, only their values change."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import LlamaConfig, LlamaForCausalLM

    from megarl.engines.hf import HFEngine

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in HF.items() if k != "model_type"}))
    engine = HFEngine(copy.deepcopy(base), eos_token_ids=[2], pad_token_id=0)
    peft_model = get_peft_model(
        copy.deepcopy(base),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False),
    )
    adapter = {k: v.detach().clone() for k, v in get_peft_model_state_dict(peft_model).items()}
    engine.load_lora_adapter(LoraAdapter(adapter, rank=4, alpha=8, target_modules=("q_proj",)))
    layer = engine.model.model.layers[0].self_attn.q_proj
    doubled = {k: v * 2 for k, v in adapter.items()}
    engine.load_lora_adapter(LoraAdapter(doubled, rank=4, alpha=8, target_modules=("q_proj",)))
    assert engine.model.model.layers[0].self_attn.q_proj is layer
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    assert torch.equal(layer.lora_B["default"].weight, doubled[name])
