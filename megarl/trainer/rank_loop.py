"""The rank loop: what every Megatron rank process runs, the step loop as named steps.

Runs in each rank process the launcher starts (local processes, Ray actors or Slurm tasks).
Rank 0 also holds the rollout host (:mod:`megarl.trainer.rollout_host`: engine, data, metrics)
or, in split placement, a proxy to the rollout actor. Every step:

1. rank 0 generates and scores a :class:`RolloutBatch`, puts the engine to sleep at
   ``rollout.sleep_level`` and takes the engine's own memory report; the batch's metadata
   (lengths, groups, advantages) and the report are broadcast;
   With ``algo.use_kl_in_reward`` the old and reference logprobs of every sequence are
   computed next (on an unpruned split), rank 0 penalises the rewards with their KL and
   recomputes the advantages (:func:`_kl_in_reward`), and the logprobs follow each sequence
   to the rank the plan gives it, so step 3 does not run them again;
   With a critic (``algo.adv_estimator=gae``) its values of every sequence come next, rank 0
   runs GAE over the batch (:mod:`megarl.trainer.critic_step`) and every rank gets the
   per-sequence summary of the new advantages;
2. every rank computes the same :class:`StepPlan` (batch planner) and :class:`StepGates`
   (pass gates) from it -- pure functions of broadcast data, so no rank can disagree -- and
   rank 0 scatters to each rank only the sequences its DP rank runs in the plan;
3. old/reference logprob forwards run only where the gates say so;
4. each optimizer step of the plan runs this rank's micro-batches (with a critic, first the
   critic's own plan on the value loss, then the actor's on the per-token advantages);
5. rank 0 wakes the engine; base (or full) weights are streamed to it in bounded buckets
   only when the base-weight gate says so, and with LoRA the adapter every step;
6. statistics are reduced and rank 0 writes the step's metrics;
7. every ``trainer.save_interval`` steps all ranks write a checkpoint (:mod:`megarl.checkpoint`).

A resumed run first restores the checkpoint (weights, optimizer, RNG, data position) and hands
the restored weights to the engine, then continues at the step after the checkpoint's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

from megarl.actor.megatron_actor import (
    LossSettings,
    MegatronActor,
    reduce_max_to_all,
    reduce_sums_to_all,
)
from megarl.actor.router_stats import RouterMonitor
from megarl.actor.train_stats import OptimizerStepStats, UpdateStats, summarise_update
from megarl.algo.advantages import get_advantage_estimator
from megarl.algo.kl_reward import KLController, apply_kl_penalty, build_kl_controller
from megarl.algo.rollout_correction import MismatchStats, mismatch_stats_of_sequences
from megarl.algo.router_replay import replay_plan
from megarl.algo.routing_mismatch import RoutingMismatch
from megarl.algo.validation import is_validation_step, validates_before_training
from megarl.batch import RolloutBatch, RolloutShard
from megarl.config import planning
from megarl.config.schema import RunConfig
from megarl.distributed import heartbeat
from megarl.distributed.launcher import WorkerContext
from megarl.planner.batch_planner import StepPlan, plan_forward_micro_batches, plan_step
from megarl.planner.gates import ReferenceSource, StepGates, decide_gates, decide_reference
from megarl.trainer import moe_routing
from megarl.trainer.metrics import PhaseTimer
from megarl.trainer.progress import PhaseHook, no_progress, reported

if TYPE_CHECKING:
    from megarl.critic.megatron_critic import MegatronCritic
    from megarl.models.spec import TransformerSpec
    from megarl.trainer.critic_step import CriticTargets
    from megarl.trainer.rollout_host import RolloutHost


@dataclass(frozen=True)
class RunInputs:
    """What the launcher resolved before spawning the ranks."""

    cfg: RunConfig
    model_dir: str
    device: str
    return_final_state: bool = False
    """Gather the trained weights (HF names; with LoRA also the peft-named adapter) into the
    result: for tests and tools."""
    resume_from: str | None = None
    """A complete training checkpoint to continue from (checked against the config already)."""
    rollout_actor: object | None = None
    """Split placement: the Ray handle of the RolloutActor rank 0 talks to instead of
    building its own RolloutHost; None = colocated."""


@dataclass(frozen=True)
class RunResult:
    """What rank 0 hands back to the launcher."""

    history: list[dict]
    final_state: dict[str, torch.Tensor] | None = None


def run_rank(ctx: WorkerContext, inputs: RunInputs) -> RunResult | None:
    """Entry point of every rank; returns the run's result on rank 0 (None elsewhere)."""
    _quiet_third_party_warnings()
    if ctx.heartbeat_dir is not None:  # the launcher names this rank if its loop stops
        heartbeat.start(ctx.heartbeat_dir, ctx.rank)
    with heartbeat.published_on_error():  # an error's line names the phase it came from
        return _run_rank(ctx, inputs)


