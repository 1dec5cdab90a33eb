"""Build a Megatron-Core ``GPTModel`` from a :class:`TransformerSpec` and load HF weights into it.

One code path for CPU and GPU: the device only picks the attention core (SDPA here; a
transformer-engine spec on GPU when installed) and the parameter dtype. Weight layouts come from
:mod:`megarl.models.mapping`, so loading and exporting share one table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from megarl.distributed.platform import SDPACoreAttention
from megarl.models import mapping
from megarl.models.chunk import layer_offset, unwrap
from megarl.models.lora import is_adapter_param_name
from megarl.models.spec import TransformerSpec
from megarl.models.value_head import attach_value_head, is_value_head_param_name


@dataclass(frozen=True)
class ValueHeadInit:
    """How the critic's value head starts (see :mod:`megarl.models.value_head`)."""

    init_std: float = 0.0
    """0 gives an all-zero head; > 0 a normal draw with this std."""
    seed: int = 0
    """The draw's seed, the same on every rank so TP replicas start equal."""
    weight: torch.Tensor | None = field(default=None, compare=False)
    """``[1, hidden]``: a head read from ``critic.model.path`` (its ``score.weight``), used
    instead of the draw; every rank reads the same tensor, so TP replicas start equal too."""


def transformer_config(
    spec: TransformerSpec,
    tp: int,
    pp: int,
    dtype: torch.dtype,
    use_cpu_initialization: bool,
    vpp: int | None = None,
    recompute: str | None = None,
    ep: int = 1,
    moe_aux_loss_coef: float = 0.0,
    moe_routing_replay: bool = False,
):
    """Megatron ``TransformerConfig`` for a Llama-style block; fusions off so CPU can run it."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    interleaved = vpp is not None and vpp > 1
    return TransformerConfig(
        **_moe_config(spec, ep, moe_aux_loss_coef, moe_routing_replay),
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        # Activations of each micro-batch's own length pass between pipeline stages; the
        # interleaved schedule exchanges one fixed shape instead (its paired sends and receives
        # deadlock with the per-message shape exchange), so under vpp every micro-batch of a
        # schedule is padded to one width (MegatronActor._run_schedule).
        variable_seq_lengths=not interleaved,
        # Interleaved over two stages, a rank's previous and next stage are the same rank, which
        # then gets an activation and a gradient in one exchange. Batched, both travel on the
        # pipeline group and pair by posting order, which differs between the two ranks: with
        # one shape for both, each silently lands in the other's buffer. Unbatched, Megatron
        # sends each direction on its own group.
        batch_p2p_comm=not interleaved,
        sequence_parallel=uses_sequence_parallel(spec, tp),
        use_cpu_initialization=use_cpu_initialization,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        # Megatron's schedule then runs backward through the autograd engine itself rather than
        # torch.autograd.backward, which a TorchFunctionMode (the CPU shims) would see and
        # switch itself off for: MoE's backward gathers allocate on the "current device".
        deallocate_pipeline_outputs=True,
        init_method_std=0.02,
        # Megatron's Literal: the config allows only selective | full here (none arrives as None)
        recompute_granularity=recompute,  # pyright: ignore[reportArgumentType]
        recompute_method="uniform" if recompute == "full" else None,
        recompute_num_layers=1 if recompute == "full" else None,
    )


def uses_sequence_parallel(spec: TransformerSpec, tp: int) -> bool:
    """Megatron trains a mixture-of-experts layer under TP only with sequence parallelism: each
    TP rank keeps ``1/tp`` of the sequence between the tensor-parallel blocks (norms, router,
    token dispatch) and gathers it for attention and the output layer. So every micro-batch's
    sequence dimension must divide by ``tp`` (:attr:`MegatronActor.length_multiple`). Dense
    models keep whole sequences on every TP rank."""
    return spec.is_moe and tp > 1


def _moe_config(
    spec: TransformerSpec, ep: int, moe_aux_loss_coef: float = 0.0, routing_replay: bool = False
) -> dict:
    """The ``TransformerConfig`` fields that differ between a dense and a mixture-of-experts block.

    The router follows the HF model: softmax in fp32; Mixtral (and Qwen3-MoE with
    ``norm_topk_prob``) renormalise the top-k weights, which is Megatron's top-k-then-softmax;
    otherwise the weights are the full softmax's (``moe_router_pre_softmax``). No auxiliary
    load-balancing loss by default (RL fine-tunes a trained router; a batch-dependent loss term
    also makes a sequence's gradient depend on which others share its micro-batch, so pruning
    is off with it). ``moe_aux_loss_coef > 0`` (``actor.moe_aux_loss_coef``) turns on Megatron's
    per-micro-batch Switch loss (``aux_loss``); the actor rescales its coefficient per
    micro-batch (``MegatronActor.router_loss_coeffs``). Tokens move between
    expert-parallel ranks with Megatron's alltoall dispatcher, the one that lets each rank hold a
    different number of tokens (the allgather dispatcher needs equal counts on every rank, which
    packed RL micro-batches never have); on CPU it runs through
    :mod:`megarl.distributed.platform`. Under TP the model runs sequence-parallel
    (:func:`uses_sequence_parallel`); under PP each stage holds its layers' experts, and
    activations of every micro-batch's own length pass between stages
    (``variable_seq_lengths``). A shared expert (Qwen2-MoE) is Megatron's
    ``SharedExpertMLP`` with its sigmoid gate (see :func:`megarl.models.mapping.shared_expert_rules`),
    computed on each rank's own tokens before dispatch, not overlapped with it.
    ``routing_replay`` (``actor.router_replay.mode`` R2/R3) gives each router Megatron's
    ``RouterReplay`` hook.
    """
    if not spec.is_moe:
        return {"moe_token_dispatcher_type": "alltoall"}
    return {
        "num_moe_experts": spec.num_experts,
        "moe_router_topk": spec.moe_top_k,
        "moe_ffn_hidden_size": spec.moe_ffn_hidden_size,
        "moe_router_pre_softmax": not spec.moe_norm_topk_prob,
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "aux_loss" if moe_aux_loss_coef > 0 else "none",
        "moe_aux_loss_coeff": moe_aux_loss_coef,
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": False,
        "expert_model_parallel_size": ep,
        "moe_shared_expert_intermediate_size": spec.moe_shared_ffn_hidden_size or None,
        "moe_shared_expert_gate": bool(spec.moe_shared_ffn_hidden_size),
        # each router gets a RouterReplay (idle until megarl.actor.router_replay arms it)
        "moe_enable_routing_replay": routing_replay,
    }


class LocalRMSNorm(torch.nn.RMSNorm):
    """The local spec's RMSNorm (torch's, as Megatron's ``WrappedTorchNorm`` builds it) that
    also runs sequence-parallel, which ``WrappedTorchNorm`` refuses: each TP rank then normalises
    its slice of the sequence, so the weight is marked ``sequence_parallel`` and Megatron's
    ``finalize_model_grads`` sums its gradient over TP, as it does for transformer-engine's
    norm."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel  # pyright: ignore[reportAttributeAccessIssue]


