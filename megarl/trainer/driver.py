"""Rank-0 duties of the embedded run: rollout engine, data, metrics, console.

Kept apart from the Megatron step loop so the same pieces can live in a Ray rollout worker
and a Ray driver later.
"""

from __future__ import annotations

import sys
from pathlib import Path

from megarl.config.schema import RunConfig
from megarl.data.loader import PromptStream, build_prompt_source
from megarl.data.rewards import get_reward_fn
from megarl.engines.hf import HFEngine
from megarl.trainer.metrics import MetricsWriter, PhaseTimer, run_summary, safe_div, step_line
from megarl.trainer.rollout import RolloutProducer, RolloutSettings


class Driver:
    def __init__(self, cfg: RunConfig, model_dir: str, device: str, tokenizer):
        self.cfg = cfg
        self.engine = _build_engine(cfg, tokenizer, device, model_dir)
        source = build_prompt_source(cfg.data.task, cfg.data.path, cfg.trainer.seed,
                                     cfg.data.max_operand, cfg.data.instruction, ops=cfg.data.ops)
        self.stream = PromptStream(source, cfg.data.prompts_per_step, cfg.trainer.seed)
        settings = RolloutSettings(
            group_size=cfg.rollout.n, max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
            adv_estimator=cfg.algo.adv_estimator, system_prompt=cfg.data.system_prompt)
        self.producer = RolloutProducer(self.engine, tokenizer, self.stream,
                                        get_reward_fn(cfg.data.reward_fn_name), settings,
                                        cfg.trainer.seed)
        self.writer = MetricsWriter(Path(cfg.trainer.run_dir), cfg.trainer.tensorboard)
        self.history: list[dict] = []
        self._export_metrics: dict[str, float] = {}
        self.console = Console(cfg.trainer.total_steps, enabled=cfg.trainer.log_console)

    def rollout(self, step: int):
        return self.producer.produce(step)

    def update_engine_weights(self, export_metrics: dict[str, float]) -> None:
        """The worker streamed the weights into ``self.engine``; keep its metrics for the step."""
        self._export_metrics = dict(export_metrics)

    def record_step(self, step, timer: PhaseTimer, rollout_metrics, plan, gates, stats, batch):
        metrics: dict = {"step": step}
        metrics.update(rollout_metrics)
        metrics.update(_actor_metrics(stats))
        metrics.update(plan.metrics)
        metrics["planner/summary"] = plan.summary()
        metrics.update(gates.metrics())
        metrics["gates/summary"] = gates.summary()
        metrics.update(self._export_metrics)
        metrics.update(timer.times)
        metrics["timing_s/step"] = timer.total()
        total_tokens = sum(batch.seq_lens)
        metrics["perf/total_num_tokens"] = total_tokens
        metrics["perf/throughput"] = total_tokens / max(metrics["timing_s/step"], 1e-9)
        self.writer.write(metrics)
        self.history.append(metrics)
        self.console.step(metrics, self.producer.last_samples)

    def close(self) -> None:
        self.console.finish(self.history)
        self.writer.close()


def _build_engine(cfg: RunConfig, tokenizer, device: str, model_dir: str):
    if cfg.rollout.engine == "vllm":
        from megarl.engines.base import build_engine

        return build_engine("vllm", model=model_dir, seed=cfg.trainer.seed)
    from megarl.models.hf_io import load_hf_model

    model, _ = load_hf_model(model_dir, device=device)
    return HFEngine(model, tokenizer, device=device)


def _actor_metrics(stats: dict[str, float]) -> dict[str, float]:
    tokens = stats.get("num_tokens", 0.0)
    return {
        "actor/pg_loss": stats.get("pg_loss", 0.0),
        "actor/kl_loss": stats.get("kl_loss", 0.0),
        "actor/entropy": safe_div(stats.get("entropy_sum", 0.0),
                                  stats.get("response_tokens", 0.0)),
        "actor/pg_clipfrac": safe_div(stats.get("clipfrac_sum", 0.0), tokens),
        "actor/ppo_kl": safe_div(stats.get("ppo_kl_sum", 0.0), tokens),
        "actor/grad_norm": stats.get("grad_norm", 0.0),
        "actor/num_optimizer_steps": stats.get("num_optimizer_steps", 0),
        "rollout/logprob_abs_diff": safe_div(stats.get("lp_diff_sum", 0.0),
                                             stats.get("lp_diff_count", 0.0)),
    }


class Console:
    """A rich progress bar plus one readable line per step, and the run summary at the end."""

    def __init__(self, total_steps: int, enabled: bool = True):
        self.enabled = enabled
        self._progress = None
        if enabled:
            from rich.console import Console as RichConsole
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self._rich = RichConsole(file=sys.stdout, highlight=False,
                                     width=None if sys.stdout.isatty() else 140)
            self._progress = Progress(TextColumn("[bold]GRPO"), BarColumn(),
                                      TextColumn("{task.completed}/{task.total} steps"),
                                      TimeRemainingColumn(), console=self._rich, transient=True)
            self._task = self._progress.add_task("train", total=total_steps)
            self._progress.start()

    def step(self, metrics: dict, samples) -> None:
        if not self.enabled:
            return
        self._progress.console.print(step_line(metrics))
        if samples:
            prompt, text, reward = samples[0]
            self._progress.console.print(
                f"         sample: {prompt!r} -> {text.strip()[:60]!r} (reward {reward:g})")
        self._progress.advance(self._task)

    def finish(self, history: list[dict]) -> None:
        if not self.enabled:
            return
        self._progress.stop()
        self._rich.print("\n[bold]Run summary[/bold]\n" + run_summary(history))
