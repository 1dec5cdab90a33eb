"""One agent rollout as the trainer sees it: token ids in order, and which of them to train.

Token-in/token-out: a trajectory is built by appending token ids as they arrive -- the engine's
sampled ids (:meth:`Trajectory.add_generated`) and the ids of what the environment answered
(:meth:`Trajectory.add_observation`, e.g. a tool result rendered by
:mod:`megarl.agent.render`). Nothing is ever decoded and re-encoded: re-tokenising generated
text changes ids (a different but equally valid segmentation), and a policy trained on ids it
never sampled does not converge. The per-token loss mask, behaviour logprobs and policy
versions are built in the same appends, so they cannot drift from the ids.

Layout (verl's ``AgentLoopOutput``): ``prompt_ids`` then ``response_ids``; ``response_mask`` is
1 on generated tokens (trained) and 0 on observation tokens (read, never trained);
``response_logprobs`` holds the engine's logprob for a generated token and 0.0 for an
observation token (unused: the mask removes it from every loss).

This module imports nothing heavier than the standard library.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")
"""Why one generate call ended: ``stop`` (an end-of-turn/EOS token or a stop string),
``length`` (its ``max_new_tokens`` ran out), ``abort`` (interrupted, e.g. by a weight update)."""


def _token_ids(values: Iterable[object], what: str) -> tuple[int, ...]:
    """``values`` as a tuple of non-negative Python ints (NumPy/torch integer scalars count;
    bools and floats do not), or a ValueError naming ``what`` and the first bad entry."""
    ids = []
    for position, value in enumerate(values):
        if isinstance(value, bool):
            raise ValueError(f"{what}[{position}] is a bool ({value}), not a token id")
        try:
            token = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            kind = type(value).__name__
            raise ValueError(
                f"{what}[{position}] is a {kind} ({value!r}), not a token id"
            ) from None
        if token < 0:
            raise ValueError(f"{what}[{position}] = {token}: token ids are >= 0")
        ids.append(token)
    return tuple(ids)


def _logprobs(values: Iterable[object], what: str) -> tuple[float, ...]:
    """``values`` as a tuple of floats that are logprobs (not NaN, not above 0)."""
    out = []
    for position, value in enumerate(values):
        try:
            number = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            kind = type(value).__name__
            raise ValueError(f"{what}[{position}] is a {kind} ({value!r}), not a number") from None
        if math.isnan(number) or number > 0:
            raise ValueError(f"{what}[{position}] = {number}: a logprob is a number <= 0")
        out.append(number)
    return tuple(out)


@dataclass(frozen=True)
class GenerateOutput:
    """What one ``ctx.generate`` call sampled: the ids, their logprobs and why it stopped.

    Sequences are stored as tuples (lists are accepted and converted) and checked on creation,
    so a trajectory never holds a logprob without its token."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    """``log_softmax(logits / temperature)[token]`` per token, as the engine reports it (see
    :class:`megarl.engines.base.Generation`)."""
    finish_reason: str
    """One of :data:`FINISH_REASONS`."""
    versions: tuple[int, ...] | None = None
    """The policy version whose weights sampled each token (asynchronous training: a request
    resumed after a weight update holds tokens of two versions); None when every token was
    sampled by the current policy (synchronous training)."""

    def __post_init__(self) -> None:
        token_ids = _token_ids(self.token_ids, "token_ids")
        logprobs = _logprobs(self.logprobs, "logprobs")
        if len(token_ids) != len(logprobs):
            raise ValueError(f"{len(token_ids)} token ids but {len(logprobs)} logprobs")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"finish_reason={self.finish_reason!r}: must be one of {', '.join(FINISH_REASONS)}"
            )
        object.__setattr__(self, "token_ids", token_ids)
        object.__setattr__(self, "logprobs", logprobs)
        if self.versions is not None:
            versions = _token_ids(self.versions, "versions")
            if len(versions) != len(token_ids):
                raise ValueError(f"{len(token_ids)} token ids but {len(versions)} versions")
            object.__setattr__(self, "versions", versions)


class Trajectory:
    """A prompt and the response built after it, one generated turn or observation at a time.

    A loop appends with :meth:`add_generated` and :meth:`add_observation` and may set
    :attr:`reward` (overrides the dataset's reward function for this sample). The tool loop
    counts :attr:`tool_calls` and :attr:`tool_errors` (reported as ``agent/*`` metrics).

    ``max_response_tokens`` bounds the response (generated and observation tokens together):
    generated ids beyond it are refused (the loop asked the engine for more than
    :attr:`remaining` allows), an observation is cut to fit. Once the budget is spent the
    trajectory is :attr:`truncated` and refuses further appends.
    """

    def __init__(self, prompt_ids: Sequence[int], max_response_tokens: int | None = None) -> None:
        self._prompt = _token_ids(prompt_ids, "prompt_ids")
        if not self._prompt:
            raise ValueError("prompt_ids is empty: a trajectory starts from at least one token")
        if max_response_tokens is not None and max_response_tokens < 1:
            raise ValueError(f"max_response_tokens={max_response_tokens}: must be >= 1")
        self.max_response_tokens = max_response_tokens
        self._response: list[int] = []
        self._mask: list[int] = []
        self._logprobs: list[float] = []
        self._versions: list[int | None] = []
        """Per response token; None on observation tokens (resolved when read)."""
        self._versioned: bool | None = None
        """Whether generated turns carry versions; None before the first generated turn."""
        self._observation_cut = False
        self.num_turns = 0
        """Generated turns appended (:meth:`add_generated` calls)."""
        self.observation_tokens = 0
        self.finish_reason: str | None = None
        """The last generated turn's finish reason; None before the first."""
        self.reward: float | None = None
        """Set by a loop to score this trajectory itself; None: the dataset's reward function."""
        self.answer_text: str | None = None
        """Set by a loop to choose what the dataset's reward function reads (the gateway: the
        session's last answer); None: the decoded response."""
        self.tool_calls = 0
        """Tool calls the model made (well-formed or not)."""
        self.tool_errors = 0
        """Tool calls that failed: unparseable, unknown tool, bad arguments, or the tool raised."""

    # --- appending ---------------------------------------------------------------------------

    def add_generated(self, output: GenerateOutput) -> None:
        """Append one generate call's sampled ids: trained (mask 1), with their logprobs."""
        if not isinstance(output, GenerateOutput):
            raise TypeError(f"add_generated takes a GenerateOutput, got {type(output).__name__}")
        self._require_open("add_generated")
        room = self.remaining
        if room is not None and len(output.token_ids) > room:
            raise ValueError(
                f"{len(output.token_ids)} generated tokens but only {room} left of "
                f"max_response_tokens={self.max_response_tokens}: ask the engine for at most "
                f"Trajectory.remaining new tokens"
            )
        versioned = output.versions is not None
        if self._versioned is not None and versioned != self._versioned:
            this, earlier = ("carries", "lack") if versioned else ("lacks", "carry")
            raise ValueError(
                f"generated turn {self.num_turns + 1} {this} versions but earlier turns "
                f"{earlier} them: all generated turns carry versions, or none"
            )
        self._versioned = versioned
        count = len(output.token_ids)
        self._response.extend(output.token_ids)
        self._mask.extend([1] * count)
        self._logprobs.extend(output.logprobs)
        self._versions.extend(output.versions if output.versions is not None else [None] * count)
        self.num_turns += 1
        self.finish_reason = output.finish_reason

    def add_observation(self, token_ids: Sequence[int]) -> int:
        """Append what the environment answered (already rendered as token ids): read by the
        model, never trained (mask 0, logprob 0.0). Cut to the remaining budget when it does
        not fit (the trajectory is then truncated); returns the number of ids appended."""
        ids = _token_ids(token_ids, "observation token_ids")
        self._require_open("add_observation")
        room = self.remaining
        if room is not None and len(ids) > room:
            ids = ids[:room]
            self._observation_cut = True
        self._response.extend(ids)
        self._mask.extend([0] * len(ids))
        self._logprobs.extend([0.0] * len(ids))
        self._versions.extend([None] * len(ids))
        self.observation_tokens += len(ids)
        return len(ids)

    def _require_open(self, verb: str) -> None:
        if self.truncated:
            raise ValueError(
                f"{verb} on a truncated trajectory: the response budget "
                f"(max_response_tokens={self.max_response_tokens}) is spent"
            )

    # --- state -------------------------------------------------------------------------------

    @property
    def remaining(self) -> int | None:
        """Response tokens that may still be appended; None without a budget."""
        if self.max_response_tokens is None:
            return None
        return self.max_response_tokens - len(self._response)

    @property
    def truncated(self) -> bool:
        """The response budget ran out (or an observation was cut to fit): the loop must stop."""
        return self._observation_cut or self.remaining == 0

    @property
    def finished(self) -> bool:
        """The model ended its last turn itself (finish reason ``stop``) and the budget was not
        cut short: the trajectory may end here without being truncated."""
        return self.finish_reason == "stop" and not self.truncated

    # --- views -------------------------------------------------------------------------------

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self._prompt

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Everything so far, prompt first: what the next ``ctx.generate`` call continues."""
        return self._prompt + tuple(self._response)

    @property
    def response_ids(self) -> tuple[int, ...]:
        return tuple(self._response)

    @property
    def response_mask(self) -> tuple[int, ...]:
        """1 on generated tokens (trained), 0 on observation tokens."""
        return tuple(self._mask)

    @property
    def response_logprobs(self) -> tuple[float, ...]:
        """The engine's logprob per generated token, 0.0 per observation token."""
        return tuple(self._logprobs)

    @property
    def generated_tokens(self) -> int:
        return len(self._response) - self.observation_tokens

    @property
    def response_versions(self) -> tuple[int, ...] | None:
        """Per response token, the policy version that sampled it; None when the generated
        turns carried none (every token sampled by the current policy).

        An observation token takes the version of the generated token before it (the first
        generated token's when it comes before any), so a sequence's oldest version -- what
        the staleness gates read -- is that of a token it trains on."""
        if not self._versioned:
            return None
        known = [v for v in self._versions if v is not None]
        last = known[0] if known else 0
        resolved = []
        for version in self._versions:
            last = version if version is not None else last
            resolved.append(last)
        return tuple(resolved)

    def __repr__(self) -> str:
        return (
            f"Trajectory(prompt={len(self._prompt)} tokens, response={len(self._response)} "
            f"tokens ({self.generated_tokens} generated), turns={self.num_turns}, "
            f"truncated={self.truncated})"
        )
