"""Engine test helpers: references for a rollout engine's logprobs (one plain forward of the same
weights), interrupted-and-resumed sampling, and the base of the fake engines that tests of the
engine's callers script."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

from megarl.engines.base import (
    EngineMemoryState,
    Generation,
    Request,
    RolloutEngine,
    SamplingParams,
    join_pieces,
)


@torch.no_grad()
def reference_logprobs(
    model: torch.nn.Module, generation: Generation, temperature: float = 1.0
) -> torch.Tensor:
    """log_softmax(logits / T)[token] of each response token, from one unpadded, uncached
    forward of prompt+response on the model's device (``T=0``, greedy, scores at 1); on CPU."""
    device = next(model.parameters()).device
    ids_T = torch.tensor(generation.prompt_ids + generation.response_ids, device=device)
    logits_TV = model(ids_T.unsqueeze(0)).logits[0].float()
    logprobs_TV = torch.log_softmax(logits_TV / (temperature or 1.0), dim=-1)
    num_prompt = len(generation.prompt_ids)
    response_T = ids_T[num_prompt:].unsqueeze(-1)
    return logprobs_TV[num_prompt - 1 : -1].gather(-1, response_T).squeeze(-1).cpu()


def mean_abs_logprob_diff(
    model: torch.nn.Module, generations: list[Generation], temperature: float = 1.0
) -> float:
    """Mean over all response tokens of |engine logprob - :func:`reference_logprobs`|."""
    diffs = [
        (reference_logprobs(model, g, temperature) - torch.tensor(g.response_logprobs)).abs()
        for g in generations
    ]
    return torch.cat(diffs).mean().item()