def _run_rank(ctx: WorkerContext, inputs: RunInputs) -> RunResult | None:
    from megarl.distributed import parallel
    from megarl.distributed.platform import exit_cpu_shims

    runtime = _setup(ctx, inputs)
    try:
        _train(runtime)
        if runtime.host is not None:  # ended normally: the plot of every step
            runtime.host.write_summary_plot()
        final_state = None
        if inputs.return_final_state:  # streamed: never the whole model on one rank
            heartbeat.mark("final_state")
            from megarl.export.stream import collect_state_dict, open_stream

            final_state = collect_state_dict(
                open_stream(
                    runtime.actor.local_params(),
                    runtime.spec,
                    runtime.cfg.export.bucket_mb << 20,
                    vpp=runtime.cfg.actor.vpp,
                )
            )
            if runtime.actor.lora is not None:  # LoRA: base weights + peft-named adapter
                adapter = runtime.actor.gather_lora_adapter()
                if final_state is not None and adapter is not None:
                    final_state.update(adapter)
        if runtime.host is None:
            return None
        return RunResult(history=runtime.host.history, final_state=final_state)
    finally:
        if runtime.host is not None:
            runtime.host.close()
        parallel.destroy()
        if inputs.device == "cpu":
            exit_cpu_shims()


def _quiet_third_party_warnings() -> None:
    warnings.filterwarnings("ignore", module=r"megatron\..*")
    warnings.filterwarnings("ignore", message=r".*Apex is not installed.*")
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass
class _Runtime:
    cfg: RunConfig
    dp_rank: int
    actor: MegatronActor
    reference: MegatronActor | None  # built only for ReferenceSource.MODEL
    reference_source: ReferenceSource
    rank_to_dp: tuple[int, ...]
    """The data-parallel rank of every global rank (what the rollout scatter sends where)."""
    host: RolloutHost | None
    """Rank 0 only: the rollout host, or in split placement its proxy (same methods)."""
    spec: TransformerSpec
    model_dir: str = ""
    resume_from: str | None = None
    kl_ctrl: KLController | None = None
    """``algo.use_kl_in_reward``: the reward KL's coefficient; rank 0's is the one used and
    checkpointed."""
    critic: MegatronCritic | None = None
    """``algo.adv_estimator=gae``: PPO's value model, on the actor's ranks and layout."""
    routers: RouterMonitor | None = None
    """Mixture-of-experts models: counts the actor's routing during the update."""
    progress: PhaseHook = no_progress
    """Rank 0 with ``trainer.progress`` on: the console's phase display (the work done in each
    phase); a no-op everywhere else."""


@dataclass(frozen=True)
class _Precomputed:
    """Logprobs the KL in the reward computed before the plan, for the sequences this rank
    runs in it: the step's old-logprob and reference passes reuse them."""

    old: dict[int, torch.Tensor]
    """Recomputed old logprobs (empty when the engine's stand in, or off the last stage)."""
    ref: dict[int, torch.Tensor]


