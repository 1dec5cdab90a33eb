"""Build a rollout engine from its config name (``rollout.engine``).

The interface (:mod:`megarl.engines.base`) knows no engine; this module knows them all. It
imports an engine's module only when that engine is asked for, so validating a config or
building the ``hf`` engine never loads the vLLM engine's code.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from megarl.engines.base import RolloutEngine

ENGINE_NAMES: tuple[str, ...] = ("hf", "vllm", "megatron")
"""The one list of engines: the config schema validates ``rollout.engine`` against it."""


def build_engine(name: str, **kwargs: Any) -> RolloutEngine:
    """The engine called ``name``, built with that engine's own constructor kwargs."""
    match name:
        case "hf":
            from megarl.engines.hf import HFEngine

            return HFEngine(**kwargs)
        case "vllm":
            from megarl.engines.vllm import VLLM_MISSING_MESSAGE, VLLMEngine

            # Checked before the constructor, so the message is the same whatever the kwargs.
            if importlib.util.find_spec("vllm") is None:
                raise RuntimeError(VLLM_MISSING_MESSAGE)
            return VLLMEngine(**kwargs)
        case "megatron":
            from megarl.engines.megatron import MegatronEngine

            return MegatronEngine(**kwargs)
    raise ValueError(f"unknown rollout engine {name!r}; known: {', '.join(ENGINE_NAMES)}")