def random_lora(
    base: torch.nn.Module,
    seed: int,
    targets: Sequence[str],
    rank: int,
    alpha: float,
    scale: float = 1.0,
) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
    """A random PEFT LoRA (drawn after ``torch.manual_seed(seed)``) on a copy of ``base``, its
    factors times ``scale``: (PEFT state dict, merged HF model in eval mode)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False
    )
    peft_model = get_peft_model(copy.deepcopy(base), config)
    if scale != 1.0:
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_" in name:
                    param.mul_(scale)
    state = {n: t.clone() for n, t in get_peft_model_state_dict(peft_model).items()}
    return state, peft_model.merge_and_unload().eval()


class InterruptAfter(threading.Event):
    """An interrupt that reads as set from its ``polls``-th poll on: the engine polls once per
    decode step (with several ranks, rank 0 does), so a call interrupted by it samples ``polls``
    tokens per row that goes on."""

    def __init__(self, polls: int) -> None:
        super().__init__()
        self.polls_left = polls

    def is_set(self) -> bool:
        self.polls_left -= 1
        return self.polls_left <= 0


def resumed(request: Request, pieces: Sequence[Generation]) -> Request:
    """``request`` going on after ``pieces``: their tokens as its ``generated_ids``."""
    return dataclasses.replace(
        request, generated_ids=tuple(t for piece in pieces for t in piece.response_ids)
    )


def first_batch_under_pushes(host, cfg, pusher_args: dict) -> tuple:
    """Step 1's batch from an :class:`~megarl.trainer.async_rollout.AsyncRollout` over ``host``
    whose engine is wrapped in :class:`PushesDuringGeneration` (``pusher_args``: its keywords but
    the box and the engine): ``(batch, metrics, pusher)``."""
    from megarl.trainer.async_rollout import AsyncRollout

    box: list = []
    pusher = PushesDuringGeneration(box, host.engine, **pusher_args)
    host.engine = pusher
    stream = AsyncRollout(host, cfg)
    box.append(stream)
    try:
        stream.start_rollout(1)
        batch, metrics, _, _ = stream.next_batch(1, timeout_s=120)
    finally:
        stream.close()
    return batch, metrics, pusher


def sample_with_interruptions(
    engine: RolloutEngine,
    requests: Sequence[Request],
    params: SamplingParams,
    interrupt: Callable[[], threading.Event],
    check_call: Callable[[list[Request], list[Generation]], None] | None = None,
) -> tuple[list[Generation], list[list[Generation]]]:
    """Sample ``requests`` with every call given a fresh ``interrupt()``, resuming the
    interrupted responses until none is left; return the joined responses and each request's
    pieces. ``check_call(calls, generations)`` sees every call, each of which must sample at
    least one token per request."""
    pieces: list[list[Generation]] = [[] for _ in requests]
    pending = list(range(len(requests)))
    for _ in range(params.max_new_tokens):  # each call advances every response
        if not pending:
            break
        calls = [resumed(requests[i], pieces[i]) for i in pending]
        generations = engine.generate_requests(calls, params, interrupt())
        if check_call is not None:
            check_call(calls, generations)
        for i, generation in zip(pending, generations, strict=True):
            assert generation.response_ids, "a call sampled no token of a request"
            pieces[i].append(generation)
        pending = [i for i, g in zip(pending, generations, strict=True) if g.interrupted]
    assert not pending, f"{len(pending)} responses unfinished after {params.max_new_tokens} calls"
    return [join_pieces(parts) for parts in pieces], pieces


class PushesDuringGeneration:
    """An engine whose first ``pushes`` calls each start with the trainer pushing the next
    policy version into the asynchronous rollout (``box[0]``, an
    :class:`~megarl.trainer.async_rollout.AsyncRollout`) while its loop generates: the push
    sets the call's interrupt, so each of those calls is interrupted, deterministically.
    ``weights(version)``: the tensors pushed as that version."""

    def __init__(
        self,
        box: list,
        engine: RolloutEngine,
        weights: Callable[[int], list[tuple[str, torch.Tensor]]],
        pushes: int = 2,
        record_checksums: bool = False,
    ) -> None:
        self.box, self.engine, self.weights = box, engine, weights
        self.pushes, self.record_checksums = pushes, record_checksums
        self.version = 0
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate_requests(self, requests, params, interrupt=None):
        self.calls += 1
        if self.calls <= self.pushes:
            self.version += 1
            [stream] = self.box
            weights = self.weights(self.version)
            stream.engine_update_weights(weights, record_checksums=self.record_checksums)
            stream.weights_loaded(self.version)  # sets the interrupt: the loop is generating
            assert interrupt is not None and interrupt.is_set()
        return self.engine.generate_requests(requests, params, interrupt)


class GenerateOnlyEngine(RolloutEngine):
    """A fake engine for tests of what only calls ``generate``: a subclass scripts
    ``eos_token_ids`` and ``generate_requests``; weights, adapters and sleep are refused, and
    the base weights are always resident."""

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def _generate(self, call):
        raise NotImplementedError

    def update_weights(self, named_tensors, record_checksums=False):
        raise NotImplementedError

    def weight_checksums(self, dtype):
        raise NotImplementedError

    def load_lora_adapter(self, adapter):
        raise NotImplementedError

    def sleep(self, level):
        raise NotImplementedError

    def wake_up(self) -> EngineMemoryState:
        raise NotImplementedError

    def memory_state(self) -> EngineMemoryState:
        return EngineMemoryState(True, False)


@contextlib.contextmanager
def megatron_world() -> Iterator[None]:
    """A Megatron world of one in this process (gloo, the CPU shims), torn down afterwards."""
    from megarl.distributed import parallel
    from megarl.distributed.platform import enter_cpu_shims, exit_cpu_shims

    enter_cpu_shims()
    try:
        parallel.init_process_group("cpu", 0, 1, "127.0.0.1", 0)
        parallel.init_model_parallel(1, 1)
        yield
    finally:
        parallel.destroy()
        exit_cpu_shims()


def megatron_engine(
    hf_model: torch.nn.Module, eos_token_id: int, pad_token_id: int, eos_bias: float | None = None
):
    """A :class:`~megarl.engines.megatron.MegatronEngine` over a Megatron ``GPTModel`` loaded with
    ``hf_model``'s weights (inside :func:`megatron_world`); ``eos_bias`` is added to the EOS
    logit by a hook on the output layer, as ``bias_eos`` does on an HF model's ``lm_head``."""
    from megarl.engines.megatron import MegatronEngine
    from megarl.models.megatron_gpt import build_gpt_model, load_hf_weights
    from megarl.models.spec import spec_from_hf_config

    spec = spec_from_hf_config(hf_model.config)  # pyright: ignore[reportArgumentType]
    gpt = build_gpt_model(spec, 1, 1)
    load_hf_weights(gpt, spec, dict(hf_model.state_dict()))
    if eos_bias is not None:
        bias_V = torch.zeros(spec.padded_vocab_size(1))
        bias_V[eos_token_id] = eos_bias
        gpt.output_layer.register_forward_hook(lambda _m, _i, out: (out[0] + bias_V, out[1]))
    engine = MegatronEngine([eos_token_id], pad_token_id, spec.vocab_size)
    engine.bind_model([gpt])
    return engine
