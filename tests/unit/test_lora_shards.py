"""LoRA adapters in checkpoints, on plain tensors: resharding a factor between TP layouts is
bitwise, and the converter's PEFT tensors from TP=2 shards equal those from the full matrices."""

from __future__ import annotations

import torch
from helpers.models import TWO_LAYER_HF_CONFIG

from megarl.checkpoint.lora_shards import (
    SavedSite,
    adapter_key,
    is_split,
    peft_adapter_from_checkpoint,
    reshard_factor,
    saved_sites,
)
from megarl.export.lora import peft_name
from megarl.models import mapping
from megarl.models.spec import spec_from_hf_config

HF = TWO_LAYER_HF_CONFIG
SPEC = spec_from_hf_config(HF)
RANK = 3
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def _full_factors(site: SavedSite, gen: torch.Generator) -> dict[str, tuple[torch.Tensor, ...]]:
    """Random full adapter of one site in HF order: A [r, in] and B parts [out_i, r]."""
    shapes = mapping.hf_shapes(site.rule, SPEC)
    in_dim = shapes[0][1]
    a = torch.randn(RANK, in_dim, generator=gen)
    b_parts = tuple(torch.randn(shape[0], RANK, generator=gen) for shape in shapes)
    return {"lora_A": (a,), "lora_B": b_parts}


def _tp_shards(site: SavedSite, factor: str, full, tp: int) -> list[torch.Tensor]:
    if not is_split(site.parallel, factor):
        return [full[0].clone() for _ in range(tp)]
    return [mapping.to_mcore_shard(site.rule, full, SPEC, t, tp) for t in range(tp)]


def test_sites_cover_every_layer_and_target():
    sites = list(saved_sites(SPEC, TARGETS))
    assert len(sites) == SPEC.num_layers * len(TARGETS)
    assert (
        adapter_key(sites[0].rule, 1, "lora_B")
        == "decoder.layers.1.self_attention.linear_qkv.lora.lora_B"
    )
    assert [s.parallel for s in sites[:4]] == ["column", "column", "row", "row"]


def test_reshard_tp2_to_tp1_and_back_is_bitwise():
    gen = torch.Generator().manual_seed(0)
    for site in saved_sites(SPEC, TARGETS):
        full = _full_factors(site, gen)
        for factor in ("lora_A", "lora_B"):
            at_tp2 = _tp_shards(site, factor, full[factor], 2)
            at_tp1 = reshard_factor(site, factor, at_tp2, SPEC, 0, 1)
            assert torch.equal(at_tp1, _tp_shards(site, factor, full[factor], 1)[0])
            for t in range(2):
                assert torch.equal(reshard_factor(site, factor, [at_tp1], SPEC, t, 2), at_tp2[t])


def test_peft_tensors_from_tp2_shards_equal_the_full_adapter():
    gen = torch.Generator().manual_seed(1)
    saved: dict[tuple[str, int], torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}
    for site in saved_sites(SPEC, TARGETS):
        full = _full_factors(site, gen)
        for factor in ("lora_A", "lora_B"):
            for t, shard in enumerate(_tp_shards(site, factor, full[factor], 2)):
                saved[(adapter_key(site.rule, site.layer, factor), t)] = shard
        for hf_name, b in zip(site.rule.hf_names(site.layer), full["lora_B"], strict=True):
            expected[peft_name(hf_name, "lora_A")] = full["lora_A"][0]
            expected[peft_name(hf_name, "lora_B")] = b
    got = peft_adapter_from_checkpoint(lambda key, t: saved[(key, t)], 2, SPEC, TARGETS)
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_lora_runs_may_save_checkpoints_and_target_modules_must_match():
    from megarl.checkpoint.resume import MUST_MATCH
    from megarl.config.schema import build_run_config

    cfg = build_run_config({"actor": {"lora": {"rank": 4}}, "trainer": {"save_interval": 2}})
    assert cfg.trainer.save_interval == 2 and cfg.actor.lora.rank == 4
    assert {"actor.lora.rank", "actor.lora.target_modules"} <= set(MUST_MATCH)
