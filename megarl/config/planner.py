"""The ``planner`` section: which work a step may skip (zero-advantage sequences, the
old-logprob and reference forwards) and whether an approximation is allowed for it.

Only the keys: what they mean for a given run (the prune mode ``auto`` resolves to, the gates'
facts) is :mod:`megarl.config.planning`'s, which reads the whole run's config.
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.config.checks import _choice, _values
from megarl.planner.gates import OldLogProbMode, RefLogProbMode
from megarl.planner.pruning import PRUNE_SETTINGS


@dataclass(frozen=True)
class PlannerConfig:
    """``planner``: which work a step may skip (zero-advantage sequences, the old-logprob and
    reference forwards) and whether an approximation is allowed for it."""

    prune_zero_adv: str = "auto"
    """One of :data:`megarl.planner.pruning.PRUNE_SETTINGS`: auto (match_loss_curve when
    exact, else off) | off | match_loss_curve (exact) | fast (merged steps; exact with one
    mini-batch)."""
    allow_approx: bool = False
    """Prune zero-advantage sequences even where that changes the loss (``actor.kl_coef`` or
    ``actor.entropy_coef`` > 0); the step's plan is then marked approximate. false refuses."""
    old_log_prob: str = "auto"
    """One of :class:`megarl.planner.gates.OldLogProbMode`, where each is explained."""
    ref_log_prob: str = "auto"
    """One of :class:`megarl.planner.gates.RefLogProbMode`, where each is explained."""

    def __post_init__(self) -> None:
        _choice("planner.prune_zero_adv", self.prune_zero_adv, PRUNE_SETTINGS)
        _choice("planner.old_log_prob", self.old_log_prob, _values(OldLogProbMode))
        _choice("planner.ref_log_prob", self.ref_log_prob, _values(RefLogProbMode))
