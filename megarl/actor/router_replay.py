"""Replays recorded expert choices in the actor's forwards, through Megatron's ``RouterReplay``.

With ``moe_enable_routing_replay`` every Megatron ``TopKRouter`` holds a ``RouterReplay``; under
the REPLAY_FORWARD action its top-k step takes the target ids instead of ``torch.topk`` and
gathers the router's own scores at them, so the gate weights keep their gradient: softmax over
the gathered logits (top-k-then-softmax, Qwen3-MoE/Mixtral) or the gathered full-softmax
probabilities (Qwen2-MoE), then the usual scaling. When the targets equal the router's own
choice the probabilities are the same numbers (the same values, in another order, which the
scatter into ``[tokens, experts]`` undoes; for ``top_k = 2`` even the softmax's sum is the same
addition), so replaying the router's own routing does not perturb training.

:class:`RouterReplayer` arms it per forward: the rank loop gives it ``{sequence: [S, layers,
k]}`` input routing (:meth:`RouterReplayer.replaying`), and the actor wraps each model forward
in :meth:`RouterReplayer.forward`, which turns the micro-batch's sequences into Megatron's
per-router ``[tokens, k]`` targets (:func:`megarl.algo.router_replay.micro_batch_targets`) and
clears them after the forward. Backward never re-runs a router: full activation recompute is
refused with replay at config validation, selective recompute only re-runs attention.

The router's *own* choice stays observable under replay: each replay hook also computes the
top-k the router would have taken (:attr:`OwnChoiceReplay.own_ids`), which the routing recorder
reports, so ``rollout/moe_routing_mismatch`` keeps meaning engine vs the trainer's own router.
The load-balancing loss is unaffected by replay either way (Megatron computes it from the
router's own scores and top-k).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from megarl.actor.router_stats import find_routers
from megarl.actor.routing_recorder import sequence_slice
from megarl.algo.router_replay import FREE, layout_of, micro_batch_targets
from megarl.batch import MicroBatchTensors


class OwnChoiceReplay(RouterReplay):
    """Megatron's ``RouterReplay`` with two additions under REPLAY_FORWARD: rows whose target is
    :data:`~megarl.algo.router_replay.FREE` take the router's own choice, and the router's own
    top-k ids (the same call its un-replayed path makes) are kept for the mismatch metric."""

    def __init__(self) -> None:
        super().__init__()
        RouterReplay.global_router_replay_instances.remove(self)  # megarl keeps its own list
        self.own_ids: torch.Tensor | None = None
        """``[tokens, k]`` of the last replayed router call; None when not replaying."""

    def get_replay_topk(
        self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None
    ):
        if (
            self.router_replay_action != RouterReplayAction.REPLAY_FORWARD
            or default_compute_topk is None
            or self.target_topk_idx is None
        ):
            return super().get_replay_topk(
                scores, topk, num_groups, group_topk, default_compute_topk
            )
        with torch.no_grad():
            own = default_compute_topk(scores, topk, num_groups, group_topk)[1]
        self.own_ids = own
        target = self.target_topk_idx.to(scores.device)
        ids = torch.where(target == FREE, own, target)
        # the gathered scores of the router's own ids are exactly its top-k values
        return scores.gather(1, ids), ids


def install_replay(modules: Sequence[torch.nn.Module]) -> list[OwnChoiceReplay]:
    """Swap each router's ``RouterReplay`` (built because ``moe_enable_routing_replay``) for an
    :class:`OwnChoiceReplay`, in layer order; drops the originals from Megatron's global list."""
    replays = []
    for router in find_routers(modules):
        if router.router_replay is None:
            raise RuntimeError("router replay needs moe_enable_routing_replay in the config")
        if router.router_replay in RouterReplay.global_router_replay_instances:
            RouterReplay.global_router_replay_instances.remove(router.router_replay)
        replay = OwnChoiceReplay()
        # a plain attribute, not a submodule (pyright reads Module.__setattr__'s types)
        object.__setattr__(router, "router_replay", replay)
        replays.append(replay)
    return replays


class RouterReplayer:
    """Forces the armed forwards onto recorded routing; idle (routers route on their own)
    otherwise."""

    def __init__(
        self, modules: Sequence[torch.nn.Module], top_k: int, sequence_group: Any = None
    ) -> None:
        """``sequence_group``: the TP group when the model runs sequence-parallel (each TP
        rank's routers then take their slice of the targets), else None. The routing it is
        armed with is of this pipeline stage's layers."""
        self.replays = install_replay(modules)
        self.top_k = top_k
        self.sequence_group = sequence_group
        self._routing: Mapping[int, torch.Tensor] | None = None

    @contextmanager
    def replaying(self, routing: Mapping[int, torch.Tensor]) -> Iterator[None]:
        """Arm for the block: its forwards replay ``{sequence: [S, layers, k]}``."""
        if self._routing is not None:
            raise RuntimeError("router replay is already armed")
        self._routing = routing
        try:
            yield
        finally:
            self._routing = None

    @contextmanager
    def forward(self, mb: MicroBatchTensors) -> Iterator[None]:
        """Wrap one model forward over ``mb``: when armed, every router replays its targets."""
        if self._routing is None:
            yield
            return
        targets_LTK = micro_batch_targets(
            self._routing, layout_of(mb), len(self.replays), self.top_k
        )
        targets_LTK = sequence_slice(targets_LTK, self.sequence_group, dim=1)
        targets_LTK = targets_LTK.to(mb.tokens_BL.device)
        for replay, target_TK in zip(self.replays, targets_LTK, strict=True):
            replay.target_topk_idx = target_TK
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        try:
            yield
        finally:
            for replay in self.replays:
                replay.clear_indices()
                replay.clear_router_replay_action()
                replay.own_ids = None
