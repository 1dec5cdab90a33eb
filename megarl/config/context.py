"""Do the prompts and ``rollout.max_new_tokens`` fit in the context the rollout can use?

A prompt whose tokens plus the response budget exceed the model's context either fails inside
the engine mid-run (vLLM refuses the request) or, with the ``hf`` engine, generates past the
positions the model was trained on: garbage that still gets rewarded and trained on. So start-up
counts the prompts that cannot fit and refuses the run, naming the keys that can fix it; there
is no key that filters long prompts out, so nothing is dropped silently.

Pure: plain ints in, :class:`~megarl.config.schema.ConfigError` out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megarl.config.schema import ConfigError


@dataclass(frozen=True)
class ContextLimit:
    """The longest prompt + response the rollout can take, and what sets it (for the message)."""

    tokens: int
    source: str
    """The key or model field the limit comes from, e.g. ``rollout.max_model_len=256``."""
    advice: str
    """What the user can change besides the prompts and ``rollout.max_new_tokens``."""


def context_limit(
    max_position_embeddings: int, engine: str, max_model_len: int | None
) -> ContextLimit:
    """The model's context, or vLLM's ``rollout.max_model_len`` when it is set (and shorter)."""
    model = ContextLimit(
        max_position_embeddings, "the model's max_position_embeddings in config.json", ""
    )
    if engine != "vllm" or max_model_len is None or max_model_len >= max_position_embeddings:
        return model
    return ContextLimit(
        max_model_len,
        f"rollout.max_model_len={max_model_len}",
        f"; raise rollout.max_model_len (the model allows {max_position_embeddings})",
    )


def check_prompts_fit(prompt_lens: Sequence[int], max_new_tokens: int, limit: ContextLimit) -> None:
    """Refuse the run if any prompt + ``max_new_tokens`` exceeds ``limit``, saying how many."""
    too_long = [n for n in prompt_lens if n + max_new_tokens > limit.tokens]
    if not too_long:
        return
    raise ConfigError(
        f"{len(too_long)} of {len(prompt_lens)} prompts do not fit: the longest has "
        f"{max(too_long)} tokens, + rollout.max_new_tokens={max_new_tokens} > {limit.tokens} "
        f"tokens ({limit.source}); lower rollout.max_new_tokens or shorten the prompts "
        f"(data.path, data.instruction, data.system_prompt){limit.advice}"
    )
