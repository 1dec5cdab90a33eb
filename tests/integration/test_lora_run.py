"""LoRA GRPO runs end to end: adapter-only sync while the engine keeps its base weights, base +
adapter after a sleep that freed them, and the engine agreeing with the trainer after each."""

from __future__ import annotations

import pytest
import torch
from helpers.runs import tiny_overrides

from megarl.train import run

pytestmark = pytest.mark.slow

LORA = {"actor.lora.rank": 4, "actor.lora.alpha": 8, "actor.lr": 5e-2}


def _init_weights(run_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    [file] = (run_dir / "init_model").glob("*.safetensors")
    return load_file(str(file))


def _adapter_effect(run_dir, final_state) -> float:
    """Max |logit change| the trained adapter makes on the base model (transformers + peft)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megarl.export.lora import save_peft_adapter
    from megarl.models.hf_io import load_hf_config
    from megarl.models.lora import LoraSettings
    from megarl.models.spec import spec_from_hf_config

    adapter = {k: v for k, v in final_state.items() if k.startswith("base_model.")}
    spec = spec_from_hf_config(load_hf_config(str(run_dir / "init_model")))
    folder = save_peft_adapter(run_dir / "adapter", adapter, LoraSettings(rank=4, alpha=8), spec)
    base = AutoModelForCausalLM.from_pretrained(str(run_dir / "init_model")).eval()
    ids = torch.arange(3, 19).unsqueeze(0)
    with torch.no_grad():
        before = base(ids).logits
        after = PeftModel.from_pretrained(base, str(folder)).eval()(ids).logits
    return (after - before).abs().max().item()


@pytest.mark.parametrize(
    ("sleep_level", "base_resent"),
    [(1, False), (2, True)],
    ids=["sleep1-adapter-only", "sleep2-base-resent"],
)
def test_lora_tp2_run_syncs_what_the_engine_lost(tmp_path, sleep_level, base_resent):
    run_dir = tmp_path / "run"
    result = run(
        tiny_overrides(
            run_dir,
            steps=2,
            **LORA,
            **{"actor.tp": 2, "trainer.n_gpus_per_node": 2, "rollout.sleep_level": sleep_level},
        ),
        return_final_state=True,
    )
    rows = result.history
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["rollout/logprob_abs_diff"] < 1e-3, row
        assert row["engine/base_weights_resident"] == float(not base_resent)
        assert row["gates/base_weight_sync"] == float(base_resent)
        action = "base + adapter" if base_resent else "adapter only"
        assert f"sync: {action}" in row["gates/summary"]
    assert rows[0]["actor/grad_norm"] > 0

    final, init = result.final_state, _init_weights(run_dir)
    base_names = [k for k in final if not k.startswith("base_model.")]
    assert sorted(base_names) == sorted(init)
    changed = [k for k in base_names if not torch.equal(final[k], init[k])]
    assert not changed, f"LoRA changed base weights: {changed[:3]}"
    # the adapter trained and matters, so the logprob agreement above is not vacuous
    assert _adapter_effect(run_dir, final) > 1e-3


def test_lora_single_process_sleep0_adapter_only_kl_from_the_actor(tmp_path):
    """Engine kept its base: adapter-only sync. With a KL term, the reference is the actor with
    its adapters disabled (no second model); the KL is 0 at step 1 (B = 0) and then grows."""
    result = run(
        tiny_overrides(
            tmp_path / "run",
            steps=2,
            **LORA,
            **{"actor.kl_coef": 0.05, "planner.prune_zero_adv": "off"},
        )
    )
    rows = result.history
    for row in rows:
        assert row["rollout/logprob_abs_diff"] < 1e-3, row
        assert row["gates/base_weight_sync"] == 0.0
        assert "sync: adapter only (engine kept base)" in row["gates/summary"]
        assert row["gates/ref_log_prob"] == 1.0
        assert "(actor without adapters)" in row["gates/reasons"]
    assert abs(rows[0]["actor/kl_loss"]) < 1e-6  # untrained adapters: policy == reference
    assert abs(rows[1]["actor/kl_loss"]) > 1e-6  # trained adapters, base reference
