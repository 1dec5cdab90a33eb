"""The engine interface and factory: parameter validation, building by name, lazy imports."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from megarl.engines import base
from megarl.engines.base import Generation, SamplingParams, merge_token_ids
from megarl.engines.factory import build_engine
from megarl.engines.vllm import VLLM_MISSING_MESSAGE


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"seed": -1}, "seed"),
    ],
)
def test_sampling_params_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_greedy_means_temperature_zero():
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams().greedy


def test_generation_needs_one_logprob_per_token():
    with pytest.raises(ValueError, match="logprobs"):
        Generation((1,), (2, 3), (-0.1,), finished=False)


def test_merge_token_ids_keeps_order_and_drops_duplicates():
    assert merge_token_ids(2, [0, 2], None, (5,)) == (2, 0, 5)
    assert merge_token_ids(None) == ()


def test_default_eos_ids_are_the_tokenizers_then_the_configs_and_none_is_refused():
    from types import SimpleNamespace

    tokenizer, config = SimpleNamespace(eos_token_id=2), SimpleNamespace(eos_token_id=[7, 2])
    assert base.default_eos_token_ids(tokenizer, config) == (2, 7)
    assert base.default_eos_token_ids(None, config) == (7, 2)
    with pytest.raises(ValueError, match="no EOS token id known"):
        base.default_eos_token_ids(None, SimpleNamespace())


@pytest.mark.parametrize(
    ("request_", "match"),
    [
        (base.Request((), 0), "request 0 has an empty prompt"),
        (base.Request((3, 16), 0), r"request 0 has token ids outside \[0, 16\)"),
        (base.Request((3,), 0, generated_ids=(-1,)), "outside"),
        (base.Request((3,), 0, generated_ids=(4, 5)), "request 0 has no budget left: 2 tokens"),
        (base.Request((3,), 0, max_new_tokens=0), "no budget left"),
        (base.Request((3,), 0, generated_ids=(2,)), "request 0 already ended: EOS among"),
    ],
)
def test_requests_a_decode_loop_cannot_continue_are_refused_by_index(request_, match):
    params = SamplingParams(max_new_tokens=2)
    base.validate_requests([base.Request((1,), 0)], params, (2,), vocab_size=16)  # a good one
    with pytest.raises(ValueError, match=match):
        base.validate_requests([request_], params, (2,), vocab_size=16)


def test_build_engine_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown rollout engine 'sglang'.*hf, vllm"):
        build_engine("sglang")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_vllm_engine_without_vllm_says_how_to_install():
    with pytest.raises(RuntimeError) as error:
        build_engine("vllm", model="unused")
    assert str(error.value) == VLLM_MISSING_MESSAGE
    from megarl.engines.vllm import VLLMEngine

    with pytest.raises(RuntimeError, match="megarl\\[gpu\\]"):
        VLLMEngine(model="unused", dtype="float32")


def test_engine_modules_import_no_engine_library():
    code = (
        "import sys, megarl.engines.factory, megarl.engines.hf, megarl.engines.vllm;"
        "print(sorted({'vllm', 'transformers', 'peft'} & set(sys.modules)))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_build_engine_hf():
    pytest.importorskip("transformers")
    from helpers.models import tiny_llama_model

    from megarl.engines.hf import HFEngine

    model = tiny_llama_model(vocab_size=32, num_hidden_layers=1)
    engine = build_engine("hf", model=model, eos_token_ids=[3])
    assert isinstance(engine, HFEngine)
    assert engine.eos_token_ids == (3,)
    assert engine.memory_state() == base.EngineMemoryState(True, False)