class LocalHeadRMSNorm(torch.nn.RMSNorm):
    """The q/k norm over each attention head: it sees whole sequences (attention gathers them
    under sequence parallelism), and ``finalize_model_grads`` sums its gradient over TP by
    name."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused) -> None:
        super().__init__(hidden_size, eps=eps)


def layer_spec(
    use_transformer_engine: bool = False, qk_layernorm: bool = False, num_experts: int = 0
):
    """Local Megatron layer spec with SDPA core attention and :class:`LocalRMSNorm`, or the
    transformer-engine spec.

    Experts are Megatron's ``SequentialMLP`` (one linear pair per expert, no grouped GEMM), whose
    per-expert parameters map one to one onto the checkpoint's per-expert tensors.
    """
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    moe = {"num_experts": num_experts or None, "moe_grouped_gemm": False}
    if use_transformer_engine:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm, **moe)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_layernorm, **moe)
    # ModuleSpec.submodules is typed ``object`` in Megatron; the local spec's layout is fixed
    layer: Any = spec.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = LocalRMSNorm
    attention = layer.self_attention.submodules
    attention.core_attention = SDPACoreAttention
    if qk_layernorm:
        attention.q_layernorm = attention.k_layernorm = LocalHeadRMSNorm
    return spec


def block_spec(config, layer, vp_stage: int | None, use_transformer_engine: bool):
    """``layer`` for every layer of this rank's stage; sequence-parallel on the local spec, with
    the final norm a :class:`LocalRMSNorm` too (Megatron would pick ``WrappedTorchNorm``)."""
    if not config.sequence_parallel or use_transformer_engine:
        return layer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (
        TransformerBlock,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    submodules = TransformerBlockSubmodules(
        layer_specs=[layer] * layers, layer_norm=ModuleSpec(module=LocalRMSNorm)
    )
    return ModuleSpec(module=TransformerBlock, submodules=submodules)


def build_gpt_model(
    spec: TransformerSpec,
    tp: int,
    pp: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    vp_stage: int | None = None,
    vpp: int | None = None,
    use_transformer_engine: bool = False,
    recompute: str | None = None,
    value_head: ValueHeadInit | None = None,
    moe_aux_loss_coef: float = 0.0,
    moe_routing_replay: bool = False,
):
    """A ``GPTModel`` holding this rank's TP shard of this rank's PP stage.

    With ``value_head`` it is the critic's value model: the same trunk, never tied, and a
    scalar head instead of the vocabulary output layer (:mod:`megarl.models.value_head`).
    Must be called after :func:`megarl.distributed.parallel.init_model_parallel`.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(
        spec,
        tp,
        pp,
        dtype,
        use_cpu_initialization=device == "cpu",
        vpp=vpp,
        recompute=recompute,
        ep=parallel_state.get_expert_model_parallel_world_size(),
        moe_aux_loss_coef=moe_aux_loss_coef,
        moe_routing_replay=moe_routing_replay,
    )
    pre = parallel_state.is_pipeline_first_stage(ignore_virtual=vpp is None, vp_stage=vp_stage)
    post = parallel_state.is_pipeline_last_stage(ignore_virtual=vpp is None, vp_stage=vp_stage)
    model = GPTModel(
        config=config,
        transformer_layer_spec=block_spec(
            config,
            layer_spec(
                use_transformer_engine, qk_layernorm=spec.qk_norm, num_experts=spec.num_experts
            ),
            vp_stage,
            use_transformer_engine,
        ),
        vocab_size=spec.padded_vocab_size(tp),
        max_sequence_length=spec.max_position_embeddings,
        pre_process=pre,
        post_process=post,
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_embeddings and value_head is None,
        position_embedding_type="rope",
        rotary_base=int(spec.rope_theta),
        vp_stage=vp_stage,
    )
    if value_head is not None:
        attach_value_head(
            model, spec.hidden_size, dtype, value_head.init_std, value_head.seed, value_head.weight
        )
    if device == "cuda":
        model = model.cuda()
    return model


