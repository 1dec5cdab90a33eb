"""The SFT run's batches: conversations drawn in seeded epochs, as the rank loop's batch.

:class:`SFTProducer` stands where the rollout producer stands (the rollout host calls
:meth:`produce` each step), so the rank loop, the planner, checkpoints and resume do not know
the difference. The stream is :class:`megarl.data.loader.PromptStream` over the examples: an
order that depends only on (seed, epoch), its position saved in checkpoints, so a resumed run
continues with the next conversation, none skipped or repeated.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from megarl.agent.gateway.sessions import tools_key
from megarl.agent.render import ChatRenderer
from megarl.batch import RolloutBatch
from megarl.config.schema import RunConfig
from megarl.data.files import read_rows
from megarl.data.loader import PromptStream
from megarl.engines.base import EngineMemoryState, RolloutEngine
from megarl.sft.conversations import BadRow, SFTExample, SFTKeys, load_examples
from megarl.trainer.rollout import StepTexts, mask_runs

if TYPE_CHECKING:
    from megarl.trainer.runtime import Runtime


class NoEngine(RolloutEngine):
    """The rollout engine of a run that has none (``algo.objective=sft``): it holds no weights
    to send (the gates skip the sync), sleeps and wakes as a no-op, and refuses to generate."""

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return ()

    @property
    def vocab_size(self) -> int:
        return 0

    def _check_can_generate(self, params):
        raise RuntimeError("algo.objective=sft has no rollout engine: nothing generates")

    def _generate(self, call):
        raise AssertionError("not reached: every call is refused before it samples")

    def update_weights(self, named_tensors, record_checksums=False):
        for _ in named_tensors:  # drained: a sync would stream into nothing
            pass

    def weight_checksums(self, dtype):
        return {}

    def load_lora_adapter(self, adapter):
        return None

    def sleep(self, level):
        return None

    def wake_up(self) -> EngineMemoryState:
        return self.memory_state()

    def memory_state(self) -> EngineMemoryState:
        return EngineMemoryState(base_weights_resident=True, adapter_resident=False)


def sft_batch(examples: Sequence[SFTExample]) -> RolloutBatch:
    """The examples as one batch: each its own group, advantage 1 (every masked token trains
    with the ``sft`` loss), reward 0, no engine logprobs (zeros: there is no engine)."""
    count = len(examples)
    return RolloutBatch(
        tokens=tuple(torch.tensor(e.token_ids, dtype=torch.long) for e in examples),
        prompt_lens=tuple(e.prompt_len for e in examples),
        group_ids=torch.arange(count),
        rewards=torch.zeros(count),
        advantages=torch.ones(count),
        engine_logprobs=tuple(torch.zeros(len(e.mask)) for e in examples),
        response_masks=tuple(torch.tensor(e.mask, dtype=torch.float32) for e in examples),
    )


class SFTProducer:
    """``produce(step)``: the step's ``data.prompts_per_step`` conversations as a batch."""

    def __init__(
        self, examples: Sequence[SFTExample], per_step: int, seed: int, tokenizer: Any
    ) -> None:
        self.examples = list(examples)
        self.stream = PromptStream(cast("Any", self.examples), per_step, seed)
        self.tokenizer = tokenizer
        self.agents = None
        """No agent loops (the host asks)."""
        self.texts: dict[int, StepTexts] = {}

    def produce(
        self, step: int, version: int = 0
    ) -> tuple[RolloutBatch, dict[str, float], dict[str, float]]:
        started = time.perf_counter()
        examples = cast("list[SFTExample]", self.stream.next_batch())
        batch = sft_batch(examples)
        trained = [e.trained_tokens for e in examples]
        metrics = {
            "sft/trained_tokens": float(sum(trained)),
            "sft/trained_tokens/mean": sum(trained) / len(trained),
            "sft/seq_len/mean": sum(len(e.token_ids) for e in examples) / len(examples),
            "sft/epoch": self.stream.state_dict().get("epoch", 0) + 0.0,
            "response_length/mean": sum(trained) / len(trained),
        }
        self.texts[step] = StepTexts(
            samples=[],
            texts=[(e.location, self._text(e), "") for e in examples],
            turns=[self._turns(e) for e in examples],
        )
        return batch, metrics, {"gen": time.perf_counter() - started}

    def _text(self, example: SFTExample) -> str:
        return self.tokenizer.decode(list(example.token_ids[example.prompt_len :]))

    def _turns(self, example: SFTExample) -> list[tuple[str, bool]]:
        response = example.token_ids[example.prompt_len :]
        return [
            (self.tokenizer.decode(ids, skip_special_tokens=False), trained)
            for ids, trained in mask_runs(response, example.mask)
        ]

    def pop_texts(self, step: int) -> StepTexts:
        return self.texts.pop(step, StepTexts(samples=[], texts=[]))


