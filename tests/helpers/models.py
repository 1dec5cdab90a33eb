"""Tiny model configurations and random models, as HF config dicts, ``transformers`` models and
saved folders."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

TINY_HF_CONFIG = {
    "model_type": "llama",
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}
"""The tiny Llama the export, LoRA and equivalence tests build with random weights."""

TINY_MOE_HF_CONFIGS = {
    "qwen3_moe": dict(
        TINY_HF_CONFIG,
        model_type="qwen3_moe",
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        norm_topk_prob=False,
    ),
    "mixtral": dict(
        TINY_HF_CONFIG, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2
    ),
    "qwen2_moe": dict(
        TINY_HF_CONFIG,
        model_type="qwen2_moe",
        num_hidden_layers=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=80,
    ),
}
"""Tiny MoE models on :data:`TINY_HF_CONFIG`: 4 experts, top-2; Qwen3-MoE without top-k
renormalisation, Mixtral with; Qwen2-MoE (q/k/v bias, no renormalisation) with a gated shared
expert beside the routed ones. What the multi-rank Megatron tests build."""

TWO_LAYER_DIMS = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 64,
}
"""The sizes of the smallest model the plain-data tests compute layouts for (no family)."""

TWO_LAYER_HF_CONFIG = {"model_type": "llama", **TWO_LAYER_DIMS, "tie_word_embeddings": False}
""":data:`TWO_LAYER_DIMS` as an untied Llama."""

MOE_EXPERTS = {
    "qwen3_moe": {"num_experts": 4, "moe_intermediate_size": 24, "head_dim": 16},
    "mixtral": {"num_local_experts": 4, "intermediate_size": 24},
    "qwen2_moe": {
        "num_experts": 4,
        "moe_intermediate_size": 24,
        "shared_expert_intermediate_size": 40,
    },
}
"""Every mixture-of-experts family's expert keys, tiny: 4 experts of FFN 24 (Qwen2-MoE with a
shared expert of 40); add ``num_experts_per_tok``."""


def tiny_llama_hf_config() -> dict:
    """``model=tiny_llama``'s HF config (configs/model/tiny_llama.yaml), what runs train."""
    import yaml

    path = Path(__file__).resolve().parents[2] / "configs" / "model" / "tiny_llama.yaml"
    return dict(yaml.safe_load(path.read_text())["hf_config"])


def tiny_llama_model(seed: int | None = 0, **config: Any):
    """A ``LlamaForCausalLM`` (eval mode) with random weights drawn after
    ``torch.manual_seed(seed)`` (none for ``None``). ``config`` goes to ``LlamaConfig`` over
    two layers, hidden 32, FFN 48, 4 heads, 2 KV heads, untied embeddings."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    values = {
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
        **config,
    }
    if seed is not None:
        torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**values)).eval()


def engine_llama(seed: int, vocab_size: int, hidden_size: int, **config: Any):
    """The engine tests' :func:`tiny_llama_model`: ``hidden_size`` wide with an FFN twice
    that, 256 positions, BOS 1 and EOS 2 (the ids their prompts avoid); ``config`` adds or
    overrides ``LlamaConfig`` keys (``pad_token_id``, ``tie_word_embeddings``, heads)."""
    values = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "max_position_embeddings": 256,
        "eos_token_id": 2,
        "bos_token_id": 1,
        **config,
    }
    return tiny_llama_model(seed, **values)


def save_llama_folder(folder: Path, **config: Any) -> Path:
    """:func:`tiny_llama_model` (seed 0, vocab 384 unless ``config`` says) saved by
    ``save_pretrained`` with SmolLM2's tokenizer files: a valid ``model.path``."""
    from megarl.models.hf_io import resolve_model_path

    model = tiny_llama_model(0, **{"vocab_size": 384, **config})
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(resolve_model_path(None) / name, folder / name)
    return folder


def edit_config(folder: Path, **changes: Any) -> None:
    """Set keys of ``folder``'s config.json (a ``None`` value deletes the key)."""
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            del config[key]
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))


def value_model_folder(folder, hf_config: dict, seed: int, num_labels: int = 1, bias: float = 0.0):
    """A random-init ``...ForTokenClassification`` (what verl's critic loads) of ``hf_config``,
    its ``score.bias`` set to ``bias``, saved by transformers: a ``critic.model.path``.
    Returns the model (eval mode)."""
    import torch
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.for_model(**hf_config, num_labels=num_labels)
    torch.manual_seed(seed)
    model = AutoModelForTokenClassification.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        model.score.bias.fill_(bias)
    model.save_pretrained(folder, safe_serialization=True)
    return model
