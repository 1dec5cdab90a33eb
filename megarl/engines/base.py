"""The rollout-engine interface: what the trainer needs from whatever samples responses.

The trainer talks to a rollout engine through five verbs only: generate token ids (with the
per-token log-probabilities it sampled them with), receive new weights as a stream of
HF-named tensors, load a LoRA adapter, and release / re-acquire memory so that training and
rollout can share one accelerator. Everything engine specific (KV caches, vLLM's allocator,
PEFT layers) stays behind this line.

Two definitions here are contracts the trainer relies on:

* ``Generation.response_logprobs`` is ``log_softmax(logits / temperature)[token]`` of the
  *untruncated* distribution (top-p changes which tokens may be drawn, not the reported
  value). The trainer recomputes exactly this from its own forward pass and logs the mean
  absolute difference as ``rollout/logprob_abs_diff``; a mismatch in definition would show up
  there as a bug, so engines must not "helpfully" report a different quantity. Greedy
  decoding (``temperature == 0``) reports ``log_softmax(logits)``, i.e. temperature 1.
* A :class:`Request` carries its own seed. The engines derive every random draw of a
  response from that seed (the HF engine: token ``j`` from ``(seed, j)`` alone), so what a
  request samples does not depend on which other requests share its call; an interrupted
  request resumed with its tokens so far (``Request.generated_ids``) continues the same
  stream on the HF engine, and a seeded new one on vLLM (see :func:`token_seed`).
* ``EngineMemoryState.base_weights_resident`` is False exactly when the engine no longer
  holds valid base weights (after a sleep that discarded them) and the trainer must resend
  them with ``update_weights`` before the next ``generate``.

This module imports no engine library and no engine: the engines import it, and
:mod:`megarl.engines.factory` builds one by its config name.
"""

from __future__ import annotations

import abc
import hashlib
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import threading

    import torch

_MAX_SEED = 2**63 - 1


def request_seed(seed: int, index: int) -> int:
    """A distinct, reproducible 63-bit seed for request ``index`` of a call seeded ``seed``."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MAX_SEED


def token_seed(seed: int, position: int) -> int:
    """The seed of the draw of response token ``position`` of a request seeded ``seed``.

    A function of the two numbers alone, so a response sampled in one call, in a batch of
    any composition, or in several calls (interrupted, then resumed from its tokens so far)
    draws the same random numbers at every position."""
    digest = hashlib.blake2b(f"{seed}:token:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MAX_SEED


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one batch of responses."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax) decoding."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]: sample only from the smallest set of tokens whose probability
    reaches top_p. Affects which token is drawn, never the reported logprob."""
    max_new_tokens: int = 32
    """Upper bound on response length, EOS included."""
    seed: int = 0
    """:meth:`RolloutEngine.generate` seeds prompt ``i`` ``request_seed(seed, i)`` from it, so a
    rollout is reproducible from (weights, prompts, seed) whatever else the process did with
    torch's global RNG (e.g. training); :meth:`RolloutEngine.generate_requests` ignores it (each
    request brings its own)."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.seed <= _MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        """Whether this call decodes by argmax (temperature 0)."""
        return self.temperature == 0


@dataclass(frozen=True)
class Request:
    """One response to sample (or to go on sampling): what :meth:`RolloutEngine.generate_requests`
    takes."""

    prompt_ids: tuple[int, ...]
    seed: int
    """This response's own sampling stream (see :func:`token_seed`)."""
    generated_ids: tuple[int, ...] = ()
    """Tokens an earlier, interrupted call already sampled for this response: context for the
    next token, not output, and counted against ``max_new_tokens``. Empty for a new request."""
    max_new_tokens: int | None = None
    """This response's own limit (tokens of earlier calls included), where the requests of one
    call differ (an agent's turns, each with the room its trajectory has left); None: the
    call's ``SamplingParams.max_new_tokens``. A request's first ``k`` tokens do not depend on
    its limit (each token has its own seed), so a limit only says where it stops."""

    def __post_init__(self) -> None:
        if not 0 <= self.seed <= _MAX_SEED:
            raise ValueError(f"request seed must be in [0, 2**63), got {self.seed}")
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise ValueError(f"request max_new_tokens must be >= 0, got {self.max_new_tokens}")

    @property
    def context_ids(self) -> tuple[int, ...]:
        """What the model reads before the next token: the prompt, then the tokens so far."""
        return tuple(self.prompt_ids) + tuple(self.generated_ids)

    def budget(self, params: SamplingParams) -> int:
        """New tokens this request may still sample in a call under ``params`` (>= 0): its own
        limit, else the call's, less what it already sampled."""
        limit = params.max_new_tokens if self.max_new_tokens is None else self.max_new_tokens
        return max(0, limit - len(self.generated_ids))