def _setup(ctx: WorkerContext, inputs: RunInputs) -> _Runtime:
    from megatron.core import parallel_state as ps

    from megarl.distributed import parallel
    from megarl.distributed.execution import execution_plan_for
    from megarl.distributed.platform import enter_cpu_shims
    from megarl.models.hf_io import load_hf_config, load_hf_tokenizer, open_hf_tensors
    from megarl.models.spec import spec_from_hf_config

    cfg = inputs.cfg
    execution = execution_plan_for(cfg, inputs.device)
    if ctx.rank == 0 and "console" in cfg.trainer.logger:
        print(f"execution: {execution.summary()}\n  " + "\n  ".join(execution.reasons), flush=True)
    if execution.cpu_shims:
        enter_cpu_shims()
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ctx.world_size))
    timeout_s = cfg.trainer.collective_timeout_s
    heartbeat.mark("init_process_group")
    parallel.init_process_group(
        inputs.device, ctx.rank, ctx.world_size, ctx.master_addr, ctx.master_port, timeout_s
    )
    parallel.init_model_parallel(
        cfg.actor.tp,
        cfg.actor.pp,
        cfg.actor.vpp if cfg.actor.vpp > 1 else None,
        timeout_s,
        ep=cfg.actor.ep,
    )
    spec = spec_from_hf_config(load_hf_config(inputs.model_dir))
    tokenizer = load_hf_tokenizer(inputs.model_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    heartbeat.mark("build_rollout_engine")
    host = _build_rollout_host(ctx, inputs, tokenizer, spec)  # engine first: its errors come early
    hf_tensors = open_hf_tensors(inputs.model_dir)
    dtype = getattr(torch, execution.params_dtype)
    build = partial(
        MegatronActor,
        spec,
        cfg.actor,
        inputs.device,
        dtype,
        hf_tensors,
        pad_id,
        execution=execution,
    )
    heartbeat.mark("build_actor")
    actor = build(trainable=True, init_seed=cfg.trainer.seed)
    reference_plan = decide_reference(planning.run_facts(cfg))
    if ctx.rank == 0 and "console" in cfg.trainer.logger:
        print(
            f"pruning: {planning.prune_mode(cfg)[1]}\nreference: {reference_plan.reason}",
            flush=True,
        )
    reference = None
    if reference_plan.source is ReferenceSource.MODEL:
        heartbeat.mark("build_reference")
        reference = build(trainable=False)
    critic = None
    if cfg.algo.uses_critic:
        heartbeat.mark("build_critic")
        critic = _build_critic(
            cfg, spec, inputs.device, dtype, hf_tensors, pad_id, execution, inputs.resume_from
        )
    return _Runtime(
        cfg=cfg,
        dp_rank=ps.get_data_parallel_rank(),
        rank_to_dp=_gather_dp_ranks(ps.get_data_parallel_rank()),
        actor=actor,
        reference=reference,
        reference_source=reference_plan.source,
        host=host,
        spec=spec,
        model_dir=inputs.model_dir,
        resume_from=inputs.resume_from,
        kl_ctrl=_kl_controller(cfg),
        critic=critic,
        routers=RouterMonitor(actor.chunks, spec.num_experts, spec.moe_top_k)
        if spec.is_moe
        else None,
        progress=_progress_hook(host),
    )


def _build_critic(
    cfg: RunConfig,
    spec,
    device: str,
    dtype,
    hf_tensors,
    pad_id: int,
    execution,
    resume_from: str | None,
):
    """The critic from ``critic.model.path`` (its head too, when it holds one) or the actor's
    checkpoint, else a fresh value head seeded by the run; rank 0 says which.

    A resumed run overwrites every critic weight from its checkpoint's ``critic/`` tensors
    (:func:`_maybe_restore`), so it builds from the actor's checkpoint and never reads
    ``critic.model.path``: what the critic learned is in the checkpoint, not in that folder."""
    from megarl.critic.hf_init import critic_init
    from megarl.critic.megatron_critic import MegatronCritic
    from megarl.models.megatron_gpt import ValueHeadInit
    from megarl.trainer.critic_step import critic_model_config

    init_std = cfg.critic.value_head_init_std
    path = None if resume_from else cfg.critic.model.path
    source = critic_init(path, hf_tensors, spec, init_std)
    if dist.get_rank() == 0 and "console" in cfg.trainer.logger:
        text = f"critic: restored from {resume_from}" if resume_from else source.description
        print(text, flush=True)
    head = ValueHeadInit(init_std=init_std, seed=cfg.trainer.seed, weight=source.head_weight)
    return MegatronCritic(
        spec, critic_model_config(cfg), device, dtype, source.weights, pad_id, head, execution
    )


def _kl_controller(cfg: RunConfig) -> KLController | None:
    if not cfg.algo.use_kl_in_reward:
        return None
    c = cfg.algo.kl_ctrl
    return build_kl_controller(c.type, c.kl_coef, c.target_kl, c.horizon)


def _gather_dp_ranks(dp_rank: int) -> tuple[int, ...]:
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, dp_rank)
    return tuple(ranks)


def _progress_hook(host: RolloutHost | None) -> PhaseHook:
    """Where rank 0 reports its phases: the rollout host's console when it shows progress (in
    split placement one Ray call per report); a no-op elsewhere, so with progress off the
    reports cost one empty call."""
    if host is None or not host.shows_progress():
        return no_progress
    return host.show_phase


def _build_rollout_host(
    ctx: WorkerContext, inputs: RunInputs, tokenizer, spec: TransformerSpec
) -> RolloutHost | None:
    """Rank 0's rollout host: a local RolloutHost, or (split placement) the proxy to the rollout
    actor; None on other ranks."""
    if ctx.rank != 0:
        return None
    if inputs.rollout_actor is not None:
        from megarl.trainer.split_rollout import RemoteRolloutHost

        # The proxy forwards every RolloutHost method to the rollout actor over Ray.
        return cast("RolloutHost", RemoteRolloutHost(inputs.rollout_actor))
    from megarl.trainer.rollout_host import RolloutHost

    return RolloutHost(inputs.cfg, inputs.model_dir, inputs.device, tokenizer, spec=spec)


