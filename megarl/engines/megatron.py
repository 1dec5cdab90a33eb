"""The Megatron engine (``rollout.engine=megatron``): the actor's own Megatron model generates.

The other engines hold a second copy of the model (a ``transformers`` model, vLLM's) that the
exporter refreshes after every optimizer step. This one is handed the actor's model chunks, the
very parameters the optimizer updates, so there is nothing to send: the gates skip the weight
sync with that reason (``sync: skip (the engine is the actor's model)``), a LoRA adapter is
already in the model's linear layers, and the weights are held once.

The engine contract (:mod:`megarl.engines.base`) is kept as the HF engine keeps it, with the HF
engine's own sampling functions, so equal logits give equal tokens: response token ``j`` of a
request is drawn from a uniform seeded ``token_seed(request.seed, j)``, logprobs are those of
the untruncated distribution, a request resumed with its tokens so far
(``Request.generated_ids``) continues the same stream, an ``interrupt`` is polled after each
step's draw (every call samples at least one token per row), and ``n`` samples of one prompt
share one prefill. The model runs through :class:`megarl.models.kv_cache.KVCache`: left-padded
rows over Megatron's static KV cache, rows that ended leaving the batch.

Memory: there is no weight to free or reload (``sleep`` keeps the weights at every level and
the engine always reports them resident); the KV cache lives only for one call. The model is
switched to eval mode while it generates and back afterwards.

Placement, on the rollout side (split placement, the asynchronous modes): the rollout actor's
process holds no actor rank, so the engine generates with a copy of its own
(:class:`megarl.engines.megatron_copy.MegatronCopy`, bound with :meth:`MegatronEngine.bind_copy`):
the same decode loop over a TP=PP=1 model that the weight sync feeds in Megatron layout, checks
by checksum and probes like any engine's copy. It generates alone: no followers.

Placement, colocated: in the actor's processes, in the actor's own layout. Rank 0 drives (the
rollout producer, agent loops, the gateway and validation call it there, like any engine); the
other ranks whose forward rank 0's needs -- its tensor- and pipeline-parallel group, and with
expert parallelism every rank, since each expert-parallel rank holds experts the others route
to -- *follow* (:meth:`MegatronEngine.serve`): for each call rank 0 broadcasts the requests and
the sampling parameters, every rank of the group runs the same decode loop on its shard (the
pipeline stages pass hidden states on; the last stage's logits, gathered over the
tensor-parallel ranks, are broadcast to its pipeline group), samples the same tokens from the
same logits with the same seeds, and after each step takes rank 0's word on whether it was
interrupted. At the end of a rollout or validation phase rank 0 releases the followers
(:meth:`MegatronEngine.release_followers`).

Data-parallel replicas share each call: every rank follows, each replica (a model-parallel
group) generates its share of the requests (:func:`megarl.engines.batching.shard_requests`, a
GRPO group on one replica), and rank 0 gathers the generations in request order. The replicas
decode in step: once per step every rank says whether its rows go on and rank 0 whether it was
interrupted (one small all-reduce), so a replica whose rows have ended waits for the others and
an interrupt ends every replica's call at the same step. Under expert parallelism the replicas'
forwards are one (each holds experts the others route to): a replica with no row left, or none
to start with, runs each step's forward on a filler row (a pad token, its draws not kept), so
that its experts serve the others' tokens.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from megarl.distributed.batch_invariant import batch_invariant_mode
from megarl.engines.base import (
    EngineMemoryState,
    GenerateCall,
    Generation,
    LoraAdapter,
    RolloutEngine,
    SamplingParams,
)
from megarl.engines.batching import DistinctContexts, left_pad, shard_requests
from megarl.engines.sampling import ResponseState, sample_step

NO_WEIGHTS_TO_SEND = "the engine is the actor's model"
"""Why nothing is ever sent to this engine (the gates' reason too)."""
DRIVER = 0
"""The global rank that drives generation (the rollout host's)."""


def generation_group(replicas_share: bool = True) -> Any:
    """The process group of the ranks that take rank 0's calls: the model-parallel group (TP x
    PP), or the whole world when the data-parallel replicas share each call
    (``replicas_share``) or their forwards are one (:func:`forwards_span_replicas`: each must
    then run every forward, even of a call it does not share); None when this rank's model
    runs alone."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if forwards_span_replicas() or (
        replicas_share and parallel_state.get_data_parallel_world_size() > 1
    ):
        return dist.group.WORLD
    group: Any = parallel_state.get_model_parallel_group()  # Megatron's annotation is loose
    return group if group.size() > 1 else None


@dataclass(frozen=True)
class ReplicaShare:
    """How this rank's replica (its model-parallel group) takes part in each call."""

    count: int = 1
    """Into how many shares a call's requests are split (:func:`shard_requests`)."""
    index: int = 0
    """Which share this replica generates."""
    in_step_forwards: bool = False
    """The replicas' forwards are one (:func:`forwards_span_replicas`): a replica with no row
    left still runs each step's forward, on a filler row."""


def replica_share(replicas_share: bool = True) -> ReplicaShare:
    """This rank's :class:`ReplicaShare`: one share per data-parallel replica, or the whole
    call for rank 0's replica alone without ``replicas_share``."""
    from megatron.core import parallel_state

    count = parallel_state.get_data_parallel_world_size()
    if not replicas_share or count == 1:
        return ReplicaShare()
    return ReplicaShare(count, parallel_state.get_data_parallel_rank(), forwards_span_replicas())


def forwards_span_replicas() -> bool:
    """Whether every data-parallel replica must run every forward: under expert parallelism,
    where each holds experts the others' tokens are routed to."""
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_world_size() > 1


def follows_driver() -> bool:
    """Whether this rank runs rank 0's generation calls with it (:meth:`MegatronEngine.serve`)."""
    import torch.distributed as dist

    group = generation_group()
    if group is None or dist.get_rank() == DRIVER:
        return False
    return DRIVER in dist.get_process_group_ranks(group)


class MegatronEngine(RolloutEngine):
    """Rollouts from the actor's Megatron model chunks (bound after the actor is built)."""

    def __init__(
        self,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        vocab_size: int,
        device: str | torch.device = "cpu",
        batch_invariant: bool = False,
    ) -> None:
        super().__init__()
        if not eos_token_ids:
            raise ValueError("no EOS token id known: pass eos_token_ids")
        self._eos_token_ids = tuple(eos_token_ids)
        self._pad_token_id = pad_token_id
        self._vocab_size = vocab_size
        self._device = torch.device(device)
        self._chunks: list[Any] | None = None
        self._copy: Any = None
        """The rollout side's :class:`~megarl.engines.megatron_copy.MegatronCopy` (None: the
        engine generates with the actor's chunks, and nothing is sent to it)."""
        self._group: Any = None
        """The ranks taking rank 0's calls (:func:`generation_group`); None: this rank alone."""
        self._replicas = ReplicaShare()
        """How this rank's replica takes part in each call (:func:`replica_share`)."""
        self._batch_invariant = batch_invariant
        """``rollout.batch_invariant``: decode in
        :func:`megarl.distributed.batch_invariant.batch_invariant_mode` and take each sampled
        token's logprob with the trainer's own vocab-parallel function from this rank's logits
        slice, so it has the bits the trainer's forward gives it."""

    def bind_model(self, chunks: Sequence[Any], replicas_share: bool = True) -> None:
        """Generate with these model chunks (the actor's, DDP-wrapped or bare) from now on.
        ``replicas_share=False``: rank 0's replica generates every call alone, the others
        idle (a run never asks for it; the benchmarks' baseline)."""
        if len(chunks) != 1:
            raise ValueError(
                f"the Megatron engine runs one model chunk per rank, got {len(chunks)} "
                "(actor.vpp > 1)"
            )
        self._chunks = list(chunks)
        self._group = generation_group(replicas_share)
        self._replicas = replica_share(replicas_share)

    def bind_copy(self, copy: Any) -> None:
        """Generate with the rollout side's own model (a ``MegatronCopy``), which the weight
        sync feeds; this rank generates alone."""
        self._chunks = [copy.model]
        self._copy = copy
        self._group = None
        self._replicas = ReplicaShare()

    # -- properties --

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def max_sleep_level(self) -> int:
        return 0

    # -- generate --

    def _generate(self, call: GenerateCall) -> list[Generation]:
        """On rank 0; the followers run the same call (:meth:`serve`)."""
        self._tell_followers(("generate", call.requests, call.params))
        return self._run(call)

    def _run(self, call: GenerateCall) -> list[Generation]:
        """This rank's part of a call: the whole decode loop, on its shard of the model, over
        its replica's share of the requests; rank 0 returns every generation."""
        shares = shard_requests(call.requests, call.params, self._replicas.count)
        mine = shares[self._replicas.index]
        responses = [ResponseState.start(call.requests[i], call.params) for i in mine]
        with self._generating() as gpt:
            self._decode(gpt, responses, call)
        generations = [response.generation() for response in responses]
        if self._replicas.count == 1:
            return generations
        return self._gather(shares, generations)

    def _gather(
        self, shares: tuple[tuple[int, ...], ...], generations: list[Generation]
    ) -> list[Generation]:
        """Every replica's generations on rank 0, in request order (an empty list elsewhere):
        each model-parallel group's first rank sends its replica's."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        group: Any = parallel_state.get_model_parallel_group()  # Megatron's annotation is loose
        leads = dist.get_rank(group=group) == 0
        sent = (self._replicas.index, generations) if leads else None
        received: list | None = (
            [None] * dist.get_world_size() if dist.get_rank() == DRIVER else None
        )
        dist.gather_object(sent, received, dst=DRIVER)
        if received is None:
            return []
        ordered: list[Generation | None] = [None] * sum(len(share) for share in shares)
        for share, share_generations in (item for item in received if item is not None):
            for index, generation in zip(shares[share], share_generations, strict=True):
                ordered[index] = generation
        assert all(generation is not None for generation in ordered)
        return cast("list[Generation]", ordered)

    # -- the ranks that generate with rank 0 --

    def serve(self) -> None:
        """A follower's part of a rollout or validation phase: run every call rank 0 makes,
        until it releases the group (:meth:`release_followers`)."""
        while True:
            message = self._hear_driver()
            if message[0] == "release":
                return
            _, requests, params = message
            self._run(GenerateCall(requests, params))

    def release_followers(self) -> None:
        """Rank 0, at the end of a rollout or validation phase: the followers go back to
        training. A no-op when this rank generates alone."""
        self._tell_followers(("release",))

    def _tell_followers(self, message: tuple) -> None:
        if self._group is not None:
            import torch.distributed as dist

            dist.broadcast_object_list([message], src=DRIVER, group=self._group)

    def _hear_driver(self) -> tuple:
        import torch.distributed as dist

        if self._group is None:
            raise RuntimeError("this rank generates alone: there is no driver to follow")
        box: list = [None]
        dist.broadcast_object_list(box, src=DRIVER, group=self._group)
        return box[0]

    def _step_ends(self, call: GenerateCall, going: bool) -> bool:
        """Whether the decode loop stops after this step's draw, the same answer on every rank
        of the group (asked once per step): every row has ended (``going``: some row of this
        rank's goes on), on every replica when they share the call, or rank 0 was interrupted.
        """
        if self._replicas.count == 1 and not going:  # the group decodes one batch: it ends as one
            return True
        if self._group is None:
            return call.interrupted
        import torch.distributed as dist

        if self._replicas.count == 1:
            flag = torch.tensor([int(call.interrupted)], device=self._device)
            dist.broadcast(flag, src=DRIVER, group=self._group)
            return bool(flag.item())
        flags = torch.tensor([int(call.interrupted), int(going)], device=self._device)
        dist.all_reduce(flags, group=self._group)  # followers' calls are never interrupted
        return bool(flags[0].item()) or not bool(flags[1].item())

    @contextlib.contextmanager
    def _generating(self) -> Iterator[Any]:
        """The bare ``GPTModel`` in eval mode, gradients off, for the block; its modes after."""
        from megarl.distributed.platform import shim_modes_in_this_thread
        from megarl.models.chunk import unwrap

        if self._chunks is None:
            raise RuntimeError("the Megatron engine has no model yet: bind_model() first")
        gpt = unwrap(self._chunks[0])
        modes = {module: module.training for module in gpt.modules()}
        gpt.eval()
        try:
            # the agent loops call from a worker thread, where the shims' torch-function modes
            # (thread-local) are not on yet
            with (
                torch.inference_mode(),
                shim_modes_in_this_thread(),
                batch_invariant_mode(self._batch_invariant),
            ):
                yield gpt
        finally:
            for module, training in modes.items():
                module.training = training

    def _decode(self, gpt: Any, responses: list[ResponseState], call: GenerateCall) -> None:
        """Fill ``responses`` until each has ended or the call is interrupted: one prefill of the
        distinct contexts, then one cached step per token, the rows still going only.

        When the replicas share the call, one with no row left (or none to start with) keeps
        asking until the others end too; if their forwards are one (expert parallelism) it also
        runs each step's forward, on a filler row whose draws are not kept."""
        budget = max((r.budget for r in responses), default=0)
        if self._replicas.in_step_forwards:  # the filler may have to last as long as any row
            budget = max(request.budget(call.params) for request in call.requests)
        rows: list[int] = []  # the response of each of the cache's rows
        cache: Any = None
        if responses:
            cache, local_BV, logits_BV = self._prefill(gpt, responses, budget)
            rows = list(range(len(responses)))
        elif self._replicas.in_step_forwards:
            cache = self._filler(gpt, budget)
        generator = torch.Generator()  # on the host: re-seeded before each draw
        while True:
            going: list[int] = []
            if rows:
                going_responses = [responses[row] for row in rows]
                token_L = sample_step(
                    going_responses,
                    logits_BV,
                    call.params,
                    generator,
                    self._eos_token_ids,
                    logprobs_of=self._trainer_logprobs_of(local_BV, call.params),
                ).to(self._device)
                going = [i for i, row in enumerate(rows) if not responses[row].ended]
            if self._step_ends(call, bool(going)):
                return
            if not going:  # this replica's rows have ended; the others' go on
                if rows and self._replicas.in_step_forwards:  # one row stays on as the filler
                    cache.select_rows(torch.zeros(1, dtype=torch.long, device=self._device))
                rows = []
                if self._replicas.in_step_forwards:
                    cache.forward(gpt, self._pad_column())
                continue
            if len(going) < len(rows):
                keep_L = torch.tensor(going, device=self._device)
                cache.select_rows(keep_L)
                token_L, rows = token_L[keep_L], [rows[i] for i in going]
            local_BV = cache.forward(gpt, token_L.unsqueeze(1))
            logits_BV = self._full_vocab(local_BV, len(rows))

    def _prefill(
        self, gpt: Any, responses: list[ResponseState], budget: int
    ) -> tuple[Any, Any, torch.Tensor]:
        """The KV cache (room for ``budget`` new tokens) after one forward over the distinct
        contexts, its rows and the logits copied out to one per response; ``(cache, this
        rank's logits, full logits)``."""
        from megarl.models.kv_cache import KVCache

        prefill = DistinctContexts.of([response.request for response in responses])
        batch = left_pad(prefill.contexts, self._pad_token_id, self._device)
        pad_U = (batch.attention_mask_BT == 0).sum(dim=1)
        cache = KVCache(gpt, pad_U, batch.input_ids_BT.shape[1] + budget)
        local_BV = cache.forward(gpt, batch.input_ids_BT)
        logits_BV = self._full_vocab(local_BV, len(prefill.contexts))
        if prefill.shared:  # GRPO's samples of a prompt: one prefill, copied rows
            rows_B = torch.tensor(prefill.rows, device=self._device)
            cache.select_rows(rows_B)
            logits_BV = logits_BV[rows_B]
            local_BV = None if local_BV is None else local_BV[rows_B]
        return cache, local_BV, logits_BV

    def _filler(self, gpt: Any, budget: int) -> Any:
        """A one-row cache after its prefill, a pad token: what a replica with no request of
        its own runs its forwards on while the others' tokens pass through its experts."""
        from megarl.models.kv_cache import KVCache

        cache = KVCache(gpt, torch.zeros(1, dtype=torch.long, device=self._device), 1 + budget)
        cache.forward(gpt, self._pad_column())
        return cache

    def _pad_column(self) -> torch.Tensor:
        return torch.full((1, 1), self._pad_token_id, dtype=torch.long, device=self._device)

    def _full_vocab(self, logits_BV: torch.Tensor | None, num_rows: int) -> torch.Tensor:
        """The whole real vocabulary's ``[B, V]`` logits on every rank of the group: the
        tensor-parallel slices gathered, the padded tail Megatron adds for equal slices cut off
        (the trainer masks it too), and under pipeline parallelism the last stage's broadcast
        to the stages before it (None there)."""
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        if logits_BV is not None:
            if parallel_state.get_tensor_model_parallel_world_size() > 1:
                logits_BV = gather_from_tensor_model_parallel_region(logits_BV)
            assert logits_BV is not None
            logits_BV = logits_BV[:, : self._vocab_size].float().contiguous()
        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            assert logits_BV is not None
            return logits_BV
        if logits_BV is None:
            logits_BV = torch.empty((num_rows, self._vocab_size), device=self._device)
        dist.broadcast(
            logits_BV,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=cast("Any", parallel_state.get_pipeline_model_parallel_group()),
        )
        return logits_BV

    def _trainer_logprobs_of(self, local_BV: torch.Tensor | None, params: SamplingParams):
        """In the batch-invariant mode, what gives the sampled tokens' logprobs instead of the
        sampling distribution's (:meth:`_trainer_logprobs` over this rank's slice ``local_BV``);
        None otherwise, and for greedy decoding (validation)."""
        if not self._batch_invariant or params.greedy or local_BV is None:
            return None
        return functools.partial(self._trainer_logprobs, local_BV, temperature=params.temperature)

    def _trainer_logprobs(
        self, local_BV: torch.Tensor, token_B: torch.Tensor, temperature: float
    ) -> torch.Tensor:
        """The sampled tokens' logprobs as the trainer computes them: its vocab-parallel
        function over this rank's slice, reduced over the tensor-parallel group."""
        from megatron.core import parallel_state

        from megarl.models.vocab_parallel import VocabShard, token_logprobs_and_entropy

        tp = parallel_state.get_tensor_model_parallel_world_size()
        shard = VocabShard(
            start=parallel_state.get_tensor_model_parallel_rank() * local_BV.shape[-1],
            real_vocab_size=self._vocab_size,
            group=parallel_state.get_tensor_model_parallel_group() if tp > 1 else None,
        )
        logp_B1, _ = token_logprobs_and_entropy(
            local_BV.unsqueeze(1),
            token_B.to(local_BV.device).unsqueeze(1),
            shard,
            temperature,
            with_entropy=False,
        )
        return logp_B1[:, 0].cpu()

    # -- weights: none to send to the actor's model; a rollout-side copy loads them --

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], record_checksums: bool = False
    ) -> int:
        """Rollout side: whole Megatron parameters by Megatron name, copied in place (the
        checksums are read from the parameters on demand)."""
        return self._own_copy("send").load(named_tensors)

    def weight_checksums(self, dtype: torch.dtype) -> Mapping[str, tuple[int, int]]:
        return self._own_copy("check").checksums(dtype)

    def load_lora_adapter(self, adapter: LoraAdapter) -> None:
        self._own_copy("load an adapter into").load_adapter(adapter)

    def _own_copy(self, action: str) -> Any:
        if self._copy is None:
            raise RuntimeError(
                f"nothing to {action} the colocated Megatron engine: {NO_WEIGHTS_TO_SEND}"
            )
        return self._copy

    # -- memory: the weights are the actor's, never freed here --

    def sleep(self, level: int) -> None:
        """Nothing to release between rollouts (the KV cache lives for one call); the weights
        are the actor's and stay at every level."""
        self._sleep.fall_asleep(level)

    def wake_up(self) -> EngineMemoryState:
        self._sleep.wake()
        return self.memory_state()

    def memory_state(self) -> EngineMemoryState:
        adapter = self._copy is not None and self._copy.lora is not None
        return EngineMemoryState(base_weights_resident=True, adapter_resident=adapter)