def loss_metrics(loss: float, name: str = "") -> dict[str, float]:
    """``sft/<name>loss`` and its perplexity ``sft/<name>ppl`` (``name``: "" or "val_")."""
    return {f"sft/{name}loss": loss, f"sft/{name}ppl": math.exp(min(loss, 50.0))}


# --- loading (start-up and every rank) --------------------------------------------------------


def load_sft_examples(
    cfg: RunConfig, tokenizer: Any, files: Sequence[str], context: int
) -> tuple[list[SFTExample], list[str]]:
    """Every row of ``files`` as an example (:func:`megarl.sft.conversations.load_examples`):
    rendered with the run's tool format, at most ``data.max_length`` tokens (or ``context``,
    the model's); a bad row raises :class:`~megarl.sft.conversations.BadRow` (``file:row``),
    or is skipped and listed with ``data.skip_bad_rows``."""
    renderers: dict[str, ChatRenderer] = {}

    def renderer_for(tools: Sequence[Mapping[str, Any]]) -> ChatRenderer:
        key = tools_key(tools)
        if key not in renderers:
            renderers[key] = ChatRenderer(
                tokenizer, tools, tool_format=cfg.rollout.agent.tool_format
            )
        return renderers[key]

    data = cfg.data
    keys = SFTKeys(
        messages=data.messages_key,
        prompt=data.prompt_key,
        response=data.response_key,
        tools=data.tools_key,
        system_prompt=data.system_prompt,
    )
    rows = [row for path in files for row in read_rows(str(path))]
    if not rows:
        raise BadRow(f"{', '.join(map(str, files))}: no rows")
    max_length = min(context, data.max_length or context)
    return load_examples(rows, renderer_for, keys, max_length, data.skip_bad_rows)


# --- validation: the loss on data.val_files (collective) --------------------------------------


def sft_validation(rt: Runtime, examples: Sequence[SFTExample]) -> dict[str, float]:
    """Collective: the token-mean loss and perplexity of the actor on ``examples``
    (``sft/val_loss``, ``sft/val_ppl``), each data-parallel rank scoring its share; on every
    rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megarl.planner.micro_batches import plan_forward_micro_batches

    started = time.perf_counter()
    batch = sft_batch(examples)
    mine = list(range(rt.dp_rank, len(examples), rt.cfg.dp))
    shard = batch.shard(mine)
    budget = rt.cfg.actor.logprob_micro_batch_tokens
    groups = plan_forward_micro_batches(
        mine, shard.seq_lens, budget, rt.cfg.actor.micro_batch_multiple
    )
    logprobs = rt.actor.compute_logprobs(shard, groups, temperature=1.0)
    totals = torch.zeros(2, dtype=torch.float64)
    if rt.actor.is_last_stage and ps.get_tensor_model_parallel_rank() == 0:
        for index, values in logprobs.items():
            mask = torch.tensor(examples[index].mask, dtype=torch.float64)
            totals[0] -= float((values.double() * mask).sum())
            totals[1] += float(mask.sum())
    dist.all_reduce(totals)
    metrics = loss_metrics(float(totals[0]) / max(float(totals[1]), 1.0), "val_")
    metrics["timing_s/testing"] = time.perf_counter() - started
    return metrics