def _train(rt: _Runtime) -> None:
    from megarl.distributed.fault_injection import (  # test-only hooks
        maybe_die,
        maybe_freeze,
        maybe_raise,
    )

    heartbeat.mark("restore")
    last_done = _maybe_restore(rt)
    if rt.host is not None:  # wandb's run id is known now: a wandb that cannot start stops here
        rt.host.start_loggers()
    if rt.host is not None and validates_before_training(
        rt.cfg.trainer.val_before_train, last_done
    ):
        heartbeat.mark("validate", 0)
        rt.host.record_validation(0, rt.host.validate(0))
    for step in range(last_done + 1, rt.cfg.trainer.total_steps + 1):
        maybe_die(dist.get_rank(), step)
        heartbeat.mark("rollout", step)
        maybe_freeze(dist.get_rank(), step)
        maybe_raise(dist.get_rank(), step)
        timer = PhaseTimer()
        header, rollout, rollout_metrics, engine_state = _broadcast_rollout(rt, step, timer)
        merged, token_rewards, all_targets = None, None, None
        if rt.kl_ctrl is not None:
            header, rollout, merged, kl_metrics, token_rewards = _kl_in_reward(
                rt, step, header, rollout, engine_state.base_weights_resident, timer
            )
            rollout_metrics = {**rollout_metrics, **kl_metrics}
        if rt.critic is not None:
            header, rollout, all_targets, gae_metrics = _values_and_gae(
                rt, header, rollout, token_rewards, timer
            )
            rollout_metrics = {**rollout_metrics, **gae_metrics}
        plan, critic_plan = _plans(rt, header)
        heartbeat.mark("scatter")
        batch = _scatter_sequences(rt, rollout, header, plan, critic_plan)
        precomputed = None if rt.kl_ctrl is None else _scatter_logprobs(rt, merged, plan)
        targets = None
        if critic_plan is not None:
            targets = _scatter_targets(rt, all_targets, plan, critic_plan)
        gates = decide_gates(
            planning.step_facts(
                rt.cfg,
                step,
                batch.num_seqs,
                engine_base_weights_resident=engine_state.base_weights_resident,
                plan=plan,
            )
        )
        old, recomputed, ref, recomputed_routing = _logprob_passes(
            rt, batch, plan, gates, timer, precomputed, record_routing=True
        )
        if critic_plan is not None and targets is not None:
            critic_metrics = _update_critic(rt, batch, critic_plan, targets, timer)
            rollout_metrics = {**rollout_metrics, **critic_metrics}
        token_advantages = None if targets is None else targets.advantages
        with rt.routers.watch() if rt.routers is not None else contextlib.nullcontext():
            stats = _update_actor(
                rt, batch, plan, old, recomputed, ref, timer, token_advantages, recomputed_routing
            )
        if rt.routers is not None:
            replicas = rt.cfg.actor.tp // rt.actor.sequence_split
            router_metrics = moe_routing.router_statistics(rt.routers, rt.spec.num_layers, replicas)
            rollout_metrics = {**rollout_metrics, **router_metrics}
        _sync_weights(rt, gates, timer, step)
        if rt.host is not None:
            validation = {}
            if is_validation_step(step, rt.cfg.trainer.total_steps, rt.cfg.trainer.val_interval):
                heartbeat.mark("validate", step)
                validation = rt.host.validate(step)
            heartbeat.mark("record_metrics")
            rt.host.record_step(
                step, timer, rollout_metrics, plan, gates, stats, rollout, validation
            )
        _maybe_save(rt, step)


def _plans(rt: _Runtime, header: RolloutShard) -> tuple[StepPlan, StepPlan | None]:
    """The actor's plan of the step, and the critic's (its own mini-batches and epochs) when
    there is a critic: pure functions of the broadcast header, the same on every rank."""
    facts = (
        header.seq_lens,
        header.response_lens,
        header.advantages.tolist(),
        header.group_ids.tolist(),
    )
    plan = plan_step(planning.planner_inputs(rt.cfg, *facts))
    if rt.critic is None:
        return plan, None
    return plan, plan_step(planning.critic_planner_inputs(rt.cfg, *facts))


def _update_critic(
    rt: _Runtime, batch: RolloutShard, plan: StepPlan, targets: CriticTargets, timer: PhaseTimer
) -> dict[str, float]:
    """Every optimizer step of the critic's plan; its ``critic/*`` update metrics."""
    from megarl.trainer.critic_step import update_critic

    assert rt.critic is not None
    heartbeat.mark("update_critic")
    with timer.phase("update_critic"):
        return update_critic(rt.critic, rt.cfg, batch, plan, rt.dp_rank, targets, rt.progress)


# --- checkpoints (megarl.checkpoint) ----------------------------------------------------------


def _maybe_restore(rt: _Runtime) -> int:
    """Load ``rt.resume_from`` (if any) and push its weights to the engine; the step it ended."""
    if rt.resume_from is None:
        return 0
    from megarl.checkpoint.trainer_state import restore_training_checkpoint

    step = restore_training_checkpoint(rt.resume_from, rt.actor, rt.spec, rt.host, rt.critic)
    if rt.kl_ctrl is not None:
        from megarl.checkpoint.trainer_state import read_algo_state

        saved = read_algo_state(rt.resume_from).get("kl_ctrl")
        if saved is not None:  # else the run had no KL in the reward: start afresh
            rt.kl_ctrl.load_state_dict(saved)
    _push_weights(rt, base=True, adapter=rt.cfg.actor.lora.enabled)
    return step


def _maybe_save(rt: _Runtime, step: int) -> None:
    """Every ``trainer.save_interval`` steps, and after the last step."""
    interval, total = rt.cfg.trainer.save_interval, rt.cfg.trainer.total_steps
    if interval <= 0 or (step % interval and step != total):
        return
    from megarl.checkpoint.trainer_state import save_training_checkpoint

    heartbeat.mark("save")
    algo_state = None if rt.kl_ctrl is None else {"kl_ctrl": rt.kl_ctrl.state_dict()}
    save_training_checkpoint(
        rt.cfg,
        step,
        rt.actor,
        rt.spec,
        rt.host,
        rt.model_dir,
        algo_state=algo_state,
        critic=rt.critic,
    )


