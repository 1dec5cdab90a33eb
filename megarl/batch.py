"""The typed data that moves between the rollout host, the rollout engine and the Megatron ranks.

Pure torch (no distributed): a :class:`RolloutBatch` is built once per step by the rollout host
on rank 0. Every rank receives a :class:`RolloutShard` of it: every sequence's lengths, group and
advantage (the planner needs them all) but the tokens and engine logprobs only of the sequences
its data-parallel rank runs, so the bytes each rank receives stay flat as DP grows. Each rank
then :func:`collate` s (or :func:`pack` s) the sequences of its micro-batches.

Token/position convention: a sequence is ``prompt + response`` (length ``S = P + R``). The
logit at position ``t`` predicts token ``t + 1``, so response token ``j`` (at position
``P + j``) is scored by the logit at ``P - 1 + j``. ``labels[t] = tokens[t + 1]`` and the loss
mask is 1 exactly at ``t in [P - 1, S - 2]``.

Two layouts of a micro-batch's *model inputs* (``tokens_BL``, ``position_ids_BL``,
``labels_BL``): right-padded ``[B, L_max]`` (:func:`collate`), or packed ``[1, T]`` with
``T = sum(S_i)`` (:func:`pack`: sequences concatenated, positions restarting at 0 per sequence,
``cu_seqlens`` marking the boundaries so attention stays inside each sequence). The *loss-side*
fields (``loss_mask_BL``, ``response_mask_BL``, ``advantages_B``) are always per sequence,
``[B, L_max]``; :meth:`MicroBatchTensors.to_rows` maps per-token model outputs (logprobs,
entropy) into that layout, so the losses and :func:`per_token_to_response` never see packing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypedDict

import torch


def _check_lengths(
    what: str, tensors: Sequence[torch.Tensor] | None, expected: list[int], unit: str
) -> None:
    """Raise unless each sequence's tensor of an optional per-position field (None: absent) is
    as long as ``expected`` says."""
    if tensors is None:
        return
    lengths = [len(t) for t in tensors]
    if lengths != expected:
        raise ValueError(f"{what} of {lengths} {unit}, {expected}")


@dataclass(frozen=True)
class RolloutBatch:
    """One step's rollouts; identical on every rank."""

    tokens: tuple[torch.Tensor, ...]
    """Per sequence: prompt + response token ids (int64, 1-D)."""
    prompt_lens: tuple[int, ...]
    group_ids: torch.Tensor
    """[N] which prompt each sequence answers (GRPO groups)."""
    rewards: torch.Tensor
    """[N] scalar reward per sequence."""
    advantages: torch.Tensor
    """[N] per-sequence advantage (exactly 0 for all-equal groups)."""
    engine_logprobs: tuple[torch.Tensor, ...]
    """Per sequence: the rollout engine's logprob of each response token."""
    engine_routing: tuple[torch.Tensor, ...] | None = None
    """Mixture-of-experts models with an engine that exposes routing: per sequence, ``[R,
    layers, top_k]`` expert ids (uint8, or int16 past 256 experts) of each response token, what
    the trainer checks its own routing against (``rollout/moe_routing_mismatch``); None
    otherwise."""
    engine_input_routing: tuple[torch.Tensor, ...] | None = None
    """Router replay R3 with an engine that exposes routing: per sequence, ``[S, layers,
    top_k]`` expert ids of every input position (:mod:`megarl.algo.router_replay`); None
    otherwise."""
    behaviour_versions: tuple[torch.Tensor, ...] | None = None
    """Per sequence: the policy version of the weights that sampled each response token (int64,
    one per token; :mod:`megarl.planner.staleness`). None = unknown, taken as the trainer's
    current weights (batches built by hand in tests)."""
    response_masks: tuple[torch.Tensor, ...] | None = None
    """Multi-turn trajectories (:mod:`megarl.agent`): per sequence, 1.0 on each response token
    the model generated (trained) and 0.0 on observation tokens (a tool's output, read but never
    trained). None = every response token was generated (single-turn rollouts)."""

    def __post_init__(self) -> None:
        n = len(self.tokens)
        sizes = {
            len(self.prompt_lens),
            len(self.group_ids),
            len(self.rewards),
            len(self.advantages),
            len(self.engine_logprobs),
        }
        if sizes != {n}:
            raise ValueError(f"RolloutBatch fields disagree on the number of sequences: {sizes}")
        for i, (toks, plen, lp) in enumerate(
            zip(self.tokens, self.prompt_lens, self.engine_logprobs, strict=True)
        ):
            if len(toks) - plen != len(lp) or len(lp) < 1:
                raise ValueError(
                    f"sequence {i}: {len(toks)} tokens, prompt {plen}, {len(lp)} response logprobs"
                )
        _check_lengths(
            "engine input routing", self.engine_input_routing, self.seq_lens, "positions"
        )
        per_response_token = (
            ("engine routing", self.engine_routing),
            ("behaviour versions", self.behaviour_versions),
            ("response masks", self.response_masks),
        )
        for what, tensors in per_response_token:
            _check_lengths(what, tensors, self.response_lens, "tokens")

    @property
    def num_seqs(self) -> int:
        return len(self.tokens)

    @property
    def oldest_versions(self) -> tuple[int, ...] | None:
        """Per sequence, the oldest behaviour version of its tokens (what the gates read)."""
        if self.behaviour_versions is None:
            return None
        return tuple(int(v.min()) for v in self.behaviour_versions)

    @property
    def seq_lens(self) -> list[int]:
        return [len(t) for t in self.tokens]

    @property
    def response_lens(self) -> list[int]:
        return [len(t) - p for t, p in zip(self.tokens, self.prompt_lens, strict=True)]

    @property
    def trained_lens(self) -> list[int]:
        """Per sequence, the response tokens the loss reads (the generated ones): what the
        planner's ``token-mean`` normaliser counts."""
        if self.response_masks is None:
            return self.response_lens
        return [int(m.sum()) for m in self.response_masks]

    def shard(self, seq_indices: Iterable[int]) -> RolloutShard:
        """Every sequence's metadata, and the tokens, engine logprobs and engine routing of
        ``seq_indices``."""
        wanted = sorted(set(seq_indices))
        routing, inputs = self.engine_routing, self.engine_input_routing
        return RolloutShard(
            prompt_lens=self.prompt_lens,
            seq_lens=tuple(self.seq_lens),
            group_ids=self.group_ids,
            advantages=self.advantages,
            tokens={i: self.tokens[i] for i in wanted},
            engine_logprobs={i: self.engine_logprobs[i] for i in wanted},
            engine_routing={} if routing is None else {i: routing[i] for i in wanted},
            engine_input_routing=({} if inputs is None else {i: inputs[i] for i in wanted}),
            oldest_versions=self.oldest_versions,
            trained_counts=None if self.response_masks is None else tuple(self.trained_lens),
            response_masks=(
                {} if self.response_masks is None else {i: self.response_masks[i] for i in wanted}
            ),
        )


