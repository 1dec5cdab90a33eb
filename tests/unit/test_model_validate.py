"""A broken HF model folder is refused with one line naming the file and the fault, from metadata.

Each case saves a tiny random Llama with ``save_pretrained`` (plus SmolLM2's tokenizer files),
breaks one thing, and checks the message of :func:`megarl.models.validate.check_hf_folder` and of
:func:`megarl.models.hf_io.resolve_model_path`, through which every loader goes.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers.models import edit_config, save_llama_folder

from megarl.models.hf_io import resolve_model_path
from megarl.models.validate import TOKENIZER_FILES, ModelPathError, check_hf_folder


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny") / "hf"
    return save_llama_folder(folder, max_position_embeddings=64)


@pytest.fixture
def folder(pristine, tmp_path) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(pristine, copy)
    return copy


def _drop_tensor(folder: Path, name: str) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(folder / "model.safetensors")
    del state[name]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


def _cut(folder: Path, keep: Callable[[int], int]) -> None:
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: keep(len(data))])


def _pickle_only(folder: Path) -> None:
    from safetensors.torch import load_file

    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()


CORRUPTIONS: dict[str, tuple[Callable[[Path], None], str]] = {
    "header cut short": (
        lambda f: _cut(f, lambda n: 6),
        "model.safetensors is not a readable safetensors file",
    ),
    "tensor data cut short": (
        lambda f: _cut(f, lambda n: n // 2),
        "model.safetensors is not a readable safetensors file",
    ),
    "garbage bytes": (
        lambda f: (f / "model.safetensors").write_bytes(b"\x07" * 4096),
        "model.safetensors is not a readable safetensors file",
    ),
    "config not json": (
        lambda f: (f / "config.json").write_text("{not json"),
        "config.json is not valid JSON",
    ),
    "config a list": (
        lambda f: (f / "config.json").write_text("[1, 2]"),
        "config.json is not a JSON object",
    ),
    "config without layers": (
        lambda f: edit_config(f, num_hidden_layers=None),
        "config.json has no num_hidden_layers",
    ),
    "config without hidden size": (
        lambda f: edit_config(f, hidden_size=None),
        "config.json has no hidden_size",
    ),
    "config of an unsupported family": (
        lambda f: edit_config(f, model_type="gpt2"),
        "config.json: model_type='gpt2' is not supported",
    ),
    "vocab larger than the weights": (
        lambda f: edit_config(f, vocab_size=400),
        "config.json vocab_size=400 but model.embed_tokens.weight has 384 rows",
    ),
    "more layers than the weights": (
        lambda f: edit_config(f, num_hidden_layers=4),
        "num_hidden_layers=4 but the weights have model.layers.0 to model.layers.1",
    ),
    "fewer layers than the weights": (
        lambda f: edit_config(f, num_hidden_layers=1),
        "num_hidden_layers=1 but the weights have model.layers.0 to model.layers.1",
    ),
    "a tensor missing": (
        lambda f: _drop_tensor(f, "model.layers.1.mlp.up_proj.weight"),
        "the weights have no tensor model.layers.1.mlp.up_proj.weight",
    ),
    "ffn size disagreeing": (
        lambda f: edit_config(f, intermediate_size=64),
        "model.layers.0.mlp.gate_proj.weight has shape [48, 32] but config.json implies [64, 32]",
    ),
    "no tokenizer": (
        lambda f: [(f / n).unlink(missing_ok=True) for n in TOKENIZER_FILES],
        "folder has no tokenizer",
    ),
    "pytorch_model.bin only": (
        _pickle_only,
        "only pytorch_model.bin weights; megarl reads safetensors only",
    ),
}


def test_a_saved_model_passes(folder):
    spec = check_hf_folder(folder)
    assert (spec.num_layers, spec.vocab_size, spec.ffn_hidden_size) == (2, 384, 48)
    assert resolve_model_path(folder) == folder


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_each_fault_is_one_line_naming_folder_and_file(folder, case):
    corrupt, needle = CORRUPTIONS[case]
    corrupt(folder)
    with pytest.raises(ModelPathError) as caught:
        resolve_model_path(folder)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"model.path={folder}: ")
    assert needle in message, message


def test_weight_readers_need_no_tokenizer(folder):
    for name in TOKENIZER_FILES:
        (folder / name).unlink(missing_ok=True)
    assert resolve_model_path(folder, tokenizer=False) == folder


def test_pickle_message_says_how_to_convert(folder):
    _pickle_only(folder)
    with pytest.raises(ModelPathError, match=r"save_pretrained\('.*'\)"):
        resolve_model_path(folder)


def test_a_sharded_index_naming_a_missing_file(folder):
    index = {
        "metadata": {},
        "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"},
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        ModelPathError, match="names model-00002-of-00002.safetensors, which is missing"
    ):
        resolve_model_path(folder)


def test_an_unparsable_gguf_is_one_line_and_caches_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGARL_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "random.gguf"
    gguf.write_bytes(bytes(range(256)) * 64)
    with pytest.raises(ModelPathError) as caught:
        resolve_model_path(gguf)
    message = str(caught.value)
    assert message.startswith(f"model.path={gguf}: not a readable .gguf model (")
    assert "\n" not in message
    assert not any(p.is_dir() for p in (tmp_path / "cache").glob("*"))
