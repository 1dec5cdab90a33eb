"""Which experts the actor's routers pick for the response tokens of chosen forwards.

The trainer side of ``rollout/moe_routing_mismatch`` (:mod:`megarl.algo.routing_mismatch`): the
rank loop arms :meth:`RoutingRecorder.recording` around the forwards that run on the weights the
engine generated with, and the actor wraps each forward of its schedule in
:meth:`RoutingRecorder.forward`, so only those forwards record, never a backward's activation
recompute or a later optimizer step's forward.

Megatron's ``TopKRouter`` returns ``(probs, routing_map)`` with ``routing_map`` a ``[s * b,
experts]`` mask over the router input ``[s, b, hidden]`` (sequence first, rows in ``s``-major
order; a packed micro-batch is ``[T, 1, hidden]``). A forward hook turns it into expert ids and
back into the micro-batch's ``[b, s]`` layout, and :func:`response_expert_ids` cuts out each
sequence's response positions. With expert parallelism each rank's router still scores all
experts for its own tokens (the dispatcher moves tokens afterwards), so the ids are global.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from megarl.actor.router_stats import find_routers
from megarl.algo.routing_mismatch import expert_ids_from_routing_map, response_expert_ids
from megarl.batch import MicroBatchTensors


class RoutingRecorder:
    """Records, while armed, ``{sequence: [R, layers, top_k]}`` expert ids of every trained
    sequence the actor's forwards run.

    ``modules``: the actor's model chunks (one: MoE runs at PP=1); the hooks only read.
    """

    def __init__(self, modules: Sequence[torch.nn.Module], top_k: int) -> None:
        self.routers = find_routers(modules)
        self.top_k = top_k
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
        handles = [router.register_forward_hook(self._hook) for router in self.routers]
        try:
            yield recorded
        finally:
            for handle in handles:
                handle.remove()
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
        ids_BSLK = torch.stack(layers, dim=2).cpu()  # one small copy per forward
        self._recorded.update(response_expert_ids(ids_BSLK, mb))

    def _hook(self, _router: torch.nn.Module, inputs: tuple, output: tuple) -> None:
        if self._layers is None:  # outside a wrapped forward (e.g. recompute in backward)
            return
        _probs, routing_map = output
        seq_len, batch_size = inputs[0].shape[:2]
        with torch.no_grad():
            ids_TK = expert_ids_from_routing_map(routing_map.detach(), self.top_k)
        self._layers.append(ids_TK.reshape(seq_len, batch_size, -1).transpose(0, 1))