@dataclass(frozen=True)
class RolloutShard:
    """What one rank holds of a step's :class:`RolloutBatch` (indices stay the batch's)."""

    prompt_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    group_ids: torch.Tensor
    advantages: torch.Tensor
    tokens: Mapping[int, torch.Tensor]
    """Only the sequences this rank runs, keyed by their index in the batch."""
    engine_logprobs: Mapping[int, torch.Tensor]
    engine_routing: Mapping[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    """The engine's expert ids of the sequences this shard holds (empty when the batch has
    none: a dense model, or an engine that does not expose routing)."""
    engine_input_routing: Mapping[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    """R3: the engine's experts of every input position of the sequences this shard holds."""
    oldest_versions: tuple[int, ...] | None = None
    """Every sequence's oldest behaviour version (:attr:`RolloutBatch.oldest_versions`)."""
    trained_counts: tuple[int, ...] | None = None
    """Every sequence's trained response tokens (:attr:`RolloutBatch.trained_lens`); None:
    all of its response tokens."""
    response_masks: Mapping[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    """The response masks of the sequences this shard holds (empty: every token trained)."""

    @property
    def num_seqs(self) -> int:
        """Sequences in the whole batch (not only in this shard)."""
        return len(self.seq_lens)

    @property
    def response_lens(self) -> list[int]:
        return [s - p for s, p in zip(self.seq_lens, self.prompt_lens, strict=True)]

    @property
    def trained_lens(self) -> list[int]:
        """Every sequence's trained response tokens (the planner's normaliser counts these)."""
        return self.response_lens if self.trained_counts is None else list(self.trained_counts)

    def with_sequences(self, sequences: RolloutShard) -> RolloutShard:
        """This shard's metadata with the tokens, engine logprobs and engine routing that
        ``sequences`` holds."""
        return dataclasses.replace(
            self,
            tokens=sequences.tokens,
            engine_logprobs=sequences.engine_logprobs,
            engine_routing=sequences.engine_routing,
            engine_input_routing=sequences.engine_input_routing,
            response_masks=sequences.response_masks,
        )


Rollouts = RolloutBatch | RolloutShard
"""Either holds what :func:`collate`, :func:`pack` and the per-token helpers read."""


def response_mask(batch: Rollouts, index: int) -> torch.Tensor | None:
    """Sequence ``index``'s response mask (1.0 trained, 0.0 observation), None when every
    response token is trained."""
    masks = batch.response_masks
    if isinstance(masks, tuple):
        return masks[index]
    if masks is None:
        return None
    return masks.get(index)


@dataclass(frozen=True)
class MicroBatchTensors:
    """Model inputs (padded ``[B, L]`` or packed ``[1, T]``) and per-sequence loss tensors."""

    seq_indices: tuple[int, ...]
    tokens_BL: torch.Tensor
    """Model input ids: ``[B, L_max]`` padded, or ``[1, T]`` packed."""
    position_ids_BL: torch.Tensor
    """Same layout as ``tokens_BL``; restarts at 0 for every sequence."""
    labels_BL: torch.Tensor
    """Next-token targets in the model-input layout (what the logprob kernel reads)."""
    loss_mask_BL: torch.Tensor
    """[B, L_max] 1.0 where the label is a trained response token, times the sequence's loss
    weight."""
    response_mask_BL: torch.Tensor
    """[B, L_max] 1.0 where the label is a trained response token (weights not applied): a
    generated token, not an observation of a multi-turn trajectory."""
    advantages_B: torch.Tensor
    cu_seqlens: tuple[int, ...] | None = None
    """Packed only: sequence boundaries in the ``[1, T]`` row (``len = B + 1``, from 0 to T)."""

    @property
    def num_tokens(self) -> int:
        return int(self.tokens_BL.numel())

    @property
    def is_packed(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def max_seqlen(self) -> int:
        return int(self.loss_mask_BL.shape[1])

    def to_rows(self, values_BL: torch.Tensor) -> torch.Tensor:
        """Per-token values in the model layout -> ``[B, L_max]`` per sequence (differentiable).

        Identity when padded. Packed: a gather of each sequence's span; slots past a sequence's
        end read position 0 and are zeroed, so they are finite and carry no gradient.
        """
        if self.cu_seqlens is None:
            return values_BL
        index_BL, valid_BL = _row_gather_index(self.cu_seqlens, self.max_seqlen, values_BL.device)
        flat = values_BL.reshape(-1)
        return flat[index_BL] * valid_BL.to(flat.dtype)

    def to(self, device: str | torch.device) -> MicroBatchTensors:
        """A copy with every tensor on ``device`` (a no-op copy on CPU)."""
        moved = {f: getattr(self, f).to(device) for f in _TENSOR_FIELDS}
        return dataclasses.replace(self, **moved)

    def with_packed_width(self, width: int, pad_id: int) -> MicroBatchTensors:
        """This packed row extended to ``width`` tokens by a padding tail (the segment
        :func:`pack` adds for ``length_multiple``): Megatron's interleaved pipeline passes one
        activation shape between stages, so every micro-batch of a schedule has the same width.
        No sequence reads the tail; the loss side is unchanged."""
        if self.cu_seqlens is None:
            raise ValueError("with_packed_width: a padded micro-batch has no packed row to extend")
        length = int(self.tokens_BL.shape[1])
        tail = width - length
        if tail < 0:
            raise ValueError(f"with_packed_width: {width} is shorter than the row's {length}")
        if tail == 0:
            return self
        device = self.tokens_BL.device
        pad = torch.full((1, tail), pad_id, dtype=self.tokens_BL.dtype, device=device)
        end = self.cu_seqlens[-1]  # the tail, old and new, is one segment counting from 0
        tail_positions = torch.arange(width - end, device=device).unsqueeze(0)
        return dataclasses.replace(
            self,
            tokens_BL=torch.cat([self.tokens_BL, pad], dim=1),
            position_ids_BL=torch.cat([self.position_ids_BL[:, :end], tail_positions], dim=1),
            labels_BL=torch.cat([self.labels_BL, pad], dim=1),
        )


_TENSOR_FIELDS = (
    "tokens_BL",
    "position_ids_BL",
    "labels_BL",
    "loss_mask_BL",
    "response_mask_BL",
    "advantages_B",
)


def _row_gather_index(
    cu_seqlens: Sequence[int], max_len: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    starts_B = torch.tensor(cu_seqlens[:-1], device=device)
    lens_B = torch.tensor(cu_seqlens[1:], device=device) - starts_B
    offs_L = torch.arange(max_len, device=device)
    valid_BL = offs_L.unsqueeze(0) < lens_B.unsqueeze(1)
    index_BL = torch.where(valid_BL, starts_B.unsqueeze(1) + offs_L.unsqueeze(0), 0)
    return index_BL, valid_BL


def _round_up(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def collate(
    batch: Rollouts,
    seq_indices: Sequence[int],
    pad_id: int,
    loss_weights: Sequence[float] | None = None,
    length_multiple: int = 1,
) -> MicroBatchTensors:
    """Pad the chosen sequences to a common length (a multiple of ``length_multiple``) and
    build labels and masks."""
    seq_indices = tuple(int(i) for i in seq_indices)
    length = _round_up(max(len(batch.tokens[i]) for i in seq_indices), length_multiple)
    num = len(seq_indices)
    tokens = torch.full((num, length), pad_id, dtype=torch.long)
    labels = torch.full((num, length), pad_id, dtype=torch.long)
    for row, i in enumerate(seq_indices):
        seq = batch.tokens[i]
        tokens[row, : len(seq)] = seq
        labels[row, : len(seq) - 1] = seq[1:]
    return MicroBatchTensors(
        seq_indices=seq_indices,
        tokens_BL=tokens,
        position_ids_BL=torch.arange(length).unsqueeze(0).expand(num, -1).contiguous(),
        labels_BL=labels,
        **_loss_side(batch, seq_indices, length, loss_weights),
    )


def pack(
    batch: Rollouts,
    seq_indices: Sequence[int],
    loss_weights: Sequence[float] | None = None,
    pad_id: int = 0,
    length_multiple: int = 1,
) -> MicroBatchTensors:
    """Concatenate the chosen sequences into one ``[1, T]`` row.

    Positions restart at 0 per sequence and the boundaries go to ``cu_seqlens``; each
    sequence's last label is a dummy (its own last token) that no mask selects, so no label
    crosses into the next sequence. Loss-side tensors are the same as :func:`collate`'s. No pad
    tokens, unless ``T`` must be a multiple of ``length_multiple``: then a tail of ``pad_id``
    follows ``cu_seqlens[-1]``, a segment of its own for attention
    (:func:`megarl.actor.megatron_actor.packed_seq_params`) that no sequence reads.
    """
    seq_indices = tuple(int(i) for i in seq_indices)
    seqs = [batch.tokens[i].long() for i in seq_indices]
    lens = [len(s) for s in seqs]
    cu = [0]
    for size in lens:
        cu.append(cu[-1] + size)
    tail = _round_up(cu[-1], length_multiple) - cu[-1]
    pad = torch.full((tail,), pad_id, dtype=torch.long)
    tokens = torch.cat([*seqs, pad])
    labels = torch.cat([*(torch.cat([s[1:], s[-1:]]) for s in seqs), pad])
    positions = torch.cat([*(torch.arange(size) for size in lens), torch.arange(tail)])
    rows = _loss_side(batch, seq_indices, max(lens), loss_weights)
    return MicroBatchTensors(
        seq_indices=seq_indices,
        tokens_BL=tokens.unsqueeze(0),
        position_ids_BL=positions.unsqueeze(0),
        labels_BL=labels.unsqueeze(0),
        cu_seqlens=tuple(cu),
        **rows,
    )


class _LossSide(TypedDict):
    loss_mask_BL: torch.Tensor
    response_mask_BL: torch.Tensor
    advantages_B: torch.Tensor


def _loss_side(
    batch: Rollouts,
    seq_indices: tuple[int, ...],
    length: int,
    loss_weights: Sequence[float] | None,
) -> _LossSide:
    weights = loss_weights if loss_weights is not None else [1.0] * len(seq_indices)
    response_mask_BL = torch.zeros((len(seq_indices), length), dtype=torch.float32)
    for row, i in enumerate(seq_indices):
        mask = response_mask(batch, i)
        span = slice(batch.prompt_lens[i] - 1, len(batch.tokens[i]) - 1)
        response_mask_BL[row, span] = 1.0 if mask is None else mask.float()
    weight_B = torch.tensor(list(weights), dtype=torch.float32)
    return _LossSide(
        loss_mask_BL=response_mask_BL * weight_B.unsqueeze(1),
        response_mask_BL=response_mask_BL,
        advantages_B=batch.advantages[list(seq_indices)].float(),
    )


def build_micro_batch(
    batch: Rollouts,
    seq_indices: Sequence[int],
    pad_id: int,
    loss_weights: Sequence[float] | None = None,
    packed: bool = False,
    length_multiple: int = 1,
) -> MicroBatchTensors:
    """:func:`pack` or :func:`collate`: the one place the layout is chosen. ``length_multiple``:
    the sequence dimension's size divides by it (sequence parallelism splits it)."""
    if packed:
        return pack(batch, seq_indices, loss_weights, pad_id, length_multiple)
    return collate(batch, seq_indices, pad_id, loss_weights, length_multiple)


def per_token_to_response(
    values_BL: torch.Tensor, mb: MicroBatchTensors, batch: Rollouts
) -> dict[int, torch.Tensor]:
    """Cut each row's response part out of a [B, L] per-token tensor, keyed by sequence index."""
    values_BL = values_BL.detach().cpu()  # one device->host copy; results live on the CPU
    out: dict[int, torch.Tensor] = {}
    for row, i in enumerate(mb.seq_indices):
        plen, size = batch.prompt_lens[i], len(batch.tokens[i])
        out[i] = values_BL[row, plen - 1 : size - 1].clone()
    return out


def response_values_to_BL(
    values: dict[int, torch.Tensor], mb: MicroBatchTensors, batch: Rollouts
) -> torch.Tensor:
    """Inverse of :func:`per_token_to_response`: place per-sequence response values in [B, L]."""
    out = torch.zeros_like(mb.loss_mask_BL)
    for row, i in enumerate(mb.seq_indices):
        plen, size = batch.prompt_lens[i], len(batch.tokens[i])
        out[row, plen - 1 : size - 1] = values[i].to(out.device)
    return out
