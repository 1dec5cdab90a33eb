"""LoRA in training checkpoints and in megarl-convert.

A tiny LoRA run at TP=2 (split and replicated adapter factors, dropout on): 4 steps straight vs
2 steps + stop + resume + 2 steps give bitwise-equal base weights *and* adapters. The saved
checkpoint then converts to a PEFT adapter folder that ``PeftModel.from_pretrained`` loads with
the same logits as the trained adapter, and to merged HF weights equal to peft's
``merge_and_unload``.
"""

from __future__ import annotations

import pytest
import torch
from helpers.runs import tiny_overrides

from megarl.checkpoint.convert import main as convert_main
from megarl.checkpoint.layout import complete_checkpoints
from megarl.models.hf_io import load_hf_state_dict
from megarl.train import run

pytestmark = pytest.mark.slow

LORA = {
    "actor.lora.rank": 4,
    "actor.lora.alpha": 8,
    "actor.lora.dropout": 0.1,
    "actor.lr": 5e-2,
    "actor.tp": 2,
    "trainer.n_gpus_per_node": 2,
    "rollout.n": 2,
}


def _adapter(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if k.startswith("base_model.")}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """(straight final state, resumed final state, resumed run_dir, state at step 2)."""
    root = tmp_path_factory.mktemp("lora_ckpt")
    straight = run(tiny_overrides(root / "straight", 4, **LORA), return_final_state=True)
    run_dir = root / "resumed"
    stopped = run(
        tiny_overrides(run_dir, 2, **LORA, **{"trainer.save_interval": 2}), return_final_state=True
    )
    assert [c.step for c in complete_checkpoints(run_dir)] == [2]
    result = run(
        tiny_overrides(run_dir, 4, **LORA, **{"trainer.save_interval": 2}), return_final_state=True
    )
    return straight.final_state, result.final_state, run_dir, stopped.final_state


def test_lora_resume_is_bitwise_exact(resumed):
    straight, result, _, _ = resumed
    adapter = _adapter(straight)
    assert adapter and any(
        k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in adapter.items()
    ), "adapters did not train"
    assert sorted(straight) == sorted(result)
    for name, tensor in straight.items():
        assert torch.equal(tensor, result[name]), name


def test_lora_checkpoint_loads_resharded_at_tp1(resumed, tmp_path):
    """The TP=2 checkpoint restored at TP=1 (no further step) holds bitwise the same base
    weights and adapters: split factors are reassembled and re-sliced, not approximated."""
    _, _, run_dir, at_step2 = resumed
    [ckpt] = [c.path for c in complete_checkpoints(run_dir) if c.step == 2]
    tp1 = {**LORA, "actor.tp": 1, "trainer.n_gpus_per_node": 1, "trainer.resume": str(ckpt)}
    result = run(tiny_overrides(tmp_path / "tp1", 2, **tp1), return_final_state=True)
    assert result.history == [] or all(r["step"] <= 2 for r in result.history)
    assert sorted(result.final_state) == sorted(at_step2)
    for name, tensor in at_step2.items():
        assert torch.equal(tensor, result.final_state[name]), name


def _logits(model_dir, adapter_dir=None) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    with torch.no_grad():
        return model(torch.arange(3, 19).unsqueeze(0)).logits


def test_convert_lora_checkpoint_to_peft_and_merged(resumed, tmp_path, capsys):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run_dir = resumed[2]
    [ckpt] = [c.path for c in complete_checkpoints(run_dir) if c.step == 2]
    hf, merged = tmp_path / "hf", tmp_path / "merged"
    assert (
        convert_main(
            ["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(hf), "--lora", "--no-progress"]
        )
        == 0
    )
    adapter_dir = tmp_path / "hf-lora"
    saved = load_file(str(adapter_dir / "adapter_model.safetensors"))
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in saved.items())
    with_adapter = _logits(hf, adapter_dir)
    assert (with_adapter - _logits(hf)).abs().max() > 1e-4, "adapter changes nothing"

    assert (
        convert_main(
            [
                "mcore-to-hf",
                "--ckpt",
                str(ckpt),
                "--out",
                str(merged),
                "--merge-lora",
                "--no-progress",
            ]
        )
        == 0
    )
    base = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
    reference = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload().state_dict()
    ours = load_hf_state_dict(merged)
    assert set(ours) <= set(reference)
    assert max((ours[k] - reference[k]).abs().max().item() for k in ours) <= 1e-6
    assert (_logits(merged) - with_adapter).abs().max() < 1e-4

    # a checkpoint without adapters: one line, exit 2, nothing written
    capsys.readouterr()
    no_lora = tmp_path / "no_lora"
    assert (
        convert_main(["hf-to-mcore", "--hf", str(hf), "--out", str(no_lora), "--no-progress"]) == 0
    )
    assert (
        convert_main(
            [
                "mcore-to-hf",
                "--ckpt",
                str(no_lora),
                "--out",
                str(tmp_path / "x"),
                "--lora",
                "--no-progress",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no LoRA adapter" in err[0], err
    assert not (tmp_path / "x").exists() and not (tmp_path / "x-lora").exists()
