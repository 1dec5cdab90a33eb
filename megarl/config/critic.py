"""The ``critic`` section: PPO's value model, built when ``algo.adv_estimator=gae``, with its
optimizer (``critic.optim``, the actor's settings under the critic's name) and where its weights
come from (``critic.model``). The null epochs and mini-batches fall back to the actor's in
:class:`megarl.config.schema.RunConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from megarl.algo.losses import AGG_MODES
from megarl.config.actor import OptimConfig
from megarl.config.checks import _choice, _positive, _require


@dataclass(frozen=True)
class CriticOptimConfig(OptimConfig):
    """``critic.optim``: the same settings as ``actor.optim``, for the critic's optimizer."""

    section: ClassVar[str] = "critic.optim"


@dataclass(frozen=True)
class CriticModelConfig:
    """``critic.model``: where the critic's weights come from."""

    path: str | None = None
    """verl's key: a HF folder the critic's trunk (and, from a ``score.weight`` of shape
    ``[1, hidden]``, its value head) is loaded from, e.g. a value model trained before or a
    reward model; it must hold the actor's architecture (checked at start-up, see
    :mod:`megarl.critic.model_source`). null = the actor's checkpoint with a fresh head."""


@dataclass(frozen=True)
class CriticConfig:
    """PPO's critic (built exactly when ``algo.adv_estimator=gae``): the actor's architecture
    and TP/PP layout on the same ranks, a scalar value head, its own optimizer. verl's keys
    where it has them."""

    lr: float = 1e-5
    """The critic's learning rate (verl keeps it under the critic's ``optim``; megarl's actor
    has ``actor.lr``, and the critic mirrors that)."""
    optim: CriticOptimConfig = field(default_factory=CriticOptimConfig)
    """AdamW settings and grad clipping, as ``actor.optim``."""
    ppo_epochs: int | None = None
    """Passes over the rollout batch per step; null = ``actor.ppo_epochs``."""
    ppo_mini_batches: int | None = None
    """Optimizer steps per epoch; null = ``actor.ppo_mini_batches``."""
    cliprange_value: float = 0.5
    """verl's key: a new value prediction is clipped to within this of the rollout's value."""
    loss_agg: str = "token-mean"
    """How the value loss is aggregated, one of :data:`megarl.algo.losses.AGG_MODES` (verl's
    ``loss_agg_mode`` of its critic)."""
    value_head_init_std: float = 0.0
    """0: the value head starts at zero (every first value is 0); > 0: a normal draw. Unused
    when ``critic.model.path`` holds a head."""
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    """Where the critic's weights come from (``critic.model.path``)."""

    def __post_init__(self) -> None:
        _positive("critic.lr", self.lr)
        _positive("critic.cliprange_value", self.cliprange_value)
        _choice("critic.loss_agg", self.loss_agg, AGG_MODES)
        _require(
            self.value_head_init_std >= 0,
            f"critic.value_head_init_std={self.value_head_init_std}: must be >= 0",
        )
        for key in ("ppo_epochs", "ppo_mini_batches"):
            value = getattr(self, key)
            _require(value is None or value > 0, f"critic.{key}={value}: must be > 0 or null")
