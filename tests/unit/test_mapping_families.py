"""Each family's table names and sizes exactly the tensors a real ``transformers`` model has.

Adding a family means adding a table: this test builds the family's HF model from a tiny config
and compares every name and shape, so a table that misses or invents a tensor fails here.
"""

from __future__ import annotations

import pytest
from helpers.models import MOE_EXPERTS, TWO_LAYER_DIMS

from megarl.models import mapping
from megarl.models.spec import ModelSpecError, spec_from_hf_config

TINY = dict(TWO_LAYER_DIMS, vocab_size=96)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("tied", [False, True])
def test_table_matches_transformers_state_dict(family, tied):
    from megarl.models.random_init import build_random_hf_model

    cfg = dict(TINY, model_type=family, tie_word_embeddings=tied)
    if family == "mistral":
        cfg["sliding_window"] = None
    if family == "qwen3":
        cfg["head_dim"] = 16  # Qwen3 sets head_dim apart from hidden / heads (here 8)
    model = build_random_hf_model(cfg, seed=0)
    state = model.state_dict()
    if tied:
        state.pop("lm_head.weight")
    spec = spec_from_hf_config(model.config)
    shapes = {}
    for rule in mapping.rules_for(spec):
        if rule.mcore == "output_layer.weight" and spec.tie_embeddings:
            continue
        for layer in range(spec.num_layers) if rule.per_layer else [None]:
            shapes.update(zip(rule.hf_names(layer), mapping.hf_shapes(rule, spec), strict=True))
    assert sorted(shapes) == sorted(state) == sorted(mapping.expected_hf_names(spec))
    assert {k: tuple(v.shape) for k, v in state.items()} == shapes
    assert spec.qkv_bias == (family == "qwen2")
    assert spec.qk_norm == (family == "qwen3")
    assert spec.num_parameters() == sum(t.numel() for t in state.values())


@pytest.mark.parametrize("family", sorted(MOE_EXPERTS))
def test_moe_table_matches_the_saved_checkpoint(family, tmp_path):
    """MoE tables name the checkpoint's per-expert tensors (what ``save_pretrained`` writes and
    vLLM loads), not transformers 5's fused in-memory experts."""
    from safetensors import safe_open

    from megarl.models.random_init import build_random_hf_model

    cfg = dict(TINY, model_type=family, num_experts_per_tok=2, **MOE_EXPERTS[family])
    model = build_random_hf_model(cfg, seed=0)
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        saved = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    spec = spec_from_hf_config(model.config)
    assert (spec.num_experts, spec.moe_top_k, spec.is_moe) == (4, 2, True)
    shapes = {}
    for rule in mapping.rules_for(spec):
        for layer in range(spec.num_layers) if rule.per_layer else [None]:
            shapes.update(zip(rule.hf_names(layer), mapping.hf_shapes(rule, spec), strict=True))
    assert shapes == saved
    assert sorted(mapping.expected_hf_names(spec)) == sorted(saved)
    assert spec.num_parameters() == sum(t.numel() for t in model.state_dict().values())
    assert spec.qk_norm == (family == "qwen3_moe")
    assert spec.qkv_bias == (family == "qwen2_moe")
    assert spec.moe_norm_topk_prob == (family == "mixtral")  # Qwen's norm_topk_prob is off
    shared = [n for n in saved if ".shared_expert" in n]
    assert len(shared) == (8 if family == "qwen2_moe" else 0)  # 2 layers x gate, up, down, gate


def test_shared_expert_is_a_dense_parameter_on_every_expert_parallel_rank():
    """Qwen2-MoE's shared expert and its gate belong to no expert: every expert-parallel rank
    holds, loads and checkpoints them, and expert-rank 0 exports them, like the attention."""
    from megarl.export.plan import export_items

    cfg = dict(TINY, model_type="qwen2_moe", num_experts_per_tok=2, **MOE_EXPERTS["qwen2_moe"])
    spec = spec_from_hf_config(cfg)
    assert spec.moe_shared_ffn_hidden_size == 40
    shared = [r for r in mapping.rules_for(spec) if ".shared_experts." in r.mcore]
    assert [r.mcore.rsplit("shared_experts.", 1)[1] for r in shared] == [
        "linear_fc1.weight",
        "linear_fc2.weight",
        "gate_weight",
    ]
    assert [mapping.expert_of(r) for r in shared] == [None, None, None]
    name = "decoder.layers.1.mlp.shared_experts.linear_fc1.weight"
    assert mapping.globalize_expert(name, 2) == name
    owners = {n: i.ep_rank for i in export_items(spec, 1, 1, 1, 4, ep=2) for n in i.hf_names}
    assert owners["model.layers.1.mlp.shared_expert_gate.weight"] is None
    assert owners["model.layers.1.mlp.shared_expert.down_proj.weight"] is None
    assert owners["model.layers.1.mlp.experts.3.down_proj.weight"] == 1


