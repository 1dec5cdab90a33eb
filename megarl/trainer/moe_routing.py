"""The rank loop's mixture-of-experts routing, on the layers of this rank's pipeline stage.

Which forwards of a step record the routers' experts and which replay recorded ones follows the
:class:`~megarl.algo.router_replay.ReplayPlan` of ``actor.router_replay.mode``; this module
arms the actor's recorder (:class:`~megarl.actor.routing_recorder.RoutingRecorder`) and replayer
(:class:`~megarl.actor.router_replay.RouterReplayer`) accordingly, compares the recorded
experts with the engine's (``rollout/moe_routing_mismatch``) and turns the router monitor's
counts into ``actor/moe_*``.

Pipeline parallelism: every stage holds a consecutive slice of the layers (the recorder's
``layers``), records and replays only those, and takes the same slice of the engine's routing,
which covers every layer. The stages of one data-parallel rank run the same sequences, so their per-token
comparisons line up and merge over the pipeline group; router counts are placed at their model
layers before the sum over ranks. A dense model has no recorder, replayer or monitor, and
nothing here runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megarl.actor.megatron_actor import reduce_sums_to_all
from megarl.actor.router_stats import RouterMonitor, router_metrics
from megarl.algo.router_replay import ReplayPlan, response_rows, stage_routing
from megarl.algo.routing_mismatch import (
    RoutingMismatch,
    StageRouting,
    routing_mismatch_of_sequences,
)
from megarl.batch import RolloutShard

if TYPE_CHECKING:
    from megarl.actor.megatron_actor import MegatronActor

Routing = Mapping[int, torch.Tensor]
"""``{sequence: [positions, layers, top_k]}`` expert ids."""


def recording(actor: MegatronActor, batch: RolloutShard, on: bool = True, for_replay: bool = False):
    """Arm the actor's routing recorder around forwards on the generating weights; yields the
    ``{sequence: experts}`` dict it fills (this stage's layers), empty unless ``on``, the model
    is MoE and this rank holds engine routing to compare with, or ``for_replay`` (R2) asks for
    it."""
    if not on or not (batch.engine_routing or for_replay) or actor.routing is None:
        return contextlib.nullcontext({})
    return actor.routing.recording()


def replaying(actor: MegatronActor, routing: Routing | None):
    """Arm the actor's router replay with ``routing`` of this stage's layers (a no-op for
    None)."""
    if routing is None or actor.replay is None:
        return contextlib.nullcontext()
    return actor.replay.replaying(routing)


def engine_replay(
    actor: MegatronActor, batch: RolloutShard, plan: ReplayPlan, seqs: Sequence[int]
) -> Routing | None:
    """R3's routing for the old-logprob pass over ``seqs``: the engine's input routing, cut to
    this stage's layers; None when the plan replays nothing there."""
    if not plan.old_log_prob_replays_engine:
        return None
    return _engine_input_routing(actor, batch, seqs)


def training_replay(
    actor: MegatronActor,
    batch: RolloutShard,
    plan: ReplayPlan,
    trained: Sequence[int],
    recorded: Routing,
) -> Routing | None:
    """What the training forwards over ``trained`` replay: the engine's routing (R3), the
    old-logprob pass's ``recorded`` (R2, which the gates ran on every sequence); None without
    replay."""
    if plan.training_replays == "engine":
        return _engine_input_routing(actor, batch, trained)
    if plan.training_replays != "old_log_prob":
        return None
    missing = [i for i in trained if i not in recorded]
    if missing:
        raise RuntimeError(f"R2: the old-logprob pass recorded no routing of {missing[:5]}")
    return recorded


def _engine_input_routing(
    actor: MegatronActor, batch: RolloutShard, seqs: Sequence[int]
) -> Routing:
    missing = [i for i in seqs if i not in batch.engine_input_routing]
    if missing:
        raise RuntimeError(f"R3: no engine routing for sequences {missing[:5]}")
    assert actor.routing is not None  # replay needs a MoE actor
    return stage_routing(batch.engine_input_routing, actor.routing.layers)


def compare_with_engine(
    actor: MegatronActor, batch: RolloutShard, trainer_input_routing: Routing
) -> StageRouting | None:
    """This stage's comparison of the trainer's recorded experts (every input position) with
    the engine's, on the response tokens both sides scored; None where either side has none."""
    if not trainer_input_routing or not batch.engine_routing or actor.routing is None:
        return None
    trainer = {
        i: response_rows(ids, batch.prompt_lens[i]) for i, ids in trainer_input_routing.items()
    }
    engine = stage_routing(batch.engine_routing, actor.routing.layers)
    return routing_mismatch_of_sequences(trainer, engine)


def stage_mismatch(
    stage: StageRouting | None, pipeline_group, pp: int, is_last_stage: bool
) -> RoutingMismatch:
    """This rank's share of the step's :class:`RoutingMismatch` (sum it over every rank).

    At ``pp`` > 1 the stages' per-token flags are merged by an element-wise maximum over
    ``pipeline_group`` and the last stage counts the tokens. Every stage of a pipeline group
    runs the same sequences and holds the same engine routing, so all of them take part or none
    (``stage`` None: a dense model, an engine without routing, nothing recorded)."""
    if stage is None:
        return RoutingMismatch()
    if pp == 1:
        return stage.counts()
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    flags = stage.differs_T.to(device=device, dtype=torch.uint8)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=pipeline_group)
    return stage.counts(flags.cpu().bool(), count_tokens=is_last_stage)


def router_statistics(monitor: RouterMonitor, num_layers: int, replicas: int) -> dict[str, float]:
    """``actor/moe_*`` from every rank's routing counts, each placed at its model layers (its
    pipeline stage's). ``replicas``: how many ranks saw the same tokens of a layer (the TP ranks,
    unless they run sequence-parallel and each routed its own slice)."""
    counts = monitor.model_counts(num_layers)
    summed = reduce_sums_to_all(counts.reshape(-1, counts.shape[-1]).tolist(), replicas)
    tokens, probs = torch.tensor(summed, dtype=torch.float64).reshape(counts.shape)
    return router_metrics(tokens, probs, monitor.top_k)
