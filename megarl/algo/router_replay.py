"""Router replay for mixture-of-experts training: which experts the training forwards must use.

A trainer's router can pick other experts than the engine did for the same tokens (bf16 vs
fp32, other kernels), and a policy update moves routing between the old-logprob forward and the
training forwards. Router replay forces the trainer's forwards onto *recorded* expert choices,
while the gate weights are still computed from the trainer's own router scores at those experts
(so the router keeps its gradient). ``actor.router_replay.mode`` (verl's key and values):

- ``disabled``: every forward routes on its own.
- ``R2``: the trainer records its own choices in the old-logprob pass (run on every sequence)
  and replays them in the training forwards.
- ``R3`` (rollout routing replay): the engine's choices for every input position, prompt and
  response, are replayed in the old-logprob pass and in every training forward.

Routing of one sequence (``prompt + response``, length ``S = P + R``) is ``[S, layers, top_k]``
expert ids, row ``t`` being the experts of the forward at input position ``t``. The engine
reports positions ``0 .. P - 2`` from its prefill and ``P - 1 .. S - 2`` as the forwards that
scored the response tokens; input position ``S - 1`` (the last response token, fed through the
model only because the micro-batch holds whole sequences) has no engine routing: :func:`input_routing`
stores :func:`filler_ids` there so the tensor stays rectangular, and the replay targets never
use that row.

Megatron's ``RouterReplay`` takes per router a ``[tokens, top_k]`` target in the router input's
order: the ``[s, b, hidden]`` input flattened sequence first (row ``s * b + b_index``); a packed
micro-batch is ``[T, 1, hidden]``, so its rows are the packed tokens in order.
:func:`micro_batch_targets` builds those rows for a padded or packed micro-batch. Rows without
recorded routing (each sequence's last input position, the right padding of a padded row, a
sequence with none recorded) are :data:`FREE`: the router takes its own choice there
(:class:`megarl.actor.router_replay.OwnChoiceReplay`). Any valid experts would leave the trained
logprobs' *values* alone (those rows come after every real token of their sequence, and no loss
mask selects them), but not their *bits*: a token sent to another expert changes how many rows
that expert's GEMM multiplies, and CPU BLAS picks its blocking by the row count, which moves
other tokens' results by rounding. Routing them as the router would keeps replaying the
router's own choice bitwise equal to not replaying.

Pure torch: no distributed, model or engine imports.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from megarl.batch import MicroBatchTensors

ROUTER_REPLAY_MODES: tuple[str, ...] = ("disabled", "R2", "R3")
"""The values of ``actor.router_replay.mode``."""

FREE = -1
"""Replay-target id of a row with no recorded routing: the router routes it on its own."""

ENGINES_REPORTING_ROUTING: tuple[str, ...] = ("hf",)
"""Rollout engines that report every position's experts (R3 needs them); vLLM does not."""


def filler_ids(top_k: int, num_layers: int, dtype: torch.dtype = torch.uint8) -> Tensor:
    """``[layers, top_k]`` experts ``0 .. k-1`` for positions without recorded routing."""
    return torch.arange(top_k, dtype=dtype).expand(num_layers, top_k).clone()


def input_routing(prompt_ids: Tensor, response_ids: Tensor) -> Tensor:
    """One sequence's ``[S, layers, k]`` routing from the engine's ``[P - 1, layers, k]`` prompt
    positions and ``[R, layers, k]`` response-scoring positions; the last input position (which
    scores nothing) gets :func:`filler_ids`."""
    num_layers, top_k = response_ids.shape[1:]
    last = filler_ids(top_k, num_layers, response_ids.dtype).unsqueeze(0)
    return torch.cat([prompt_ids, response_ids, last])


def response_rows(ids_SLK: Tensor, prompt_len: int) -> Tensor:
    """The rows of a sequence's input routing that score its response tokens (``P - 1 .. S -
    2``), the rows ``rollout/moe_routing_mismatch`` compares."""
    return ids_SLK[prompt_len - 1 : len(ids_SLK) - 1]


