"""In-process harness for step-phase benchmarks: one rank, real actor, one real rollout batch.

Benchmarks that compare planner or gate modes must time them on *identical* rollouts and from
*identical* weights. Separate runs only share rollouts at step 1, and each pays model loading and
generation. This harness builds the rank-0 runtime of a normal run once (same config, same code as
``megarl-train``), produces one scored rollout batch, and lets a benchmark execute the step's
named phases (plan, gates, logprob passes, update) under any mode, restoring the weights and a
fresh optimizer before each trial.

It calls the step's own stages (``megarl.trainer.logprob_passes``, ``actor_update``, ``scatter``)
and reaches into ``megarl.trainer.rank_loop``'s set-up on purpose: the benchmark must time exactly
what the training loop runs, not a re-implementation of it.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megarl.batch import RolloutBatch, RolloutShard
from megarl.config import planning
from megarl.config.schema import RunConfig
from megarl.distributed import quiet
from megarl.planner.gate_results import StepGates
from megarl.planner.gates import decide_gates
from megarl.planner.step_plan import StepPlan
from megarl.trainer import rank_loop
from megarl.trainer.actor_update import update_actor
from megarl.trainer.logprob_passes import logprob_passes
from megarl.trainer.metrics import PhaseTimer
from megarl.trainer.runtime import Runtime
from megarl.trainer.scatter import scatter_sequences


@dataclass
class Harness:
    """A live rank-0 runtime plus the rollout batch every trial reuses."""

    runtime: Runtime
    batch: RolloutBatch
    header: RolloutShard
    """The batch's metadata, as every rank receives it (what the planner reads)."""
    initial_params: list[torch.Tensor]
    device: str

    @property
    def cfg(self) -> RunConfig:
        return self.runtime.cfg

    def with_planner(self, **changes) -> RunConfig:
        return dataclasses.replace(
            self.cfg, planner=dataclasses.replace(self.cfg.planner, **changes)
        )

    def plan(self, cfg: RunConfig) -> tuple[StepPlan, StepGates, RolloutShard]:
        """The step's plan and gates under ``cfg``, and the shard of sequences it trains."""
        self.runtime.cfg = cfg
        plan, _ = rank_loop._plans(self.runtime, self.header)
        shard = scatter_sequences(self.runtime, self.batch, self.header, plan)
        gates = decide_gates(planning.step_facts(cfg, 1, shard.num_seqs, plan=plan))
        return plan, gates, shard

    def reset_weights(self) -> None:
        """Initial weights and a fresh optimizer: every trial starts from the same state."""
        actor = self.runtime.actor
        with torch.no_grad():
            for param, initial in zip(actor.model.parameters(), self.initial_params, strict=True):
                param.copy_(initial)
        actor.optimizer = actor._build_optimizer()

    def run_step(self, cfg: RunConfig) -> tuple[PhaseTimer, StepPlan, StepGates]:
        """Plan, gates, logprob passes and update of one step under ``cfg``; returns the timer."""
        self.reset_weights()
        plan, gates, shard = self.plan(cfg)
        timer = PhaseTimer()
        rt = self.runtime
        update_actor(rt, shard, plan, logprob_passes(rt, shard, plan, gates, timer), timer)
        return timer, plan, gates

    def trained_params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.runtime.actor.model.parameters()]


def build_runtime_only(overrides: list[str]) -> Runtime:
    """The rank-0 runtime of ``megarl-train overrides`` (world size 1), as the worker builds it."""
    from megarl.distributed.launcher import WorkerContext, find_free_port
    from megarl.train import compose_config, resolve_device, resolve_model_dir

    run_dir = tempfile.mkdtemp(prefix="megarl-bench-")
    cfg = compose_config(
        [
            f"trainer.run_dir={run_dir}",
            "trainer.log_console=false",
            "trainer.tensorboard=false",
            *overrides,
        ]
    )
    if cfg.trainer.world_size != 1:
        raise SystemExit("benchmark harness: one rank only (trainer.n_gpus_per_node=1)")
    inputs = rank_loop.RunInputs(
        cfg=cfg, model_dir=resolve_model_dir(cfg), device=resolve_device(cfg.trainer.device)
    )
    quiet.install(inputs.device)  # as every rank does, before Megatron-Core is imported
    return rank_loop._setup(WorkerContext(0, 1, "127.0.0.1", find_free_port()), inputs)


def open_harness(overrides: list[str]) -> Harness:
    """Build the rank-0 runtime of ``megarl-train overrides`` and one scored rollout batch."""
    runtime = build_runtime_only(overrides)
    device = "cuda" if next(runtime.actor.model.parameters()).is_cuda else "cpu"
    rollout = runtime.source.next_batch(1, PhaseTimer())
    header, batch = rollout.header, rollout.batch
    assert batch is not None  # rank 0
    initial = [p.detach().clone() for p in runtime.actor.model.parameters()]
    return Harness(runtime, batch, header, initial_params=initial, device=device)


def close_harness(harness: Harness) -> None:
    from megarl.distributed import parallel
    from megarl.distributed.platform import exit_cpu_shims

    harness.runtime.host.close()
    parallel.destroy()
    if harness.device == "cpu":
        exit_cpu_shims()


def median_of(trials: list[float]) -> float:
    return statistics.median(trials) if trials else float("nan")


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
