"""Divergence as a named event: a non-finite gradient norm or updated weight stops the run with
one line saying the step, the quantity and the settings most likely responsible.

A learning rate that blows the weights up otherwise trains a step "normally" and fails a step
later far from its cause (the sampler's "probability tensor contains inf, nan or element < 0").
The trainer checks the global gradient norm before the optimizer applies it (the CPU optimizer
skips a non-finite update; Megatron-LM's ``check_for_nan_in_loss_and_grad`` is the model) and
the weights after every update, so the engine never receives non-finite weights;
``trainer.skip_nonfinite_updates=true`` skips such an update, counts it
(``actor/skipped_nonfinite_updates``) and trains on from the unchanged weights instead.

Pure: the messages and the decision, on plain numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megarl.errors import MegarlError


class DivergenceError(MegarlError):
    """Training diverged: a non-finite gradient norm, update or sampling distribution."""


@dataclass(frozen=True)
class DivergenceHints:
    """The settings a divergence message names (the usual causes)."""

    lr: float
    grad_clip: float

    def advice(self) -> str:
        clip = (
            "clip gradients (actor.optim.grad_clip=1.0)"
            if self.grad_clip <= 0
            else f"lower actor.optim.grad_clip={self.grad_clip:g}"
        )
        return f"lower actor.lr={self.lr:g} or {clip}"


def nonfinite_grad_message(step: int, optimizer_step: int, grad_norm: float, hints) -> str:
    """The one line for a non-finite global gradient norm (its update was not applied)."""
    return (
        f"training diverged at step {step}: actor/grad_norm is {grad_norm} at optimizer step "
        f"{optimizer_step + 1} of the step, so its update was not applied; {hints.advice()}, or "
        "set trainer.skip_nonfinite_updates=true to skip such updates and train on"
    )


def nonfinite_weights_message(step: int, optimizer_step: int, hints) -> str:
    """The one line for weights that an update left non-finite (never sent to the engine)."""
    return (
        f"training diverged at step {step}: the weights after optimizer step "
        f"{optimizer_step + 1} of the step are not finite (not sent to the engine, not saved); "
        f"{hints.advice()}"
    )


def nonfinite_sampling_message(step: int, version: int, detail: str) -> str:
    """The one line for an engine whose sampling distribution is not finite: the weights it
    serves (policy ``version``) diverged although each was finite."""
    return (
        f"training diverged before step {step}: the engine's sampling probabilities are not "
        f"finite under the weights of policy version {version} ({detail}); lower actor.lr or "
        "clip gradients (actor.optim.grad_clip)"
    )


def is_nonfinite(value: float) -> bool:
    return not math.isfinite(value)
