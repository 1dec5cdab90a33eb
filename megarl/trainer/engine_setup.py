"""The run's rollout engine from its config: which engine, with which settings.

The vLLM settings are decided by pure code (:mod:`megarl.engines.vllm_settings`) from the
``rollout.*`` keys, the model's shape and the memory free now; start-up asks the same question
before anything is written, so a run that could not start vLLM is refused in one line. The
Megatron engine is built the same way on rank 0 and on the ranks that follow its calls (they
must stop on the same tokens).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from megarl.config.schema import RunConfig
from megarl.engines.base import RolloutEngine
from megarl.engines.factory import build_engine
from megarl.models.spec import TransformerSpec, spec_from_hf_config

if TYPE_CHECKING:
    from megarl.engines.megatron import MegatronEngine


def vllm_request(cfg: RunConfig, device: str, params_dtype: str):
    """The ``rollout.*`` keys the vLLM settings decision reads (pure; tested on CPU)."""
    from megarl.engines.vllm_settings import VLLMRequest

    r = cfg.rollout
    return VLLMRequest(
        device=device,
        params_dtype=params_dtype,
        temperature=r.temperature,
        top_p=r.top_p,
        tp=r.tp,
        sleep_level=r.sleep_level,
        gpu_memory_utilization=r.gpu_memory_utilization,
        kv_cache_gb=r.kv_cache_gb,
        max_model_len=r.max_model_len,
        max_num_seqs=r.max_num_seqs,
        max_num_batched_tokens=r.max_num_batched_tokens,
        enforce_eager=r.enforce_eager,
        lora_rank=cfg.actor.lora.rank,
        seed=cfg.trainer.seed,
        bucket_mb=cfg.export.bucket_mb,
    )


def vllm_settings(cfg: RunConfig, model_dir: str, device: str):
    """How this run starts vLLM (``megarl.engines.vllm_settings``), from the config, the model
    and the memory available now. Raises ``VLLMSettingsError`` naming the key."""
    import psutil

    from megarl.distributed.execution import execution_plan_for
    from megarl.engines.vllm_settings import ModelFacts, decide_vllm_settings
    from megarl.models.hf_io import load_hf_config

    spec = spec_from_hf_config(load_hf_config(model_dir))
    execution = execution_plan_for(cfg, device)
    facts = ModelFacts(
        num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        num_experts=spec.num_experts,
    )
    return decide_vllm_settings(
        vllm_request(cfg, device, execution.params_dtype),
        facts,
        model_dir,
        psutil.virtual_memory().available,
    )


def build_run_engine(
    cfg: RunConfig, tokenizer, device: str, model_dir: str, spec: TransformerSpec
) -> tuple[RolloutEngine, int]:
    """The rollout engine and the sleep level it will actually use."""
    if cfg.rollout.engine == "vllm":  # its processes start while the trainer builds its models
        settings = vllm_settings(cfg, model_dir, device)
        engine = build_engine("vllm", **settings.engine_kwargs, start_in_background=True)
        return engine, settings.sleep_level
    if cfg.rollout.engine == "megatron":  # colocated: the actor's model, bound once it is built
        engine = build_engine(
            "megatron",
            **megatron_engine_kwargs(
                tokenizer, model_dir, spec, device, cfg.rollout.batch_invariant
            ),
        )
        if not cfg.rollout.engine_is_actor:  # the rollout side: a copy of its own
            cast("MegatronEngine", engine).bind_copy(megatron_copy(cfg, model_dir, spec, device))
        return engine, 0  # nothing to release between rollouts: the KV cache lives per call
    from megarl.distributed.quiet import hf_progress_bars_off
    from megarl.models.hf_io import load_hf_model

    with hf_progress_bars_off():  # the console has its own display; the actor loads without one
        model, _ = load_hf_model(model_dir, device=device)
    engine = build_engine(cfg.rollout.engine, model=model, tokenizer=tokenizer, device=device)
    return engine, cfg.rollout.sleep_level


def megatron_copy(cfg: RunConfig, model_dir: str, spec: TransformerSpec, device: str):
    """The rollout side's Megatron model (:mod:`megarl.engines.megatron_copy`): the run's
    starting weights in the run's parameter dtype, with the actor's LoRA adapters."""
    import torch

    from megarl.distributed.execution import execution_plan_for
    from megarl.engines.megatron_copy import build_megatron_copy
    from megarl.models.hf_io import open_hf_tensors

    lora = None
    if cfg.actor.lora.enabled:
        from megarl.models.lora import LoraSettings

        lora = LoraSettings.from_config(cfg.actor.lora, seed=cfg.trainer.seed)
    dtype = getattr(torch, execution_plan_for(cfg, device).params_dtype)
    return build_megatron_copy(spec, open_hf_tensors(model_dir), dtype, device, lora)


def megatron_engine_kwargs(
    tokenizer, model_dir: str, spec: TransformerSpec, device: str, batch_invariant: bool = False
) -> dict[str, Any]:
    """The Megatron engine's constructor kwargs, the same on rank 0 and on the ranks that follow
    it (they must stop on the same tokens): the EOS ids of the tokenizer and the generation
    config, as the HF engine takes them."""
    from megarl.engines.base import merge_token_ids
    from megarl.engines.hf import resolve_pad_token_id
    from megarl.models.hf_io import load_generation_eos_ids

    eos = merge_token_ids(tokenizer.eos_token_id, load_generation_eos_ids(model_dir))
    return {
        "eos_token_ids": eos,
        "pad_token_id": resolve_pad_token_id(None, tokenizer, eos),
        "vocab_size": spec.vocab_size,
        "device": device,
        "batch_invariant": batch_invariant,
    }
