"""Where each step's batch comes from: generated inline, or taken from the rollout side's stream.

The step loop asks its :class:`RolloutSource` for a step's batch and tells it when new weights
reached the engine; it does not know which source it holds.

* :class:`InlineSource` (``async_training.mode=sync``): rank 0's rollout host generates and
  scores the step's prompts now, with the weights of the step before, then puts the engine to
  sleep for training (``rollout.sleep_level``); it is woken again before the weight sync.
* :class:`StreamSource` (``one_step_off`` / ``fully_async``): the rollout actor generates in
  the background (:mod:`megarl.trainer.async_rollout`) and rank 0 takes the step's groups from
  its buffer, waiting only if they are not finished yet (``timing_s/wait_rollout``); the engine
  never sleeps, and pushed weights are applied on the rollout side between generations.

Either way every rank receives the batch's metadata (what the planner reads) and the engine's
own memory report; the full batch stays on rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.distributed as dist

from megarl.distributed import heartbeat
from megarl.engines.base import EngineMemoryState
from megarl.trainer.metrics import PhaseTimer

if TYPE_CHECKING:
    from megarl.batch import RolloutBatch, RolloutShard
    from megarl.engines.megatron import MegatronEngine
    from megarl.planner.gate_results import StepGates
    from megarl.trainer.rollout_host import RolloutHost


@dataclass(frozen=True)
class StepRollout:
    """One step's scored batch as a rank holds it."""

    header: RolloutShard
    """Every sequence's metadata (lengths, groups, advantages, oldest behaviour versions)."""
    batch: RolloutBatch | None
    """The full batch: rank 0 only."""
    metrics: dict[str, float]
    """The rollout's metrics (rewards, lengths, engine report; ``async/*``), on every rank."""
    engine_state: EngineMemoryState
    """The engine's own report after the rollout (what the base-weight gate reads)."""

    def with_advantages(self, advantages: torch.Tensor, metrics: dict[str, float]) -> StepRollout:
        """The same rollout with new advantages (every rank: ``advantages`` was broadcast) and
        more metrics; rank 0's batch follows."""
        batch = None if self.batch is None else replace(self.batch, advantages=advantages)
        return replace(
            self,
            header=replace(self.header, advantages=advantages),
            batch=batch,
            metrics={**self.metrics, **metrics},
        )


class RolloutSource:
    """What the step loop needs of the rollout side. Every method is collective or rank-0-only
    as it says; ``host`` is rank 0's rollout host (or its proxy), None elsewhere."""

    def __init__(self, host: RolloutHost | None, follower: MegatronEngine | None = None) -> None:
        self.host = host
        self.follower = follower
        """A rank that generates with rank 0 (``rollout.engine=megatron`` over several ranks:
        its model-parallel group, or a data-parallel replica taking its share): its engine,
        which runs rank 0's calls; None elsewhere."""

    def follow_generation(self) -> None:
        """A follower's part of rank 0's rollout or validation phase (a no-op elsewhere)."""
        if self.follower is not None:
            self.follower.serve()

    def start(self, first_step: int) -> None:
        """Rank 0, once the engine holds the weights step ``first_step`` trains from (after a
        resume's restore): the rollout side may begin."""

    def next_batch(self, step: int, timer: PhaseTimer) -> StepRollout:
        """Collective: step ``step``'s batch, on every rank."""
        raise NotImplementedError

    def before_weight_sync(self, timer: PhaseTimer, gates: StepGates) -> None:
        """Rank 0, before the weights stream out: whatever the engine needs first."""

    def weights_synced(self, version: int) -> None:
        """Rank 0: every weight of policy version ``version`` reached the rollout side."""
        if self.host is not None:
            self.host.weights_loaded(version)

    def _broadcast(self, payload: list) -> tuple:
        heartbeat.mark("broadcast_rollout")
        dist.broadcast_object_list(payload, src=0)
        return payload[0]


class InlineSource(RolloutSource):
    """The synchronous loop: generate now, then free the engine's memory for training."""

    def next_batch(self, step: int, timer: PhaseTimer) -> StepRollout:
        payload: list = [None]
        batch = None
        if self.host is not None:
            batch, metrics, phase_seconds = self.host.rollout(step)
            with timer.phase("engine_sleep"):
                engine_state = self.host.release_engine_for_training()
            metrics = {**metrics, **self.host.engine_metrics(engine_state)}
            payload = [(batch.shard(()), metrics, phase_seconds, engine_state)]
        else:
            self.follow_generation()
        header, metrics, phase_seconds, engine_state = self._broadcast(payload)
        timer.add(phase_seconds)
        return StepRollout(header, batch, metrics, engine_state)

    def before_weight_sync(self, timer: PhaseTimer, gates: StepGates) -> None:
        if self.host is None:
            return
        with timer.phase("engine_wake"):
            check_wake_report(self.host.wake_engine(), gates)


class StreamingHost(Protocol):
    """What rank 0 calls on the asynchronous rollout (:class:`~megarl.trainer.async_rollout.
    AsyncRollout`, through the rollout actor's proxy) beyond the host's own methods."""

    def start_rollout(self, first_step: int) -> None: ...

    def next_batch(self, step: int, timeout_s: float) -> tuple: ...


class StreamSource(RolloutSource):
    """The asynchronous modes: take the step's groups from the rollout side's buffer."""

    def __init__(self, host: RolloutHost | None, timeout_s: float) -> None:
        super().__init__(host)
        self.stream = cast("StreamingHost | None", host)
        self.timeout_s = timeout_s

    def start(self, first_step: int) -> None:
        if self.stream is not None:
            self.stream.start_rollout(first_step)

    def next_batch(self, step: int, timer: PhaseTimer) -> StepRollout:
        payload: list = [None]
        batch = None
        if self.stream is not None:
            heartbeat.mark("wait_rollout", step)
            with timer.phase("wait_rollout"):
                taken = self.stream.next_batch(step, self.timeout_s)
            batch, metrics, phase_seconds, engine_state = taken
            payload = [(batch.shard(()), metrics, phase_seconds, engine_state)]
        header, metrics, phase_seconds, engine_state = self._broadcast(payload)
        timer.add(phase_seconds)  # the rollout side's: generation, scoring, idle
        return StepRollout(header, batch, metrics, engine_state)


def check_wake_report(state: EngineMemoryState, gates: StepGates) -> None:
    """The engine's wake-up report must not contradict the report the gates decided from."""
    if not state.base_weights_resident and not gates.base_weight_sync.run:
        raise RuntimeError(
            "rollout engine reports freed base weights after wake-up, but the base-weight gate "
            f"skipped the base sync ({gates.base_weight_sync.reason}): the engine's sleep "
            "report was wrong"
        )
