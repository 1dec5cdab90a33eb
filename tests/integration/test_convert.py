"""megarl-convert: HF -> Megatron shards -> HF is bitwise, and the result loads in transformers.

Single process (conversion needs no process group); marked slow because SmolLM2 is 0.5 GB.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from megarl.checkpoint.convert import main
from megarl.checkpoint.layout import read_checkpoint
from megarl.models.hf_io import load_hf_state_dict, resolve_model_path

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def _save_tiny(name: str, out: Path) -> Path:
    from megarl.models.random_init import save_random_hf_model

    cfg = yaml.safe_load((REPO / "configs" / "model" / f"{name}.yaml").read_text())
    return save_random_hf_model(cfg["hf_config"], 3, out)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    return _save_tiny("tiny_llama", tmp_path_factory.mktemp("tiny") / "hf")


def _convert_both_ways(hf: Path, tmp_path: Path, tp: int, pp: int) -> Path:
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    argv = ["--no-progress"]
    assert (
        main(
            [
                "hf-to-mcore",
                "--hf",
                str(hf),
                "--out",
                str(mcore),
                "--tp",
                str(tp),
                "--pp",
                str(pp),
                *argv,
            ]
        )
        == 0
    )
    info = read_checkpoint(mcore)
    assert (info.tp, info.pp, info.kind) == (tp, pp, "converted")
    assert len(list(mcore.glob("model_tp*_pp*.safetensors"))) == tp * pp
    assert main(["mcore-to-hf", "--ckpt", str(mcore), "--out", str(back), *argv]) == 0
    return back


def _assert_bitwise(original: Path, converted: Path) -> None:
    a, b = load_hf_state_dict(original), load_hf_state_dict(converted)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def _assert_same_logits(original: Path, converted: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokens = AutoTokenizer.from_pretrained(converted)("What is 12 + 7?", return_tensors="pt")
    logits = []
    for folder in (original, converted):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(**tokens).logits)
    assert torch.equal(logits[0], logits[1])


def test_tiny_round_trip_tp2_pp2(tiny_hf, tmp_path):
    back = _convert_both_ways(tiny_hf, tmp_path, tp=2, pp=2)
    _assert_bitwise(tiny_hf, back)
    _assert_same_logits(tiny_hf, back)


@pytest.mark.parametrize(
    ("model", "tp", "pp", "family_tensor"),
    [
        # Qwen3's q/k norms and its head size apart from hidden / heads
        ("tiny_qwen3", 2, 2, "model.layers.3.self_attn.k_norm.weight"),
        # per-expert tensors and the router, the experts' intermediate size split over TP and
        # their layers over PP
        ("tiny_qwen3_moe", 2, 2, "model.layers.3.mlp.experts.3.down_proj.weight"),
        # Qwen2-MoE's gated shared expert beside the routed ones, q/k/v bias
        ("tiny_qwen2_moe", 1, 1, "model.layers.3.mlp.shared_expert_gate.weight"),
    ],
)
def test_newer_families_round_trip(model, tp, pp, family_tensor, tmp_path):
    original = _save_tiny(model, tmp_path / "hf")
    back = _convert_both_ways(original, tmp_path, tp=tp, pp=pp)
    assert family_tensor in load_hf_state_dict(back)
    _assert_bitwise(original, back)
    _assert_same_logits(original, back)


def test_smollm2_round_trip_tp3_pp2(tmp_path):
    original = resolve_model_path(None)
    back = _convert_both_ways(original, tmp_path, tp=3, pp=2)
    _assert_bitwise(original, back)
    _assert_same_logits(original, back)


def _error_line(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    return err


def test_bad_inputs_are_one_line_and_write_nothing(tiny_hf, tmp_path, capsys):
    out = tmp_path / "out"
    smollm2 = str(resolve_model_path(None))
    err = _error_line(capsys, ["hf-to-mcore", "--hf", smollm2, "--out", str(out), "--tp", "2"])
    assert "--tp 2 does not divide the model's 9 attention heads" in err
    err = _error_line(capsys, ["hf-to-mcore", "--hf", str(tiny_hf), "--out", str(out), "--pp", "3"])
    assert "--pp 3 does not divide the model's 4 layers" in err
    err = _error_line(capsys, ["hf-to-mcore", "--hf", str(tmp_path / "nope"), "--out", str(out)])
    assert "no such file" in err
    wrong = tmp_path / "gpt2"
    wrong.mkdir()
    (wrong / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (wrong / "model.safetensors").write_bytes(b"")
    err = _error_line(capsys, ["hf-to-mcore", "--hf", str(wrong), "--out", str(out)])
    assert "model_type='gpt2' is not supported" in err
    err = _error_line(capsys, ["mcore-to-hf", "--ckpt", str(tiny_hf), "--out", str(out)])
    assert "no megarl_checkpoint.json" in err
    err = _error_line(
        capsys, ["mcore-to-hf", "--ckpt", str(tiny_hf), "--out", str(out), "--lora", "--merge-lora"]
    )
    assert "--lora and --merge-lora: choose one" in err
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")] == []
    err = _error_line(capsys, ["hf-to-mcore", "--hf", str(tiny_hf), "--out", str(tiny_hf)])
    assert "already exists" in err


def test_tools_script_runs_the_same_main(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "convert.py"),
            "mcore-to-hf",
            "--ckpt",
            str(tmp_path),
            "--out",
            str(tmp_path / "x"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("megarl-convert: error: checkpoint")


def test_training_starts_from_a_converted_checkpoint(tiny_hf, tmp_path):
    from helpers.runs import tiny_overrides

    from megarl.train import run

    mcore = tmp_path / "mcore"
    assert (
        main(
            ["hf-to-mcore", "--hf", str(tiny_hf), "--out", str(mcore), "--tp", "2", "--no-progress"]
        )
        == 0
    )
    run_dir = tmp_path / "run"
    result = run(
        tiny_overrides(run_dir, 1, **{"model.hf_config": "null", "model.path": str(mcore)})
    )
    assert len(result.history) == 1
    _assert_bitwise(tiny_hf, run_dir / "init_model")
