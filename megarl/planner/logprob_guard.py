"""The logprob guard: whether the rollout engine sampled with the trainer's weights.

Every step the trainer recomputes the logprobs of the tokens the engine sampled, under the weights
that sampled them, and compares (``rollout/logprob_abs_diff``, the mean absolute difference over
the compared tokens). Rounding alone keeps that mean small and steady for a given engine and
precision; weights the engine did not get right -- a sync that wrote garbage, a sleep/wake that
lost a tensor, an engine upgrade that loads a layer differently -- move it by orders of
magnitude. Training on such rollouts is training on another policy's samples, silently.

:func:`decide_logprob_guard` turns one comparison (a step's, or the probe's after an engine start
or wake-up) into a verdict: go on, or stop with one line naming the engine, the last weight sync
and the measured difference. The rank loop decides *before* the optimizer step, on a difference
every rank holds after the same all-reduce, so every rank stops together and no rank applies an
update the others skip. Pure: imports nothing of torch or the machinery.

The default thresholds (``rollout.max_logprob_diff: auto``) come from measured distributions of
the demo (SmolLM2-135M-Instruct, GRPO on arithmetic, both engines, fp32 and bf16; the numbers
are in ``docs/reliability.md``): the largest step value seen, times a margin of at least 5.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from megarl.errors import MegarlError

AUTO = "auto"
"""``rollout.max_logprob_diff: auto``: the threshold of :data:`DEFAULT_MAX_LOGPROB_DIFF`."""

DEFAULT_MAX_LOGPROB_DIFF: Mapping[tuple[str, str], float] = {
    ("hf", "float32"): 1e-3,
    ("vllm", "float32"): 1e-3,
    ("hf", "bfloat16"): 2e-1,
    ("vllm", "bfloat16"): 2e-1,
}
"""``(rollout.engine, parameter dtype)`` -> the default threshold on the mean absolute logprob
difference, from the demo's measured step values (``docs/reliability.md``). fp32: at most 8.9e-6
on either engine, so 1e-3 leaves a margin of 100. bf16 (8-bit mantissas; the transformers
engine decodes with a KV cache, the trainer runs one packed pass): up to 5.0e-2 (vLLM's probe
6.8e-2), so 2e-1 leaves a margin of 4, while the final norm scaled by 1.5 (the test hook) moves
SmolLM2's logprobs by 0.43 or more."""

FALLBACK_MAX_LOGPROB_DIFF: Mapping[str, float] = {"float32": 1e-3, "bfloat16": 2e-1}
"""By dtype, for an engine the table above does not name (a new engine is guarded from its
first run; measure it and add its row)."""


PROBE_TEXT = "Once upon a time, in a small village by the sea, there lived a"
"""The probe's fixed prompt: plain text that stops mid-sentence, so a language model goes on
rather than ending its response at once, and the probe compares its full
``PROBE_SAMPLES x PROBE_MAX_NEW_TOKENS`` tokens (a question ending in "Answer:" made
SmolLM2-135M end 73% of its samples with their first token: 4 tokens compared instead of 64)."""
PROBE_SAMPLES = 8
PROBE_MAX_NEW_TOKENS = 8
"""Samples of the probe prompt, and tokens per sample at most (fewer when
``rollout.max_new_tokens`` is smaller): 64 tokens, enough that a corrupted tensor cannot hide
in a few, in few decode steps (a CPU engine's decode step costs about the same for 4 rows as
for 32: the steps, not the tokens, are the probe's cost)."""
PROBE_SEED = 20_261_129
"""The probe's sampling seed: the same tokens for the same weights, run after run."""


class LogprobGuardError(MegarlError):
    """The engine's logprobs left the trainer's past ``rollout.max_logprob_diff`` (exit 1)."""


def default_max_logprob_diff(engine: str, dtype: str) -> float:
    """The default threshold for ``engine`` at parameter dtype ``dtype`` (``float32`` or
    ``bfloat16``); an unnamed engine takes its dtype's fallback, an unknown dtype bf16's (the
    widest)."""
    if (engine, dtype) in DEFAULT_MAX_LOGPROB_DIFF:
        return DEFAULT_MAX_LOGPROB_DIFF[(engine, dtype)]
    return FALLBACK_MAX_LOGPROB_DIFF.get(dtype, FALLBACK_MAX_LOGPROB_DIFF["bfloat16"])


def resolve_max_logprob_diff(setting: float | str | None, engine: str, dtype: str) -> float | None:
    """``rollout.max_logprob_diff`` as the run applies it: a number as given, ``auto`` the
    default for the engine and dtype, ``None`` off."""
    if setting is None:
        return None
    if setting == AUTO:
        return default_max_logprob_diff(engine, dtype)
    return float(setting)


