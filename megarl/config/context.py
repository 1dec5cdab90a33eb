"""Do the prompts and ``rollout.max_new_tokens`` fit in the context the rollout can use?

A prompt whose tokens plus the response budget exceed the model's context either fails inside
the engine mid-run (vLLM refuses the request) or, with the ``hf`` engine, generates past the
positions the model was trained on: garbage that still gets rewarded and trained on. So start-up
counts the prompts that cannot fit and refuses the run, naming the keys that can fix it, or, with
``data.filter_overlong_prompts=true`` (verl's key), drops them at load time and says how many.
``data.max_prompt_length`` (verl's key) caps prompts below what the context allows.

Pure: plain ints in, :class:`~megarl.config.checks.ConfigError` out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megarl.config.checks import ConfigError


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


def prompt_budget(limit: ContextLimit, max_new_tokens: int, max_prompt_length: int | None) -> int:
    """The most prompt tokens a sample may have: the context minus the response budget, or
    ``data.max_prompt_length`` when that is smaller."""
    fit = limit.tokens - max_new_tokens
    return fit if max_prompt_length is None else min(fit, max_prompt_length)


def overlong(prompt_lens: Sequence[int], budget: int) -> list[int]:
    """Indices of the prompts longer than ``budget`` tokens."""
    return [i for i, n in enumerate(prompt_lens) if n > budget]


def check_prompts_fit(
    prompt_lens: Sequence[int],
    max_new_tokens: int,
    limit: ContextLimit,
    max_prompt_length: int | None = None,
) -> None:
    """Refuse the run if any prompt is over its budget (:func:`prompt_budget`), saying how many
    and which key sets the budget."""
    too_long = [
        prompt_lens[i]
        for i in overlong(prompt_lens, prompt_budget(limit, max_new_tokens, max_prompt_length))
    ]
    if not too_long:
        return
    drop = "; or drop them with data.filter_overlong_prompts=true"
    if any(n + max_new_tokens > limit.tokens for n in too_long):
        raise ConfigError(
            f"{len(too_long)} of {len(prompt_lens)} prompts do not fit: the longest has "
            f"{max(too_long)} tokens, + rollout.max_new_tokens={max_new_tokens} > {limit.tokens} "
            f"tokens ({limit.source}); lower rollout.max_new_tokens or shorten the prompts "
            f"(data.path, data.instruction, data.system_prompt){limit.advice}{drop}"
        )
    raise ConfigError(
        f"{len(too_long)} of {len(prompt_lens)} prompts are longer than "
        f"data.max_prompt_length={max_prompt_length} tokens (the longest has {max(too_long)}); "
        f"raise data.max_prompt_length{drop}"
    )
