"""The GPU-cluster rollout engine: vLLM's offline ``LLM``, driven in-process.

Written against vLLM 0.33.0 (``vllm-0.33.0`` wheel source: ``vllm/entrypoints/llm.py``,
``vllm/sampling_params.py``, ``vllm/v1/sample/sampler.py``, ``vllm/v1/worker/gpu_worker.py``,
``vllm/model_executor/models/utils.py`` (``AutoWeightsLoader``), ``vllm/lora/``). vLLM is
CUDA-only and cannot be installed where this was written; ``tests/gpu/test_vllm_engine.py``
exercises it where it can be installed. Nothing here imports vLLM at module import time.

Choices, and why:

* **Logprobs.** The interface promises ``log_softmax(logits / T)[token]`` of the untruncated
  distribution. vLLM's ``logprobs_mode`` offers ``raw_logprobs`` (its default: before
  temperature, so wrong whenever T != 1) and ``processed_logprobs`` (after temperature *and*
  top-k/top-p, renormalised). We pick ``processed_logprobs``: with top-k off and top-p = 1 the
  truncation is the identity, so it is exactly our quantity, and for greedy requests vLLM
  returns ``log_softmax(logits)`` (T = 1), again our definition. With top-p < 1 no mode gives
  the untruncated value for the sampled token, so ``generate`` refuses top-p < 1 rather than
  report a different quantity that ``rollout/logprob_abs_diff`` would flag as a bug.
* **Seeds.** vLLM seeds each request separately; a GRPO group repeats one prompt, so giving
  every request ``params.seed`` would make the whole group identical. Request ``i`` gets
  ``request_seed(params.seed, i)``, a hash of both.
* **Weights.** Base weights go through ``collective_rpc`` to each worker's
  ``model.load_weights(iterable of (HF name, tensor))``, the per-parameter loaders that also
  load checkpoints: they fuse q/k/v and gate/up and shard for tensor parallelism, and accept
  any subset of the weights, so buckets of any size work. (vLLM's ``reload_weights`` wraps the
  same call in a layerwise reload that assumes every layer is complete within one call, and its
  NCCL/IPC weight-transfer API needs a trainer-side sender; neither fits a stream of buckets.)
  The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is set unless the
  caller set it) so, at tensor_parallel_size=1, the call and its tensors (even on the GPU) are
  handed to the worker directly; with more workers they are pickled to each worker process.
  Tied ``lm_head.weight`` is renamed to ``model.embed_tokens.weight`` because vLLM's loader
  skips the alias and raises unless the canonical name arrives in the same call. After an
  update the prefix cache is reset (its KV entries were computed with the old weights) and the
  workers' LoRA state too, as vLLM's own ``reload_weights`` does; the adapter stays registered
  and vLLM reloads it from its folder on the next request that uses it.
* **LoRA.** vLLM loads adapters from a PEFT directory, so the tensors are written to a private
  temporary directory (``adapter_model.safetensors`` + ``adapter_config.json``) and added with a
  fresh ``LoRARequest`` id; the previous adapter is removed.
* **Sleep.** vLLM level 1 offloads weights to host memory and discards the KV cache; level 2
  discards weights too. Residency is tracked honestly: after waking from level 2, the base
  weights count as resident only once every vLLM parameter has been loaded again (from the set
  of names ``load_weights`` reports; a fused parameter counts as loaded once any of its parts
  is), and the adapter (allocated in the same memory pool as the weights) must be reloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megarl.engines.base import (
    VLLM_MISSING_MESSAGE,
    EngineMemoryState,
    Generation,
    RolloutEngine,
    SamplingParams,
    SleepState,
    merge_token_ids,
)

if TYPE_CHECKING:
    from vllm import LLM

VLLM_VERSION_WRITTEN_AGAINST = "0.33.0"
LOGPROBS_MODE = "processed_logprobs"
TIED_LM_HEAD = "lm_head.weight"
EMBED_TOKENS = "model.embed_tokens.weight"
DEFAULT_BUCKET_BYTES = 512 * 1024**2


# --- pure helpers (tested on CPU) ------------------------------------------------------------


VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""Values vLLM's ``LoRAConfig.max_lora_rank`` accepts (its ``MaxLoRARanks`` literal)."""


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of ``rank``."""
    for allowed in VLLM_MAX_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest max_lora_rank "
                     f"{VLLM_MAX_LORA_RANKS[-1]}")


def request_seed(seed: int, index: int) -> int:
    """A distinct, reproducible 63-bit seed for request ``index`` of a call seeded ``seed``."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def sampled_token_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[Mapping[int, Any]] | None
) -> tuple[float, ...]:
    """The logprob of each sampled token from vLLM's per-position ``{token_id: Logprob}``.

    Works for both ``list[dict[int, Logprob]]`` and ``FlatLogprobs`` (which indexes the same
    way).
    """
    if logprobs is None:
        raise RuntimeError("vLLM returned no logprobs; requests must set logprobs=0")
    if len(logprobs) != len(token_ids):
        raise RuntimeError(f"vLLM returned {len(logprobs)} logprobs for {len(token_ids)} tokens")
    return tuple(
        float(position[token].logprob) for token, position in zip(token_ids, logprobs, strict=True)
    )


