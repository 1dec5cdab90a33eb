"""The rollout host: the rollout engine, the data, the metrics and the console of a run.

Runs in rank 0's process (colocated placement) or in the rollout actor's own process (split
placement, :mod:`megarl.trainer.split_rollout`); the Megatron step loop
(:mod:`megarl.trainer.rank_loop`) calls it and does not know which. Imports the engines, data,
models and the actor's statistics types; nothing imports it but the rank loop, the split
placement and start-up.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megarl.actor.train_stats import UpdateStats
from megarl.agent.driver import validation_trajectory_metrics
from megarl.agent.loop import RunFacts
from megarl.agent.trajectory import Trajectory
from megarl.algo.validation import validation_metrics
from megarl.config.schema import RunConfig
from megarl.data.arithmetic import ArithmeticTask
from megarl.data.files import load_problem_files
from megarl.data.loader import PromptSource, PromptStream, build_prompt_source
from megarl.data.problems import Problem
from megarl.distributed import fault_injection
from megarl.engines.base import EngineMemoryState, LoraAdapter, RolloutEngine, SamplingParams
from megarl.models.spec import TransformerSpec, spec_from_hf_config
from megarl.trainer import perf
from megarl.trainer.agent_rollout import AgentRollout
from megarl.trainer.engine_setup import build_run_engine
from megarl.trainer.generations import rollout_records, validation_records, write_step_file
from megarl.trainer.metrics import (
    MetricsWriter,
    PhaseTimer,
    WandbRun,
    new_wandb_run_id,
    startup_line,
    step_line,
    validation_line,
)
from megarl.trainer.perf import PeakFlops, peak_flops
from megarl.trainer.progress import LiveProgress, PhaseHook, no_progress, progress_enabled
from megarl.trainer.rollout import (
    RolloutProducer,
    RolloutSettings,
    StepTexts,
    rollout_prompt_ids,
    sampling_seed,
)
from megarl.trainer.sft_batches import NoEngine, SFTProducer, load_sft_examples, loss_metrics
from megarl.trainer.summary import summarize
from megarl.trainer.summary_plot import SUMMARY_PLOT, write_summary_plot

NO_ENGINE_METRICS = ("rollout/logprob_abs_diff", "rollout_corr/", "critic/", "actor/pg_clipfrac")
"""Metrics that compare with an engine's sampling or describe rewards: not in an SFT step."""

VALIDATION_SEED_BATCH = 1_000_003
"""``sampling_seed``'s batch number for validation: far from dynamic sampling's 1, 2, ..."""