def build_model_chunks(
    spec: TransformerSpec,
    tp: int,
    pp: int,
    vpp: int = 1,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    use_transformer_engine: bool = False,
    recompute: str | None = None,
    value_head: ValueHeadInit | None = None,
    moe_aux_loss_coef: float = 0.0,
    moe_routing_replay: bool = False,
) -> list:
    """This rank's model chunks: one ``GPTModel`` without a virtual pipeline, else ``vpp`` of them.

    With a virtual pipeline, chunk ``v`` of pipeline rank ``p`` holds Megatron's interleaved
    layer slice (global chunk ``v * pp + p``); only chunk 0 of rank 0 embeds and only the last
    chunk of the last rank has the output layer.
    """
    # No virtual pipeline is vpp=None and vp_stage=None for Megatron, not vpp=1 and stage 0.
    stages: list[int | None] = [None] if vpp == 1 else list(range(vpp))
    return [
        build_gpt_model(
            spec,
            tp,
            pp,
            dtype,
            device,
            vp_stage=stage,
            vpp=None if vpp == 1 else vpp,
            use_transformer_engine=use_transformer_engine,
            recompute=recompute,
            value_head=value_head,
            moe_aux_loss_coef=moe_aux_loss_coef,
            moe_routing_replay=moe_routing_replay,
        )
        for stage in stages
    ]


