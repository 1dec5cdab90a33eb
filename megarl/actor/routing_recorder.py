"""Which experts the actor's routers pick for every input position of chosen forwards.

The trainer side of ``rollout/moe_routing_mismatch`` (:mod:`megarl.algo.routing_mismatch`): the
rank loop arms :meth:`RoutingRecorder.recording` around the forwards that run on the weights the
engine generated with, and the actor wraps each forward of its schedule in
:meth:`RoutingRecorder.forward`, so only those forwards record, never a backward's activation
recompute or a later optimizer step's forward.

Megatron's ``TopKRouter`` returns ``(probs, routing_map)`` with ``routing_map`` a ``[s * b,
experts]`` mask over the router input ``[s, b, hidden]`` (sequence first, rows in ``s``-major
order; a packed micro-batch is ``[T, 1, hidden]``). A forward hook turns it into expert ids,
and :func:`megarl.algo.router_replay.sequence_ids` cuts each sequence's positions out of that
order. With expert parallelism each rank's router still scores all experts for its own tokens
(the dispatcher moves tokens afterwards), so the ids are global. Sequence-parallel (MoE under
TP), a TP rank's router sees the ``t``-th of ``tp`` equal slices of that order; the recorder
gathers the slices over the TP group. R2 records the same way, in the old-logprob pass.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from megarl.actor.router_stats import find_routers, router_layers
from megarl.algo.router_replay import layout_of, sequence_ids
from megarl.algo.routing_mismatch import expert_id_dtype, expert_ids_from_routing_map
from megarl.batch import MicroBatchTensors
from megarl.models.hooks import forward_hooks


class RoutingRecorder:
    """Records, while armed, ``{sequence: [S, layers, top_k]}`` expert ids of every input
    position of every trained sequence the actor's forwards run (the mismatch check cuts out the
    response rows, :func:`megarl.algo.router_replay.response_rows`; R2 replays them all). Under
    router replay it records the router's own choice, not the replayed one.

    ``modules``: the actor's model chunks; the hooks only read. Under pipeline parallelism the
    ids are of this stage's layers (:attr:`layers`).
    ``sequence_group``: the TP group when the model runs sequence-parallel, else None.
    """

    def __init__(
        self, modules: Sequence[torch.nn.Module], top_k: int, sequence_group: Any = None
    ) -> None:
        self.routers = find_routers(modules)
        self.layers = router_layers(self.routers)
        """The model layers the recorded ids are of: this pipeline stage's."""
        self.top_k = top_k
        self.sequence_group = sequence_group
        self._recorded: dict[int, torch.Tensor] | None = None
        """The dict the armed recording fills; None while disarmed."""
        self._layers: list[torch.Tensor] | None = None
        """Per layer, ``[b, s, top_k]`` ids of the forward running now; None between forwards."""

    @contextmanager
    def recording(self) -> Iterator[dict[int, torch.Tensor]]:
        """Arm the recorder for the block; yields the dict the block's forwards fill."""
        if self._recorded is not None:
            raise RuntimeError("routing recording is already armed")
        recorded: dict[int, torch.Tensor] = {}
        self._recorded = recorded
        try:
            with forward_hooks(self.routers, self._hook):
                yield recorded
        finally:
            self._recorded = None

    @contextmanager
    def forward(self, mb: MicroBatchTensors) -> Iterator[None]:
        """Wrap one model forward over ``mb``: when armed, its routing is recorded."""
        if self._recorded is None:
            yield
            return
        self._layers = []
        try:
            yield
            layers = self._layers
        finally:
            self._layers = None
        if len(layers) != len(self.routers):
            raise RuntimeError(f"{len(layers)} router outputs for {len(self.routers)} routers")
        ids_TLK = gather_sequence(torch.stack(layers, dim=1), self.sequence_group).cpu()
        trained_B = mb.loss_mask_BL.amax(dim=1) > 0
        every = sequence_ids(ids_TLK, layout_of(mb))
        self._recorded.update(
            {seq: every[seq] for row, seq in enumerate(mb.seq_indices) if bool(trained_B[row])}
        )

    def _hook(self, router: torch.nn.Module, _inputs: tuple, output: tuple) -> None:
        if self._layers is None:  # outside a wrapped forward (e.g. recompute in backward)
            return
        own_ids = getattr(getattr(router, "router_replay", None), "own_ids", None)
        with torch.no_grad():
            if own_ids is not None:  # replaying: the router's own choice, not the replayed one
                ids_TK = own_ids.sort(dim=1).values.to(expert_id_dtype(output[1].shape[1]))
            else:
                ids_TK = expert_ids_from_routing_map(output[1].detach(), self.top_k)
        self._layers.append(ids_TK)


def gather_sequence(rows: torch.Tensor, group: Any) -> torch.Tensor:
    """Every TP rank's slice of the router-input rows, concatenated in rank order (the rows
    themselves without sequence parallelism, ``group`` None)."""
    if group is None:
        return rows
    slices = [torch.empty_like(rows) for _ in range(dist.get_world_size(group))]
    dist.all_gather(slices, rows.contiguous(), group=group)
    return torch.cat(slices)


def sequence_slice(rows: torch.Tensor, group: Any, dim: int = 0) -> torch.Tensor:
    """This TP rank's slice of router-input rows along ``dim`` (all of them without sequence
    parallelism): the inverse of :func:`gather_sequence`."""
    if group is None:
        return rows
    return rows.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)]