def _broadcast_rollout(rt: _Runtime, step: int, timer: PhaseTimer):
    """Rank 0 produces the scored batch (timing its phases) and puts the engine to sleep for
    training; every rank receives the batch's metadata (a shard without sequences: what the
    planner reads) and the engine's own memory report. The full batch stays on rank 0."""
    payload: list = [None]
    rollout = None
    if rt.host is not None:
        rollout, metrics, phase_seconds = rt.host.rollout(step)
        with timer.phase("engine_sleep"):
            engine_state = rt.host.release_engine_for_training()
        metrics = {**metrics, **rt.host.engine_metrics(engine_state)}
        payload = [(rollout.shard(()), metrics, phase_seconds, engine_state)]
    heartbeat.mark("broadcast_rollout")
    dist.broadcast_object_list(payload, src=0)
    header, metrics, phase_seconds, engine_state = payload[0]
    timer.add(phase_seconds)
    return header, rollout, metrics, engine_state


def _scatter_sequences(
    rt: _Runtime,
    rollout: RolloutBatch | None,
    header: RolloutShard,
    plan: StepPlan,
    critic_plan: StepPlan | None = None,
) -> RolloutShard:
    """Rank 0 sends every rank the sequences its DP rank runs in ``plan`` (and in the critic's
    plan, which may split the batch differently), the same shard to the TP/PP ranks of one DP
    rank, so no rank receives the whole batch."""
    source = None if rollout is None else rollout.shard
    return header.with_sequences(_scatter_by_dp_rank(rt, source, plan, critic_plan))


def _scatter_by_dp_rank(rt: _Runtime, part_of, *plans: StepPlan | None):
    """Rank 0 (which passes ``part_of``, a function of a sorted tuple of sequence indices)
    sends every rank the part of the sequences its DP rank runs in any of ``plans``; each DP
    rank's part is made once and shared by its TP/PP ranks. Returns this rank's part."""
    parts = None
    if part_of is not None:
        by_dp = {dp: part_of(_sequences_on_rank(dp, *plans)) for dp in set(rt.rank_to_dp)}
        parts = [by_dp[dp] for dp in rt.rank_to_dp]
    received: list = [None]
    dist.scatter_object_list(received, parts, src=0)
    return received[0]


def _sequences_on_rank(dp: int, *plans: StepPlan | None) -> tuple[int, ...]:
    """Every sequence DP rank ``dp`` runs in any of ``plans``, sorted."""
    return tuple(sorted({i for p in plans if p is not None for i in p.sequences_on_rank(dp)}))


def _values_and_gae(
    rt: _Runtime,
    header: RolloutShard,
    rollout: RolloutBatch | None,
    token_rewards: dict | None,
    timer: PhaseTimer,
) -> tuple[RolloutShard, RolloutBatch | None, CriticTargets | None, dict[str, float]]:
    """The critic's values of every sequence (an unpruned split), then on rank 0 GAE's
    targets of every sequence and the ``critic/*`` data metrics; every rank gets the
    per-sequence advantage summary the planner reads."""
    from megarl.trainer.critic_step import gae_targets, gather_values

    assert rt.critic is not None
    cfg = rt.cfg
    unpruned = plan_step(planning.every_sequence_inputs(cfg, header))
    batch = _scatter_sequences(rt, rollout, header, unpruned)
    heartbeat.mark("values")
    mine = unpruned.trained_sequences(rt.dp_rank)
    with timer.phase("values"), reported(rt.progress, "values", len(mine), "sequences"):
        values = gather_values(rt.critic, batch, mine, cfg.actor.logprob_micro_batch_tokens)
    payload: list = [None]
    targets, metrics = None, {}
    if rollout is not None and values is not None:
        with timer.phase("adv"):
            targets, summary_B, metrics = gae_targets(cfg, rollout, values, token_rewards)
        rollout = dataclasses.replace(rollout, advantages=summary_B)
        payload = [summary_B]
    dist.broadcast_object_list(payload, src=0)
    return dataclasses.replace(header, advantages=payload[0]), rollout, targets, metrics


def _scatter_targets(
    rt: _Runtime, targets: CriticTargets | None, plan: StepPlan, critic_plan: StepPlan
) -> CriticTargets:
    """Rank 0 sends every rank the GAE targets of the sequences it runs in either plan."""
    source = None if targets is None else targets.subset
    return _scatter_by_dp_rank(rt, source, plan, critic_plan)


