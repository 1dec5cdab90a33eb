"""The export schedule: which HF tensors go in which bucket, and which pipeline stage owns each.

Pure code (no torch.distributed, no megatron). Every rank computes the same :class:`ExportPlan`
from metadata it already has (the model spec, the mapping table, the parallel layout, the
parameter dtype), so the bucket schedule needs no negotiation and no rank can wait on a
collective another rank skips.

Invariants (tested in ``tests/unit/test_export_plan.py``):

- every HF tensor of the model appears in exactly one item, and items keep the model's order
  (embedding, layers 0..L-1, final norm, output layer);
- a bucket's bytes never exceed the budget, except a single item larger than the budget, which
  travels alone;
- an item's owner is the pipeline rank whose model chunk holds it: layer ``l`` lives in virtual
  chunk ``l // layers_per_chunk``, and chunk ``c`` sits on pipeline rank ``c % pp`` (Megatron's
  interleaved assignment; ``vpp = 1`` reduces to contiguous stages); an expert ``e``'s
  parameters also name their expert-parallel rank, ``e // (experts / ep)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.models import mapping
from megarl.models.mapping import ParamRule
from megarl.models.spec import TransformerSpec


@dataclass(frozen=True)
class ExportItem:
    """One Megatron parameter and the HF tensors it becomes."""

    rule: ParamRule
    layer: int | None
    pp_rank: int
    """Pipeline rank that holds the parameter (its TP group gathers it; its leader sends it)."""
    hf_names: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    nbytes: int
    """Bytes of the HF tensors (what the engine receives; the same in Megatron layout)."""
    gathered_nbytes: int
    """Bytes of all TP shards together on the gathering rank (vocab padding included)."""
    ep_rank: int | None = None
    """Expert-parallel rank holding an expert's parameter; None for everything else (which every
    expert-parallel rank holds)."""
    mcore_shape: tuple[int, ...] = ()
    """Shape of the whole parameter at TP=1 (real vocabulary rows): what a Megatron engine
    receives in place of the HF tensors (:func:`megarl.models.mapping.to_mcore_full`)."""

    def sent(self, megatron_layout: bool) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """The ``(name, shape)`` of each tensor this item becomes on the wire: the HF tensors,
        or in Megatron layout the one whole parameter under its Megatron name."""
        if megatron_layout:
            return ((self.rule.mcore_name(self.layer), self.mcore_shape),)
        return tuple(zip(self.hf_names, self.hf_shapes, strict=True))


@dataclass(frozen=True)
class Bucket:
    items: tuple[ExportItem, ...]
    nbytes: int


@dataclass(frozen=True)
class ExportPlan:
    buckets: tuple[Bucket, ...]
    bucket_bytes: int
    """The budget the plan was made with."""

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def largest_item_bytes(self) -> int:
        return max(i.nbytes for b in self.buckets for i in b.items)

    @property
    def largest_gathered_bytes(self) -> int:
        return max(i.gathered_nbytes for b in self.buckets for i in b.items)

    def memory_bound(self) -> int:
        """What one rank may hold at once: a full bucket plus one item's gathered shards.

        An item bigger than the budget makes its own bucket, so the bucket term is
        ``max(budget, largest item)``.
        """
        return max(self.bucket_bytes, self.largest_item_bytes) + self.largest_gathered_bytes


def owner_pp_rank(layer: int, num_layers: int, pp: int, vpp: int) -> int:
    """Pipeline rank holding global ``layer`` under Megatron's (interleaved) layer assignment."""
    per_chunk = num_layers // (pp * vpp)
    return (layer // per_chunk) % pp


def _item(
    rule: ParamRule,
    layer: int | None,
    pp_rank: int,
    spec: TransformerSpec,
    tp: int,
    element_size: int,
    ep: int = 1,
) -> ExportItem:
    shapes = mapping.hf_shapes(rule, spec)
    expert = mapping.expert_of(rule)
    numel = sum(_numel(s) for s in shapes)
    gathered = numel
    if rule.layout == "vocab":
        gathered = spec.padded_vocab_size(tp) * spec.hidden_size
    elif rule.layout == "replicated":
        gathered = 0  # never gathered: the leader sends its own copy
    return ExportItem(
        rule=rule,
        layer=layer,
        pp_rank=pp_rank,
        ep_rank=None if expert is None else expert // (spec.num_experts // ep),
        hf_names=rule.hf_names(layer),
        hf_shapes=shapes,
        nbytes=numel * element_size,
        gathered_nbytes=gathered * element_size,
        mcore_shape=mapping.mcore_full_shape(rule, spec),
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _layer_number(item: ExportItem) -> int:
    if item.layer is None:
        raise ValueError(f"{item} is not a per-layer parameter")
    return item.layer


def export_items(
    spec: TransformerSpec, tp: int, pp: int, vpp: int, element_size: int, ep: int = 1
) -> list[ExportItem]:
    """Every exported parameter in model order, with its owning pipeline rank."""
    head: list[ExportItem] = []
    layers: list[ExportItem] = []
    tail: list[ExportItem] = []
    for rule in mapping.rules_for(spec):
        if rule.mcore == "output_layer.weight" and spec.tie_embeddings:
            continue  # the first stage's embedding is the one exported
        if rule.per_layer:
            for layer in range(spec.num_layers):
                owner = owner_pp_rank(layer, spec.num_layers, pp, vpp)
                layers.append(_item(rule, layer, owner, spec, tp, element_size, ep))
        elif rule.mcore.startswith("embedding."):
            head.append(_item(rule, None, 0, spec, tp, element_size))
        else:
            tail.append(_item(rule, None, pp - 1, spec, tp, element_size))
    layers.sort(key=_layer_number)  # stable: table order within a layer
    return head + layers + tail


def plan_buckets(items: list[ExportItem], bucket_bytes: int) -> ExportPlan:
    """Greedy, order-preserving packing into buckets of at most ``bucket_bytes``."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket budget must be positive, got {bucket_bytes}")
    buckets: list[Bucket] = []
    current: list[ExportItem] = []
    size = 0
    for item in items:
        if current and size + item.nbytes > bucket_bytes:
            buckets.append(Bucket(tuple(current), size))
            current, size = [], 0
        current.append(item)
        size += item.nbytes
    if current:
        buckets.append(Bucket(tuple(current), size))
    return ExportPlan(buckets=tuple(buckets), bucket_bytes=bucket_bytes)


def plan_export(
    spec: TransformerSpec,
    tp: int,
    pp: int,
    vpp: int,
    element_size: int,
    bucket_bytes: int,
    ep: int = 1,
) -> ExportPlan:
    spec.check_parallelism(tp, pp, vpp)
    return plan_buckets(export_items(spec, tp, pp, vpp, element_size, ep), bucket_bytes)