def canonical_weight_name(name: str, tied_embeddings: bool) -> str:
    """Rename a tied ``lm_head.weight`` to the embedding it aliases (what vLLM loads)."""
    return EMBED_TOKENS if tied_embeddings and name == TIED_LM_HEAD else name


def read_checkpoint_shapes(model_path: str) -> dict[str, tuple[int, ...]] | None:
    """HF parameter name -> shape, from a local checkpoint's safetensors headers.

    Only headers are read. Returns None when ``model_path`` is not a local folder of
    safetensors files (e.g. a hub id), in which case only vLLM's own checks apply. A tied
    ``lm_head.weight`` is added with the embedding's shape so that either name is accepted.
    """
    from safetensors import safe_open

    folder = Path(model_path)
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    if read_tie_word_embeddings(model_path) and EMBED_TOKENS in shapes:
        shapes.setdefault(TIED_LM_HEAD, shapes[EMBED_TOKENS])
    return shapes


def read_tie_word_embeddings(model_path: str) -> bool:
    """Whether the checkpoint's ``config.json`` ties input and output embeddings."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return False
    config = json.loads(config_file.read_text())
    text_config = config.get("text_config") or {}
    return bool(config.get("tie_word_embeddings", text_config.get("tie_word_embeddings", False)))


def check_weight(
    name: str, tensor: torch.Tensor, expected_shapes: Mapping[str, tuple[int, ...]] | None
) -> None:
    """ValueError naming ``name`` if it is unknown or mis-shaped (when shapes are known)."""
    if expected_shapes is None:
        return
    if name not in expected_shapes:
        raise ValueError(f"unknown parameter name {name!r} for the served model")
    if tuple(tensor.shape) != expected_shapes[name]:
        raise ValueError(
            f"parameter {name!r} has shape {expected_shapes[name]}, got {tuple(tensor.shape)}"
        )


def bucket_by_bytes(
    named_tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream into lists of at most ``max_bytes`` (a bigger tensor goes alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def write_peft_adapter(
    folder: Path,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    rank: int,
    alpha: float,
    target_modules: Sequence[str],
) -> int:
    """Write a PEFT LoRA adapter folder vLLM can load; return the number of tensors."""
    from safetensors.torch import save_file

    tensors = {name: t.detach().to("cpu").contiguous() for name, t in named_tensors}
    if not tensors:
        raise ValueError("LoRA adapter has no tensors")
    for name in tensors:
        if ".lora_A." not in name and ".lora_B." not in name:
            raise ValueError(f"LoRA tensor {name!r} is not a PEFT lora_A/lora_B weight name")
    folder.mkdir(parents=True, exist_ok=False)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(target_modules),
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "task_type": "CAUSAL_LM",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return len(tensors)


# --- worker-side functions (run inside each vLLM worker via collective_rpc) --------------------


def _worker_param_names(worker: Any) -> set[str]:
    """vLLM-side parameter names, LoRA wrappers unwrapped (as ``reload_weights`` counts them)."""
    model = worker.model_runner.get_model()
    return {name.replace(".base_layer.", ".") for name, _ in model.named_parameters()}


def _worker_load_weights(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
    """Load HF-named tensors with the model's own loaders; return vLLM names loaded."""
    model = worker.model_runner.get_model()
    loaded = model.load_weights(weights)
    reset_lora_state = getattr(worker.model_runner, "reset_lora_state", None)
    if reset_lora_state is not None:
        reset_lora_state()
    return set(loaded)