@dataclass(frozen=True)
class Generation:
    """One sampled response and what the trainer needs to score it.

    From :meth:`RolloutEngine.generate_requests`, a resumed request's generation holds only
    the tokens that call sampled (its ``prompt_ids`` are the request's own prompt); the caller
    joins the pieces."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    """Sampled tokens; ends with the EOS token when the response stopped on EOS."""
    response_logprobs: tuple[float, ...]
    """``log_softmax(logits / temperature)[token]`` per response token, before any top-p
    truncation (temperature 1 when greedy)."""
    finished: bool
    """True when the response stopped on EOS, False when it hit ``max_new_tokens`` or was
    interrupted."""
    routed_experts: torch.Tensor | None = None
    """Mixture-of-experts models, engines that expose routing: ``[R, layers, top_k]`` ids of
    the experts each layer's router picked in the forward that produced each response token's
    logprob (:mod:`megarl.algo.routing_mismatch`); None otherwise."""
    prompt_routed_experts: torch.Tensor | None = None
    """With ``routed_experts``: ``[P - 1, layers, top_k]`` ids of the prompt positions before
    the last (the prefill's), which with ``routed_experts`` make the routing of every input
    position that router replay (R3) needs (:mod:`megarl.algo.router_replay`). None for a
    resumed request (its prompt routing came with its first piece)."""
    interrupted: bool = False
    """The call was interrupted (``generate_requests``' ``interrupt``) before this response
    ended: resume it with a :class:`Request` whose ``generated_ids`` hold its tokens so far."""
    response_mask: tuple[int, ...] | None = None
    """A multi-turn trajectory (:mod:`megarl.agent`) as one generation: 1 on each response token
    the model generated, 0 on observation tokens (logprob 0.0, never trained). None from an
    engine: every response token was generated."""

    def __post_init__(self) -> None:
        if len(self.response_ids) != len(self.response_logprobs):
            raise ValueError(
                f"{len(self.response_ids)} response tokens but "
                f"{len(self.response_logprobs)} logprobs"
            )
        if self.routed_experts is not None and len(self.routed_experts) != len(self.response_ids):
            raise ValueError(
                f"{len(self.response_ids)} response tokens but routing of "
                f"{len(self.routed_experts)}"
            )
        if self.response_mask is not None and len(self.response_mask) != len(self.response_ids):
            raise ValueError(
                f"{len(self.response_ids)} response tokens but a mask of {len(self.response_mask)}"
            )
        prompt_routed = self.prompt_routed_experts
        if prompt_routed is not None and len(prompt_routed) != len(self.prompt_ids) - 1:
            raise ValueError(
                f"{len(self.prompt_ids)} prompt tokens but prompt routing of {len(prompt_routed)}"
            )


def join_pieces(pieces: Sequence[Generation]) -> Generation:
    """One response sampled in several calls (interrupted, then resumed from its tokens so far)
    as one generation: the first piece's prompt and prompt routing, every piece's tokens,
    logprobs, routing and mask in order, the last piece's end."""
    if not pieces:
        raise ValueError("no pieces to join")
    first, last = pieces[0], pieces[-1]
    routed = [p.routed_experts for p in pieces]
    joined_routing = None
    if all(r is not None for r in routed):
        import torch

        joined_routing = torch.cat(routed)  # type: ignore[arg-type]
    masked = any(p.response_mask is not None for p in pieces)
    return Generation(
        prompt_ids=tuple(first.prompt_ids),
        response_ids=tuple(t for p in pieces for t in p.response_ids),
        response_logprobs=tuple(lp for p in pieces for lp in p.response_logprobs),
        finished=last.finished,
        routed_experts=joined_routing,
        prompt_routed_experts=first.prompt_routed_experts,
        interrupted=last.interrupted,
        response_mask=(
            tuple(m for p in pieces for m in p.response_mask or [1] * len(p.response_ids))
            if masked
            else None
        ),
    )


class NonFiniteLogitsError(RuntimeError):
    """The model gave inf or NaN logits: no token can be drawn (its weights diverged)."""


@dataclass(frozen=True)
class EngineMemoryState:
    """What survived the last sleep, so the trainer knows what it must resend."""

    base_weights_resident: bool
    """False after a sleep that freed the weights, until all base weights were resent."""
    adapter_resident: bool
    """True when a LoRA adapter is loaded and will be applied by ``generate``."""


@dataclass(frozen=True)
class LoraAdapter:
    """One LoRA adapter as the trainer sends it to a rollout engine: its tensors and the
    layout they were trained with, which always travel together (an engine needs all four to
    build or check its LoRA layers)."""

    named_tensors: Mapping[str, torch.Tensor]
    """PEFT-named tensors (``get_peft_model_state_dict``), e.g.
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``."""
    rank: int
    """LoRA rank ``r``: the inner dimension of every ``lora_A`` / ``lora_B`` pair."""
    alpha: float
    """LoRA alpha; the adapter's output is scaled by ``alpha / rank``."""
    target_modules: tuple[str, ...]
    """The HF module names the adapter wraps (PEFT's ``target_modules``), e.g. ``q_proj``."""

    @property
    def layout(self) -> tuple[int, float, tuple[str, ...]]:
        """``(rank, alpha, target_modules)``: equal layouts share LoRA layers, so an engine
        that holds one can copy new values in place instead of rebuilding them."""
        return (self.rank, float(self.alpha), tuple(self.target_modules))


@dataclass(frozen=True)
class GenerateCall:
    """One :meth:`RolloutEngine.generate_requests` call past the checks every engine makes (the
    engine ready, at least one request, each one valid): what an engine's own sampling gets."""

    requests: tuple[Request, ...]
    params: SamplingParams
    interrupt: threading.Event | None = None
    """Set by the caller to end the call between two tokens; None: the call runs to the end."""

    @property
    def interrupted(self) -> bool:
        """Whether the caller has asked the call to end (never, without an event)."""
        return self.interrupt is not None and self.interrupt.is_set()


class RolloutEngine(abc.ABC):
    """A sampler the trainer can feed weights to and put to sleep between rollouts.

    :meth:`generate_requests` is the same for every engine: it refuses a call the engine cannot
    serve now (asleep, base weights freed and not resent, :meth:`_check_can_generate`), answers
    an empty one with an empty list, refuses a request no decode loop can continue
    (:func:`validate_requests`), and hands the rest to the engine's own :meth:`_generate`."""

    def __init__(self) -> None:
        self._sleep = SleepState()
        """What the engine's sleeps left (its :meth:`sleep` and :meth:`wake_up` record them here);
        :meth:`generate_requests` refuses while it is asleep or its freed base weights have not
        all been resent."""

    @property
    @abc.abstractmethod
    def eos_token_ids(self) -> tuple[int, ...]:
        """Token ids that end a response (all of them stop generation)."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Token ids the model embeds: a request holding an id outside ``[0, vocab_size)`` is
        refused."""

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Generation]:
        """Sample one response per prompt, in prompt order; prompt ``i`` is seeded
        ``request_seed(params.seed, i)``.

        A GRPO group is expressed by repeating a prompt; each copy gets its own sample.
        Raises RuntimeError when the engine is asleep or its base weights were freed.
        """
        requests = [
            Request(tuple(prompt), request_seed(params.seed, index))
            for index, prompt in enumerate(prompts)
        ]
        return self.generate_requests(requests, params)

    def generate_requests(
        self,
        requests: Sequence[Request],
        params: SamplingParams,
        interrupt: threading.Event | None = None,
    ) -> list[Generation]:
        """Sample (or go on sampling) one response per request, in request order.

        ``params.seed`` is unused: each request brings its own. A request with
        ``generated_ids`` continues from them and may sample ``params.max_new_tokens`` minus
        their number (a request with no budget left is refused). Once ``interrupt`` is set the
        call returns soon (between two tokens): every response that has not ended comes back
        with ``interrupted=True`` and the tokens sampled so far -- at least one: every engine
        samples a first token per request before it looks at ``interrupt``, so a response
        advances however early its calls are interrupted -- ready to be resumed (after a weight
        update, by the asynchronous rollout). Raises RuntimeError when the engine is asleep or
        its base weights were freed.
        """
        self.wait_until_started()
        self._sleep.require_ready_to_generate()
        self._check_can_generate(params)
        if not requests:
            return []
        validate_requests(requests, params, self.eos_token_ids, self.vocab_size)
        return self._generate(GenerateCall(tuple(requests), params, interrupt))

    def _check_can_generate(self, params: SamplingParams) -> None:
        """Refuse a call this engine cannot serve now beyond what every engine checks:
        RuntimeError for its state, ValueError for ``params``. Nothing by default."""
        return

    @abc.abstractmethod
    def _generate(self, call: GenerateCall) -> list[Generation]:
        """The engine's own sampling of a checked call: one generation per request, in order,
        as :meth:`generate_requests` promises."""

    def scale_weight(self, name: str, factor: float) -> None:
        """Multiply the engine's copy of the HF-named weight ``name`` by ``factor`` in place,
        behind the trainer's back: the fault a sync that wrote wrong bits leaves (the test hook
        ``MEGARL_FAULT_AT=<rank>:<step>:rollout:corrupt-engine``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot scale a weight")

    @abc.abstractmethod
    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], record_checksums: bool = False
    ) -> int:
        """Copy base weights in by HF parameter name; return how many tensors were applied.

        Names are those of the HF model's ``state_dict()`` (e.g.
        ``model.layers.0.self_attn.q_proj.weight``); ``lm_head.weight`` is accepted for tied
        embeddings. An unknown name or a shape mismatch raises ValueError naming it. Any subset
        of the weights may be sent, in any number of calls. With ``record_checksums`` the
        engine keeps a checksum of what it loaded for :meth:`weight_checksums`.
        """

    @abc.abstractmethod
    def weight_checksums(self, dtype: torch.dtype) -> Mapping[str, tuple[int, int]]:
        """HF name -> ``megarl.export.checksum.tensor_checksum`` of the base weight the engine
        holds, read as ``dtype`` (the dtype the trainer sent), for the last weights loaded
        with ``record_checksums=True``. Proves the engine serves the bits the trainer sent."""

    @property
    def max_sleep_level(self) -> int:
        """The deepest :meth:`sleep` level this engine supports (0: it cannot sleep)."""
        return 2

    def wait_until_started(self) -> None:
        """Return once the engine can serve; raise if it could not start. An engine that starts
        in the background (vLLM's processes, while the trainer builds its models) waits here;
        one that was ready when built returns at once."""
        return

    @abc.abstractmethod
    def load_lora_adapter(self, adapter: LoraAdapter) -> None:
        """Replace the current LoRA adapter (if any) with this one."""

    @abc.abstractmethod
    def sleep(self, level: int) -> None:
        """Release memory for training.

        Level 1 frees what can be rebuilt (KV cache) and keeps the weights (possibly moved
        off the accelerator); level 2 also discards the weights and the adapter.
        """

    @abc.abstractmethod
    def wake_up(self) -> EngineMemoryState:
        """Re-acquire memory after ``sleep`` and report what must be resent."""

    @abc.abstractmethod
    def memory_state(self) -> EngineMemoryState:
        """What is resident now."""


def merge_token_ids(*sources: int | Sequence[int] | None) -> tuple[int, ...]:
    """Union of token ids from several sources (an id, a list of ids, or None), in order.

    EOS ids come from the tokenizer and the generation config, which may disagree (chat
    models end a turn with ``<|im_end|>`` rather than the pretraining EOS); stopping on any
    of them is what ``transformers`` and vLLM do.
    """
    ids: list[int] = []
    for source in sources:
        if source is None:
            continue
        ids.extend([source] if isinstance(source, int) else (int(i) for i in source))
    return tuple(dict.fromkeys(ids))


def default_eos_token_ids(tokenizer: object, config: object) -> tuple[int, ...]:
    """The EOS ids an engine stops on when none are given: the tokenizer's plus the model
    config's (its generation config, or vLLM's text config), as ``transformers`` and vLLM stop
    on both."""
    ids = merge_token_ids(
        getattr(tokenizer, "eos_token_id", None), getattr(config, "eos_token_id", None)
    )
    if not ids:
        raise ValueError("no EOS token id known: pass eos_token_ids or a tokenizer that has one")
    return ids


def validate_requests(
    requests: Sequence[Request],
    params: SamplingParams,
    eos_token_ids: Iterable[int],
    vocab_size: int,
) -> None:
    """Refuse what a decode loop cannot continue: an empty prompt, ids the embedding does not
    have, a response that already ended (no budget left, or EOS among its tokens)."""
    eos = set(eos_token_ids)
    for index, request in enumerate(requests):
        if len(request.prompt_ids) == 0:
            raise ValueError(f"request {index} has an empty prompt")
        context = request.context_ids
        if min(context) < 0 or max(context) >= vocab_size:
            raise ValueError(f"request {index} has token ids outside [0, {vocab_size})")
        if request.budget(params) == 0:
            raise ValueError(
                f"request {index} has no budget left: {len(request.generated_ids)} tokens "
                f"generated, max_new_tokens={params.max_new_tokens}"
            )
        if any(token in eos for token in request.generated_ids):
            raise ValueError(f"request {index} already ended: EOS among its generated_ids")


SLEEP_LEVELS: tuple[int, ...] = (1, 2)
"""The levels :meth:`RolloutEngine.sleep` accepts (1: free the KV cache; 2: the weights too).
``rollout.sleep_level`` may also be 0: the engine never sleeps."""


def validate_sleep_level(level: int) -> None:
    """Reject sleep levels :meth:`RolloutEngine.sleep` does not know (shared by all engines)."""
    if level not in SLEEP_LEVELS:
        levels = " or ".join(str(n) for n in SLEEP_LEVELS)
        raise ValueError(f"sleep level must be {levels}, got {level}")


class SleepState:
    """Sleep/wake bookkeeping every engine shares.

    It records the level an engine sleeps at and which base parameters a level-2 sleep freed
    and have not been resent since. ``base_weights_resident`` is what an engine reports to the
    base-weight gate, so it must come from this record of what actually happened, never from
    config.
    """

    def __init__(self) -> None:
        self.level = 0
        self.awaiting_reload: set[Hashable] = set()

    def fall_asleep(self, level: int, freed: Iterable[Hashable] = ()) -> None:
        """Record a sleep; at level 2, ``freed`` names the base parameters that will be lost."""
        validate_sleep_level(level)
        if self.level:
            raise RuntimeError(f"engine is already asleep (level {self.level})")
        self.level = level
        if level == 2:
            self.awaiting_reload = set(freed)

    def wake(self) -> int:
        """Record waking up; returns the level the engine was asleep at (0: it was awake)."""
        previous, self.level = self.level, 0
        return previous

    def mark_reloaded(self, keys: Iterable[Hashable]) -> None:
        self.awaiting_reload.difference_update(keys)

    @property
    def base_weights_resident(self) -> bool:
        return self.level != 2 and not self.awaiting_reload

    def require_awake(self, action: str) -> None:
        if self.level:
            raise RuntimeError(
                f"cannot {action}: engine is asleep (level {self.level}); call wake_up() first"
            )

    def require_ready_to_generate(self) -> None:
        self.require_awake("generate")
        if self.awaiting_reload:
            raise RuntimeError(
                "cannot generate: base weights were freed by sleep(2) and "
                f"{len(self.awaiting_reload)} parameters have not been resent; "
                "call update_weights() with the full model first"
            )
