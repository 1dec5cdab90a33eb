"""Megatron <-> Hugging Face parameter names and tensor layouts, one table per model family.

Pure tensor code (no megatron, no torch.distributed). A :class:`ParamRule` says which HF tensors
make one Megatron parameter and how they are laid out across tensor-parallel ranks:

- ``replicated``: every TP rank holds the whole tensor (norms).
- ``column`` / ``row``: split along dim 0 / dim 1 (``ColumnParallelLinear`` / ``RowParallelLinear``).
- ``vocab``: rows padded to the padded vocabulary, then split along dim 0.
- ``qkv``: q, k, v fused *per query group*: each group is ``[its q heads, its k head, its v
  head]``; TP rank r holds groups ``[r*g/tp, (r+1)*g/tp)``. Bias, if any, follows the same layout.
- ``gate_up``: TP rank r holds ``[gate_r; up_r]`` (chunks of gate and of up), not a chunk of the
  concatenation.

Both directions go through ``to_mcore_shard`` / ``to_hf``, so a round trip is bitwise. Adding a
family means adding a table (see ``FAMILY_RULES``), not touching the loader or the exporter.
Layer names use *global* layer numbers; pipeline stages translate with their layer offset.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch

from megarl.models.spec import ModelSpecError, TransformerSpec

LAYOUTS = ("replicated", "column", "row", "vocab", "qkv", "gate_up")
DIMS = ("vocab", "hidden", "ffn", "q", "kv", "head", "experts", "expert_ffn", "shared_ffn", "one")
"""Symbolic dims of HF tensor shapes: ``q`` = heads x head_dim, ``kv`` = KV heads x head_dim,
``head`` = head_dim, ``expert_ffn`` = one expert's intermediate size, ``shared_ffn`` = the shared
expert's, ``one`` = 1 (the shared expert's gate has a single output)."""


@dataclass(frozen=True)
class ParamRule:
    """How one Megatron parameter is made of HF tensors."""

    mcore: str
    """Megatron name; ``{layer}`` stands for the global layer number."""
    hf: tuple[str, ...]
    """HF names in the order the layout expects (q, k, v for ``qkv``; gate, up for ``gate_up``)."""
    layout: str
    shapes: tuple[tuple[str, ...], ...] = ()
    """Each HF tensor's shape in symbolic dims (``DIMS``), in ``hf`` order: every rank knows every
    tensor's size without holding it, so the exporter can plan buckets from metadata alone."""

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r} for {self.mcore}")
        if len(self.shapes) != len(self.hf):
            raise ValueError(f"{self.mcore}: one shape per HF tensor is needed")
        for shape in self.shapes:
            unknown = set(shape) - set(DIMS)
            if unknown:
                raise ValueError(f"{self.mcore}: unknown dims {sorted(unknown)}")

    @property
    def per_layer(self) -> bool:
        return "{layer}" in self.mcore

    def mcore_name(self, layer: int | None = None) -> str:
        return self.mcore.format(layer=layer) if self.per_layer else self.mcore

    def hf_names(self, layer: int | None = None) -> tuple[str, ...]:
        return tuple(n.format(layer=layer) for n in self.hf) if self.per_layer else self.hf


_L = "decoder.layers.{layer}."
_H = "model.layers.{layer}."

_VH, _H1 = ("vocab", "hidden"), ("hidden",)

