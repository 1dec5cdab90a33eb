"""Cheap checks of a Hugging Face model folder, before anything loads its weights.

A broken model folder otherwise surfaces deep inside a worker (a safetensors parse error on rank
0, a shape mismatch in the Megatron loader, a zero-padded embedding that trains silently), long
after the run started writing. Everything here reads metadata only: ``config.json``, the
safetensors headers (names and shapes, through ``safe_open``; no tensor data), and which
tokenizer files exist. Every problem is one :class:`ModelPathError` line
naming the folder, the file and what is wrong with it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megarl.models import mapping
from megarl.models.spec import ModelSpecError, TransformerSpec, spec_from_hf_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
"""Any one of these lets ``AutoTokenizer`` build a tokenizer (with its ``tokenizer_config.json``)."""
EMBEDDING = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class ModelPathError(ValueError):
    """A model path that cannot be loaded; the message names the path and the problem."""


def check_hf_folder(folder: Path, tokenizer: bool = True) -> TransformerSpec:
    """Raise :class:`ModelPathError` unless ``folder`` is a loadable HF model; return its spec.

    ``tokenizer=False`` for readers that only need the weights (a folder written by the exporter
    for a weight comparison need not carry a tokenizer).
    """
    where = f"model.path={folder}"
    spec = spec_of_config(folder, where)
    shapes = read_weight_shapes(folder, where)
    check_weights_match_config(spec, shapes, where)
    if tokenizer and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ModelPathError(
            f"{where}: folder has no tokenizer (none of "
            f"{', '.join(TOKENIZER_FILES)}); copy the base model's tokenizer "
            "files into it"
        )
    return spec


def spec_of_config(folder: Path, where: str) -> TransformerSpec:
    """``config.json`` parsed and turned into a spec; its faults named as ``config.json: ...``."""
    path = folder / "config.json"
    try:
        config: Any = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelPathError(f"{where}: folder has no config.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelPathError(f"{where}: config.json is not valid JSON ({exc})") from None
    if not isinstance(config, Mapping):
        raise ModelPathError(f"{where}: config.json is not a JSON object")
    try:
        return spec_from_hf_config(config)
    except KeyError as exc:
        raise ModelPathError(f"{where}: config.json has no {exc.args[0]}") from None
    except ModelSpecError as exc:
        raise ModelPathError(f"{where}: config.json: {exc}") from None
    except (TypeError, ValueError) as exc:  # e.g. "hidden_size": "large"
        raise ModelPathError(
            f"{where}: config.json has a value of the wrong type ({exc})"
        ) from None


def read_weight_shapes(folder: Path, where: str) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape from the safetensors headers; no tensor data is read.

    ``safe_open`` also checks that the header's offsets cover the file, so a truncated or
    overwritten file is caught here, not when a rank reads the tensor.
    """
    from safetensors import SafetensorError, safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelPathError(_no_safetensors_message(folder, where))
    _check_shard_index(folder, where)
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                names = list(handle.keys())
                for name in names:
                    shapes[name] = tuple(handle.get_slice(name).get_shape())
        except (SafetensorError, OSError) as exc:
            raise ModelPathError(
                f"{where}: {file.name} is not a readable safetensors file "
                f"({str(exc).strip().splitlines()[0]})"
            ) from None
    if not shapes:
        raise ModelPathError(f"{where}: no tensors in *.safetensors")
    return shapes


def _no_safetensors_message(folder: Path, where: str) -> str:
    pickled = sorted(p.name for p in folder.glob("*.bin"))
    if not pickled:
        return f"{where}: folder has no *.safetensors weights"
    return (
        f"{where}: only {pickled[0]} weights; megarl reads safetensors only: convert with "
        f'`python -c "from transformers import AutoModelForCausalLM as M; '
        f"M.from_pretrained('{folder}').save_pretrained('{folder}')\"` "
        "(save_pretrained writes model.safetensors)"
    )


def _check_shard_index(folder: Path, where: str) -> None:
    """A sharded checkpoint's index must name only files that are there."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        wanted = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelPathError(f"{where}: {index.name} is not a valid shard index ({exc})") from None
    missing = [name for name in wanted if not (folder / name).is_file()]
    if missing:
        raise ModelPathError(f"{where}: {index.name} names {missing[0]}, which is missing")


def check_weights_match_config(
    spec: TransformerSpec,
    shapes: Mapping[str, tuple[int, ...]],
    where: str,
    output_layer: bool = True,
) -> None:
    """The config describes these weights: vocabulary, layer count, every tensor and its shape.

    The vocabulary and layer count come first with their own message, since they are the usual
    way a hand-edited config and its weights part. ``output_layer=False`` for a folder that
    only the critic reads (its value head replaces ``lm_head``, which a reward model lacks).
    """
    for name in (EMBEDDING, LM_HEAD):
        rows = shapes.get(name, (None,))[0]
        if rows is not None and rows != spec.vocab_size:
            raise ModelPathError(
                f"{where}: config.json vocab_size={spec.vocab_size} but {name} has {rows} rows"
            )
    layers = {int(m.group(1)) for name in shapes if (m := _LAYER.match(name))}
    if layers and max(layers) + 1 != spec.num_layers:
        raise ModelPathError(
            f"{where}: config.json num_hidden_layers={spec.num_layers} but the "
            f"weights have model.layers.0 to model.layers.{max(layers)}"
        )
    expected = {}
    for rule in mapping.rules_for(spec):
        if rule.mcore == "output_layer.weight" and (spec.tie_embeddings or not output_layer):
            continue
        for layer in range(spec.num_layers) if rule.per_layer else [None]:
            expected.update(zip(rule.hf_names(layer), mapping.hf_shapes(rule, spec), strict=True))
    missing = [name for name in expected if name not in shapes]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelPathError(
            f"{where}: the weights have no tensor {missing[0]}{more}, which config.json implies"
        )
    for name, shape in expected.items():
        if shapes[name] != shape:
            raise ModelPathError(
                f"{where}: {name} has shape {list(shapes[name])} but config.json "
                f"implies {list(shape)}"
            )