@dataclass(frozen=True)
class GuardChecks:
    """Which of the guard's checks a run makes (:func:`guard_checks`)."""

    step_check: bool
    """Compare each step's training forward with the engine. Off with LoRA dropout: dropout
    makes the training forward differ from any engine by design (~2.6e-2 on the tiny model),
    so only the probes (scored without dropout) check the engine then."""
    probe_on: bool
    """Probe after the engine starts or a resume restores it: the synchronous loop (the engine
    is at rest between steps) with an engine that holds a copy of the weights. The colocated
    Megatron engine generates with the actor's own parameters: no copy a sync could corrupt
    (on the rollout side it holds a copy, probed like any engine's)."""
    probe_after_wake: bool
    """Probe after every wake-up and sync too: ``probe_on`` and the engine really sleeps."""


def guard_checks(
    engine_is_actor: bool, is_async: bool, lora_dropout: float, sleep_level: int
) -> GuardChecks:
    """What the guard checks in a run whose engine is (or is not) the actor's own model
    (``RolloutConfig.engine_is_actor``), of this loop, LoRA dropout and sleep level."""
    probed = not is_async and not engine_is_actor
    return GuardChecks(
        step_check=lora_dropout == 0,
        probe_on=probed,
        probe_after_wake=probed and sleep_level > 0,
    )


@dataclass(frozen=True)
class SyncRecord:
    """The last time the engine's weights were set, as the line names it."""

    what: str
    """``full weights``, ``LoRA adapter``, ``full weights + LoRA adapter``, or
    ``the model's own weights`` (the engine loaded them itself at start)."""
    step: int
    """The step whose update was sent (0: the start or a resume's restored weights)."""
    num_bytes: int = 0
    """Bytes of base weights streamed (0: none, or the engine loaded them from disk)."""
    checksum: str | None = None
    """A digest of the sent tensors' checksums when that sync verified them
    (``export.checksum_interval``); None when it did not."""

    def describe(self) -> str:
        when = f"after step {self.step}" if self.step > 0 else "at start"
        size = f", {self.num_bytes / 2**20:.1f} MiB" if self.num_bytes else ""
        checked = (
            f", checksum {self.checksum} (matched the engine's)"
            if self.checksum is not None
            else ", no checksum taken (export.checksum_interval)"
        )
        return f"{self.what} {when}{size}{checked}"


@dataclass(frozen=True)
class LogprobCheck:
    """One comparison of the engine's logprobs with the trainer's on the same tokens."""

    where: str
    """What was compared, for the line: ``step 5``, ``the probe after the engine started``."""
    mean_abs_diff: float
    num_tokens: int


@dataclass(frozen=True)
class GuardVerdict:
    stop: bool
    line: str
    """Why: the stop's one-line error, or what was checked."""


def decide_logprob_guard(
    check: LogprobCheck,
    threshold: float | None,
    engine: str,
    last_sync: SyncRecord | None,
    consequence: str = "",
) -> GuardVerdict:
    """Stop when the difference exceeds ``threshold`` (or is not a number); ``None`` = off, and
    a check of no tokens passes. ``consequence`` ends the stop's line (what was and was not
    applied or written)."""
    if threshold is None:
        return GuardVerdict(False, "rollout.max_logprob_diff=null: not checked")
    if check.num_tokens == 0:
        return GuardVerdict(False, f"{check.where}: no tokens compared")
    diff = check.mean_abs_diff
    if math.isfinite(diff) and diff <= threshold:
        return GuardVerdict(False, f"{check.where}: {diff:.1e} <= {threshold:.0e}")
    sync = last_sync.describe() if last_sync is not None else "none recorded"
    line = (
        f"rollout engine {engine} does not run the trainer's weights: at {check.where} its "
        f"logprobs differ from the trainer's by {diff:.2e} on average over {check.num_tokens} "
        f"tokens (rollout.max_logprob_diff={threshold:.0e}); last weight sync: {sync}"
    )
    return GuardVerdict(True, f"{line}; {consequence}" if consequence else line)


def probe_micro_batches(pp: int) -> list[list[int]]:
    """The probe's samples (indices) grouped into the trainer's micro-batches: at least
    :data:`PROBE_SAMPLES`, rounded up to a multiple of the pipeline stages, in ``pp``
    micro-batches of equal size -- one micro-batch without a pipeline, and as many as stages
    with one, which an interleaved (virtual) pipeline schedule needs."""
    per_micro_batch = -(-PROBE_SAMPLES // pp)
    return [list(range(m * per_micro_batch, (m + 1) * per_micro_batch)) for m in range(pp)]