LLAMA_RULES: tuple[ParamRule, ...] = (
    ParamRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", (_VH,)),
    ParamRule(
        _L + "input_layernorm.weight", (_H + "input_layernorm.weight",), "replicated", (_H1,)
    ),
    ParamRule(
        _L + "self_attention.linear_qkv.weight",
        (
            _H + "self_attn.q_proj.weight",
            _H + "self_attn.k_proj.weight",
            _H + "self_attn.v_proj.weight",
        ),
        "qkv",
        (("q", "hidden"), ("kv", "hidden"), ("kv", "hidden")),
    ),
    ParamRule(
        _L + "self_attention.linear_proj.weight",
        (_H + "self_attn.o_proj.weight",),
        "row",
        (("hidden", "q"),),
    ),
    ParamRule(
        _L + "pre_mlp_layernorm.weight",
        (_H + "post_attention_layernorm.weight",),
        "replicated",
        (_H1,),
    ),
    ParamRule(
        _L + "mlp.linear_fc1.weight",
        (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"),
        "gate_up",
        (("ffn", "hidden"), ("ffn", "hidden")),
    ),
    ParamRule(
        _L + "mlp.linear_fc2.weight", (_H + "mlp.down_proj.weight",), "row", (("hidden", "ffn"),)
    ),
    ParamRule("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated", (_H1,)),
    ParamRule("output_layer.weight", ("lm_head.weight",), "vocab", (_VH,)),
)

QKV_BIAS_RULE = ParamRule(
    _L + "self_attention.linear_qkv.bias",
    (_H + "self_attn.q_proj.bias", _H + "self_attn.k_proj.bias", _H + "self_attn.v_proj.bias"),
    "qkv",
    (("q",), ("kv",), ("kv",)),
)

QK_NORM_RULES = (
    ParamRule(
        _L + "self_attention.q_layernorm.weight",
        (_H + "self_attn.q_norm.weight",),
        "replicated",
        (("head",),),
    ),
    ParamRule(
        _L + "self_attention.k_layernorm.weight",
        (_H + "self_attn.k_norm.weight",),
        "replicated",
        (("head",),),
    ),
)
"""Qwen3's per-head query/key RMSNorm: one ``head_dim`` weight shared by every head, so every TP
rank holds all of it."""

FAMILY_RULES: dict[str, tuple[ParamRule, ...]] = {
    "llama": LLAMA_RULES,
    "mistral": LLAMA_RULES,
    "qwen2": (*LLAMA_RULES, QKV_BIAS_RULE),
    "qwen3": (*LLAMA_RULES, *QK_NORM_RULES),
    "qwen3_moe": (*LLAMA_RULES, *QK_NORM_RULES),
    "mixtral": LLAMA_RULES,
    "qwen2_moe": LLAMA_RULES,  # q/k/v bias by its qkv_bias flag (rules_for)
}

DENSE_MLP = (_L + "mlp.linear_fc1.weight", _L + "mlp.linear_fc2.weight")
"""The dense MLP's parameters, which a mixture-of-experts layer replaces."""

MOE_HF_NAMES: dict[str, tuple[str, tuple[str, str, str]]] = {
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}
"""Per MoE family: the HF module holding the router (``.gate``) and the experts, and the names
of an expert's gate, up and down projections. These are the checkpoint's names (what
``save_pretrained`` writes and vLLM loads); transformers 5 fuses the experts in memory."""


def moe_rules(spec: TransformerSpec) -> tuple[ParamRule, ...]:
    """The router, one gate_up / down pair per expert (expert ``e`` named by its global index),
    and the shared expert if the model has one.

    Megatron's ``SequentialMLP`` names its experts ``local_experts.{i}`` on each expert-parallel
    rank; :func:`megarl.models.megatron_gpt.iter_local_params` turns local indices into global
    ones, so everything downstream (loading, export, checkpoints) sees one name per expert.
    """
    module, (gate, up, down) = MOE_HF_NAMES[spec.family]
    hf = _H + module + "."
    rules = [
        ParamRule(
            _L + "mlp.router.weight", (hf + "gate.weight",), "replicated", (("experts", "hidden"),)
        )
    ]
    for e in range(spec.num_experts):
        mc, he = f"{_L}mlp.experts.local_experts.{e}.", f"{hf}experts.{e}."
        rules.append(
            ParamRule(
                mc + "linear_fc1.weight",
                (he + f"{gate}.weight", he + f"{up}.weight"),
                "gate_up",
                (("expert_ffn", "hidden"), ("expert_ffn", "hidden")),
            )
        )
        rules.append(
            ParamRule(
                mc + "linear_fc2.weight",
                (he + f"{down}.weight",),
                "row",
                (("hidden", "expert_ffn"),),
            )
        )
    if spec.moe_shared_ffn_hidden_size:
        rules.extend(shared_expert_rules(hf))
    return tuple(rules)


def shared_expert_rules(hf: str) -> tuple[ParamRule, ...]:
    """Qwen2-MoE's shared expert (``hf`` is the HF MoE module's prefix) as Megatron's
    ``SharedExpertMLP`` holds it.

    Megatron computes ``MLP(x) * sigmoid(x @ gate_weight.T)`` and adds it to the routed output,
    which is HF's ``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` with ``gate_weight`` the
    ``[1, hidden]`` gate weight itself. Every rank holds the shared expert whatever the expert
    parallel size (no ``local_experts`` in its names, so :func:`expert_of` is None): the
    exporter, checkpoints and the gradient norm treat it like the attention weights. Under TP its
    linear layers split like a dense MLP's; the gate is whole on every rank.
    """
    mc = _L + "mlp.shared_experts."
    return (
        ParamRule(
            mc + "linear_fc1.weight",
            (hf + "shared_expert.gate_proj.weight", hf + "shared_expert.up_proj.weight"),
            "gate_up",
            (("shared_ffn", "hidden"), ("shared_ffn", "hidden")),
        ),
        ParamRule(
            mc + "linear_fc2.weight",
            (hf + "shared_expert.down_proj.weight",),
            "row",
            (("hidden", "shared_ffn"),),
        ),
        ParamRule(
            mc + "gate_weight",
            (hf + "shared_expert_gate.weight",),
            "replicated",
            (("one", "hidden"),),
        ),
    )


@functools.cache
def rules_for(spec: TransformerSpec) -> tuple[ParamRule, ...]:
    """The family's table, adjusted for per-model flags (qkv bias; experts instead of an MLP)."""
    rules = FAMILY_RULES[spec.family]
    if spec.qkv_bias and QKV_BIAS_RULE not in rules:
        rules = (*rules, QKV_BIAS_RULE)
    if spec.is_moe:
        rules = (*(r for r in rules if r.mcore not in DENSE_MLP), *moe_rules(spec))
    return rules


def hf_shapes(rule: ParamRule, spec: TransformerSpec) -> tuple[tuple[int, ...], ...]:
    """Concrete shapes of ``rule``'s HF tensors for this model."""
    sizes = {
        "vocab": spec.vocab_size,
        "hidden": spec.hidden_size,
        "ffn": spec.ffn_hidden_size,
        "q": spec.num_heads * spec.head_dim,
        "kv": spec.num_kv_heads * spec.head_dim,
        "head": spec.head_dim,
        "experts": spec.num_experts,
        "expert_ffn": spec.moe_ffn_hidden_size,
        "shared_ffn": spec.moe_shared_ffn_hidden_size,
        "one": 1,
    }
    return tuple(tuple(sizes[d] for d in shape) for shape in rule.shapes)


# --- HF -> one Megatron TP shard -------------------------------------------------------------


def to_mcore_shard(
    rule: ParamRule,
    hf_tensors: Sequence[torch.Tensor],
    spec: TransformerSpec,
    tp_rank: int,
    tp: int,
) -> torch.Tensor:
    """The slice of ``rule``'s Megatron parameter that TP rank ``tp_rank`` of ``tp`` holds."""
    layout = rule.layout
    if layout == "replicated":
        return hf_tensors[0].clone()
    if layout == "column":
        return hf_tensors[0].chunk(tp, dim=0)[tp_rank].clone()
    if layout == "row":
        return hf_tensors[0].chunk(tp, dim=1)[tp_rank].clone()
    if layout == "vocab":
        padded = _pad_vocab(rule.hf[0], hf_tensors[0], spec, tp)
        return padded.chunk(tp, dim=0)[tp_rank].clone()
    if layout == "gate_up":
        gate, up = hf_tensors
        return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]], dim=0)
    return _qkv_shard(hf_tensors, spec, tp_rank, tp)


