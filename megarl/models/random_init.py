"""Random-initialised HF models from an inline config (``model=tiny_llama``), saved as a HF folder.

Materialising the random model as an ordinary HF folder means the actor, the reference, the
rollout engine and the converters all load it exactly like a pretrained checkpoint, and every
rank sees bitwise-identical initial weights.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

INIT_MARKER = "megarl_init.json"


def build_random_hf_model(hf_config: Mapping[str, Any], seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**dict(hf_config))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    return model


def save_random_hf_model(
    hf_config: Mapping[str, Any], seed: int, out_dir: Path, tokenizer_from: str | None = None
) -> Path:
    """Write ``out_dir`` (config + safetensors + tokenizer) once; reuse it if already complete."""
    out_dir = Path(out_dir)
    if is_saved(hf_config, seed, out_dir):
        return out_dir
    from megarl.distributed.quiet import hf_progress_bars_off
    from megarl.models.hf_io import load_hf_tokenizer

    model = build_random_hf_model(hf_config, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    with hf_progress_bars_off():  # a tiny model, written in a moment: no "Writing model shards"
        model.save_pretrained(out_dir, safe_serialization=True)
    load_hf_tokenizer(tokenizer_from).save_pretrained(out_dir)
    (out_dir / INIT_MARKER).write_text(json.dumps(_stamp(hf_config, seed)))
    return out_dir


def is_saved(hf_config: Mapping[str, Any], seed: int, out_dir: Path) -> bool:
    """``out_dir`` already holds the model of this config and seed (its marker is written last)."""
    marker = Path(out_dir) / INIT_MARKER
    return marker.is_file() and json.loads(marker.read_text()) == _stamp(hf_config, seed)


def _stamp(hf_config: Mapping[str, Any], seed: int) -> dict[str, Any]:
    return {"hf_config": dict(hf_config), "seed": seed}
