"""The rollout-engine contract (:mod:`helpers.engine_contract`) against the vLLM engine, vLLM's
CPU build in fp32 (``test_engine_contract.py`` runs the same functions against the HF and
Megatron engines). One engine, started once, serves the module; its own promises (a resumed
request is a new draw, no token before the first poll, processed logprobs) are stated in
:mod:`helpers.engine_contract`. What only vLLM has (weight loading, adapters, sleep, a dying
engine core) is tested in ``test_vllm_engine.py``."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

from helpers.engine_contract import (  # noqa: E402
    EOS,
    EngineContract,
    EngineUnderTest,
    contract_model,
)

from megarl.engines.base import SamplingParams  # noqa: E402
from megarl.engines.vllm import VLLMEngine  # noqa: E402

SAMPLED = SamplingParams(temperature=0.8, max_new_tokens=12)
"""Processed logprobs report any temperature, but only without top-p (vLLM renormalises after
it): the HF and Megatron engines' setting less its top-p."""


@pytest.fixture(scope="module")
def vllm_engine(tmp_path_factory):
    folder = tmp_path_factory.mktemp("contract-llama")
    contract_model().save_pretrained(folder)
    engine = VLLMEngine(
        str(folder),
        dtype="float32",
        logprobs_mode="processed_logprobs",
        enforce_eager=True,
        kv_cache_memory_bytes=64 << 20,
        max_model_len=256,
        max_num_seqs=16,
        eos_token_ids=[EOS],
        skip_tokenizer_init=True,
        weight_load_method="load_weights",
    )
    yield engine
    engine.close()


@pytest.fixture
def contract(vllm_engine, monkeypatch) -> EngineUnderTest:
    """The module's engine; an EOS bias is a ``logit_bias`` on each request of the test (vLLM
    applies it before the processed logprobs, so they include it, as the other engines' hooks
    do; vLLM clamps it to [-100, 100], which still never samples EOS at -1e4)."""
    build_params = vllm_engine._vllm_sampling_params

    def build(eos_bias: float | None) -> VLLMEngine:
        def with_bias(params, request):
            vllm_params = build_params(params, request)
            vllm_params.logit_bias = {EOS: eos_bias}
            return vllm_params

        monkeypatch.setattr(vllm_engine, "_vllm_sampling_params", build_params)
        if eos_bias is not None:
            monkeypatch.setattr(vllm_engine, "_vllm_sampling_params", with_bias)
        return vllm_engine

    return EngineUnderTest(
        "vllm",
        build,
        SAMPLED,
        resumes_the_same_stream=False,
        lockstep=False,
    )


class TestVLLMEngineContract(EngineContract):
    """The contract's tests, against this module's ``contract`` engines."""