def _pad_vocab(name: str, weight: torch.Tensor, spec: TransformerSpec, tp: int) -> torch.Tensor:
    """Zero rows from ``vocab_size`` up to Megatron's padded vocabulary, and only those.

    A tensor whose rows differ from ``vocab_size`` is a config that disagrees with its weights;
    padding it would turn real token ids into zero embeddings (or fail on a negative size), so
    it is refused.
    """
    if weight.shape[0] != spec.vocab_size:
        raise ModelSpecError(
            f"{name} has {weight.shape[0]} rows but vocab_size="
            f"{spec.vocab_size}: the config and the weights disagree"
        )
    padded_rows = spec.padded_vocab_size(tp)
    if weight.shape[0] == padded_rows:
        return weight
    pad = weight.new_zeros((padded_rows - weight.shape[0], *weight.shape[1:]))
    return torch.cat([weight, pad], dim=0)


def _qkv_shard(hf_tensors, spec: TransformerSpec, tp_rank: int, tp: int) -> torch.Tensor:
    q, k, v = hf_tensors
    d, groups = spec.head_dim, spec.num_kv_heads
    trailing = q.shape[1:]
    q_g = q.reshape(groups, spec.heads_per_group * d, *trailing)
    k_g = k.reshape(groups, d, *trailing)
    v_g = v.reshape(groups, d, *trailing)
    fused = torch.cat([q_g, k_g, v_g], dim=1)  # [groups, (hpg + 2) * d, ...]
    mine = fused.chunk(tp, dim=0)[tp_rank]
    return mine.reshape(-1, *trailing).clone()


# --- Megatron TP shards -> HF ----------------------------------------------------------------