class RolloutHost:
    """The rollout engine, the prompt stream, the rollout producer and the run's metrics."""

    def __init__(
        self,
        cfg: RunConfig,
        model_dir: str,
        device: str,
        tokenizer,
        spec: TransformerSpec | None = None,
    ):
        from megarl.models.hf_io import load_hf_config

        self.cfg = cfg
        self.spec = spec if spec is not None else spec_from_hf_config(load_hf_config(model_dir))
        self.tokenizer = tokenizer
        self._val_problems: list[Problem] | None = None
        self.console = Console(
            cfg.trainer.total_steps,
            enabled="console" in cfg.trainer.logger,
            progress=cfg.trainer.progress,
        )
        self.engine: RolloutEngine = NoEngine()
        self.sleep_level = 0
        self.producer: RolloutProducer
        """RL: prompts, engine, rewards, advantages (not set under ``algo.objective=sft``)."""
        self.sft: SFTProducer | None = None
        """``algo.objective=sft``: the batches come from the dataset's conversations."""
        if cfg.algo.is_sft:  # no engine (megarl.sft)
            context = self.spec.max_position_embeddings
            examples, _ = load_sft_examples(cfg, tokenizer, cfg.data.train_files or (), context)
            self.sft = SFTProducer(examples, cfg.data.prompts_per_step, cfg.trainer.seed, tokenizer)
            self.stream = self.sft.stream
        else:
            self.engine, self.sleep_level = build_run_engine(
                cfg, tokenizer, device, model_dir, self.spec
            )
            fault_injection.register_engine(self.engine)  # MEGARL_FAULT_AT's corrupt-engine
            self.producer = self._rollout_producer(model_dir)
        self.writer = metrics_writer(cfg)
        self.history: list[dict] = []
        # validations outside a training step (step 0): in the summary, not in the history
        self._validation_only: list[dict] = []
        self._export_metrics: dict[str, float] = {}
        self._startup_metrics: dict[str, float] = {}
        self._perf = _PerfContext.build(model_dir, device, cfg.trainer.world_size)
        self.weights_version = 0
        """The policy version the engine serves (:mod:`megarl.planner.staleness`): 0 for the
        model's own weights, then each step's number once its weights arrived."""

    def _rollout_producer(self, model_dir: str) -> RolloutProducer:
        """RL's producer: the prompt stream, the engine, rewards and advantages."""
        cfg, tokenizer = self.cfg, self.tokenizer
        source, _ = training_source(
            cfg, model_dir, self.spec.max_position_embeddings, tokenizer=tokenizer
        )
        self.stream = PromptStream(source, cfg.data.prompts_per_step, cfg.trainer.seed)
        settings = RolloutSettings(
            group_size=cfg.rollout.n,
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            adv_estimator=cfg.algo.estimator,
            system_prompt=cfg.data.system_prompt,
            reward_error=cfg.data.reward_error,
            reward_timeout_s=cfg.data.reward_timeout_s,
            overlong_buffer_len=cfg.overlong_buffer_len,
            overlong_penalty_factor=cfg.reward.overlong_buffer.penalty_factor,
            length_penalty=cfg.algo.length_penalty.weights,
            filter_groups=cfg.algo.filter_groups.enable,
            max_num_gen_batches=cfg.algo.filter_groups.max_num_gen_batches,
            input_routing=cfg.actor.router_replay.mode == "R3",
        )
        return RolloutProducer(
            self.engine,
            tokenizer,
            self.stream,
            cfg.data.reward_choice,
            settings,
            cfg.trainer.seed,
            progress=self.progress_hook(),
            agents=AgentRollout(
                cfg.rollout.agent,
                tokenizer,
                cfg.data.system_prompt,
                agent_run_facts(cfg, self.spec.max_position_embeddings),
            ),
            components=cfg.data.weighted_rewards,
        )

    def share_actor_model(self, chunks) -> None:
        """``rollout.engine=megatron``: the engine generates with the actor's model chunks
        (built after this host)."""
        from megarl.engines.megatron import MegatronEngine

        if not isinstance(self.engine, MegatronEngine):
            raise TypeError(f"{type(self.engine).__name__} holds its own copy of the model")
        self.engine.bind_model(chunks)

    def wait_for_engine(self) -> None:
        """The rollout engine has started (a vLLM start overlaps the trainer's set-up); its
        start-up error, if any, is raised here."""
        self.engine.wait_until_started()

    def rollout(self, step: int):
        """The synchronous loop's step: generate and score the step's prompts now."""
        if self.sft is not None:
            return self.sft.produce(step)
        return self.producer.produce(step, self.weights_version)

    def weights_loaded(self, version: int) -> None:
        """Every weight of policy ``version`` reached the engine (the trainer's last push)."""
        self.weights_version = version

    # --- the live progress display (trainer.progress; megarl.trainer.progress) ---

    def shows_progress(self) -> bool:
        """Whether the console draws the phase display (the rank loop reports only then)."""
        return self.console.shows_progress

    def show_phase(self, phase: str, done: int, total: int | None = None, unit: str = "") -> None:
        """The rank loop's :class:`~megarl.trainer.progress.PhaseHook` (rank 0, progress on)."""
        self.console.phase(phase, done, total, unit)

    def progress_hook(self) -> PhaseHook:
        """Where this process reports phases: the console's display, or nowhere when it is off."""
        return self.console.phase if self.console.shows_progress else no_progress

    def validate(self, step: int) -> dict[str, float]:
        """Generate on the held-out problems (:func:`validation_problems`) with the engine's
        current weights and score them.

        Sampling follows ``rollout.val.*`` (greedy by default) from its own seed per step, and
        the engines draw from a generator seeded per call, so a run with validation trains
        exactly like one without.
        """
        val = self.cfg.rollout.val
        started = time.perf_counter()
        problems = self._val_problems
        if problems is None:
            problems = self._val_problems = validation_problems(self.cfg)
        params = SamplingParams(
            temperature=val.temperature if val.do_sample else 0.0,
            top_p=val.top_p,
            max_new_tokens=self.cfg.rollout.max_new_tokens,
            seed=sampling_seed(self.cfg.trainer.seed, step, VALIDATION_SEED_BATCH),
        )
        chunk = self.cfg.data.val_batch_size or len(problems)
        rewards: list[list[float]] = []
        final_answers: list[list[str | None]] = []  # what each sample answered, for maj@k
        response_lens: list[int] = []
        samples: list[tuple[str, str, str]] = []
        trajectories: list[Trajectory] = []  # agent loops' (none for a single-turn rollout)
        progress = self.progress_hook()
        for start in range(0, len(problems), chunk):
            progress("validate", start, len(problems), "prompts")
            part = problems[start : start + chunk]
            prompts = [self.producer.encode_prompt(p) for p in part]
            generated = self.producer.generate(part, prompts, val.n, params.seed, params)
            gens = generated.gens
            trajectories += generated.trajectories
            texts = [self.tokenizer.decode(g.response_ids, skip_special_tokens=True) for g in gens]
            if generated.answer_texts:  # what a loop chose for the reward (the gateway's answer)
                texts = [
                    own if own is not None else text
                    for own, text in zip(generated.answer_texts, texts, strict=True)
                ]
            answers = [p.answer for p in part for _ in range(val.n)]
            sources = [p.data_source for p in part for _ in range(val.n)]
            scores = self.producer.score(texts, answers, sources, step)
            scores = tuple(
                score if own is None else float(own)
                for score, own in zip(scores, generated.rewards, strict=True)
            )
            rewards += [list(scores[i : i + val.n]) for i in range(0, len(scores), val.n)]
            said = [
                self.producer.reward.final_answer(text, source)
                for text, source in zip(texts, sources, strict=True)
            ]
            final_answers += [said[i : i + val.n] for i in range(0, len(said), val.n)]
            response_lens += [
                len(g.response_ids) if g.response_mask is None else sum(g.response_mask)
                for g in gens
            ]
            samples += [(part[i // val.n].prompt, texts[i], answers[i]) for i in range(len(gens))]
        sources = [p.data_source for p in problems]
        metrics = validation_metrics(sources, rewards, response_lens, final_answers)
        metrics.update(validation_trajectory_metrics(trajectories))
        if self.cfg.trainer.validation_data_dir is not None:
            per_sample = [source for source in sources for _ in range(val.n)]
            flat = [reward for prompt_rewards in rewards for reward in prompt_rewards]
            records = validation_records(step, per_sample, samples, flat)
            write_step_file(Path(self.cfg.trainer.validation_data_dir), step, records)
        self._release_followers()
        metrics["timing_s/testing"] = time.perf_counter() - started
        return metrics

    def record_export_metrics(self, export_metrics: dict[str, float]) -> None:
        """The worker streamed the weights into ``self.engine``; keep its metrics for the step."""
        self._export_metrics = dict(export_metrics)

    # --- engine memory and LoRA (base-weight gate; see megarl.planner.gates) ---

    def release_engine_for_training(self) -> EngineMemoryState:
        """Sleep the engine at ``rollout.sleep_level`` (0: stays resident); its own report.

        The report (did it keep its base weights?) is what the base-weight gate decides from.
        """
        self._release_followers()
        if self.sleep_level > 0:
            self.engine.sleep(self.sleep_level)
        return self.engine.memory_state()

    def _release_followers(self) -> None:
        """``rollout.engine=megatron`` over several ranks: the end of a generation phase, so
        the ranks that generated with rank 0 go back to the step."""
        from megarl.engines.megatron import MegatronEngine

        if isinstance(self.engine, MegatronEngine):
            self.engine.release_followers()

    def engine_metrics(self, state: EngineMemoryState) -> dict[str, float]:
        """What the engine reported after its sleep (the base-weight gate's input)."""
        if self.sft is not None:
            return {}
        return {
            "engine/sleep_level": float(self.sleep_level),
            "engine/base_weights_resident": float(state.base_weights_resident),
        }

    def engine_sleep_level(self) -> int:
        """The level the engine really sleeps at (an engine may refuse a deeper one)."""
        return self.sleep_level

    def probe_engine(self, samples: int) -> list[tuple[list[int], int, list[float]]]:
        """The logprob guard's probe (:mod:`megarl.trainer.engine_guard`): ``samples`` samples
        of the fixed probe prompt at the run's temperature and a fixed seed, as ``(prompt +
        response ids, prompt length, the engine's logprobs)``."""
        from megarl.planner.logprob_guard import PROBE_MAX_NEW_TOKENS, PROBE_SEED, PROBE_TEXT

        prompt = list(self.tokenizer.encode(PROBE_TEXT))
        r = self.cfg.rollout
        params = SamplingParams(
            temperature=r.temperature,
            max_new_tokens=min(r.max_new_tokens, PROBE_MAX_NEW_TOKENS),
            seed=PROBE_SEED,
        )
        return [
            (
                list(g.prompt_ids) + list(g.response_ids),
                len(g.prompt_ids),
                list(g.response_logprobs),
            )
            for g in self.engine.generate([prompt] * samples, params)
        ]

    def wake_engine(self) -> EngineMemoryState:
        """Re-acquire the engine's memory after training; what it reports it must be sent."""
        return self.engine.wake_up()

    def update_engine_adapter(self, adapter: dict[str, torch.Tensor] | None) -> None:
        """Adapter-only update: the engine applies the peft-named LoRA tensors."""
        if adapter is None:
            return
        from megarl.models.lora import hf_target_modules

        lora = self.cfg.actor.lora
        self.engine.load_lora_adapter(
            LoraAdapter(
                named_tensors=adapter,
                rank=lora.rank,
                alpha=lora.alpha,
                target_modules=tuple(hf_target_modules(self.spec, lora.target_modules)),
            )
        )

    def record_step(
        self,
        step,
        timer: PhaseTimer,
        rollout_metrics,
        plan,
        gates,
        stats: UpdateStats,
        batch,
        validation: Mapping[str, float] | None = None,
    ):
        metrics: dict = {"step": step}
        metrics.update(rollout_metrics)
        metrics.update(validation or {})
        metrics.update(stats.metrics())
        if self.cfg.algo.is_sft:  # the sft loss is the NLL; nothing was sampled to compare
            metrics.update(loss_metrics(metrics["actor/pg_loss"]))
            for key in [k for k in metrics if k.startswith(NO_ENGINE_METRICS)]:
                del metrics[key]
        metrics.update(plan.metrics)
        metrics["planner/summary"] = plan.summary()
        metrics.update(gates.metrics())
        metrics["gates/summary"] = gates.summary()
        metrics.update(self._startup_metrics)  # first: a wake-up's probe supersedes the start's
        self._startup_metrics = {}
        metrics.update(self._export_metrics)
        metrics.update(timer.times)
        metrics["timing_s/step"] = timer.total()
        total_tokens = sum(batch.seq_lens)
        metrics["perf/total_num_tokens"] = total_tokens
        metrics["perf/throughput"] = total_tokens / max(metrics["timing_s/step"], 1e-9)
        metrics.update(self._perf.update_metrics(plan, batch, timer.times))
        texts = (self.sft or self.producer).pop_texts(step)
        if self.cfg.trainer.rollout_data_dir is not None:
            self._dump_rollout(step, batch, plan, texts)
        self.writer.write(metrics)
        self.history.append(metrics)
        self.console.step(metrics, texts.samples)

    def _dump_rollout(self, step: int, batch, plan, texts: StepTexts) -> None:
        """``trainer.rollout_data_dir``: the step's sequences, and which the plan trained."""
        num_dp = len(plan.optimizer_steps[0].ranks)
        trained = {i for dp in range(num_dp) for i in plan.trained_sequences(dp)}
        records = rollout_records(
            step,
            texts.texts,
            batch.rewards.tolist(),
            batch.advantages.tolist(),
            batch.group_ids.tolist(),
            trained,
            texts.turns,
            texts.branches,
        )
        write_step_file(Path(str(self.cfg.trainer.rollout_data_dir)), step, records)

    def record_startup(self, metrics: Mapping[str, float]) -> None:
        """Where the start-up went (``timing_s/startup/*``): one console line now, and the
        metrics logged with the first step this run trains."""
        self._startup_metrics = dict(metrics)
        self.console.startup(self._startup_metrics)

    def start_loggers(self) -> None:
        """Start the metric sinks that connect somewhere (wandb), after a resume's restore."""
        self.writer.start()

    def record_validation(self, step: int, validation: Mapping[str, float]) -> None:
        """A validation outside a training step (``trainer.val_before_train``: step 0): a record
        of its own in every sink, not part of the training history."""
        metrics = {"step": step, **validation}
        self.writer.write(metrics)
        self._validation_only.append(metrics)
        self.console.validation(metrics)

    # --- checkpoint state (megarl.checkpoint.trainer_state) ----------------------------------

    def state_dict(self) -> dict:
        state: dict = {"stream": self.stream.state_dict()}
        if self.writer.wandb_run_id is not None:
            state["wandb_run_id"] = self.writer.wandb_run_id
        return state

    def load_state_dict(self, state: dict, history: list[dict]) -> None:
        """Continue the data stream where the checkpoint stopped, and its wandb run if it saved
        one (with wandb on); ``history`` = its metrics."""
        self.stream.load_state_dict(state["stream"])
        if state.get("wandb_run_id"):
            self.writer.continue_wandb_run(state["wandb_run_id"])
        self.history = [row for row in history if row.get("step", 0) >= 1]  # training steps
        self._validation_only = [row for row in history if row.get("step", 0) < 1]
        self.console.skip(len(self.history))

    def write_summary_plot(self) -> None:
        """The run ended normally: ``<run_dir>/summary.png`` of all its steps (a resumed run's
        history holds the steps before the resume too). Warns instead of raising."""
        rows = self._validation_only + self.history
        write_summary_plot(rows, Path(self.cfg.trainer.run_dir) / SUMMARY_PLOT)

    def close(self) -> None:
        self.console.finish(self._validation_only + self.history)
        self.writer.close()
        close_engine = getattr(self.engine, "close", None)
        if close_engine is not None:
            close_engine()


def metrics_writer(cfg: RunConfig) -> MetricsWriter:
    """The sinks ``trainer.logger`` names (the console is :class:`Console`)."""
    loggers = cfg.trainer.logger
    wandb = None
    if "wandb" in loggers:
        wandb = WandbRun(
            project=cfg.trainer.project_name,
            name=cfg.trainer.experiment,
            run_id=new_wandb_run_id(),
            config=cfg.to_dict(),
            directory=Path(cfg.trainer.run_dir),
        )
    return MetricsWriter(
        Path(cfg.trainer.run_dir),
        tensorboard="tensorboard" in loggers,
        jsonl="jsonl" in loggers,
        wandb=wandb,
    )


# --- MFU of the update phase ---
@dataclass(frozen=True)
class _PerfContext:
    """What ``perf/mfu/actor`` needs besides the step: the model shape and the device peak."""

    spec: TransformerSpec
    peak: PeakFlops
    num_devices: int

    @classmethod
    def build(cls, model_dir: str, device: str, num_devices: int) -> _PerfContext:
        from megarl.models.hf_io import load_hf_config

        name = torch.cuda.get_device_name() if device == "cuda" else None
        return cls(spec_from_hf_config(load_hf_config(model_dir)), peak_flops(name), num_devices)

    def update_metrics(self, plan, batch, times: dict[str, float]) -> dict:
        seconds = times.get("timing_s/update_actor", 0.0)
        return perf.update_metrics(
            self.spec, plan, batch.seq_lens, seconds, self.num_devices, self.peak
        )


def agent_run_facts(cfg: RunConfig, max_position_embeddings: int) -> RunFacts:
    """What the agent loops may need of the run: the reward-error policy (the gateway applies
    it to the user's agent) and the longest prompt a trajectory may start from."""
    from megarl.config.context import context_limit, prompt_budget

    limit = context_limit(max_position_embeddings, cfg.rollout.engine, cfg.rollout.max_model_len)
    budget = prompt_budget(limit, cfg.rollout.max_new_tokens, cfg.data.max_prompt_length)
    return RunFacts(reward_error=cfg.data.reward_error, max_prompt_tokens=budget)


def fitting_problems(
    cfg: RunConfig, problems: list[Problem], tokenizer, max_position_embeddings: int
) -> tuple[list[Problem], int]:
    """The problems whose prompt is within budget (:func:`megarl.config.context.prompt_budget`)
    and how many were left out, as ``data.filter_overlong_prompts`` trains on them. Start-up
    and the rollout host both call this, so they agree on the dataset."""
    from megarl.config.context import context_limit, overlong, prompt_budget

    limit = context_limit(max_position_embeddings, cfg.rollout.engine, cfg.rollout.max_model_len)
    budget = prompt_budget(limit, cfg.rollout.max_new_tokens, cfg.data.max_prompt_length)
    agents = AgentRollout(cfg.rollout.agent, tokenizer, cfg.data.system_prompt)
    lens = [len(rollout_prompt_ids(tokenizer, p, cfg.data.system_prompt, agents)) for p in problems]
    dropped = set(overlong(lens, budget))
    return [p for i, p in enumerate(problems) if i not in dropped], len(dropped)


def training_source(
    cfg: RunConfig, model_dir: str, max_position_embeddings: int, tokenizer=None
) -> tuple[PromptSource, int]:
    """The prompts the run trains on and how many ``data.filter_overlong_prompts`` left out
    (the tokenizer is loaded from ``model_dir`` only when filtering needs it)."""
    source = prompt_source(cfg)
    if not (cfg.data.filter_overlong_prompts and isinstance(source, list)):
        return source, 0
    if tokenizer is None:
        from megarl.models.hf_io import load_hf_tokenizer

        tokenizer = load_hf_tokenizer(model_dir)
    return fitting_problems(cfg, source, tokenizer, max_position_embeddings)


def validation_problems(cfg: RunConfig) -> list[Problem]:
    """The held-out problems: ``data.val_files``, else the built-in arithmetic task's
    ``data.val_problems`` (start-up loads them once to check them)."""
    if not cfg.data.val_files:
        source = prompt_source(cfg)
        return source.validation_problems() if isinstance(source, ArithmeticTask) else []
    return load_problem_files(
        cfg.data.val_files or (),
        cfg.data.prompt_key,
        cfg.data.answer_key,
        cfg.data.instruction,
        cfg.data.reward_choice,
    )


def prompt_source(cfg: RunConfig) -> PromptSource:
    """The prompts the ``data.*`` keys name (start-up builds it once to check them)."""
    return build_prompt_source(
        cfg.data.task,
        cfg.data.path,
        cfg.trainer.seed,
        cfg.data.max_operand,
        cfg.data.instruction,
        ops=cfg.data.ops,
        train_files=cfg.data.train_files or (),
        prompt_key=cfg.data.prompt_key,
        answer_key=cfg.data.answer_key,
        reward=cfg.data.reward_choice,
        held_out=cfg.data.val_problems,
    )


class Console:
    """One readable line per step, and the run summary at the end; with ``trainer.progress`` a
    live bar above them with the step's phase and the run's ETA (:class:`LiveProgress`)."""

    def __init__(self, total_steps: int, enabled: bool = True, progress: bool | str = "auto"):
        self.enabled = enabled
        self._live: LiveProgress | None = None
        if enabled:
            from rich.console import Console as RichConsole

            tty = sys.stdout.isatty()
            self._rich = RichConsole(
                file=sys.stdout,
                highlight=False,
                width=None if tty else 140,
                force_terminal=True if progress is True else None,
            )
            if progress_enabled(progress, console_on=True, isatty=tty):
                self._live = LiveProgress(self._rich, total_steps)
                self._live.start()

    @property
    def shows_progress(self) -> bool:
        return self._live is not None

    def phase(self, phase: str, done: int, total: int | None = None, unit: str = "") -> None:
        """A :class:`~megarl.trainer.progress.PhaseHook` (only called with progress on)."""
        if self._live is not None:
            self._live.phase(phase, done, total, unit)

    def step(self, metrics: dict, samples) -> None:
        if not self.enabled:
            return
        self._rich.print(step_line(metrics))
        if samples:
            prompt, text, reward = samples[0]
            self._rich.print(
                f"         sample: {prompt!r} -> {text.strip()[:60]!r} (reward {reward:g})"
            )
        if self._live is not None:
            self._live.step_done(metrics["timing_s/step"])

    def validation(self, metrics: dict) -> None:
        if self.enabled:
            self._rich.print(validation_line(metrics))

    def startup(self, metrics: Mapping[str, float]) -> None:
        if self.enabled:
            self._rich.print(startup_line(metrics))

    def skip(self, steps: int) -> None:
        """Steps already done before a resume."""
        if self._live is not None and steps:
            self._live.skip(steps)

    def finish(self, history: Sequence[Mapping[str, Any]]) -> None:
        """The run summary: its headline, then one table per section."""
        if not self.enabled:
            return
        if self._live is not None:
            self._live.stop()
        summary = summarize(history)
        self._rich.print(f"\n[bold]Run summary[/bold]: {summary.headline}")
        for table in summary.tables:
            self._rich.print(table.rich())