def _logprob_passes(
    rt: _Runtime,
    batch: RolloutShard,
    plan: StepPlan,
    gates: StepGates,
    timer: PhaseTimer,
    precomputed: _Precomputed | None = None,
    record_routing: bool = False,
):
    """Run the forwards the gates asked for, over the sequences this DP rank trains (or take
    them from ``precomputed``: the KL in the reward ran them on every sequence already).

    Returns old, recomputed and reference logprobs, and the actor's experts of every input
    position of the recomputed sequences, recorded with ``record_routing`` where the engine
    reported routing (the old-logprob pass runs on the generating weights) and always under
    router replay R2 (the training forwards replay them). Under R3 the pass replays the
    engine's routing.
    """
    mine = plan.trained_sequences(rt.dp_rank)
    if precomputed is not None:
        return *_reuse_logprobs(rt, batch, mine, gates, precomputed), {}
    temperature = rt.cfg.rollout.temperature
    budget = rt.cfg.actor.logprob_micro_batch_tokens
    recomputed: dict[int, torch.Tensor] = {}
    routing: dict[int, torch.Tensor] = {}
    replay = replay_plan(rt.cfg.actor.router_replay.mode)
    if gates.old_log_prob.source == "rollout":
        old = {i: batch.engine_logprobs[i] for i in mine}
    else:
        if gates.old_log_prob.run:
            wanted = set(gates.old_log_prob.seq_indices)
            groups = plan_forward_micro_batches(
                [i for i in mine if i in wanted], batch.seq_lens, budget
            )
            heartbeat.mark("old_log_prob")
            num_seqs = sum(len(group) for group in groups)
            with (
                timer.phase("old_log_prob"),
                reported(rt.progress, "old_log_prob", num_seqs, "sequences"),
                moe_routing.recording(
                    rt.actor, batch, record_routing, replay.old_log_prob_records_for_training
                ) as routing,
                moe_routing.replaying(
                    rt.actor,
                    moe_routing.engine_replay(
                        rt.actor, batch, replay, [i for g in groups for i in g]
                    ),
                ),
            ):
                recomputed = rt.actor.compute_logprobs(batch, groups, temperature)
        old = recomputed
    ref = None
    if gates.ref_log_prob.run:
        groups = plan_forward_micro_batches(list(mine), batch.seq_lens, budget)
        heartbeat.mark("ref")
        with timer.phase("ref"), reported(rt.progress, "ref", len(mine), "sequences"):
            ref = _reference_logprobs(rt, batch, groups, temperature)
    return old, recomputed, ref, routing


def _reuse_logprobs(
    rt: _Runtime,
    batch: RolloutShard,
    mine: tuple[int, ...],
    gates: StepGates,
    pre: _Precomputed,
):
    """The step's logprob passes when the KL in the reward already ran them on every sequence
    (the gates then name every sequence; a mismatch would mean the two disagree)."""
    if gates.old_log_prob.source == "rollout":
        old = {i: batch.engine_logprobs[i] for i in mine}
        recomputed: dict[int, torch.Tensor] = {}
    else:
        recomputed = {i: pre.old[i] for i in mine if i in pre.old}
        old = recomputed
    ref = {i: pre.ref[i] for i in mine if i in pre.ref}
    complete = len(old) == len(ref) == len(mine)
    if rt.actor.is_last_stage and not (complete and gates.ref_log_prob.run):
        raise RuntimeError(
            f"KL in the reward precomputed logprobs of {len(ref)}/{len(mine)} sequences, "
            f"or ones the gates do not use ({gates.summary()})"
        )
    return old, recomputed, ref


def _kl_in_reward(
    rt: _Runtime,
    step: int,
    header: RolloutShard,
    rollout: RolloutBatch | None,
    engine_base_weights_resident: bool | None,
    timer: PhaseTimer,
) -> tuple[RolloutShard, RolloutBatch | None, dict | None, dict[str, float], dict | None]:
    """Old and reference logprobs of every sequence, then (rank 0) the rewards penalised
    with their KL and the advantages recomputed from the penalised scores, broadcast.

    The forwards run on an unpruned split (every advantage counts as non-zero), since the
    advantages that would prune are what this computes. Returns the header and batch with the
    new advantages, rank 0's ``{seq: (old, ref)}`` of every sequence (None elsewhere) for
    :func:`_scatter_logprobs`, and the ``critic/kl*`` metrics (rank 0).
    """
    cfg = rt.cfg
    n = header.num_seqs
    unpruned = plan_step(planning.every_sequence_inputs(cfg, header))
    gates = decide_gates(
        planning.step_facts(cfg, step, n, engine_base_weights_resident=engine_base_weights_resident)
    )
    batch = _scatter_sequences(rt, rollout, header, unpruned)
    old, _, ref, _ = _logprob_passes(rt, batch, unpruned, gates, timer)
    local = {}
    if rt.actor.is_last_stage and ref is not None:
        local = {i: (old[i].float(), ref[i].float()) for i in ref}
    gathered: list | None = [None] * dist.get_world_size() if rt.host is not None else None
    dist.gather_object(local, gathered, dst=0)
    payload: list = [None]
    merged, token_rewards = None, None
    metrics: dict[str, float] = {}
    if rollout is not None and gathered is not None and rt.kl_ctrl is not None:
        merged = {i: pair for part in gathered for i, pair in part.items()}
        rollout, metrics, token_rewards = _penalise_rewards(cfg, rollout, merged, rt.kl_ctrl)
        payload = [rollout.advantages]
    dist.broadcast_object_list(payload, src=0)
    header = dataclasses.replace(header, advantages=payload[0])
    return header, rollout, merged, metrics, token_rewards