QWEN2_MOE = {
    "model_type": "qwen2_moe",
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 8,
    "shared_expert_intermediate_size": 16,
}


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"model_type": "llama", "attention_bias": True}, "attention_bias"),
        ({"model_type": "llama", "mlp_bias": True}, "mlp_bias"),
        ({"model_type": "mistral", "sliding_window": 16}, "sliding_window"),
        ({"model_type": "qwen3", "attention_bias": True}, "attention_bias"),
        (
            {
                "model_type": "qwen3_moe",
                "num_experts": 4,
                "moe_intermediate_size": 8,
                "num_experts_per_tok": 2,
                "mlp_only_layers": [1],
            },
            "mlp_only_layers",
        ),
        (dict(QWEN2_MOE, decoder_sparse_step=2), "^decoder_sparse_step=2: dense layers"),
        (dict(QWEN2_MOE, mlp_only_layers=[0]), r"^mlp_only_layers=\[0\]: dense layers"),
        (dict(QWEN2_MOE, shared_expert_intermediate_size=0), "^shared_expert_intermediate_size=0"),
        (
            {
                "model_type": "mixtral",
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "router_jitter_noise": 0.1,
            },
            "router_jitter_noise",
        ),
        (
            {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 5},
            "num_experts_per_tok",
        ),
        (
            {
                "model_type": "mixtral",
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "sliding_window": 16,
            },
            "sliding_window",
        ),
    ],
)
def test_unmapped_features_are_refused(extra, words):
    with pytest.raises(ModelSpecError, match=words):
        spec_from_hf_config(dict(TINY, **extra))


@pytest.mark.parametrize(
    "family_cfg", [{"model_type": "qwen2"}, QWEN2_MOE], ids=lambda c: c["model_type"]
)
def test_qwen2_sliding_window_off_by_default_is_accepted(family_cfg):
    spec = spec_from_hf_config(
        dict(TINY, **family_cfg, sliding_window=16, use_sliding_window=False)
    )
    assert spec.qkv_bias


def test_qwen2_moe_qkv_bias_follows_its_config_flag():
    """transformers 5's ``qkv_bias`` switches Qwen2-MoE's q/k/v bias off; checkpoints without the
    key (Qwen1.5-MoE) are biased."""
    from megarl.models.random_init import build_random_hf_model

    model = build_random_hf_model(dict(TINY, **QWEN2_MOE, qkv_bias=False), seed=0)
    spec = spec_from_hf_config(model.config)
    assert not spec.qkv_bias
    assert not any(name.endswith(".bias") for name in mapping.expected_hf_names(spec))
    assert spec.num_parameters() == sum(t.numel() for t in model.state_dict().values())


def test_rule_with_unknown_dim_is_rejected():
    with pytest.raises(ValueError, match="unknown dims"):
        mapping.ParamRule("x.weight", ("y.weight",), "column", (("hidden", "heads"),))


@pytest.mark.parametrize(
    ("tp", "pp", "ep", "words"),
    [
        (1, 3, 1, "actor.pp=3 does not divide"),
        (3, 1, 1, "actor.tp=3 does not divide"),
        (1, 1, 3, "actor.ep=3 does not divide the model's 4 experts"),
    ],
)
def test_moe_layouts_megarl_cannot_train_are_refused(tp, pp, ep, words):
    spec = spec_from_hf_config(
        dict(TINY, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
    )
    spec.check_parallelism(1, 1, ep=2)
    spec.check_parallelism(2, 1, ep=2)  # sequence-parallel
    spec.check_parallelism(1, 2, ep=2)  # each stage holds its layers' experts
    with pytest.raises(ModelSpecError, match=words):
        spec.check_parallelism(tp, pp, ep=ep)


def test_expert_parallel_needs_experts():
    with pytest.raises(ModelSpecError, match="actor.ep=2 needs a mixture-of-experts model"):
        spec_from_hf_config(dict(TINY, model_type="llama")).check_parallelism(1, 1, ep=2)


def test_expert_names_are_global_on_every_expert_parallel_rank():
    name = "decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"
    assert mapping.globalize_expert(name, 0) == name
    assert mapping.globalize_expert(name, 2) == name.replace("local_experts.1.", "local_experts.3.")
    assert mapping.globalize_expert("decoder.layers.1.mlp.router.weight", 2).endswith(
        "router.weight"
    )
    spec = spec_from_hf_config(
        dict(TINY, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
    )
    experts = [mapping.expert_of(rule) for rule in mapping.rules_for(spec)]
    assert [e for e in experts if e is not None] == [0, 0, 1, 1, 2, 2, 3, 3]
