"""The rank loop: what every Megatron rank process runs, the step as its named stages.

Runs in each rank process the launcher starts (local processes, Ray actors or Slurm tasks).
Rank 0 also holds the rollout host (:mod:`megarl.trainer.rollout_host`: engine, data, metrics)
or, in split placement, a proxy to the rollout actor. A step (:func:`_train_step`) is:

1. **rollout** -- the step's scored batch from the rollout source
   (:mod:`megarl.trainer.rollout_source`): generated now (``async_training.mode=sync``) or
   taken from the rollout side's stream; every rank gets its metadata and the engine's report;
2. **KL in the reward** (``algo.use_kl_in_reward``, :mod:`megarl.trainer.kl_in_reward`),
   **distillation** (a teacher, :mod:`megarl.trainer.distill_step`) and **values and GAE** (a
   critic, :mod:`megarl.trainer.critic_step`) replace the advantages;
3. **plan and gates** -- every rank computes the same :class:`StepPlan` (batch planner) and
   :class:`StepGates` (pass gates) from broadcast data, and rank 0 scatters to each rank only
   the sequences its DP rank runs (:mod:`megarl.trainer.scatter`);
4. **logprob passes** -- old (proximal) and reference forwards only where the gates say so
   (:mod:`megarl.trainer.logprob_passes`);
5. **update** -- the critic's plan (with a critic), then every optimizer step of the actor's
   plan (:mod:`megarl.trainer.actor_update`);
6. **weight sync** -- base (or full) weights and/or the LoRA adapter to the engine, as the
   gates say (:mod:`megarl.trainer.weight_sync`);
7. **record** -- rank 0 validates when due and writes the step's metrics; every
   ``trainer.save_interval`` steps all ranks write a checkpoint (:mod:`megarl.checkpoint`).

A resumed run first restores the checkpoint (weights, optimizer, RNG, data position) and hands
the restored weights to the engine, then continues at the step after the checkpoint's.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

from megarl.actor.megatron_actor import MegatronActor
from megarl.actor.router_stats import RouterMonitor
from megarl.algo.kl_reward import KLController, build_kl_controller
from megarl.algo.validation import is_validation_step, validates_before_training
from megarl.batch import RolloutShard
from megarl.config import planning
from megarl.config.schema import RunConfig
from megarl.distributed import heap, heartbeat, quiet
from megarl.distributed.launcher import WorkerContext
from megarl.errors import storage_error
from megarl.planner.batch_planner import plan_step
from megarl.planner.gate_results import ReferenceSource
from megarl.planner.gates import decide_gates, decide_reference, decide_restore_sync
from megarl.planner.staleness import staleness_stats, trainer_version
from megarl.planner.step_plan import StepPlan
from megarl.trainer import moe_routing
from megarl.trainer.actor_update import update_actor
from megarl.trainer.kl_in_reward import RewardKL, kl_in_reward, scatter_logprobs
from megarl.trainer.logprob_passes import logprob_passes
from megarl.trainer.metrics import PhaseTimer, StartupClock
from megarl.trainer.progress import PhaseHook, no_progress
from megarl.trainer.rollout_source import InlineSource, RolloutSource, StepRollout, StreamSource
from megarl.trainer.runtime import Runtime
from megarl.trainer.scatter import scatter_sequences
from megarl.trainer.token_rules import step_token_rule
from megarl.trainer.weight_sync import push_weights, sync_weights

if TYPE_CHECKING:
    from megarl.engines.megatron import MegatronEngine
    from megarl.models.spec import TransformerSpec
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
    teacher_dir: str | None = None
    """``algo.distill.teacher_path`` resolved to an HF folder (its tokenizer checked)."""
    rollout_actor: object | None = None
    """Split placement: the Ray handle of the RolloutActor rank 0 talks to instead of
    building its own RolloutHost; None = colocated."""
    rank_cores: tuple[int, ...] | None = None
    """Split placement on one CPU machine: the cores the ranks share (the rollout actor has
    the others); None = every core."""


@dataclass(frozen=True)
class RunResult:
    """What rank 0 hands back to the launcher."""

    history: list[dict]
    final_state: dict[str, torch.Tensor] | None = None


def run_rank(ctx: WorkerContext, inputs: RunInputs) -> RunResult | None:
    """Entry point of every rank; returns the run's result on rank 0 (None elsewhere)."""
    quiet.install(inputs.device)  # before this rank imports Megatron-Core, however started
    if ctx.heartbeat_dir is not None:  # the launcher names this rank if its loop stops
        heartbeat.start(ctx.heartbeat_dir, ctx.rank)
    with heartbeat.published_on_error():  # an error's line names the phase it came from
        try:
            return _run_rank(ctx, inputs)
        except OSError as exc:  # a full or failing disk is one line, not a bug's traceback
            failure = storage_error(exc, inputs.cfg.trainer.run_dir, heartbeat.during())
            if failure is None:
                raise
            raise failure from None


