"""The architecture of a Llama-style decoder, read from a Hugging Face config.

Pure code (no megatron, no torch.distributed): the Megatron builder, the weight mapping, the
exporter and the config validation all read one :class:`TransformerSpec`, so a model family is
described once. Supported families share the Llama block (RMSNorm, RoPE, SwiGLU, GQA) and differ
in small flags (Qwen2: bias on q/k/v; Qwen3: RMSNorm on each query and key head, and a head size
that need not be hidden/heads). Mixture-of-experts families (Qwen3-MoE, Mixtral, Qwen2-MoE)
replace every layer's MLP by a router and ``num_experts`` SwiGLU experts of which each token uses
``moe_top_k``; Qwen2-MoE adds a shared expert every token passes through, scaled by a sigmoid gate.

"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral", "qwen2_moe")
MOE_FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe")
VOCAB_DIVISIBLE_BY = 128


def vpp_training_problem(is_moe: bool, lora: bool, critic: bool, packed: bool) -> str | None:
    """What ``actor.vpp > 1`` cannot train yet, or None. The interleaved schedule trains a dense
    model's full weights on packed micro-batches (it passes one activation shape between
    stages, and a packed row widens to it with a padding tail that no sequence reads); a
    mixture of experts (its routing recorder and replay, its load-balancing loss per virtual
    stage), LoRA adapters and a critic have not been carried over to several model chunks per
    rank."""
    what = [
        name
        for name, on in (
            ("a mixture-of-experts model", is_moe),
            ("LoRA (actor.lora.rank > 0)", lora),
            ("a critic (algo.adv_estimator=gae)", critic),
            ("padded micro-batches (actor.pack_sequences=false)", not packed),
        )
        if on
    ]
    if not what:
        return None
    return (
        f"actor.vpp > 1 trains dense models on packed micro-batches, without LoRA or a critic; "
        f"this run has {' and '.join(what)}: use actor.vpp=1"
    )


class ModelSpecError(ValueError):
    """An unsupported or inconsistent model config, or a parallel layout it cannot take."""


@dataclass(frozen=True)
class TransformerSpec:
    """Shape and numerics of a Llama-style causal LM."""

    family: str
    """HF ``model_type``: one of ``SUPPORTED_FAMILIES``; selects the weight-mapping table."""
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    """Query groups (GQA); equals ``num_heads`` for multi-head attention."""
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_embeddings: bool
    qkv_bias: bool
    max_position_embeddings: int
    qk_norm: bool = False
    """RMSNorm over each query and key head before RoPE (Qwen3's ``q_norm``/``k_norm``; Megatron's
    ``qk_layernorm``), with the block's ``rms_norm_eps``."""
    num_experts: int = 0
    """Experts per layer; 0 for a dense model (every layer's MLP is then ``ffn_hidden_size``)."""
    moe_top_k: int = 0
    """Experts each token is routed to."""
    moe_ffn_hidden_size: int = 0
    """Each expert's intermediate size."""
    moe_norm_topk_prob: bool = True
    """Renormalise the top-k routing weights to sum to 1 (Mixtral always; Qwen3-MoE's and
    Qwen2-MoE's ``norm_topk_prob``). Otherwise the weights are the full softmax's entries."""
    moe_shared_ffn_hidden_size: int = 0
    """Intermediate size of the shared expert (Qwen2-MoE's ``shared_expert_intermediate_size``)
    that every token passes through beside its routed experts, its output scaled by
    ``sigmoid(shared_expert_gate(x))``; 0 when the family has none."""

    def __post_init__(self) -> None:
        if self.family not in SUPPORTED_FAMILIES:
            raise ModelSpecError(
                f"model family {self.family!r} is not supported (supported: "
                f"{', '.join(SUPPORTED_FAMILIES)})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ModelSpecError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def padded_vocab_size(self, tp: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
        """Megatron pads the vocabulary so every TP rank holds an equal, aligned slice."""
        multiple = divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    def num_parameters(self) -> int:
        h, f, d = self.hidden_size, self.ffn_hidden_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        attn += d * 2 * self.num_kv_heads + d * self.num_heads if self.qkv_bias else 0
        attn += 2 * d if self.qk_norm else 0
        mlp = (
            self.num_experts * (h + 3 * h * self.moe_ffn_hidden_size) if self.is_moe else 3 * h * f
        )
        if self.moe_shared_ffn_hidden_size:
            mlp += 3 * h * self.moe_shared_ffn_hidden_size + h  # the shared expert and its gate
        per_layer = attn + mlp + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    def check_parallelism(self, tp: int, pp: int, vpp: int = 1, ep: int = 1) -> None:
        """Raise :class:`ModelSpecError` naming ``actor.tp``/``actor.pp``/``actor.ep`` when the
        layout cannot fit."""
        if tp < 1 or pp < 1:
            raise ModelSpecError(f"actor.tp={tp} and actor.pp={pp} must be >= 1")
        if self.num_heads % tp:
            raise ModelSpecError(
                f"actor.tp={tp} does not divide the model's {self.num_heads} attention heads"
            )
        if self.num_kv_heads % tp:
            raise ModelSpecError(
                f"actor.tp={tp} does not divide the model's {self.num_kv_heads} key/value heads"
            )
        if self.num_layers % (pp * vpp):
            raise ModelSpecError(
                f"actor.pp={pp}"
                + (f" x actor.vpp={vpp}" if vpp > 1 else "")
                + f" does not divide the model's {self.num_layers} layers"
            )
        if ep > 1 and not self.is_moe:
            raise ModelSpecError(f"actor.ep={ep} needs a mixture-of-experts model")
        if self.is_moe and self.num_experts % ep:
            raise ModelSpecError(
                f"actor.ep={ep} does not divide the model's {self.num_experts} experts"
            )
        if self.is_moe and self.moe_ffn_hidden_size % tp:
            raise ModelSpecError(
                f"actor.tp={tp} does not divide the experts' intermediate size "
                f"{self.moe_ffn_hidden_size}"
            )


def _rope_theta(config: Mapping[str, Any]) -> float:
    """``rope_theta`` moved into ``rope_parameters`` in transformers 5; accept both."""
    params = config.get("rope_parameters") or {}
    if isinstance(params, Mapping) and "rope_theta" in params:
        rope_type = params.get("rope_type", "default")
        if rope_type not in ("default", None):
            raise ModelSpecError(f"rope_type={rope_type!r} is not supported (only default RoPE)")
        return float(params["rope_theta"])
    scaling = config.get("rope_scaling")
    if scaling:
        raise ModelSpecError(f"rope_scaling={scaling!r} is not supported (only default RoPE)")
    return float(config.get("rope_theta", 10000.0))


def _reject_unmapped_features(family: str, config: Mapping[str, Any]) -> None:
    """Features the Megatron block and the mapping tables do not carry: refuse, never drop them.

    Llama/Mistral/Qwen3 ``attention_bias`` also biases ``o_proj`` and ``mlp_bias`` biases the MLP; a
    sliding attention window changes attention beyond the window. Silently ignoring any of them
    would train a different model than the checkpoint.
    """
    if family != "qwen2" and config.get("attention_bias"):
        raise ModelSpecError(f"attention_bias=True ({family}: bias on o_proj too) is not supported")
    if config.get("mlp_bias"):
        raise ModelSpecError("mlp_bias=True is not supported")
    window = config.get("sliding_window")
    uses_window = config.get("use_sliding_window", family in ("mistral", "mixtral"))
    if window and uses_window and int(window) < int(config.get("max_position_embeddings", 0)):
        raise ModelSpecError(
            f"sliding_window={window} < max_position_embeddings: windowed attention is not "
            "supported"
        )


def spec_from_hf_config(config: Mapping[str, Any] | Any) -> TransformerSpec:
    """Build a :class:`TransformerSpec` from a HF config (a ``PretrainedConfig`` or its dict)."""
    if not isinstance(config, Mapping):
        config = config.to_dict()
    family = config.get("model_type", "")
    if family not in SUPPORTED_FAMILIES:
        raise ModelSpecError(
            f"model_type={family!r} is not supported (supported: {', '.join(SUPPORTED_FAMILIES)})"
        )
    if config.get("hidden_act", "silu") != "silu":
        raise ModelSpecError(
            f"hidden_act={config['hidden_act']!r}: only SwiGLU (silu) is supported"
        )
    _reject_unmapped_features(family, config)
    moe = _moe_fields(family, config)
    num_heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    head_dim = config.get("head_dim") or hidden // num_heads
    return TransformerSpec(
        family=family,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        ffn_hidden_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(config),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=_qkv_bias(family, config),
        max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
        qk_norm=family in ("qwen3", "qwen3_moe"),
        **moe,
    )


def _qkv_bias(family: str, config: Mapping[str, Any]) -> bool:
    """Bias on q, k and v. Qwen2 always has it; Qwen2-MoE too unless its config says
    ``qkv_bias: false`` (transformers 5's flag, absent from older checkpoints, which are biased);
    other families take ``attention_bias`` (whose bias on o_proj
    :func:`_reject_unmapped_features` refuses)."""
    if family == "qwen2":
        return True
    if family == "qwen2_moe":
        return bool(config.get("qkv_bias", True))
    return bool(config.get("attention_bias", False))


def _moe_fields(family: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of the spec; refuses layouts the Megatron block lacks.

    Qwen3-MoE and Qwen2-MoE can keep dense MLPs in some layers (``decoder_sparse_step``,
    ``mlp_only_layers``) and Mixtral can jitter the router in training; Megatron's layer stack
    here is all-MoE and deterministic, so those are refused rather than trained as another model.
    """
    if family not in MOE_FAMILIES:
        return {}
    shared = 0
    if family in ("qwen3_moe", "qwen2_moe"):
        _reject_dense_layers(config)
        # checkpoints say num_experts; transformers 5's to_dict says num_local_experts
        experts = config.get("num_experts") or config["num_local_experts"]
        ffn = config["moe_intermediate_size"]
        norm = bool(config.get("norm_topk_prob", False))
        if family == "qwen2_moe":
            shared = int(config["shared_expert_intermediate_size"])
            if shared <= 0:
                # HF still builds an (empty) shared expert and its gate; Megatron refuses size 0
                raise ModelSpecError(
                    f"shared_expert_intermediate_size={shared}: a Qwen2-MoE model without a "
                    "shared expert is not supported"
                )
    else:
        if float(config.get("router_jitter_noise") or 0.0):
            raise ModelSpecError("router_jitter_noise > 0 is not supported")
        experts, ffn, norm = config["num_local_experts"], config["intermediate_size"], True
    top_k = int(config["num_experts_per_tok"])
    if not 0 < top_k <= int(experts):
        raise ModelSpecError(f"num_experts_per_tok={top_k} must be in [1, {experts}]")
    return {
        "num_experts": int(experts),
        "moe_top_k": top_k,
        "moe_ffn_hidden_size": int(ffn),
        "moe_norm_topk_prob": norm,
        "moe_shared_ffn_hidden_size": shared,
    }


def _reject_dense_layers(config: Mapping[str, Any]) -> None:
    """Qwen-MoE's dense layers between MoE layers, named by the key that asks for them."""
    step = int(config.get("decoder_sparse_step", 1))
    if step != 1:
        raise ModelSpecError(
            f"decoder_sparse_step={step}: dense layers between MoE layers are not supported"
        )
    dense = config.get("mlp_only_layers")
    if dense:
        raise ModelSpecError(
            f"mlp_only_layers={list(dense)}: dense layers between MoE layers are not supported"
        )
