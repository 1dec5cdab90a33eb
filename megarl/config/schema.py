"""Typed, frozen run configuration, built from the Hydra/OmegaConf tree and validated up front.

:class:`RunConfig` is the whole tree: one field per section, each section a dataclass that
checks its own keys, kept with the sections of the same concept in a module of its own
(:mod:`megarl.config.trainer`, :mod:`~megarl.config.actor`, :mod:`~megarl.config.rollout`,
:mod:`~megarl.config.data`, :mod:`~megarl.config.model`, :mod:`~megarl.config.algorithm`,
:mod:`~megarl.config.critic`, :mod:`~megarl.config.planner`; ``rollout.agent`` lives with the
agent loops; the shared checks are :mod:`~megarl.config.checks`'s). This module holds
what no one section can decide: the checks across sections (:meth:`RunConfig.__post_init__`),
and the conversion of a plain tree into the dataclasses (:func:`build_run_config`), which
refuses unknown keys and wrong types and makes every number-typed key of every section finite
(:func:`_refuse_non_finite`, one rule for all of them). Code outside ``megarl/config/`` takes
:class:`RunConfig`, :func:`build_run_config` and :class:`ConfigError` from here, and a
section's class or choice list from the section's module.

Pure code: no megatron, torch.distributed, ray or hydra imports. Every check raises
:class:`ConfigError` with one line that names the key (``actor.tp``) and what is wrong, so the
CLI can print it and exit 2 before any process or model is started. A key that names a choice
(an engine, an estimator, a loss aggregation, a gate mode) is validated against the list kept
by the code that implements the choices, never a copy of it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from megarl.agent.loop import GATEWAY_NAMES
from megarl.algo.advantages import GROUP_ESTIMATORS
from megarl.algo.policy_losses import COVARIANCE_LOSSES
from megarl.algo.router_replay import router_replay_problem
from megarl.config.actor import ActorConfig
from megarl.config.algorithm import AlgoConfig
from megarl.config.checks import ConfigError, _require
from megarl.config.critic import CriticConfig
from megarl.config.data import DataConfig, RewardConfig
from megarl.config.model import ModelConfig
from megarl.config.planner import PlannerConfig
from megarl.config.rollout import AsyncTrainingConfig, ExportConfig, RolloutConfig
from megarl.config.trainer import TrainerConfig


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
            self.rollout.n >= 2 or self.algo.estimator not in GROUP_ESTIMATORS or self.algo.is_sft,
            f"rollout.n={self.rollout.n}: algo.adv_estimator={self.algo.adv_estimator} compares "
            "the samples of a prompt's group and needs at least 2 per prompt (one sample per "
            "prompt suits gae or reinforce_plus_plus)",
        )
        self._check_megatron_engine()
        self._check_async_training()
        self._check_agent_loops()
        self._check_sft()
        self._check_distill()
        self._check_covariance_loss()
        num_seqs = self.num_seqs_per_step
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

    def _check_megatron_engine(self) -> None:
        """``rollout.engine=megatron``. Colocated it generates with the actor's own model, in
        the actor's processes and layout, between two updates: one model chunk per rank, and
        the bitwise logprobs on a stage that records the responses. On the rollout side (split
        placement, every asynchronous mode) it is a copy at TP=PP=1 in a process of its own:
        one device, and no bitwise promise, since its sums run in another layout than the
        trainer's."""
        if self.rollout.engine != "megatron" or self.algo.is_sft:
            return
        key = "rollout.engine=megatron"
        if not self.rollout.engine_is_actor:
            _require(
                self.rollout.tp == 1,
                f"{key} on the rollout side (rollout.n_gpus={self.rollout.n_gpus}) runs its "
                f"copy at TP=1: rollout.tp={self.rollout.tp} is vLLM's; set rollout.tp=1",
            )
            _require(
                not self.rollout.batch_invariant,
                f"rollout.batch_invariant=true with rollout.n_gpus={self.rollout.n_gpus}: the "
                "rollout side's copy (TP=PP=1, its own process) cannot give the trainer's bits; "
                "set rollout.n_gpus=0 (colocated sync training) or batch_invariant=false",
            )
            return
        _require(
            self.actor.vpp == 1,
            f"{key} colocated runs one model chunk per rank: actor.vpp={self.actor.vpp} "
            "interleaves several; set actor.vpp=1 (or rollout.n_gpus > 0 for a rollout-side "
            "copy)",
        )
        _require(
            not self.rollout.batch_invariant or self.actor.pp == 1,
            f"rollout.batch_invariant=true with actor.pp={self.actor.pp}: the bitwise logprobs "
            "are taken on the last pipeline stage, which does not record the responses; set "
            "actor.pp=1",
        )

    def _check_sft(self) -> None:
        """``algo.objective=sft``: a dataset's assistant turns, the NLL loss, no rollout."""
        if not self.algo.is_sft:
            return
        key = "algo.objective=sft"
        _require(
            self.data.task == "files",
            f"{key} trains on a dataset's conversations: set data.train_files",
        )
        _require(
            self.actor.policy_loss == "sft",
            f"{key} needs actor.policy_loss=sft (the NLL of the assistant tokens), got "
            f"{self.actor.policy_loss}; recipe=sft sets both",
        )
        _require(
            not self.algo.uses_critic and not self.algo.use_kl_in_reward,
            f"{key} has no rewards: algo.adv_estimator=gae and algo.use_kl_in_reward do not apply",
        )
        _require(self.actor.kl_coef == 0, f"{key} with actor.kl_coef={self.actor.kl_coef}: set 0")
        _require(
            not self.async_training.is_async and self.rollout.n_gpus == 0,
            f"{key} has no rollout: async_training.mode=sync and rollout.n_gpus=0",
        )
        _require(
            self.rollout.temperature == 1.0,
            f"{key} scores tokens at temperature 1: set rollout.temperature=1.0",
        )

    def _check_distill(self) -> None:
        """``algo.distill.teacher_path``: the distillation advantages replace the estimator's
        per token, before the plan; what else would rewrite them is refused by name."""
        if not self.algo.distill.enabled:
            return
        key = "algo.distill.teacher_path"
        _require(not self.algo.is_sft, f"{key} distils on the student's samples: not with sft")
        _require(
            not self.algo.uses_critic,
            f"{key} gives per-token advantages itself: not with algo.adv_estimator=gae",
        )
        _require(
            not self.algo.use_kl_in_reward,
            f"{key} with algo.use_kl_in_reward=true: the teacher's KL is the reward already; "
            "use actor.kl_coef for a reference KL",
        )
        _require(
            self.planner.old_log_prob != "never",
            f"{key} needs the student's logprobs of every sequence before the advantages: "
            "planner.old_log_prob=never cannot give them; use auto",
        )

    def _check_covariance_loss(self) -> None:
        """clip_cov / kl_cov rank tokens by the covariance of log-prob and the sequence's
        advantage, fitted over the whole batch before the plan: per-token advantages made
        later (a critic's, a teacher's) are not what it ranks."""
        if self.actor.policy_loss not in COVARIANCE_LOSSES:
            return
        key = f"actor.policy_loss={self.actor.policy_loss}"
        _require(
            not self.algo.uses_critic and not self.algo.distill.enabled,
            f"{key} selects tokens by the covariance of log-prob and each sequence's advantage: "
            "not with per-token advantages (algo.adv_estimator=gae, algo.distill)",
        )

    def _check_agent_loops(self) -> None:
        """What multi-turn trajectories do not combine with yet, refused by name."""
        if not self.rollout.multi_turn:
            return
        key = f"rollout.agent.loop={self.rollout.agent.loop}"
        _require(
            self.actor.router_replay.mode != "R3",
            f"{key} with actor.router_replay.mode=R3: trajectories carry no engine routing of "
            "their input positions; use R2 or no replay",
        )
        if self.rollout.agent.loop in GATEWAY_NAMES:
            mini_batches = max(self.actor.ppo_mini_batches, self.critic_ppo_mini_batches)
            _require(
                mini_batches == 1,
                f"{key} with {mini_batches} PPO mini-batches: a session may become several "
                "sequences (its branches), so a step's sequence count varies and cannot be split "
                "into equal mini-batches; set actor.ppo_mini_batches=1 (critic.ppo_mini_batches too)",
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
        """Sequences of a step's batch: ``rollout.n`` per prompt, one per conversation in SFT."""
        if self.algo.is_sft:
            return self.data.prompts_per_step
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

NAME_OR_LIST = ("data.reward",)
"""Keys that take a name or a list of mappings (checked by their section)."""

AUTO_OR_NUMBER = ("rollout.max_logprob_diff",)
"""Keys that take ``auto``, a number or null (checked by their section)."""


def _null_allowed(fld: dataclasses.Field, value: Any) -> bool:
    """``value`` is null and the key's type admits null (``str | None`` with a string default)."""
    return value is None and "None" in str(fld.type)


def _convert_leaf(fld: dataclasses.Field, key: str, value: Any) -> Any:
    default = fld.default if fld.default is not dataclasses.MISSING else None
    if key in (*AUTO_OR_BOOL, *NAME_OR_LIST, *AUTO_OR_NUMBER) or _null_allowed(fld, value):
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
