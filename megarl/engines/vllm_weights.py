"""Weights on their way from the trainer into vLLM: names, shapes, fused-group buckets, adapters.

The vLLM engine (:mod:`megarl.engines.vllm`) streams HF-named tensors into vLLM's workers, which
hold some of them fused (q/k/v, gate/up, a layer's experts) and load a LoRA adapter only from a
PEFT folder. What is decided on the host before a tensor leaves is here, tested without vLLM:
which names and shapes the served checkpoint has (read from its safetensors headers), the name a
tied ``lm_head.weight`` is loaded under, where a stream may be cut into buckets without splitting
a fused group, and the adapter folder vLLM reads.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import torch

from megarl.engines.tensor_transport import tensor_nbytes

TIED_LM_HEAD = "lm_head.weight"
EMBED_TOKENS = "model.embed_tokens.weight"


def canonical_weight_name(name: str, tied_embeddings: bool) -> str:
    """Rename a tied ``lm_head.weight`` to the embedding it aliases (what vLLM loads)."""
    return EMBED_TOKENS if tied_embeddings and name == TIED_LM_HEAD else name


def read_checkpoint_shapes(model_path: str) -> dict[str, tuple[int, ...]] | None:
    """HF parameter name -> shape, from a local checkpoint's safetensors headers.

    Only headers are read. None when ``model_path`` is not a local folder of safetensors files
    (e.g. a hub id), in which case only vLLM's own checks apply. A tied ``lm_head.weight`` is
    added with the embedding's shape so that either name is accepted.
    """
    from safetensors import safe_open

    folder = Path(model_path)
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    if read_tie_word_embeddings(model_path) and EMBED_TOKENS in shapes:
        shapes.setdefault(TIED_LM_HEAD, shapes[EMBED_TOKENS])
    return shapes


def read_tie_word_embeddings(model_path: str) -> bool:
    """Whether the checkpoint's ``config.json`` ties input and output embeddings."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return False
    config = json.loads(config_file.read_text())
    text_config = config.get("text_config") or {}
    return bool(config.get("tie_word_embeddings", text_config.get("tie_word_embeddings", False)))


def check_weight(
    name: str, tensor: torch.Tensor, expected_shapes: Mapping[str, tuple[int, ...]] | None
) -> None:
    """ValueError naming ``name`` if it is unknown or mis-shaped (when shapes are known)."""
    if expected_shapes is None:
        return
    if name not in expected_shapes:
        raise ValueError(f"unknown parameter name {name!r} for the served model")
    if tuple(tensor.shape) != expected_shapes[name]:
        raise ValueError(
            f"parameter {name!r} has shape {expected_shapes[name]}, got {tuple(tensor.shape)}"
        )


def fused_group(
    name: str, packed_modules: Mapping[str, Sequence[str]]
) -> tuple[str, str, str] | None:
    """``(group key, fused module, part)`` when ``name`` is part of a fused vLLM parameter.

    ``model.layers.0.self_attn.k_proj.weight`` with ``{"qkv_proj": ["q_proj", "k_proj",
    "v_proj"]}`` is part ``k_proj`` of ``qkv_proj``, group
    ``model.layers.0.self_attn.qkv_proj.weight``; a name in no group gives None. A member may
    span two name parts: a layer's experts are one group whose members are ``{e}.gate_proj``,
    ``{e}.up_proj``, ``{e}.down_proj`` for every expert ``e``.
    """
    parts = name.split(".")
    for index in range(len(parts)):
        for width in (1, 2):
            part = ".".join(parts[index : index + width])
            for fused, members in packed_modules.items():
                if part in members:
                    key = [*parts[:index], fused, *parts[index + width :]]
                    return ".".join(key), fused, part
    return None


class FusedGroupBatcher:
    """Cut a stream of HF tensors into buckets that never split a fused group.

    A fused group's parts are held back until the last one arrives and then enter a bucket
    together; a bucket is closed once it holds at least ``max_bytes`` (a group larger than the
    budget makes its bucket larger). Parts still waiting when a stream ends stay in
    :attr:`pending` for the next stream, so a sync sent as several calls works too.
    """

    def __init__(self, packed_modules: Mapping[str, Sequence[str]], max_bytes: int) -> None:
        self.packed = {fused: tuple(parts) for fused, parts in packed_modules.items()}
        self.max_bytes = max_bytes
        self.pending: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
        """Group key -> part -> (name, tensor), for groups not yet complete."""

    def buckets(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in named_tensors:
            ready = self._release(name, tensor)
            bucket.extend(ready)
            size += sum(tensor_nbytes(t) for _, t in ready)
            if size >= self.max_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

    def _release(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """What may be sent now: this tensor, or its whole group once the group is complete."""
        group = fused_group(name, self.packed)
        if group is None:
            return [(name, tensor)]
        key, fused, part = group
        seen = self.pending.setdefault(key, {})
        seen[part] = (name, tensor)
        if len(seen) < len(self.packed[fused]):
            return []
        del self.pending[key]
        return [seen[member] for member in self.packed[fused]]

    def pending_names(self) -> list[str]:
        return sorted(name for parts in self.pending.values() for name, _ in parts.values())


def write_peft_adapter(
    folder: Path,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    rank: int,
    alpha: float,
    target_modules: Sequence[str],
) -> int:
    """Write a PEFT LoRA adapter folder vLLM can load; return the number of tensors."""
    from safetensors.torch import save_file

    tensors = {name: t.detach().to("cpu").contiguous() for name, t in named_tensors}
    if not tensors:
        raise ValueError("LoRA adapter has no tensors")
    for name in tensors:
        if ".lora_A." not in name and ".lora_B." not in name:
            raise ValueError(f"LoRA tensor {name!r} is not a PEFT lora_A/lora_B weight name")
    folder.mkdir(parents=True, exist_ok=False)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(target_modules),
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "task_type": "CAUSAL_LM",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return len(tensors)