def _worker_copy_shards(worker: Any, shards_by_rank: Sequence[Sequence[tuple[str, Any]]]) -> set:
    """Copy this worker's own pre-sliced shards (vLLM names, its TP rank's layout) into place.

    The trainer computed each engine rank's slice (``megarl.export.target_layout``), so no
    weight loader slices again; a shape mismatch means the layouts disagree and is an error.
    """
    from vllm.distributed import get_tensor_model_parallel_rank

    params = dict(worker.model_runner.get_model().named_parameters())
    loaded = set()
    for name, tensor in shards_by_rank[get_tensor_model_parallel_rank()]:
        param = params.get(name)
        if param is None or tuple(param.shape) != tuple(tensor.shape):
            got = None if param is None else tuple(param.shape)
            raise ValueError(f"engine shard {name}: vLLM holds {got}, got {tuple(tensor.shape)}")
        param.data.copy_(tensor)
        loaded.add(name)
    return loaded


# --- the engine ------------------------------------------------------------------------------


class VLLMEngine(RolloutEngine):
    """Rollouts from vLLM's offline engine, with weights pushed from the trainer."""

    def __init__(
        self,
        model: str,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        dtype: str = "bfloat16",
        enable_sleep_mode: bool = True,
        enable_lora: bool = False,
        max_lora_rank: int = 16,
        seed: int = 0,
        eos_token_ids: Sequence[int] | None = None,
        max_model_len: int | None = None,
        weight_bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        **llm_kwargs: Any,
    ) -> None:
        """Start vLLM on ``model`` (a HF checkpoint folder or hub id) in this process.

        ``gpu_memory_utilization`` defaults to half the GPU because the trainer is colocated;
        ``enable_sleep_mode`` is needed for ``sleep``; ``enable_lora``/``max_lora_rank`` for
        ``load_lora_adapter``; ``seed`` is vLLM's global seed (each request is seeded from
        ``SamplingParams.seed`` anyway). ``eos_token_ids`` overrides tokenizer + config EOS
        (required with ``skip_tokenizer_init=True``). Other ``LLM``/``EngineArgs`` options
        (``enforce_eager``, ``skip_tokenizer_init``, ...) pass through ``llm_kwargs``.
        """
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            from vllm import LLM
        except ImportError as error:
            raise RuntimeError(VLLM_MISSING_MESSAGE) from error
        self._enable_sleep_mode = enable_sleep_mode
        self._enable_lora = enable_lora
        self._bucket_bytes = weight_bucket_bytes
        lora_kwargs = {"max_lora_rank": max_lora_rank, "max_loras": 1} if enable_lora else {}
        self._llm: LLM = LLM(
            model=model,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            dtype=dtype,
            enable_sleep_mode=enable_sleep_mode,
            enable_lora=enable_lora,
            seed=seed,
            max_model_len=max_model_len,
            logprobs_mode=LOGPROBS_MODE,
            **lora_kwargs,
            **llm_kwargs,
        )
        self._eos_token_ids = (
            merge_token_ids(eos_token_ids) if eos_token_ids else self._default_eos_ids()
        )
        text_config = self._llm.llm_engine.model_config.hf_text_config
        self._tied_embeddings = bool(getattr(text_config, "tie_word_embeddings", False))
        self._expected_shapes = read_checkpoint_shapes(model)
        self._all_param_names = set().union(*self._llm.collective_rpc(_worker_param_names))
        self._sleep = SleepState()
        self._lora_root = Path(tempfile.mkdtemp(prefix="megarl-vllm-lora-"))
        self._lora_request: Any = None
        self._next_lora_id = 1

    def _default_eos_ids(self) -> tuple[int, ...]:
        """Tokenizer EOS plus the model's generation-config EOS (vLLM stops on both too)."""
        tokenizer = self._llm.get_tokenizer()
        text_config = self._llm.llm_engine.model_config.hf_text_config
        ids = merge_token_ids(
            getattr(tokenizer, "eos_token_id", None), getattr(text_config, "eos_token_id", None)
        )
        if not ids:
            raise ValueError("no EOS token id known for this model: pass eos_token_ids")
        return ids

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @property
    def llm(self) -> LLM:
        """The underlying ``vllm.LLM``, for inspection and tests."""
        return self._llm

    # -- generate --

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Generation]:
        self._sleep.require_ready_to_generate()
        if params.top_p < 1.0:
            raise ValueError(
                "VLLMEngine needs top_p == 1: with top-p truncation vLLM can only report the "
                "renormalised truncated logprob, not log_softmax(logits / T) that the trainer "
                "compares against"
            )
        if not prompts:
            return []
        outputs = self._llm.generate(
            [{"prompt_token_ids": list(prompt)} for prompt in prompts],
            [self._vllm_sampling_params(params, index) for index in range(len(prompts))],
            use_tqdm=False,
            lora_request=self._lora_request,
        )
        return [
            self._to_generation(prompt, out) for prompt, out in zip(prompts, outputs, strict=True)
        ]

    def _vllm_sampling_params(self, params: SamplingParams, index: int) -> Any:
        from vllm import SamplingParams as VLLMSamplingParams

        return VLLMSamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=1.0,
            top_k=0,
            max_tokens=params.max_new_tokens,
            seed=request_seed(params.seed, index),
            logprobs=0,
            stop_token_ids=list(self._eos_token_ids),
            detokenize=False,
        )

    @staticmethod
    def _to_generation(prompt: Sequence[int], request_output: Any) -> Generation:
        completion = request_output.outputs[0]
        token_ids = tuple(completion.token_ids)
        return Generation(
            prompt_ids=tuple(prompt),
            response_ids=token_ids,
            response_logprobs=sampled_token_logprobs(token_ids, completion.logprobs),
            finished=completion.finish_reason == "stop",
        )

    # -- weights --

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        self._sleep.require_awake("update_weights")
        num_applied = 0
        for bucket in bucket_by_bytes(self._checked(named_tensors), self._bucket_bytes):
            loaded_per_worker = self._llm.collective_rpc(_worker_load_weights, args=(bucket,))
            self._sleep.mark_reloaded(set().union(*loaded_per_worker))
            num_applied += len(bucket)
        self._llm.reset_prefix_cache()
        return num_applied

    def update_weight_shards(
        self, shards_by_rank: Sequence[Sequence[tuple[str, torch.Tensor]]]
    ) -> int:
        """Load per-engine-rank shards under vLLM's fused names (``rollout.tp`` > 1 resharding).

        Not yet run against vLLM. ``collective_rpc`` hands every worker the whole list and each
        copies only its own entry: correct, but the transport still carries all ranks' shards;
        a per-rank channel (each trainer rank feeding its colocated engine rank) is the next step.
        """
        self._sleep.require_awake("update_weight_shards")
        loaded_per_worker = self._llm.collective_rpc(_worker_copy_shards, args=(shards_by_rank,))
        self._sleep.mark_reloaded(set().union(*loaded_per_worker))
        self._llm.reset_prefix_cache()
        return sum(len(s) for s in shards_by_rank)

    def _checked(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named_tensors:
            check_weight(name, tensor, self._expected_shapes)
            yield canonical_weight_name(name, self._tied_embeddings), tensor.detach()

    def load_lora_adapter(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        rank: int,
        alpha: float,
        target_modules: Sequence[str],
    ) -> None:
        from vllm.lora.request import LoRARequest

        self._sleep.require_awake("load_lora_adapter")
        if not self._enable_lora:
            raise RuntimeError("VLLMEngine was built with enable_lora=False")
        lora_id = self._next_lora_id
        self._next_lora_id += 1
        folder = self._lora_root / f"adapter-{lora_id}"
        write_peft_adapter(folder, named_tensors, rank, alpha, target_modules)
        request = LoRARequest(
            lora_name=f"megarl-{lora_id}", lora_int_id=lora_id, lora_path=str(folder)
        )
        self._forget_lora()
        self._llm.llm_engine.add_lora(request)
        self._lora_request = request

    def _forget_lora(self) -> None:
        """Remove the current adapter from vLLM (if still there) and from disk."""
        if self._lora_request is None:
            return
        self._llm.llm_engine.remove_lora(self._lora_request.lora_int_id)
        shutil.rmtree(self._lora_request.lora_path, ignore_errors=True)
        self._lora_request = None

    # -- memory --

    def sleep(self, level: int) -> None:
        if not self._enable_sleep_mode:
            raise RuntimeError("VLLMEngine was built with enable_sleep_mode=False")
        self._sleep.fall_asleep(level, freed=self._all_param_names)
        self._llm.sleep(level=level)

    def wake_up(self) -> EngineMemoryState:
        if not self._sleep.level:
            return self.memory_state()
        self._llm.wake_up()
        if self._sleep.wake() == 2:
            self._forget_lora()
        self._llm.reset_prefix_cache()
        return self.memory_state()

    def memory_state(self) -> EngineMemoryState:
        return EngineMemoryState(
            base_weights_resident=self._sleep.base_weights_resident,
            adapter_resident=self._sleep.level != 2 and self._lora_request is not None,
        )

    def close(self) -> None:
        """Delete the temporary adapter folders (the vLLM engine itself is left to GC)."""
        shutil.rmtree(self._lora_root, ignore_errors=True)

