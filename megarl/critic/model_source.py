"""Where the critic's weights come from: the actor's checkpoint, or ``critic.model.path``.

verl's ``critic.model.path`` lets PPO's value model start from another HF folder than the
policy: a value model trained before, or a reward model. megarl builds the critic through the
actor's code at the actor's TP/PP on the actor's ranks, so that folder must hold the actor's
architecture; these rules decide, on plain data (no torch, no megatron), whether it does and
where the value head starts. The driver applies them at start-up, before anything is written;
the ranks apply them again when they load, so both always agree.

What may differ from the actor:

* ``tie_embeddings``: the critic has no vocabulary output layer (the value head replaces it),
  so whether the folder's ``lm_head`` is tied to its embedding never reaches the critic; a
  reward model saved as ``...ForSequenceClassification`` has no ``lm_head`` at all.

Everything else must be equal, the vocabulary size included: the critic is fed the actor's
token ids, so its embedding table must be indexed by the same vocabulary (a larger table would
accept the ids but could belong to another tokenizer; the Megatron build also pads the table
by the actor's vocabulary).

The value head: HF's scalar heads (``AutoModelForTokenClassification(num_labels=1)``, what
verl's critic loads, and ``...ForSequenceClassification``, a reward model) are a linear layer
``score`` after the final norm, which is exactly where megarl's value head sits, so a
``score.weight`` of shape ``[1, hidden]`` is loaded as the head. megarl's head has no bias: a
``score.bias`` (token classification keeps one) is accepted only when it is zero, since a
constant offset on every value cannot be folded into a bias-free head and dropping it would
start from other values than the folder's model computes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from megarl.models.spec import TransformerSpec

SCORE_WEIGHT = "score.weight"
"""HF's scalar head in token- and sequence-classification models."""
SCORE_BIAS = "score.bias"
MAY_DIFFER = ("tie_embeddings",)
"""Spec fields the critic's folder may have otherwise than the actor's (see the module doc)."""


class CriticModelError(ValueError):
    """``critic.model.path`` cannot initialise the critic; the message is one line naming it."""


def first_spec_difference(
    actor: TransformerSpec, critic: TransformerSpec
) -> tuple[str, object, object] | None:
    """The first spec field (in declaration order) where the critic's folder differs from the
    actor's, as ``(field, critic's value, actor's value)``; None when the critic can be built
    through the actor's code."""
    for fld in fields(TransformerSpec):
        if fld.name in MAY_DIFFER:
            continue
        mine, actors = getattr(critic, fld.name), getattr(actor, fld.name)
        if mine != actors:
            return fld.name, mine, actors
    return None


def check_same_architecture(where: str, actor: TransformerSpec, critic: TransformerSpec) -> None:
    """Raise :class:`CriticModelError` naming the first differing field and both values."""
    difference = first_spec_difference(actor, critic)
    if difference is not None:
        name, mine, actors = difference
        raise CriticModelError(
            f"{where}: {name} {mine} differs from the actor's {actors} (the critic is built "
            "with the actor's architecture and layout)"
        )


@dataclass(frozen=True)
class ValueHeadSource:
    """Where the critic's value head starts."""

    from_checkpoint: bool
    """Load ``score.weight`` of the critic's folder; else a fresh head."""
    description: str
    """For the start-up log line."""


def fresh_head(init_std: float) -> str:
    if init_std > 0:
        return f"value head drawn with critic.value_head_init_std={init_std}"
    return "value head zero-initialised (critic.value_head_init_std=0)"


def decide_value_head(
    where: str,
    shapes: Mapping[str, Sequence[int]],
    bias: Sequence[float] | None,
    hidden_size: int,
    init_std: float,
) -> ValueHeadSource:
    """The head from the folder's ``score.weight`` when it has one (``shapes`` are the folder's
    tensor shapes by HF name, ``bias`` the values of its ``score.bias`` if any), else fresh.

    Refused: a ``score.weight`` that is not ``[1, hidden_size]`` (a classifier of several
    labels, or another model's width), and a nonzero ``score.bias``.
    """
    if SCORE_WEIGHT not in shapes:
        return ValueHeadSource(False, f"{fresh_head(init_std)}; {where} has no {SCORE_WEIGHT}")
    shape = list(shapes[SCORE_WEIGHT])
    if shape != [1, hidden_size]:
        raise CriticModelError(
            f"{where}: {SCORE_WEIGHT} has shape {shape}; a value head needs [1, {hidden_size}] "
            "(a scalar head: num_labels=1)"
        )
    if bias is not None and any(b != 0 for b in bias):
        shown = ", ".join(f"{b:.4g}" for b in bias[:4])
        raise CriticModelError(
            f"{where}: {SCORE_BIAS} is nonzero ([{shown}]); megarl's value head has no bias "
            f"(save the model with {SCORE_BIAS} zeroed, or without it)"
        )
    return ValueHeadSource(True, f"value head from {where} ({SCORE_WEIGHT})")