def _penalise_rewards(
    cfg: RunConfig, rollout: RolloutBatch, merged: dict, kl_ctrl: KLController
) -> tuple[RolloutBatch, dict[str, float], dict[int, torch.Tensor]]:
    """Rank 0: rewards minus ``beta * KL`` (:func:`apply_kl_penalty`, which also updates the
    controller), the estimator on the penalised scores, the new advantage metrics, and each
    sequence's penalised token rewards (what GAE reads; a critic's advantages come later, in
    :func:`_values_and_gae`, so they are left as they are here)."""
    from torch.nn.utils.rnn import pad_sequence

    from megarl.trainer.rollout import advantage_metrics

    if sorted(merged) != list(range(rollout.num_seqs)):
        raise RuntimeError(f"KL in the reward got logprobs of {len(merged)}/{rollout.num_seqs}")
    order = range(rollout.num_seqs)
    old_BT = pad_sequence([merged[i][0] for i in order], batch_first=True)
    ref_BT = pad_sequence([merged[i][1] for i in order], batch_first=True)
    mask_BT = pad_sequence([torch.ones(len(merged[i][0])) for i in order], batch_first=True)
    result = apply_kl_penalty(
        rollout.rewards, old_BT, ref_BT, mask_BT, cfg.algo.kl_penalty, kl_ctrl
    )
    token_rewards = {i: result.token_rewards_BT[i, : len(merged[i][0])].float() for i in order}
    kl_metrics = {
        "critic/kl": result.current_kl,
        "critic/kl_coef": result.beta,
        # recent verl's names for the same two numbers, for dashboards moved over from it
        "actor/reward_kl_penalty": result.current_kl,
        "actor/reward_kl_penalty_coeff": result.beta,
    }
    if cfg.algo.uses_critic:
        return rollout, kl_metrics, token_rewards
    advantages = get_advantage_estimator(cfg.algo.estimator)(result.scores_B, rollout.group_ids)
    rollout = dataclasses.replace(rollout, advantages=advantages)
    return rollout, {**advantage_metrics(advantages), **kl_metrics}, token_rewards


def _scatter_logprobs(rt: _Runtime, merged: dict | None, plan: StepPlan) -> _Precomputed:
    """Rank 0 sends every rank the precomputed logprobs of the sequences it runs in ``plan``
    (which may put a sequence on another DP rank than the unpruned split did)."""
    parts = None
    if merged is not None:
        by_dp = {
            dp: {i: merged[i] for i in plan.sequences_on_rank(dp)} for dp in set(rt.rank_to_dp)
        }
        parts = [by_dp[dp] for dp in rt.rank_to_dp]
    received: list = [None]
    dist.scatter_object_list(received, parts, src=0)
    mine = received[0]
    recompute = rt.cfg.planner.old_log_prob != "rollout"
    return _Precomputed(
        old={i: old for i, (old, _) in mine.items()} if recompute else {},
        ref={i: ref for i, (_, ref) in mine.items()},
    )


def _reference_logprobs(rt: _Runtime, batch: RolloutShard, groups, temperature: float):
    """Run the reference forward from the source decided at start-up (see decide_reference)."""
    if rt.reference_source is ReferenceSource.ACTOR_WITHOUT_ADAPTERS:
        return rt.actor.compute_logprobs(batch, groups, temperature, without_adapters=True)
    if rt.reference is None:
        raise RuntimeError(
            "the gates run the reference pass, but start-up decided no step "
            "needs one (decide_reference and decide_ref_log_prob disagree)"
        )
    return rt.reference.compute_logprobs(batch, groups, temperature)


def _loss_settings(cfg: RunConfig) -> LossSettings:
    a = cfg.actor
    return LossSettings(
        temperature=cfg.rollout.temperature,
        clip_low=a.clip_ratio_low,
        clip_high=a.clip_ratio_high,
        agg=cfg.loss_agg,
        kl_coef=a.kl_coef,
        kl_estimator=a.kl_estimator,
        entropy_coef=a.entropy_coef,
        policy_loss=a.policy_loss,
        clip_ratio_c=a.clip_ratio_c,
        loss_scale_factor=cfg.loss_scale_factor,
        rollout_correction=cfg.algo.rollout_correction.settings,
    )


