"""The Megatron engine on the rollout side: its own TP=1 copy, fed by the exporter in Megatron
layout, in a world of one.

The copy starts from other weights than the trainer's; after one sync through the real exporter
(whole Megatron parameters under Megatron names, checksums verified) it generates what the HF
engine fed the same weights generates (greedy tokens, logprobs to fp32 rounding) and, bitwise,
what the Megatron engine bound to the trainer's own model generates. A LoRA adapter synced under
peft's names lands in the copy's adapters: bitwise the trainer's adapted model again.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")
from helpers.engines import megatron_world
from test_engine_hf import EOS, PAD, PROMPTS, make_engine, tiny_llama

from megarl.engines.base import LoraAdapter, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=10, seed=3)


@pytest.fixture(scope="module", autouse=True)
def _world():
    with megatron_world():
        yield


def _trainer_model(hf_model, lora=None):
    """A TP=1 Megatron model of ``hf_model``'s weights: the trainer's side of the sync."""
    from megarl.models.megatron_gpt import build_gpt_model, load_hf_weights
    from megarl.models.spec import spec_from_hf_config

    spec = spec_from_hf_config(hf_model.config)
    gpt = build_gpt_model(spec, 1, 1)
    load_hf_weights(gpt, spec, dict(hf_model.state_dict()))
    if lora is not None:
        from megarl.models.lora import apply_lora

        apply_lora(gpt, spec, lora)
    return gpt, spec


def _engine_over(model_or_copy, spec):
    from megarl.engines.megatron import MegatronEngine
    from megarl.engines.megatron_copy import MegatronCopy

    engine = MegatronEngine([EOS], PAD, spec.vocab_size)
    if isinstance(model_or_copy, MegatronCopy):
        engine.bind_copy(model_or_copy)
    else:
        engine.bind_model([model_or_copy])
    return engine


def _copy_of(hf_model, lora=None):
    from megarl.engines.megatron_copy import build_megatron_copy
    from megarl.models.spec import spec_from_hf_config

    spec = spec_from_hf_config(hf_model.config)
    return build_megatron_copy(spec, dict(hf_model.state_dict()), torch.float32, "cpu", lora)


def _sync(trainer_gpt, spec, engine, checksum: bool = True):
    """One weight sync through the exporter, as the trainer's rank 0 runs it."""
    from megarl.export.sync import sync_engine_weights
    from megarl.models.megatron_gpt import iter_local_params

    return sync_engine_weights(
        iter_local_params(trainer_gpt, spec),
        spec,
        bucket_mb=1,
        vpp=1,
        checksum=checksum,
        engine=engine,
        megatron_layout=True,
    )


@pytest.mark.parametrize("tie", [False, True])
def test_after_a_sync_the_copy_generates_what_the_trainers_weights_generate(tie):
    trained = tiny_llama(tie=tie, seed=0)
    trainer_gpt, spec = _trainer_model(trained)
    copy = _copy_of(tiny_llama(tie=tie, seed=1))
    engine = _engine_over(copy, spec)
    before = engine.generate(PROMPTS * 2, GREEDY)
    result = _sync(trainer_gpt, spec, engine)
    assert result.metrics["export/checksum_ok"] == 1.0 and result.checksum is not None
    assert result.metrics["export/bytes"] == 4 * spec.num_parameters()
    after = engine.generate(PROMPTS * 2, GREEDY)
    assert after != before  # (a tied random model repeats its last token: the logprobs differ)
    hf = make_engine(trained).generate(PROMPTS * 2, GREEDY)
    assert [g.response_ids for g in after] == [g.response_ids for g in hf]
    for a, b in zip(after, hf, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.response_logprobs), torch.tensor(b.response_logprobs), atol=1e-5, rtol=0
        )
    colocated = _engine_over(trainer_gpt, spec)
    for params in (GREEDY, SAMPLED):
        assert engine.generate(PROMPTS * 2, params) == colocated.generate(PROMPTS * 2, params)


def test_a_copy_that_does_not_hold_what_was_sent_fails_the_checksum():
    from megarl.export.sync import ExportChecksumError

    trainer_gpt, spec = _trainer_model(tiny_llama(seed=0))
    copy = _copy_of(tiny_llama(seed=1))
    engine = _engine_over(copy, spec)
    real_load = copy.load

    def load_and_corrupt(named_tensors):
        count = real_load(named_tensors)
        with torch.no_grad():
            copy.model.decoder.final_layernorm.weight.mul_(1.5)
        return count

    copy.load = load_and_corrupt
    with pytest.raises(ExportChecksumError, match="decoder.final_layernorm.weight"):
        _sync(trainer_gpt, spec, engine)


def test_a_synced_lora_adapter_generates_bitwise_like_the_trainers_adapted_model():
    """The trainer's adapters (B moved away from 0, as training does), gathered under peft's
    names and loaded into the copy's adapters: the copy and the trainer's model then generate
    the same bits; before the adapter sync they do not."""
    from megarl.export.lora import gather_peft_adapter
    from megarl.models.lora import LoraSettings, hf_target_modules, iter_adapters

    lora = LoraSettings(rank=4, alpha=8.0, seed=5)
    hf_model = tiny_llama(seed=0)
    trainer_gpt, spec = _trainer_model(hf_model, lora)
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for site in iter_adapters(trainer_gpt, spec):
            site.adapter.lora_B.copy_(0.3 * torch.randn(site.adapter.lora_B.shape, generator=gen))
    copy = _copy_of(hf_model, lora)
    engine = _engine_over(copy, spec)
    assert engine.memory_state().adapter_resident
    trainer_engine = _engine_over(trainer_gpt, spec)
    expected = trainer_engine.generate(PROMPTS * 2, SAMPLED)
    assert engine.generate(PROMPTS * 2, SAMPLED) != expected
    adapter = gather_peft_adapter(trainer_gpt, spec)
    assert adapter is not None
    targets = tuple(hf_target_modules(spec, lora.target_modules))
    engine.load_lora_adapter(LoraAdapter(adapter, rank=4, alpha=8.0, target_modules=targets))
    assert engine.generate(PROMPTS * 2, SAMPLED) == expected
    with pytest.raises(ValueError, match="differs from the copy's"):
        engine.load_lora_adapter(LoraAdapter(adapter, rank=2, alpha=8.0, target_modules=targets))


def test_the_copy_refuses_a_process_that_is_in_a_larger_world(monkeypatch):
    """The copy's forward would run its collectives in whatever world the process is in: it
    takes a world of one (its own, or a test's) and refuses any other, naming it."""
    import torch.distributed as dist

    from megarl.engines.megatron_copy import open_private_world

    open_private_world("cpu")  # this module's world of one: taken as it is
    monkeypatch.setattr(dist, "get_world_size", lambda *_a, **_k: 2)
    with pytest.raises(
        RuntimeError, match="needs a process of its own: this one is in a world of 2"
    ):
        open_private_world("cpu")
