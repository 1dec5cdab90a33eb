"""The rollout-engine contract (:mod:`helpers.engine_contract`) against the in-process engines:
the HF engine and the Megatron engine (the same weights in a Megatron model, in a world of one).
The vLLM engine runs the same functions in ``tests/integration/test_engine_contract_vllm.py``."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("transformers")
pytest.importorskip("megatron.core")
from helpers.engine_contract import (
    EOS,
    PAD,
    EngineContract,
    EngineUnderTest,
    bias_eos,
    contract_model,
)
from helpers.engines import megatron_engine, megatron_world

from megarl.engines.base import RolloutEngine, SamplingParams
from megarl.engines.hf import HFEngine

SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=12)


@pytest.fixture(scope="module")
def _megatron():
    with megatron_world():
        yield


def hf_engine(eos_bias: float | None) -> RolloutEngine:
    model = contract_model()
    if eos_bias is not None:
        bias_eos(model, eos_bias)
    return HFEngine(model, device="cpu", eos_token_ids=[EOS], pad_token_id=PAD)


def megatron_contract_engine(eos_bias: float | None) -> RolloutEngine:
    return megatron_engine(copy.deepcopy(contract_model()), EOS, PAD, eos_bias)


@pytest.fixture(params=["hf", "megatron"])
def contract(request) -> EngineUnderTest:
    """Both in-process engines draw token ``j`` from ``(seed, j)``, sample a first token
    before they poll an interrupt and one token per poll after it."""
    if request.param == "megatron":
        request.getfixturevalue("_megatron")
    build = hf_engine if request.param == "hf" else megatron_contract_engine
    return EngineUnderTest(
        request.param,
        build,
        SAMPLED,
        resumes_the_same_stream=True,
        lockstep=True,
    )


class TestInProcessEngineContract(EngineContract):
    """The contract's tests, against this module's ``contract`` engines."""