@dataclass(frozen=True)
class MicroBatchLayout:
    """The token layout of one micro-batch's model input, all a target needs."""

    seq_indices: tuple[int, ...]
    seq_lens: tuple[int, ...]
    width: int
    """Padded: the row length ``L_max``; packed: the total ``T`` (sequences, then any padding
    tail)."""
    packed: bool


def layout_of(mb: MicroBatchTensors) -> MicroBatchLayout:
    """A micro-batch's layout. Packed lengths are the ``cu_seqlens`` spans; a padded row's
    length is its last response label's position + 2 (labels end at ``S - 2``; every sequence
    has at least one response token)."""
    if mb.cu_seqlens is not None:
        cu = mb.cu_seqlens
        lens = tuple(int(b - a) for a, b in itertools.pairwise(cu))
        return MicroBatchLayout(mb.seq_indices, lens, int(mb.tokens_BL.shape[1]), packed=True)
    lens = tuple(int(row.nonzero().max()) + 2 for row in mb.response_mask_BL)
    return MicroBatchLayout(mb.seq_indices, lens, int(mb.tokens_BL.shape[1]), packed=False)


def sequence_ids(ids_TLK: Tensor, layout: MicroBatchLayout) -> dict[int, Tensor]:
    """The inverse of :func:`micro_batch_targets`: ``[tokens, layers, k]`` ids in the router
    input's order -> ``{sequence: [S, layers, k]}`` of every input position (padding dropped)."""
    if layout.packed:
        starts = [0]
        for length in layout.seq_lens[:-1]:
            starts.append(starts[-1] + length)
        return {
            seq: ids_TLK[start : start + length]
            for seq, start, length in zip(layout.seq_indices, starts, layout.seq_lens, strict=True)
        }
    rows = len(layout.seq_indices)
    ids_BSLK = ids_TLK.reshape(layout.width, rows, *ids_TLK.shape[1:]).transpose(0, 1)
    return {
        seq: ids_BSLK[b, :length]
        for b, (seq, length) in enumerate(zip(layout.seq_indices, layout.seq_lens, strict=True))
    }


def micro_batch_targets(
    routing: Mapping[int, Tensor], layout: MicroBatchLayout, num_layers: int, top_k: int
) -> Tensor:
    """``[layers, tokens, k]`` int64 replay targets in Megatron's router-input token order.

    ``routing``: ``{sequence: [S, layers, k]}`` input routing. Each sequence's last input
    position, sequences absent from ``routing`` and padding are :data:`FREE` (see the module
    docstring for why). Padded ``[B, L_max]``: row ``s * B + b``. Packed ``[1, T]``: the
    sequences concatenated.
    """
    rows = []
    for seq, length in zip(layout.seq_indices, layout.seq_lens, strict=True):
        free = torch.full((length, num_layers, top_k), FREE, dtype=torch.long)
        ids = routing.get(seq)
        if ids is not None:
            if ids.shape != (length, num_layers, top_k):
                raise ValueError(
                    f"sequence {seq}: routing {tuple(ids.shape)}, "
                    f"expected {(length, num_layers, top_k)}"
                )
            free[: length - 1] = ids[: length - 1].long()
        rows.append(free)
    if layout.packed:
        tail = layout.width - sum(layout.seq_lens)  # padding after the last sequence
        if tail < 0:
            raise ValueError(
                f"packed routing of {sum(layout.seq_lens)} tokens, row of {layout.width}"
            )
        tokens_TLK = torch.cat([*rows, torch.full((tail, num_layers, top_k), FREE)])
    else:
        padded_BSLK = torch.full((len(rows), layout.width, num_layers, top_k), FREE)
        for b, ids in enumerate(rows):
            padded_BSLK[b, : len(ids)] = ids
        tokens_TLK = padded_BSLK.transpose(0, 1).reshape(-1, num_layers, top_k)  # s-major
    return tokens_TLK.permute(1, 0, 2).contiguous()


@dataclass(frozen=True)
class ReplayPlan:
    """Which routing each forward of a step records and replays, from
    ``actor.router_replay.mode`` alone (the rank loop executes it; :func:`replay_plan`)."""

    old_log_prob_replays_engine: bool
    """R3: the old-logprob pass runs on the engine's routing."""
    old_log_prob_records_for_training: bool
    """R2: the old-logprob pass records the routers' choices for the training forwards (it
    records for ``rollout/moe_routing_mismatch`` anyway where the engine reported routing)."""
    training_replays: str
    """``"engine"`` (R3), ``"old_log_prob"`` (R2) or ``"none"``."""


