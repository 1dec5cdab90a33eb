"""The critic's initial weights on disk: the actor's checkpoint, or ``critic.model.path``.

:func:`check_critic_folder` reads metadata only (``config.json``, safetensors headers, and the
one-element ``score.bias`` when there is one) and applies :mod:`megarl.critic.model_source`'s
rules; the driver calls it at start-up, so a folder the critic cannot start from is refused in
one line before anything is written. :func:`critic_init` is what each rank calls when it builds
the critic: the same check (so the driver's decision and the ranks' cannot part), then a reader
of the folder's tensors and its head. No megatron at import: the driver imports this module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from megarl.critic.model_source import (
    SCORE_BIAS,
    SCORE_WEIGHT,
    CriticModelError,
    ValueHeadSource,
    check_same_architecture,
    decide_value_head,
    fresh_head,
)
from megarl.models.hf_io import tensor_reader
from megarl.models.spec import TransformerSpec
from megarl.models.validate import check_weights_match_config, read_weight_shapes, spec_of_config

HfWeights = Callable[[str], torch.Tensor] | Mapping[str, torch.Tensor]


def where_of(path: str) -> str:
    return f"critic.model.path={path}"


def check_critic_folder(path: str, actor: TransformerSpec, init_std: float) -> ValueHeadSource:
    """Raise :class:`CriticModelError` or :class:`~megarl.models.validate.ModelPathError` (one
    line, both ``ValueError``) unless ``path`` holds the actor's architecture with every trunk
    tensor; return where the value head starts."""
    where = where_of(path)
    folder = Path(path).expanduser()
    if not folder.exists():
        raise CriticModelError(f"{where}: no such folder")
    if not folder.is_dir():
        raise CriticModelError(f"{where}: not a folder (the critic reads a HF model folder)")
    spec = spec_of_config(folder, where)
    check_same_architecture(where, actor, spec)
    shapes = read_weight_shapes(folder, where)
    check_weights_match_config(spec, shapes, where, output_layer=False)
    bias = None
    if SCORE_BIAS in shapes and SCORE_WEIGHT in shapes:
        bias = [float(b) for b in _read(folder, where, SCORE_BIAS).flatten().tolist()]
    return decide_value_head(where, shapes, bias, actor.hidden_size, init_std)


def _read(folder: Path, where: str, name: str) -> torch.Tensor:
    return tensor_reader(folder, where)(name)


@dataclass(frozen=True)
class CriticInit:
    """What a rank builds its critic from."""

    weights: HfWeights
    """The trunk's HF tensors by name."""
    head_weight: torch.Tensor | None
    """``[1, hidden]`` from the folder's ``score.weight``; None for a fresh head."""
    description: str
    """One line for the start-up log: where the trunk and the head come from."""


def critic_init(
    path: str | None, actor_weights: HfWeights, actor: TransformerSpec, init_std: float
) -> CriticInit:
    """The critic's weights: ``path``'s (``critic.model.path``) when set, else the actor's
    checkpoint with a fresh head. A resumed run builds from here too and then overwrites
    trunk and head with its checkpoint's ``critic/`` tensors."""
    if path is None:
        text = f"critic: trunk from the actor's checkpoint, {fresh_head(init_std)}"
        return CriticInit(actor_weights, None, text)
    source = check_critic_folder(path, actor, init_std)
    where = where_of(path)
    read = tensor_reader(Path(path).expanduser(), where)
    head = read(SCORE_WEIGHT) if source.from_checkpoint else None
    return CriticInit(read, head, f"critic: trunk from {where}, {source.description}")
