"""The generation side of a run: the ``rollout`` section (the engine, its sampling, memory and
placement, ``rollout.val``'s sampling for validation; ``rollout.agent`` lives with the agent
loops), ``async_training`` (how generation overlaps training) and ``export`` (how the trained
weights reach the engine).

What an asynchronous mode needs from the other sections (split placement, an engine that never
sleeps, a rollout correction) is checked by :class:`megarl.config.schema.RunConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megarl.agent.loop import SINGLE_TURN_NAMES, AgentSettings
from megarl.config.checks import _choice, _optional_positive, _positive, _require
from megarl.engines.base import SLEEP_LEVELS
from megarl.engines.factory import ENGINE_NAMES
from megarl.planner.logprob_guard import AUTO

ROLLOUT_SLEEP_LEVELS: tuple[int, ...] = (0, *SLEEP_LEVELS)
"""``rollout.sleep_level``: 0 (the engine never sleeps) or a level the engines sleep at."""


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
    | vllm (GPU clusters) | megatron (Megatron-Core generates: colocated, the actor's own model,
    no second copy of the weights and no weight sync; with split placement or an asynchronous
    mode, a TP=PP=1 copy on the rollout side fed the trainer's weights in Megatron layout)."""
    n: int = 8
    """Group size: samples per prompt."""
    max_new_tokens: int = 16
    """The most tokens a response may have (a multi-turn trajectory: its generated and tool
    output tokens together)."""
    temperature: float = 1.0
    """Sampling temperature, > 0 (a group of greedy samples would all be the same)."""
    top_p: float = 1.0
    """Nucleus sampling, in (0, 1]."""
    batch_invariant: bool = False
    """True on-policy: the actor's forward runs batch-invariant
    (:mod:`megarl.distributed.batch_invariant`), so a token's logprob has the same bits from
    the Megatron engine's decode as from the trainer (``rollout/logprob_abs_diff`` 0.0, rollout
    correction weights 1). Needs ``rollout.engine=megatron``; costs forward speed
    (docs/algorithms.md)."""
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
    max_logprob_diff: float | str | None = AUTO
    """Stop the run when the engine's logprobs of a step's sampled tokens (or of the probe after
    an engine start or wake-up, ``sync/probe_logprob_diff``) differ from the trainer's by more
    than this on average (``rollout/logprob_abs_diff``): the engine did not sample with the
    trainer's weights. The step's update is not applied and nothing of it is written; exit 1.
    auto = by engine and dtype (:mod:`megarl.planner.logprob_guard`): 1e-3 in fp32 (the demo
    measured <= 8.9e-6 on both engines), 2e-1 in bf16 (measured <= 5.0e-2) | a number > 0 |
    null = off."""
    val: RolloutValConfig = field(default_factory=RolloutValConfig)
    agent: AgentSettings = field(default_factory=AgentSettings)
    """Multi-turn agent loops (:mod:`megarl.agent`): ``single_turn`` is the plain rollout."""
    # --- placement ---
    n_gpus: int = 0
    """0 = colocated (the engine shares rank 0's device) | N = split placement: the engine runs
    in its own Ray actor on N devices of its own (on CPU: its own process). Needs launcher=ray."""

    @property
    def engine_is_actor(self) -> bool:
        """The Megatron engine colocated: it generates with the actor's own model, so nothing
        is ever sent to it. Under split placement (every asynchronous mode too) it holds a copy
        on the rollout side, which the weight sync feeds like any engine's."""
        return self.engine == "megatron" and self.n_gpus == 0

    @property
    def takes_megatron_layout(self) -> bool:
        """The weight sync sends this engine whole Megatron parameters under Megatron names
        (the Megatron engine's rollout-side copy is a Megatron model); the other engines take
        HF names, fused q/k/v and gate/up split as HF stores them."""
        return self.engine == "megatron"

    def __post_init__(self) -> None:
        _choice("rollout.engine", self.engine, ENGINE_NAMES)
        _require(
            not self.batch_invariant or self.engine == "megatron",
            f"rollout.batch_invariant=true needs rollout.engine=megatron "
            f"(engine={self.engine}): only the actor's own model can give the trainer's bits",
        )
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
        _require(
            self.max_logprob_diff in (None, AUTO)
            or (
                isinstance(self.max_logprob_diff, int | float)
                and not isinstance(self.max_logprob_diff, bool)
                and self.max_logprob_diff > 0
            ),
            f"rollout.max_logprob_diff={self.max_logprob_diff!r}: must be a number > 0, auto "
            "(by engine and dtype) or null (off)",
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
