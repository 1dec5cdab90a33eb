"""A Megatron model chunk as megarl walks it: the bare ``GPTModel`` and where its layers sit.

The lowest layer of :mod:`megarl.models` that touches a built model: the model builder
(:mod:`~megarl.models.megatron_gpt`) and the adapters (:mod:`~megarl.models.lora`) both walk
chunks with these helpers, so neither has to import the other for them.
"""

from __future__ import annotations

from typing import Any


def unwrap(model: Any) -> Any:
    """The bare ``GPTModel`` under DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def layer_offset(model: Any) -> int:
    """Global number of this chunk's first transformer layer."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    model = unwrap(model)
    return get_transformer_layer_offset(model.config, vp_stage=getattr(model, "vp_stage", None))
