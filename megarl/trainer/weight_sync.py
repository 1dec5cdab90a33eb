"""The weight sync: the trainer's new weights (or only the LoRA adapter) to the rollout engine.

Every rank takes part (the exporter gathers over TP/PP); rank 0 streams the HF-named tensors (a
Megatron engine's rollout-side copy: whole Megatron parameters under Megatron names) to the
engine in bounded buckets (:func:`megarl.export.sync.sync_engine_weights`). What is sent is
the gates' decision: base (or full) weights unless LoRA kept the engine's base, the adapter with
LoRA. The rollout source is told the policy version that arrived: the synchronous loop's engine
serves it from the next rollout on; the asynchronous rollout side applies it between two
generations (:mod:`megarl.trainer.async_rollout`). The logprob guard
(:mod:`megarl.trainer.engine_guard`) is told what was sent, and after a wake-up probes the
engine before the next rollout trusts it.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from megarl.distributed import heartbeat
from megarl.trainer.progress import PhaseHook, no_progress

if TYPE_CHECKING:
    from megarl.planner.gate_results import StepGates
    from megarl.trainer.metrics import PhaseTimer
    from megarl.trainer.runtime import Runtime


def sync_weights(rt: Runtime, gates: StepGates, timer: PhaseTimer, step: int) -> None:
    """After step ``step``'s update: send what the gates say, then name its version."""
    from megarl.export.sync import is_checksum_step

    heartbeat.mark("update_weights")
    rt.source.before_weight_sync(timer, gates)
    metrics: dict[str, float] = {}
    if gates.base_weight_sync.run or gates.adapter_sync.run:  # else timing_s/update_weights = 0
        rt.progress("update_weights", 0)
        with timer.phase("update_weights"):
            metrics = push_weights(
                rt,
                base=gates.base_weight_sync.run,
                adapter=gates.adapter_sync.run,
                checksum=is_checksum_step(step, rt.cfg.export.checksum_interval),
                progress=rt.progress,
                step=step,
            )
    rt.source.weights_synced(step)  # the weights after step s are policy version s
    if rt.guard is not None and rt.guard.probe_after_wake:
        from megarl.trainer.engine_guard import probe

        with timer.phase("engine_probe"):
            metrics.update(probe(rt, f"the probe after the wake-up and sync of step {step}"))
    if rt.host is not None:
        rt.host.record_export_metrics(metrics)


def push_weights(
    rt: Runtime,
    base: bool,
    adapter: bool,
    checksum: bool = False,
    progress: PhaseHook = no_progress,
    step: int = 0,
) -> dict[str, float]:
    """Collective: stream the base (or full) weights to the engine on rank 0 in bounded buckets
    and/or gather the LoRA adapter into it; the export metrics (on rank 0). ``progress`` is told
    the buckets sent; the guard (rank 0) what was sent after ``step`` (0: a resume's restore)."""
    from megarl.export.sync import SyncResult, sync_engine_weights

    result = SyncResult({})
    if base:
        engine = rt.host.engine if rt.host is not None else None
        result = sync_engine_weights(
            rt.actor.local_params(),
            rt.spec,
            rt.cfg.export.bucket_mb,
            rt.cfg.actor.vpp,
            checksum,
            engine,
            on_bucket=partial(progress, "update_weights", unit="buckets"),
            megatron_layout=rt.cfg.rollout.takes_megatron_layout,
        )
    if adapter:
        lora = rt.actor.gather_lora_adapter()
        if rt.host is not None:
            rt.host.update_engine_adapter(lora)
    if rt.guard is not None and (base or adapter):
        from megarl.trainer.engine_guard import sync_record

        rt.guard.last_sync = sync_record(base, adapter, step, result.metrics, result.checksum)
    return result.metrics
