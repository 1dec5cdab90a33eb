"""Bad input: one line naming the key or file, exit code 2, no traceback, nothing written."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest


def _train(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megarl.train", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


_VLLM_CASES = [] if importlib.util.find_spec("vllm") is None else [
    (["rollout.engine=vllm", "model=tiny_llama", "model.hf_config.num_attention_heads=8",
      "model.hf_config.num_key_value_heads=4"], "head size 16 is not supported"),
    (["rollout.engine=vllm", "rollout.kv_cache_gb=100000"], "rollout.kv_cache_gb=100000"),
    (["rollout.engine=vllm", "rollout.temperature=0.7", "rollout.top_p=0.9"],
     "rollout.top_p=0.9 with rollout.temperature=0.7"),
]
"""vLLM settings it cannot honour (where vLLM is installed; without it, a test below)."""


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["actor.tpp=2"], "actor.tpp"),
        (["actor.tp=0"], "actor.tp=0"),
        (["model=tiny_llama", "actor.tp=3", "trainer.n_gpus_per_node=3"],
         "actor.tp=3 does not divide the model's 4 attention heads"),
        (["model=tiny_llama", "actor.pp=3", "trainer.n_gpus_per_node=3"],
         "actor.pp=3 does not divide the model's 4 layers"),
        (["actor.ppo_mini_batches=5"], "actor.ppo_mini_batches=5"),
        (["model.path=/nonexistent/model"], "model.path=/nonexistent/model"),
        (["data.task=jsonl", "data.path=/nonexistent/data.jsonl"], "/nonexistent/data.jsonl"),
        (["planner.prune_zero_adv=match_loss_curve", "actor.kl_coef=0.1"], "actor.kl_coef"),
        (["planner.ref_log_prob=never", "actor.kl_coef=0.1"], "planner.ref_log_prob"),
        (["trainer.resume=/nonexistent/ckpt"], "checkpoint /nonexistent/ckpt: no such directory"),
        *_VLLM_CASES,
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, needle):
    """Checked before any worker starts or anything is written."""
    run_dir = tmp_path / "run"
    proc = _train(f"trainer.run_dir={run_dir}", *args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("megarl-train")]
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (run_dir / "metrics.jsonl").exists()


def test_malformed_dataset_row_names_file_and_line(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": "no answer"}\n')
    proc = _train(f"trainer.run_dir={tmp_path / 'run'}", "data.task=jsonl", f"data.path={data}",
                  cwd=tmp_path)
    assert proc.returncode == 2
    assert f"{data}:2:" in proc.stderr and "Traceback" not in proc.stderr