def to_hf(
    rule: ParamRule, shards: Sequence[torch.Tensor], spec: TransformerSpec
) -> tuple[torch.Tensor, ...]:
    """Reassemble HF tensors (in ``rule.hf`` order) from all TP shards of a Megatron parameter."""
    layout, tp = rule.layout, len(shards)
    if layout == "replicated":
        return (shards[0],)
    if layout == "column":
        return (torch.cat(list(shards), dim=0),)
    if layout == "row":
        return (torch.cat(list(shards), dim=1),)
    if layout == "vocab":
        return (torch.cat(list(shards), dim=0)[: spec.vocab_size],)
    if layout == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        gate = torch.cat([h[0] for h in halves], dim=0)
        up = torch.cat([h[1] for h in halves], dim=0)
        return gate, up
    return _qkv_unshard(shards, spec, tp)


def _qkv_unshard(shards, spec: TransformerSpec, tp: int) -> tuple[torch.Tensor, ...]:
    d, groups, hpg = spec.head_dim, spec.num_kv_heads, spec.heads_per_group
    fused = torch.cat(list(shards), dim=0)
    trailing = fused.shape[1:]
    per_group = fused.reshape(groups, (hpg + 2) * d, *trailing)
    q, k, v = per_group.split([hpg * d, d, d], dim=1)
    return (
        q.reshape(groups * hpg * d, *trailing),
        k.reshape(groups * d, *trailing),
        v.reshape(groups * d, *trailing),
    )


# --- Megatron TP shards -> the whole Megatron parameter (TP=1) --------------------------------


def to_mcore_full(
    rule: ParamRule, shards: Sequence[torch.Tensor], spec: TransformerSpec
) -> torch.Tensor:
    """The parameter a TP=1 Megatron model holds, from all TP shards of it: what a rollout-side
    Megatron engine loads, without the HF split of fused q/k/v or gate/up. Equal to
    ``to_mcore_shard(rule, to_hf(rule, shards, spec), spec, 0, 1)`` (tested bitwise), except
    that a vocabulary matrix keeps its real rows only (the padding differs by layout). Query
    groups are whole on every TP rank, so fused q/k/v shards concatenate; gate/up shards are
    ``[gate_r; up_r]`` and regroup."""
    layout = rule.layout
    if layout == "replicated":
        return shards[0]
    if layout == "row":
        return torch.cat(list(shards), dim=1)
    if layout == "vocab":
        return torch.cat(list(shards), dim=0)[: spec.vocab_size]
    if layout == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(list(shards), dim=0)  # column, qkv


def mcore_full_shape(rule: ParamRule, spec: TransformerSpec) -> tuple[int, ...]:
    """The shape :func:`to_mcore_full` gives: fused HF tensors stacked along dim 0."""
    shapes = hf_shapes(rule, spec)
    if len(shapes) == 1:
        return shapes[0]
    return (sum(shape[0] for shape in shapes), *shapes[0][1:])


# --- whole-model helpers ---------------------------------------------------------------------


def expected_hf_names(spec: TransformerSpec) -> list[str]:
    """Every HF tensor name of the model (``lm_head`` only when embeddings are untied)."""
    names: list[str] = []
    for rule in rules_for(spec):
        if rule.mcore == "output_layer.weight" and spec.tie_embeddings:
            continue
        layers = range(spec.num_layers) if rule.per_layer else [None]
        for layer in layers:
            names.extend(rule.hf_names(layer))
    return names


LOCAL_EXPERTS = ".mlp.experts.local_experts."


def globalize_expert(mcore_name: str, first_expert: int) -> str:
    """``...local_experts.{i}...`` -> ``...local_experts.{first_expert + i}...``.

    An expert-parallel rank holds experts ``[first_expert, first_expert + E / ep)`` under local
    indices from 0; the mapping tables, the exporter and checkpoints name each expert by its
    global index, so a checkpoint reads back at any expert-parallel size.
    """
    head, found, tail = mcore_name.partition(LOCAL_EXPERTS)
    if not found or not first_expert:
        return mcore_name
    index, rest = tail.split(".", 1)
    return f"{head}{LOCAL_EXPERTS}{int(index) + first_expert}.{rest}"


def expert_of(rule: ParamRule) -> int | None:
    """The global expert a rule's parameter belongs to; None outside the experts."""
    _, found, tail = rule.mcore.partition(LOCAL_EXPERTS)
    return int(tail.split(".", 1)[0]) if found else None


def split_layer_name(mcore_name: str) -> tuple[str, int | None]:
    """``decoder.layers.7.mlp...`` -> (``decoder.layers.{layer}.mlp...``, 7)."""
    prefix = "decoder.layers."
    if not mcore_name.startswith(prefix):
        return mcore_name, None
    index, rest = mcore_name[len(prefix) :].split(".", 1)
    return f"{prefix}{{layer}}.{rest}", int(index)


@functools.cache
def rule_index(spec: TransformerSpec) -> Mapping[str, ParamRule]:
    """Megatron name template -> rule."""
    return MappingProxyType({rule.mcore: rule for rule in rules_for(spec)})