def _update_actor(
    rt: _Runtime,
    batch: RolloutShard,
    plan: StepPlan,
    old,
    recomputed,
    ref,
    timer: PhaseTimer,
    token_advantages: dict[int, torch.Tensor] | None = None,
    recomputed_routing: dict[int, torch.Tensor] | None = None,
) -> UpdateStats:
    """Every optimizer step of the plan on this rank's micro-batches; the step's statistics,
    each the mean over optimizer steps. ``token_advantages``: a critic's, per token.

    The engine check (logprobs, ``rollout_corr/*``, MoE routing) compares the first forward of
    each trained sequence on the weights the engine generated with: the old-logprob pass's
    (``recomputed``, ``recomputed_routing``) where the gates ran it, else the first optimizer
    step's training forward, which also runs before any weight moves.
    """
    loss = _loss_settings(rt.cfg)
    per_step: list[OptimizerStepStats] = []
    grad_norms: list[float] = []
    lp_diff = [0.0, 0.0]  # |engine - trainer| summed, tokens compared
    mismatch = MismatchStats()  # rollout_corr/*: the same tokens, old vs engine
    stage_routing = None  # rollout/moe_routing_mismatch*: the same tokens' experts
    num_steps = len(plan.optimizer_steps)
    trained = plan.trained_sequences(rt.dp_rank)
    replay = replay_plan(rt.cfg.actor.router_replay.mode)
    replayed = moe_routing.training_replay(
        rt.actor, batch, replay, trained, recomputed_routing or {}
    )
    with timer.phase("update_actor"):
        for index, opt_step in enumerate(plan.optimizer_steps):
            heartbeat.mark("update_actor")  # each optimizer step is progress
            rt.progress("update_actor", index, num_steps, "optimizer steps")
            with (
                moe_routing.recording(rt.actor, batch, on=index == 0) as train_routing,
                moe_routing.replaying(rt.actor, replayed),
            ):
                result = rt.actor.train_step(
                    batch,
                    opt_step,
                    rt.dp_rank,
                    old,
                    ref,
                    loss,
                    capture_logprobs=index == 0,
                    token_advantages=token_advantages,
                )
            per_step.append(result.stats if rt.actor.is_last_stage else OptimizerStepStats())
            grad_norms.append(result.grad_norm)
            if index == 0 and rt.actor.is_last_stage:
                trainer_logprobs = {**result.train_logprobs, **recomputed}
                lp_diff = _logprob_diff(batch, trainer_logprobs)
                mismatch = mismatch_stats_of_sequences(
                    trainer_logprobs, batch.engine_logprobs, loss.rollout_correction
                )
            if index == 0:  # every pipeline stage compares the experts of its own layers
                stage_routing = moe_routing.compare_with_engine(
                    rt.actor, batch, {**train_routing, **(recomputed_routing or {})}
                )
        rt.progress("update_actor", num_steps, num_steps, "optimizer steps")
    tp = rt.cfg.actor.tp
    global_steps = [
        OptimizerStepStats.from_row(row)
        for row in reduce_sums_to_all([s.as_row() for s in per_step], tp)
    ]
    routing = moe_routing.stage_mismatch(
        stage_routing, _pipeline_group(rt), rt.cfg.actor.pp, rt.actor.is_last_stage
    )
    num_routing = len(routing.as_row())
    [[lp_diff_sum, lp_diff_count, *sums]] = reduce_sums_to_all(
        [lp_diff + mismatch.sum_row() + routing.as_row()], tp
    )
    mismatch_sums, routing_sums = sums[:-num_routing], sums[-num_routing:]
    mismatch = MismatchStats.from_rows(mismatch_sums, reduce_max_to_all(mismatch.max_row()))
    return summarise_update(
        global_steps,
        grad_norms,
        lp_diff_sum,
        lp_diff_count,
        mismatch.metrics(),
        RoutingMismatch.from_row(routing_sums).metrics(),
    )


def _pipeline_group(rt: _Runtime):
    """This rank's pipeline-parallel group (the stages of its model replica); None at PP = 1."""
    if rt.cfg.actor.pp == 1:
        return None
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_group()


def _logprob_diff(batch: RolloutShard, trainer_logprobs: dict) -> list[float]:
    """Engine vs trainer logprobs of the same tokens under the same (generating) weights:
    the summed absolute difference and the number of tokens compared."""
    diff_sum, count = 0.0, 0
    for i, logp in trainer_logprobs.items():
        diff_sum += float((logp.float() - batch.engine_logprobs[i]).abs().sum())
        count += logp.numel()
    return [diff_sum, float(count)]


def _sync_weights(rt: _Runtime, gates: StepGates, timer: PhaseTimer, step: int) -> None:
    """Wake the engine and send what the gates say: base (or full) weights, the adapter."""
    from megarl.export.sync import is_checksum_step

    heartbeat.mark("update_weights")
    rt.progress("update_weights", 0)
    if rt.host is not None:
        with timer.phase("engine_wake"):
            _check_wake_report(rt.host.wake_engine(), gates)
    with timer.phase("update_weights"):
        metrics = _push_weights(
            rt,
            base=gates.base_weight_sync.run,
            adapter=gates.adapter_sync.run,
            checksum=is_checksum_step(step, rt.cfg.export.checksum_interval),
            progress=rt.progress,
        )
    if rt.host is not None:
        rt.host.record_export_metrics(metrics)


def _push_weights(
    rt: _Runtime,
    base: bool,
    adapter: bool,
    checksum: bool = False,
    progress: PhaseHook = no_progress,
) -> dict[str, float]:
    """Collective: stream the base (or full) weights to the engine on rank 0 in bounded buckets
    and/or gather the LoRA adapter into it; the export metrics (on rank 0). ``progress`` is told
    the buckets sent."""
    from megarl.export.sync import sync_engine_weights

    metrics: dict[str, float] = {}
    if base:
        engine = rt.host.engine if rt.host is not None else None
        metrics = sync_engine_weights(
            rt.actor.local_params(),
            rt.spec,
            rt.cfg.export.bucket_mb,
            rt.cfg.actor.vpp,
            checksum,
            engine,
            on_bucket=partial(progress, "update_weights", unit="buckets"),
        )
    if adapter:
        lora = rt.actor.gather_lora_adapter()
        if rt.host is not None:
            rt.host.update_engine_adapter(lora)
    return metrics


def _check_wake_report(state, gates: StepGates) -> None:
    """The engine's wake-up report must not contradict the report the gates decided from."""
    if not state.base_weights_resident and not gates.base_weight_sync.run:
        raise RuntimeError(
            "rollout engine reports freed base weights after wake-up, but the base-weight gate "
            f"skipped the base sync ({gates.base_weight_sync.reason}): the engine's sleep "
            "report was wrong"
        )