def _run_rank(ctx: WorkerContext, inputs: RunInputs) -> RunResult | None:
    from megarl.distributed import parallel
    from megarl.distributed.platform import exit_cpu_shims

    runtime = _setup(ctx, inputs)
    heap.freeze_after_startup()  # the model, optimizer and engine live as long as the rank
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


def _setup(ctx: WorkerContext, inputs: RunInputs) -> Runtime:
    from megatron.core import parallel_state as ps

    from megarl.distributed import parallel
    from megarl.distributed.execution import execution_plan_for
    from megarl.distributed.platform import enter_cpu_shims
    from megarl.models.hf_io import load_hf_config, load_hf_tokenizer, open_hf_tensors
    from megarl.models.spec import spec_from_hf_config

    cfg = inputs.cfg
    clock = StartupClock()
    execution = execution_plan_for(cfg, inputs.device)
    if ctx.rank == 0 and "console" in cfg.trainer.logger:
        print(f"execution: {execution.summary()}\n  " + "\n  ".join(execution.reasons), flush=True)
    if execution.cpu_shims:
        enter_cpu_shims()
        cores = os.cpu_count() or 1
        if inputs.rank_cores is not None:
            from megarl.distributed.execution import pin_to_cores

            pin_to_cores(inputs.rank_cores)
            cores = len(inputs.rank_cores)
        torch.set_num_threads(max(1, cores // ctx.world_size))
    timeout_s = cfg.trainer.collective_timeout_s
    heartbeat.mark("init_process_group")
    with clock.phase("process_groups"):
        parallel.join_launched_group(ctx, inputs.device, timeout_s)
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
    with clock.phase("rollout_host"):  # engine first: it starts while the actor is built
        host = _build_rollout_host(ctx, inputs, tokenizer, spec)
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
    with clock.phase("actor"):
        actor = build(
            trainable=True,
            init_seed=cfg.trainer.seed,
            batch_invariant=cfg.rollout.batch_invariant,
        )
    reference_plan = decide_reference(planning.run_facts(cfg))
    if ctx.rank == 0 and "console" in cfg.trainer.logger:
        print(
            f"pruning: {planning.prune_mode(cfg)[1]}\nreference: {reference_plan.reason}",
            flush=True,
        )
    reference = None
    if reference_plan.source is ReferenceSource.MODEL:
        heartbeat.mark("build_reference")
        with clock.phase("reference"):
            reference = build(trainable=False)
    teacher = None
    if inputs.teacher_dir is not None:
        heartbeat.mark("build_teacher")
        with clock.phase("teacher"):
            teacher = _build_teacher(inputs, pad_id, execution, dtype)
    critic = None
    if cfg.algo.uses_critic:
        heartbeat.mark("build_critic")
        with clock.phase("critic"):
            critic = _build_critic(
                cfg, spec, inputs.device, dtype, hf_tensors, pad_id, execution, inputs.resume_from
            )
    follower = _share_actor_model(inputs, host, actor, tokenizer, spec)
    if host is not None:  # the engine started meanwhile (vLLM: its processes, in the background)
        heartbeat.mark("start_rollout_engine")
        with clock.phase("rollout_engine"):
            host.wait_for_engine()
    guard = None
    if not cfg.algo.is_sft:
        from megarl.trainer.engine_guard import build_engine_guard, engine_sleep_level

        guard = build_engine_guard(cfg, execution.params_dtype, engine_sleep_level(host))
    return Runtime(
        cfg=cfg,
        source=_rollout_source(cfg, host, follower),
        dp_rank=ps.get_data_parallel_rank(),
        rank_to_dp=_gather_dp_ranks(ps.get_data_parallel_rank()),
        actor=actor,
        reference=reference,
        reference_source=reference_plan.source,
        teacher=teacher,
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
        startup=clock,
        sft_validation=_sft_validation_examples(cfg, tokenizer, spec),
        guard=guard,
    )


def _build_teacher(inputs: RunInputs, pad_id: int, execution, dtype) -> MegatronActor:
    """The distillation teacher: a frozen Megatron model built as the reference is, from its
    own HF folder and shape, on the actor's TP/PP ranks (start-up checked that it splits)."""
    from megarl.models.hf_io import load_hf_config, open_hf_tensors
    from megarl.models.spec import spec_from_hf_config

    assert inputs.teacher_dir is not None
    if dist.get_rank() == 0 and "console" in inputs.cfg.trainer.logger:
        print(f"teacher: {inputs.teacher_dir} (algo.distill)", flush=True)
    return MegatronActor(
        spec_from_hf_config(load_hf_config(inputs.teacher_dir)),
        inputs.cfg.actor,
        inputs.device,
        dtype,
        open_hf_tensors(inputs.teacher_dir),
        pad_id,
        execution=execution,
        trainable=False,
    )


def _sft_validation_examples(cfg: RunConfig, tokenizer, spec: TransformerSpec):
    """``algo.objective=sft`` with ``data.val_files``: the validation conversations, loaded by
    every rank (each scores its data-parallel share); None otherwise."""
    if not cfg.algo.is_sft or not cfg.data.val_files:
        return None
    from megarl.trainer.sft_batches import load_sft_examples

    examples, _ = load_sft_examples(
        cfg, tokenizer, cfg.data.val_files, spec.max_position_embeddings
    )
    return examples


def _rollout_source(
    cfg: RunConfig, host: RolloutHost | None, follower: MegatronEngine | None = None
) -> RolloutSource:
    """Where the steps' batches come from: generated inline (sync), or the rollout side's
    stream (one_step_off, fully_async), which fails a wait past the collective timeout."""
    if cfg.async_training.is_async:
        return StreamSource(host, cfg.trainer.collective_timeout_s)
    return InlineSource(host, follower)


def _share_actor_model(
    inputs: RunInputs, host: RolloutHost | None, actor: MegatronActor, tokenizer, spec
) -> MegatronEngine | None:
    """``rollout.engine=megatron`` colocated: rank 0's engine generates with the actor's model
    chunks, and the ranks that take its calls with it (its model-parallel group; every rank when
    data-parallel replicas share the calls or under expert parallelism) get an engine of their
    own over theirs, to follow (returned; None on every other rank, with any other engine, and
    on the rollout side, whose engine holds a copy of its own)."""
    cfg = inputs.cfg
    if not cfg.rollout.engine_is_actor or cfg.algo.is_sft:
        return None
    if host is not None:
        host.share_actor_model(actor.chunks)
        return None
    from megarl.engines.megatron import MegatronEngine, follows_driver
    from megarl.trainer.engine_setup import megatron_engine_kwargs

    if not follows_driver():
        return None
    follower = MegatronEngine(
        **megatron_engine_kwargs(
            tokenizer, inputs.model_dir, spec, inputs.device, inputs.cfg.rollout.batch_invariant
        )
    )
    follower.bind_model(actor.chunks)
    return follower


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
    from megarl.distributed.execution import execution_plan_for
    from megarl.models.megatron_gpt import ValueHeadInit
    from megarl.trainer.critic_step import critic_model_config

    init_std = cfg.critic.value_head_init_std
    path = None if resume_from else cfg.critic.model.path
    source = critic_init(path, hf_tensors, spec, init_std)
    if dist.get_rank() == 0 and "console" in cfg.trainer.logger:
        text = f"critic: restored from {resume_from}" if resume_from else source.description
        print(text, flush=True)
    head = ValueHeadInit(init_std=init_std, seed=cfg.trainer.seed, weight=source.head_weight)
    execution = execution_plan_for(cfg, execution.device, optim=cfg.critic.optim)
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


def _train(rt: Runtime) -> None:
    from megarl.distributed.fault_injection import (  # test-only hooks
        maybe_die,
        maybe_freeze,
        maybe_raise,
    )

    heartbeat.mark("restore")
    with rt.startup.phase("restore"):
        last_done = _maybe_restore(rt)
    probed = {}
    if rt.guard is not None and rt.guard.probe_on:  # the engine holds what training starts from
        from megarl.trainer.engine_guard import probe

        with rt.startup.phase("engine_probe"):
            where = "the probe after the restore" if last_done else "the probe after engine start"
            probed = probe(rt, where)
    if rt.host is not None:  # wandb's run id is known now: a wandb that cannot start stops here
        rt.host.start_loggers()
        rt.host.record_startup({**rt.startup.metrics(), **probed})
    if validates_before_training(rt.cfg.trainer.val_before_train, last_done):
        validation = _validate(rt, 0)
        if rt.host is not None:
            rt.host.record_validation(0, validation)
    rt.source.start(last_done + 1)
    for step in range(last_done + 1, rt.cfg.trainer.total_steps + 1):
        maybe_die(dist.get_rank(), step)
        heartbeat.mark("rollout", step)
        maybe_freeze(dist.get_rank(), step)
        maybe_raise(dist.get_rank(), step)
        _train_step(rt, step)


def _train_step(rt: Runtime, step: int) -> None:
    """One RL step, as its stages (the module docstring says what each does)."""
    timer = PhaseTimer()
    rollout = rt.source.next_batch(step, timer)
    reward_kl = RewardKL(logprobs=None, token_rewards=None)
    if rt.kl_ctrl is not None:
        rollout, reward_kl = kl_in_reward(rt, step, rollout, timer)
    distillation = None
    if rt.teacher is not None:
        from megarl.trainer.distill_step import distill_advantages

        rollout, distillation = distill_advantages(rt, step, rollout, timer)
    all_targets = None
    if rt.critic is not None:
        from megarl.trainer.critic_step import values_and_gae

        rollout, all_targets = values_and_gae(rt, rollout, reward_kl.token_rewards, timer)
    plan, critic_plan = _plans(rt, rollout.header)
    heartbeat.mark("scatter")
    batch = scatter_sequences(rt, rollout.batch, rollout.header, plan, critic_plan)
    precomputed = None
    if rt.kl_ctrl is not None:
        precomputed = scatter_logprobs(rt, reward_kl.logprobs, plan)
    elif distillation is not None:
        precomputed = scatter_logprobs(rt, distillation.logprobs, plan)
    facts = planning.step_facts(
        rt.cfg,
        step,
        batch.num_seqs,
        engine_base_weights_resident=rollout.engine_state.base_weights_resident,
        plan=plan,
        behaviour_versions=rollout.header.oldest_versions,
    )
    gates = decide_gates(facts)
    logprobs = logprob_passes(rt, batch, plan, gates, timer, precomputed, record_routing=True)
    metrics = dict(rollout.metrics)
    token_advantages = None
    if distillation is not None:
        from megarl.trainer.distill_step import scatter_token_advantages

        token_advantages = scatter_token_advantages(rt, distillation.token_advantages, plan)
    if critic_plan is not None:
        from megarl.trainer.critic_step import critic_update, scatter_targets

        targets = scatter_targets(rt, all_targets, plan, critic_plan)
        metrics.update(critic_update(rt, batch, critic_plan, targets, timer))
        token_advantages = targets.advantages
    token_rule = step_token_rule(rt, rollout.batch, batch, plan, logprobs.old, step)
    with rt.routers.watch() if rt.routers is not None else contextlib.nullcontext():
        stale = frozenset(facts.stale_sequences)
        stats = update_actor(
            rt, batch, plan, logprobs, timer, token_advantages, stale, step, token_rule
        )
    if rt.routers is not None:
        replicas = rt.cfg.actor.tp // rt.actor.sequence_split
        metrics.update(moe_routing.router_statistics(rt.routers, rt.spec.num_layers, replicas))
    sync_weights(rt, gates, timer, step)
    validation = {}
    if is_validation_step(step, rt.cfg.trainer.total_steps, rt.cfg.trainer.val_interval):
        validation = _validate(rt, step)
    if rt.host is not None:
        _record_step(rt, step, timer, rollout, plan, gates, stats, metrics, validation)
    _maybe_save(rt, step)


def _validate(rt: Runtime, step: int) -> dict[str, float]:
    """Validation after ``step`` (0: before training): rank 0's rollout host generates and
    scores; under ``algo.objective=sft`` every rank takes part in the loss on the validation
    conversations (empty elsewhere, or without any)."""
    heartbeat.mark("validate", step)
    if rt.sft_validation is not None:
        from megarl.trainer.sft_batches import sft_validation

        return sft_validation(rt, rt.sft_validation)
    if rt.host is None or rt.cfg.algo.is_sft:
        rt.source.follow_generation()  # rollout.engine=megatron: rank 0 generates with this rank
        return {}
    return rt.host.validate(step)


def _record_step(
    rt: Runtime, step: int, timer, rollout: StepRollout, plan, gates, stats, metrics, validation
):
    """Rank 0: the step's metrics (its validation's included) to every sink and the console."""
    assert rt.host is not None and rollout.batch is not None
    if rt.cfg.async_training.is_async and rollout.batch.behaviour_versions is not None:
        trained = {i for dp in range(rt.cfg.dp) for i in plan.trained_sequences(dp)}
        versions = [v.tolist() for v in rollout.batch.behaviour_versions]
        metrics.update(staleness_stats(versions, trained, trainer_version(step)).metrics())
    heartbeat.mark("record_metrics")
    rt.host.record_step(step, timer, metrics, plan, gates, stats, rollout.batch, validation)


def _plans(rt: Runtime, header: RolloutShard) -> tuple[StepPlan, StepPlan | None]:
    """The actor's plan of the step, and the critic's (its own mini-batches and epochs) when
    there is a critic: pure functions of the broadcast header, the same on every rank."""
    inputs = planning.planner_inputs(rt.cfg, **planning.batch_facts(header))
    plan = plan_step(inputs)
    if rt.critic is None:
        return plan, None
    return plan, plan_step(planning.critic_planner_inputs(rt.cfg, inputs))


# --- checkpoints (megarl.checkpoint) ----------------------------------------------------------


def _maybe_restore(rt: Runtime) -> int:
    """Load ``rt.resume_from`` (if any) and push its weights to the engine; the step it ended."""
    if rt.resume_from is None:
        return 0
    from megarl.checkpoint.trainer_state import restore_training_checkpoint

    step = restore_training_checkpoint(
        rt.resume_from, rt.actor, rt.spec, rt.host, rt.critic, run_dir=rt.cfg.trainer.run_dir
    )
    if rt.kl_ctrl is not None:
        from megarl.checkpoint.trainer_state import read_algo_state

        saved = read_algo_state(rt.resume_from).get("kl_ctrl")
        if saved is not None:  # else the run had no KL in the reward: start afresh
            rt.kl_ctrl.load_state_dict(saved)
    base, adapter = decide_restore_sync(planning.run_facts(rt.cfg))
    push_weights(rt, base=base.run, adapter=adapter.run, step=step)
    rt.source.weights_synced(step)  # the weights after step s are policy version s
    return step


def _maybe_save(rt: Runtime, step: int) -> None:
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
