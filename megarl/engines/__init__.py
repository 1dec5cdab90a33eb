"""Rollout engines behind one interface (see ``base``); engine modules are imported lazily."""

from megarl.engines.base import (
    ENGINES,
    EngineMemoryState,
    Generation,
    RolloutEngine,
    SamplingParams,
    build_engine,
    register_engine,
)

__all__ = [
    "ENGINES",
    "EngineMemoryState",
    "Generation",
    "RolloutEngine",
    "SamplingParams",
    "build_engine",
    "register_engine",
]
