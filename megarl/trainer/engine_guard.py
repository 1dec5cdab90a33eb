"""The logprob guard as every rank runs it: the step's check before its optimizer step, and the
probe after the engine starts and after each wake-up.

The decision is :func:`megarl.planner.logprob_guard.decide_logprob_guard` (pure); this module
only gathers its facts. A comparison's sums are reduced over the world in one all-reduce, so
every rank decides on the same number and all stop together (rank 0's line, the one the
launcher reports, names the last weight sync, which only rank 0 saw).

**The step check** runs inside the first optimizer step, after the gradients are final and
before the optimizer moves a weight (:meth:`MegatronActor.train_step`'s ``before_update``): a
stop leaves the weights, the checkpoints and the metrics file as the previous step left them.

**The probe** (``sync/probe_logprob_diff``): the engine samples a fixed prompt
(:data:`~megarl.planner.logprob_guard.PROBE_TEXT`,
:data:`~megarl.planner.logprob_guard.PROBE_SAMPLES` samples, a fixed seed, the run's
temperature) and every rank's trainer scores the same tokens. It runs once the engine
holds the weights training starts from (after a resume's restore too) and, with
``rollout.sleep_level > 0``, after each wake-up and weight sync -- where a sleep that lost a
tensor would otherwise show only in the next step's rollouts. The asynchronous modes skip it:
their engine is generating in the background then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megarl.batch import RolloutBatch
from megarl.distributed import heartbeat
from megarl.planner.logprob_guard import (
    LogprobCheck,
    LogprobGuardError,
    SyncRecord,
    decide_logprob_guard,
    guard_checks,
    probe_micro_batches,
    resolve_max_logprob_diff,
)

if TYPE_CHECKING:
    from megarl.config.schema import RunConfig
    from megarl.trainer.rollout_host import RolloutHost
    from megarl.trainer.runtime import Runtime

NOT_APPLIED = (
    "the step's update was not applied and nothing of it was written; fix the engine, then run "
    "again to resume from the last checkpoint (trainer.resume=auto)"
)
PROBE_STOP = (
    "nothing of this step was written; fix the engine, then run again to resume from the last "
    "checkpoint (trainer.resume=auto)"
)


@dataclass
class EngineGuard:
    """What a rank needs to check the engine: the threshold, the engine's name and (rank 0)
    the last weight sync."""

    threshold: float
    engine: str
    probe_after_wake: bool
    probe_on: bool
    step_check: bool = True
    """These three as :func:`megarl.planner.logprob_guard.guard_checks` decides them."""
    last_sync: SyncRecord | None = None

    def check(self, where: str, local: list[float], tp: int, consequence: str) -> LogprobCheck:
        """Collective: reduce this rank's ``[|diff| sum, tokens]`` over the world, decide, and
        raise :class:`LogprobGuardError` on every rank when the verdict is to stop; what was
        compared."""
        from megarl.actor.megatron_actor import reduce_sums_to_all

        [[diff_sum, count]] = reduce_sums_to_all([local], tp)
        mean = diff_sum / count if count > 0 else 0.0
        check = LogprobCheck(where, mean, round(count))
        verdict = decide_logprob_guard(
            check, self.threshold, self.engine, self.last_sync, consequence
        )
        if verdict.stop:
            raise LogprobGuardError(verdict.line)
        return check


def build_engine_guard(cfg: RunConfig, params_dtype: str, sleep_level: int) -> EngineGuard | None:
    """None when the run has no engine (``algo.objective=sft``) or the guard is off."""
    threshold = resolve_max_logprob_diff(
        cfg.rollout.max_logprob_diff, cfg.rollout.engine, params_dtype
    )
    if threshold is None or cfg.algo.is_sft:
        return None
    checks = guard_checks(
        cfg.rollout.engine_is_actor,
        cfg.async_training.is_async,
        cfg.actor.lora.dropout,
        sleep_level,
    )
    return EngineGuard(
        threshold=threshold,
        engine=cfg.rollout.engine,
        probe_after_wake=checks.probe_after_wake,
        probe_on=checks.probe_on,
        step_check=checks.step_check,
        last_sync=SyncRecord("the model's own weights", 0),
    )


def engine_sleep_level(host: RolloutHost | None) -> int:
    """Collective: the sleep level rank 0's engine really uses (an engine may sleep less deeply
    than asked), on every rank."""
    payload = [host.engine_sleep_level() if host is not None else 0]
    dist.broadcast_object_list(payload, src=0)
    return int(payload[0])


def probe(rt: Runtime, where: str) -> dict[str, float]:
    """Collective: the engine samples the probe, every rank's trainer scores it, the guard
    decides; ``sync/probe_logprob_diff`` and the tokens it compared (``sync/probe_tokens``) on
    every rank."""
    guard = rt.guard
    assert guard is not None
    heartbeat.mark("engine_probe")
    micro_batches = probe_micro_batches(rt.cfg.actor.pp)
    samples = sum(len(mb) for mb in micro_batches)
    payload: list = [rt.host.probe_engine(samples) if rt.host is not None else None]
    dist.broadcast_object_list(payload, src=0)
    batch = probe_batch(payload[0])
    trainer = rt.actor.compute_logprobs(batch, micro_batches, rt.cfg.rollout.temperature)
    from megarl.trainer.actor_update import logprob_diff

    local = logprob_diff(batch, trainer) if rt.actor.is_last_stage else [0.0, 0.0]
    check = guard.check(where, local, rt.cfg.actor.tp, PROBE_STOP)
    return {
        "sync/probe_logprob_diff": check.mean_abs_diff,
        "sync/probe_tokens": float(check.num_tokens),
    }


def probe_batch(samples: list[tuple[list[int], int, list[float]]]) -> RolloutBatch:
    """The probe's samples ``(prompt + response ids, prompt length, engine logprobs)`` as a
    batch the actor scores."""
    n = len(samples)
    return RolloutBatch(
        tokens=tuple(torch.tensor(ids, dtype=torch.int64) for ids, _, _ in samples),
        prompt_lens=tuple(prompt_len for _, prompt_len, _ in samples),
        group_ids=torch.zeros(n, dtype=torch.int64),
        rewards=torch.zeros(n),
        advantages=torch.zeros(n),
        engine_logprobs=tuple(torch.tensor(lp, dtype=torch.float32) for _, _, lp in samples),
    )


def sync_record(base: bool, adapter: bool, step: int, metrics: dict, checksum: str | None):
    """The sync just done, as the guard's line names it."""
    what = " + ".join(
        name for name, sent in (("full weights", base), ("LoRA adapter", adapter)) if sent
    )
    return SyncRecord(
        what or "nothing", step, int(metrics.get("export/bytes", 0)), checksum if base else None
    )
