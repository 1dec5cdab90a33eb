"""Stream HF-named tensors from a Megatron model (any TP x PP x VPP) to global rank 0, bucketed.

Or, for a Megatron engine (a TP=PP=1 copy on the rollout side), each parameter whole under its
Megatron name (``megatron_layout``): the same plan, gathers and sends, without the HF split of
fused q/k/v and gate/up that the engine would only undo (:func:`megarl.models.mapping.to_mcore_full`).

Why this shape: the engine lives on global rank 0, so every tensor must end there, but no rank
may hold the whole model. Each rank walks the same :class:`~megarl.export.plan.ExportPlan`
(computed from metadata, so all ranks agree without talking). Per item:

1. the owning stage's TP group (data-parallel replica 0 only) gathers the shards to its TP rank 0
   (the stage *leader*) -- once, with ``dist.gather``; replicated tensors are not gathered;
2. the leader turns the shards into HF tensors with the family's mapping table;
3. if the leader is rank 0 the tensors join the current bucket; otherwise the leader sends them
   point-to-point to rank 0, which receives into buffers whose shapes it knows from the plan.

Rank 0 yields one bucket at a time. All communication uses the model-parallel groups and the
global group, which carry timeouts (:mod:`megarl.distributed.parallel`), so a dead peer becomes
an error, not a hang. Deadlock-free: rank 0 and every leader process items in the same order,
and a TP group's gather involves only that stage's ranks.

Every rank measures its own high-water mark of bytes held by the exporter (gather buffers,
converted tensors, the bucket being filled), exposed as :attr:`BucketStream.peak_bytes`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.export.checksum import tensor_checksum
from megarl.export.plan import ExportItem, ExportPlan, plan_export
from megarl.models import mapping
from megarl.models.spec import TransformerSpec

NamedTensors = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class ExportRanks:
    """Where this rank sits, as the exporter needs it (read from Megatron's parallel state)."""

    rank: int
    pp_rank: int
    dp_rank: int
    tp: int
    tp_rank: int
    tp_group: dist.ProcessGroup
    tp_leader: int
    """Global rank of TP rank 0 in this rank's TP group."""
    stage_leaders: tuple[int, ...]
    """Global rank of the leader (TP 0, DP 0) of each pipeline stage; meaningful on rank 0."""
    ep_rank: int = 0
    expert_dp_rank: int = 0
    """Replica index among the ranks holding the same experts; replica 0 exports them."""
    expert_leaders: tuple[tuple[int, ...], ...] = ((0,),)
    """Per pipeline stage, the global rank exporting each expert-parallel rank's experts;
    meaningful on rank 0. Megatron numbers ranks with the pipeline stage outermost in both its
    dense and its expert grid, so stage ``p`` is rank 0's expert-parallel group (TP rank 0,
    replica 0 of every expert rank) shifted to stage ``p``'s leader."""

    def source_of(self, pp_rank: int, ep_rank: int | None) -> int:
        """The global rank that sends rank 0 an item of stage ``pp_rank`` (an expert's of
        expert-parallel rank ``ep_rank``, or a dense parameter's for None)."""
        if ep_rank is None:
            return self.stage_leaders[pp_rank]
        return self.expert_leaders[pp_rank][ep_rank]

    @staticmethod
    def from_megatron() -> ExportRanks:
        from megatron.core import parallel_state as ps

        pp_group = _one_group(ps.get_pipeline_model_parallel_group())
        leaders = tuple(dist.get_process_group_ranks(pp_group))
        ep_group = dist.get_process_group_ranks(_one_group(ps.get_expert_model_parallel_group()))
        return ExportRanks(
            rank=dist.get_rank(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            dp_rank=ps.get_data_parallel_rank(),
            tp=ps.get_tensor_model_parallel_world_size(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_group=_one_group(ps.get_tensor_model_parallel_group()),
            tp_leader=ps.get_tensor_model_parallel_src_rank(),
            stage_leaders=leaders,
            ep_rank=ps.get_expert_model_parallel_rank(),
            expert_dp_rank=ps.get_expert_data_parallel_rank(),
            expert_leaders=tuple(
                tuple(lead + r - ep_group[0] for r in ep_group) for lead in leaders
            ),
        )


def _one_group(group: object) -> dist.ProcessGroup:
    """A Megatron group getter's result as the one process group it is here (Megatron annotates
    the getters with every kind of group they can hold: lists of groups, ranks)."""
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"expected a process group, got {type(group).__name__}")
    return group


class MemoryMeter:
    """High-water mark of bytes in tensor storages the exporter holds (parameters excluded)."""

    def __init__(self) -> None:
        self.peak_bytes = 0

    def observe(self, *groups: Iterable[torch.Tensor]) -> None:
        seen: dict[int, int] = {}
        for group in groups:
            for t in group:
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        self.peak_bytes = max(self.peak_bytes, sum(seen.values()))


class BucketStream:
    """One export pass. Iterate :meth:`buckets` on every rank; only rank 0 gets tensors.

    ``checksums``: when set, each leader computes a checksum of every HF tensor it produces and
    rank 0 receives it with the tensor; :attr:`sent_checksums` maps HF name -> checksum there.
    ``megatron_layout``: send whole Megatron parameters under their Megatron names instead of HF
    tensors (checksums are then keyed by those names).
    """

    def __init__(
        self,
        plan: ExportPlan,
        spec: TransformerSpec,
        local_params: Iterable,
        dtype: torch.dtype,
        ranks: ExportRanks,
        checksums: bool = False,
        megatron_layout: bool = False,
    ):
        self.plan, self.spec, self.dtype, self.ranks = plan, spec, dtype, ranks
        self.checksums = checksums
        self.megatron_layout = megatron_layout
        self.params = {(rule.mcore, layer): param for rule, layer, param in local_params}
        self.device = next(iter(self.params.values())).device
        self.meter = MemoryMeter()
        self.sent_checksums: dict[str, tuple[int, int]] = {}
        self.num_buckets = 0
        self.num_bytes = 0

    @property
    def peak_bytes(self) -> int:
        return self.meter.peak_bytes

    def _exports(self, item: ExportItem) -> bool:
        """Whether this rank's TP group sends ``item``: data-parallel replica 0 of its pipeline
        stage (the other replicas hold the same weights), and for an expert's parameter replica 0
        of the expert-parallel rank that holds the expert."""
        r = self.ranks
        if r.pp_rank != item.pp_rank:
            return False
        if item.ep_rank is None:
            return r.dp_rank == 0
        return r.ep_rank == item.ep_rank and r.expert_dp_rank == 0

    def buckets(self) -> Iterator[NamedTensors]:
        """Yield each bucket's ``(hf_name, tensor)`` list on rank 0 (empty lists elsewhere)."""
        for bucket in self.plan.buckets:
            out: NamedTensors = []
            for item in bucket.items:
                out.extend(self._export_item(item, [t for _, t in out]))
            self.meter.observe([t for _, t in out])
            if self.ranks.rank == 0:
                self.num_buckets += 1
                self.num_bytes += sum(t.numel() * t.element_size() for _, t in out)
            yield out
            del out

    def named_tensors(
        self, on_bucket: Callable[[int, int], None] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The buckets flattened: what ``RolloutEngine.update_weights`` takes.

        Each tensor is released from the bucket as it is handed out, so no finished bucket is
        still referenced while the next one is being filled. ``on_bucket(handed, total)`` is
        called after each bucket's last tensor was taken (the live progress display).
        """
        total = len(self.plan.buckets)
        for handed, bucket in enumerate(self.buckets(), start=1):
            bucket.reverse()
            while bucket:
                yield bucket.pop()
            if on_bucket is not None:
                on_bucket(handed, total)

    def run_to_end(self) -> None:
        """Drive the protocol on a rank that consumes nothing (every rank but 0)."""
        for bucket in self.buckets():
            bucket.clear()

    # --- one item ------------------------------------------------------------------------------

    def _export_item(self, item: ExportItem, held: list[torch.Tensor]) -> NamedTensors:
        r = self.ranks
        owns = self._exports(item)
        produced: NamedTensors = []
        if owns:
            tensors = self._gather_and_convert(item, held)
            if r.tp_rank == 0:
                names = [name for name, _ in item.sent(self.megatron_layout)]
                produced = list(zip(names, tensors, strict=True))
                if r.rank == 0 and self.checksums:
                    self.sent_checksums.update((n, tensor_checksum(t)) for n, t in produced)
                if r.rank != 0:
                    self._send(produced)
                    produced = []
        elif r.rank == 0:
            produced = self._receive(item)
        return produced if r.rank == 0 else []

    def _gather_and_convert(self, item: ExportItem, held: list[torch.Tensor]):
        """All TP ranks of the stage take part; only the leader gets tensors back."""
        key = (item.rule.mcore, item.layer)
        if key not in self.params:
            raise KeyError(
                f"export plan expects {item.rule.mcore_name(item.layer)} on pipeline rank "
                f"{item.pp_rank}, but this rank does not hold it"
            )
        param = self.params[key].detach()
        if item.rule.layout == "replicated":
            return (param.clone(),) if self.ranks.tp_rank == 0 else ()
        stacked = item.rule.layout in ("column", "vocab") or (
            self.megatron_layout and item.rule.layout == "qkv"  # whole query groups: stacked
        )
        shards = self._gather_shards(param, into_one_buffer=stacked)
        if self.ranks.tp_rank != 0:
            return ()
        gathered = shards if self.ranks.tp > 1 else []  # at TP=1 the "shard" is the parameter
        self.meter.observe(held, gathered)
        if stacked:  # the shards are already the sent tensor (vocab: minus padding rows)
            full = shards[0] if len(shards) == 1 else _base_of(shards)
            tensors = (full[: self.spec.vocab_size] if item.rule.layout == "vocab" else full,)
            if self.ranks.tp == 1:
                tensors = (tensors[0].clone(),)  # never hand out the live parameter
        elif self.megatron_layout:
            tensors = (mapping.to_mcore_full(item.rule, shards, self.spec).contiguous(),)
        else:
            tensors = tuple(t.contiguous() for t in mapping.to_hf(item.rule, shards, self.spec))
        self.meter.observe(held, gathered, tensors)
        return tensors

    def _gather_shards(self, param: torch.Tensor, into_one_buffer: bool) -> list[torch.Tensor]:
        """TP shards on the leader. Dim-0 layouts land in consecutive slices of one buffer, so
        the gathered buffer *is* the HF tensor and no second copy is made."""
        r = self.ranks
        if r.tp == 1:
            return [param]
        buffers = None
        if r.tp_rank == 0:
            if into_one_buffer:
                full = param.new_empty((r.tp * param.shape[0], *param.shape[1:]))
                buffers = list(full.chunk(r.tp, dim=0))
            else:
                buffers = [torch.empty_like(param) for _ in range(r.tp)]
        dist.gather(param.contiguous(), buffers, dst=r.tp_leader, group=r.tp_group)
        return buffers or []

    def _send(self, named: NamedTensors) -> None:
        for _name, tensor in named:
            dist.send(tensor, dst=0)
            if self.checksums:
                pair = torch.tensor(tensor_checksum(tensor), dtype=torch.int64, device=self.device)
                dist.send(pair, dst=0)

    def _receive(self, item: ExportItem) -> NamedTensors:
        src = self.ranks.source_of(item.pp_rank, item.ep_rank)
        out: NamedTensors = []
        for name, shape in item.sent(self.megatron_layout):
            buffer = torch.empty(shape, dtype=self.dtype, device=self.device)
            dist.recv(buffer, src=src)
            out.append((name, buffer))
            if self.checksums:
                pair = torch.empty(2, dtype=torch.int64, device=self.device)
                dist.recv(pair, src=src)
                self.sent_checksums[name] = (int(pair[0]), int(pair[1]))
        return out


def open_stream(
    actor_params: Iterable,
    spec: TransformerSpec,
    bucket_bytes: int,
    vpp: int = 1,
    checksums: bool = False,
    megatron_layout: bool = False,
) -> BucketStream:
    """A :class:`BucketStream` for this rank, its plan computed from the parallel layout."""
    from megatron.core import parallel_state as ps

    params = list(actor_params)
    dtype = params[0][2].dtype
    plan = plan_export(
        spec,
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        vpp,
        torch.empty((), dtype=dtype).element_size(),
        bucket_bytes,
        ps.get_expert_model_parallel_world_size(),
    )
    ranks = ExportRanks.from_megatron()
    return BucketStream(plan, spec, params, dtype, ranks, checksums, megatron_layout)


def collect_state_dict(stream: BucketStream) -> dict[str, torch.Tensor] | None:
    """The whole HF state dict on rank 0 (``None`` elsewhere): for tests and final states only."""
    if stream.ranks.rank != 0:
        stream.run_to_end()
        return None
    return dict(stream.named_tensors())


def _base_of(chunks: list[torch.Tensor]) -> torch.Tensor:
    """The whole buffer that ``chunks`` (consecutive dim-0 slices of it) were cut from."""
    first = chunks[0]
    rows = sum(c.shape[0] for c in chunks)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())
