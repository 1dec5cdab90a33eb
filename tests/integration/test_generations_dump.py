"""``trainer.rollout_data_dir`` and ``trainer.validation_data_dir`` on a tiny run: one JSONL file
per step with every sequence, what its numbers agree with, and no file ever written over."""

from __future__ import annotations

import json

import pytest
from helpers.runs import tiny_overrides

from megarl.train import StartupError, run

pytestmark = pytest.mark.slow


def _read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_step_dumps_its_generations_and_a_resume_adds_only_new_files(tmp_path):
    val = tmp_path / "val.jsonl"
    rows = [
        {"prompt": f"What is {a} + 1?", "reward_model": {"ground_truth": str(a + 1)}}
        for a in range(3)
    ]
    val.write_text("\n".join(json.dumps(r) for r in rows))
    gens, val_gens, run_dir = tmp_path / "gens", tmp_path / "val_gens", tmp_path / "run"
    overrides = {
        "trainer.rollout_data_dir": str(gens),
        "trainer.validation_data_dir": str(val_gens),
        "data.val_files": str(val),
        "trainer.val_interval": 2,
        "trainer.val_before_train": "true",
        "trainer.save_interval": 2,
        "trainer.n_gpus_per_node": 2,  # DP=2: the trained flags come from both ranks' plans
    }
    result = run(tiny_overrides(run_dir, 2, **overrides))
    assert sorted(p.name for p in gens.iterdir()) == ["1.jsonl", "2.jsonl"]
    assert sorted(p.name for p in val_gens.iterdir()) == ["0.jsonl", "2.jsonl"]
    for row in result.history:
        records = _read(gens / f"{row['step']}.jsonl")
        assert len(records) == 2 * 4  # data.prompts_per_step x rollout.n
        assert {r["step"] for r in records} == {row["step"]}
        assert [r["group"] for r in records] == [0, 0, 0, 0, 1, 1, 1, 1]
        assert all(r["prompt"] and isinstance(r["response"], str) for r in records)
        mean = sum(r["reward"] for r in records) / len(records)
        assert mean == pytest.approx(row["critic/rewards/mean"], abs=1e-6)
        # pruning is on (kl_coef = entropy_coef = 0): exactly the non-zero advantages train
        assert [r["trained"] for r in records] == [r["advantage"] != 0 for r in records]
        kept = sum(r["trained"] for r in records) / len(records)
        assert kept == pytest.approx(row["planner/kept_seq_frac"])
    initial = _read(val_gens / "0.jsonl")
    assert len(initial) == 3 and {r["data_source"] for r in initial} == {"unknown"}
    metrics = _read(run_dir / "metrics.jsonl")
    assert metrics[0]["step"] == 0
    assert sum(r["reward"] for r in initial) / 3 == pytest.approx(
        metrics[0]["val-core/unknown/reward/mean@1"]
    )

    before = {p.name: p.read_bytes() for p in gens.iterdir()}
    run(tiny_overrides(run_dir, 3, **overrides))  # resumes from step 2
    assert sorted(p.name for p in gens.iterdir()) == ["1.jsonl", "2.jsonl", "3.jsonl"]
    assert {name: (gens / name).read_bytes() for name in before} == before
    assert sorted(p.name for p in val_gens.iterdir()) == ["0.jsonl", "2.jsonl", "3.jsonl"]

    metrics_before = (run_dir / "metrics.jsonl").read_bytes()
    with pytest.raises(StartupError) as info:  # a fresh start would write steps 1.. again
        run(tiny_overrides(run_dir, 3, **overrides, **{"trainer.resume": "never"}))
    assert str(info.value).startswith(f"trainer.rollout_data_dir={gens}: 1.jsonl, 2.jsonl, 3.jsonl")
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics_before  # nothing set aside