def iter_local_params(model, spec: TransformerSpec):
    """Yield ``(rule, global_layer, param)`` for every base parameter this rank holds.

    ``model`` is one chunk or a list of virtual-pipeline chunks. With tied embeddings and PP > 1
    the last stage's ``output_layer.weight`` is a copy of the embedding; it maps to the HF
    embedding tensor.
    """
    if isinstance(model, (list, tuple)):
        for chunk in model:
            yield from iter_local_params(chunk, spec)
        return
    rules = mapping.rule_index(spec)
    offset = layer_offset(model)
    first_expert = _first_local_expert(spec)
    for name, param in unwrap(model).named_parameters():
        if is_adapter_param_name(name):
            continue  # LoRA adapters are exported by megarl.export.lora, not as base weights
        if is_value_head_param_name(name):
            continue  # the critic's head has no HF tensor: initialised, never loaded or exported
        global_name = mapping.globalize_expert(canonical_param_name(name), first_expert)
        template, local_layer = mapping.split_layer_name(global_name)
        rule = rules.get(template)
        if rule is None:
            raise KeyError(f"Megatron parameter {name} has no mapping for family {spec.family}")
        if rule.mcore == "output_layer.weight" and spec.tie_embeddings:
            rule = rules["embedding.word_embeddings.weight"]
        layer = None if local_layer is None else local_layer + offset
        yield rule, layer, param


def _first_local_expert(spec: TransformerSpec) -> int:
    """Global index of this rank's first expert (experts are split evenly over EP ranks)."""
    if not spec.is_moe:
        return 0
    from megatron.core import parallel_state

    ep = parallel_state.get_expert_model_parallel_world_size()
    return parallel_state.get_expert_model_parallel_rank() * (spec.num_experts // ep)


# transformer-engine's layer spec fuses each pre-norm into the following linear layer
# (TELayerNormColumnParallelLinear), so the norm weight lives under the linear's name.
TE_PARAM_ALIASES = {
    ".self_attention.linear_qkv.layer_norm_weight": ".input_layernorm.weight",
    ".mlp.linear_fc1.layer_norm_weight": ".pre_mlp_layernorm.weight",
}


def canonical_param_name(name: str) -> str:
    """A Megatron parameter name as the local spec spells it (TE's fused-norm names mapped)."""
    for te_suffix, local_suffix in TE_PARAM_ALIASES.items():
        if name.endswith(te_suffix):
            return name[: -len(te_suffix)] + local_suffix
    return name


@torch.no_grad()
def load_hf_weights(
    model, spec: TransformerSpec, get_hf: Callable[[str], torch.Tensor] | Mapping[str, torch.Tensor]
) -> int:
    """Copy HF tensors into this rank's Megatron shards; returns the number of params loaded.

    ``get_hf`` maps a HF name to its full tensor (a dict, or a lazy loader for large checkpoints).
    """
    from megatron.core import parallel_state

    fetch = get_hf.__getitem__ if isinstance(get_hf, Mapping) else get_hf
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    count = 0
    for rule, layer, param in iter_local_params(model, spec):
        hf_tensors = [fetch(name) for name in rule.hf_names(layer)]
        shard = mapping.to_mcore_shard(rule, hf_tensors, spec, tp_rank, tp)
        if shard.shape != param.shape:
            raise ValueError(
                f"shape mismatch loading {rule.hf_names(layer)} into a Megatron shard: "
                f"{tuple(shard.shape)} vs {tuple(param.shape)}"
            )
        param.copy_(shard.to(param.dtype))
        count += 1
    return count
