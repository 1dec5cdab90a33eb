"""On-policy distillation end to end on the tiny model: a teacher equal to the student gives
exactly zero advantage and a pure-distillation step that leaves every weight as it was; a
different teacher gives a positive reverse KL that moves the weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from helpers.runs import REPO, tiny_overrides

from megarl.models.hf_io import load_hf_state_dict
from megarl.train import StartupError, run

TINY = yaml.safe_load((REPO / "configs" / "model" / "tiny_llama.yaml").read_text())["hf_config"]


def _tiny_folder(path: Path, seed: int) -> Path:
    from megarl.models.random_init import save_random_hf_model

    return Path(save_random_hf_model(TINY, seed, path))


def _sharper_teacher(student: Path, path: Path, scale: float) -> Path:
    """The student with its output layer scaled: the same tokenizer and body, but a much more
    peaked next-token distribution, so the reverse KL is large and its fall clear of the
    sampling noise of a few tiny steps."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(student, path)
    state = load_hf_state_dict(path)
    state["lm_head.weight"] = state["lm_head.weight"] * scale
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _distill_overrides(run_dir: Path, student: Path, teacher: Path, steps: int, **extra):
    overrides = tiny_overrides(run_dir, steps, **extra)
    return [o for o in overrides if not o.startswith("model=")] + [
        f"model.path={student}",
        f"algo.distill.teacher_path={teacher}",
    ]


def test_a_teacher_equal_to_the_student_trains_nothing(tmp_path):
    """reward_coef=0, no pruning (so the training forward and the optimizer step do run): every
    sampled token's advantage is exactly 0, and so are the loss and the weights' change."""
    student = _tiny_folder(tmp_path / "student", seed=0)
    extra = {"algo.distill.reward_coef": 0, "planner.prune_zero_adv": "off"}
    result = run(
        _distill_overrides(tmp_path / "run", student, student, 1, **extra),
        return_final_state=True,
    )
    [row] = result.history
    assert row["distill/reverse_kl/mean"] == 0.0
    assert row["critic/advantages/zero_adv_ratio"] == 1.0
    assert row["critic/advantages/max"] == row["critic/advantages/min"] == 0.0
    assert row["actor/pg_loss"] == 0.0
    assert row["timing_s/teacher"] > 0
    assert "teacher: algo.distill" in row["gates/reasons"]
    initial = load_hf_state_dict(student)
    assert result.final_state is not None and set(result.final_state) == set(initial)
    for name, tensor in result.final_state.items():
        assert torch.equal(tensor, initial[name]), name


def test_a_different_teacher_gives_a_positive_reverse_kl_and_moves_the_weights(tmp_path):
    """A sharper teacher (the student's output layer x4): every step's reverse KL is positive,
    the advantages are exactly its negative on average (``reward_coef=0``), and the weights
    move. At DP=2: the token advantages follow each sequence to the rank the plan gives it.
    Whether a few tiny steps lower the KL is left to sampling noise: with 32 samples of
    6 tokens the per-step estimate moves by +-0.1 at KL ~0.24 whatever the learning rate."""
    student = _tiny_folder(tmp_path / "student", seed=0)
    teacher = _sharper_teacher(student, tmp_path / "teacher", scale=4.0)
    extra = {"algo.distill.reward_coef": 0, "trainer.n_gpus_per_node": 2}
    result = run(
        _distill_overrides(tmp_path / "run", student, teacher, 2, **extra),
        return_final_state=True,
    )
    for row in result.history:
        kl = row["distill/reverse_kl/mean"]
        assert kl > 0.05, kl
        assert row["critic/advantages/mean"] == pytest.approx(-kl, rel=1e-5, abs=1e-6)
        assert row["critic/advantages/zero_adv_ratio"] < 0.1
    initial = load_hf_state_dict(student)
    assert result.final_state is not None
    moved = max((t - initial[n]).abs().max().item() for n, t in result.final_state.items())
    assert moved > 1e-4, moved


def test_a_teacher_with_another_tokenizer_stops_the_start(tmp_path):
    from transformers import AutoTokenizer

    student = _tiny_folder(tmp_path / "student", seed=0)
    teacher = _tiny_folder(tmp_path / "teacher", seed=1)
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    tokenizer.add_tokens(["<an_extra_token>"])
    tokenizer.save_pretrained(teacher)
    with pytest.raises(StartupError, match="its tokenizer differs from the model's"):
        run(_distill_overrides(tmp_path / "run", student, teacher, 1))
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_a_megarl_run_folder_is_a_teacher_as_it_is_a_model_path(tmp_path):
    """The teacher resolved from a run folder's newest checkpoint (converted once into
    ``<run_dir>/teacher_model``), as ``model.path`` is: the student started from the same run
    folder is its own teacher, so the step is exact again."""
    first = tmp_path / "first"
    run(tiny_overrides(first, 1, **{"trainer.save_interval": 1}))
    run_dir = tmp_path / "run"
    extra = {"algo.distill.reward_coef": 0, "planner.prune_zero_adv": "off"}
    result = run(_distill_overrides(run_dir, first, first, 1, **extra), return_final_state=True)
    [row] = result.history
    assert row["distill/reverse_kl/mean"] == 0.0
    source = json.loads((run_dir / "teacher_model" / "megarl_source.json").read_text())
    assert source["step"] == 1 and "step_000001" in source["source"]
    initial = load_hf_state_dict(run_dir / "init_model")
    assert result.final_state is not None
    for name, tensor in result.final_state.items():
        assert torch.equal(tensor, initial[name]), name


def test_a_teacher_of_another_shape_scores_the_students_tokens(tmp_path):
    """The teacher is built from its own folder's shape (here half the width and depth), on
    the actor's ranks: only the tokenizer must be shared."""
    from megarl.models.random_init import save_random_hf_model

    student = _tiny_folder(tmp_path / "student", seed=0)
    narrow = {**TINY, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
    teacher = Path(save_random_hf_model(narrow, 3, tmp_path / "teacher"))
    result = run(_distill_overrides(tmp_path / "run", student, teacher, 1))
    [row] = result.history
    assert row["distill/reverse_kl/mean"] != 0.0
    assert row["timing_s/teacher"] > 0