def replay_plan(mode: str) -> ReplayPlan:
    """The :class:`ReplayPlan` of a validated ``actor.router_replay.mode``."""
    if mode not in ROUTER_REPLAY_MODES:
        raise ValueError(f"router replay mode {mode!r}")
    return ReplayPlan(
        old_log_prob_replays_engine=mode == "R3",
        old_log_prob_records_for_training=mode == "R2",
        training_replays={"R3": "engine", "R2": "old_log_prob"}.get(mode, "none"),
    )


def stage_layers(layer_numbers: Sequence[int]) -> range:
    """The model layers (0-based) of one pipeline stage's routers, from Megatron's 1-based
    global ``layer_number`` of each, in model order; they must be consecutive."""
    first = layer_numbers[0] - 1 if layer_numbers else 0
    layers = range(first, first + len(layer_numbers))
    if [n - 1 for n in layer_numbers] != list(layers):
        raise ValueError(f"router layers {list(layer_numbers)} are not consecutive")
    return layers


def stage_routing(routing: Mapping[int, Tensor], layers: range) -> dict[int, Tensor]:
    """``{sequence: [S, all layers, k]}`` routing cut to one pipeline stage's ``layers`` (views:
    what that stage's routers replay or are compared with)."""
    return {seq: ids[:, layers.start : layers.stop] for seq, ids in routing.items()}


def router_replay_problem(
    mode: str,
    *,
    engine: str,
    recompute: str,
    old_log_prob: str,
    kl_in_reward: bool = False,
) -> str | None:
    """The one-line reason a replay setting cannot run with the rest of the config, or None.

    Model-independent rules (the dense-model rule is :func:`dense_model_problem`):

    - R3 needs the engine's routing of every position; only :data:`ENGINES_REPORTING_ROUTING`
      report it.
    - Full activation recompute re-runs the router in backward, where Megatron expects the
      per-micro-batch REPLAY_BACKWARD queue; megarl replays forwards only, so it refuses the
      combination rather than risk a recomputed forward routing differently from its forward.
      Selective recompute (the attention core) never re-runs a router and is fine.
    - R2 records in the old-logprob pass, which ``planner.old_log_prob=rollout`` or ``never``
      never runs; with ``algo.use_kl_in_reward`` that pass runs on another split of the
      sequences, before the plan, and its routing is not carried to the training ranks yet.
    """
    if mode not in ROUTER_REPLAY_MODES:
        return f"actor.router_replay.mode={mode!r}: must be one of {', '.join(ROUTER_REPLAY_MODES)}"
    if mode == "disabled":
        return None
    if mode == "R3" and engine not in ENGINES_REPORTING_ROUTING:
        return (
            f"actor.router_replay.mode=R3 needs the engine's routing, which rollout.engine="
            f"{engine} does not report; use rollout.engine=hf or actor.router_replay.mode=R2"
        )
    if recompute == "full":
        return (
            f"actor.router_replay.mode={mode} with actor.recompute=full is not supported (a "
            "recomputed layer would re-run its router in backward); use selective or none"
        )
    if mode == "R2" and old_log_prob in ("rollout", "never"):
        return (
            f"actor.router_replay.mode=R2 records routing in the old-logprob pass, which "
            f"planner.old_log_prob={old_log_prob} never runs; use auto or always"
        )
    if mode == "R2" and kl_in_reward:
        return (
            "actor.router_replay.mode=R2 with algo.use_kl_in_reward=true is not supported yet; "
            "use R3 or disabled"
        )
    return None


def dense_model_problem(mode: str, family: str) -> str | None:
    """A dense model has no router to replay: any mode but ``disabled`` is refused."""
    if mode == "disabled":
        return None
    return (
        f"actor.router_replay.mode={mode}: the model ({family}) is dense and has no router "
        "to replay; set it to disabled"
    )
