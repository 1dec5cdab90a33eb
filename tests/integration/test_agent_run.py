"""Agent loops in training on the tiny model: a user's loop by class path and the built-in tool
loop train end to end; observation tokens are shown in the dump and never trained; the engine's
logprobs of the generated tokens match the trainer's; bad loops stop the start in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.agent_loops import OBSERVATION
from helpers.runs import tiny_overrides

from megarl.train import StartupError, run

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _records(folder: Path, step: int) -> list[dict]:
    return [json.loads(line) for line in (folder / f"{step}.jsonl").read_text().splitlines()]


def _two_turns_run(tmp_path: Path, **settings: object) -> tuple[list[dict], Path]:
    """Two steps of the documented two-turn loop with ``settings``: the metrics history and
    the folder of the generations it dumped."""
    gens = tmp_path / "gens"
    overrides = {
        "rollout.agent.loop": "agent_loops:TwoTurns",
        "rollout.max_new_tokens": 40,
        "trainer.rollout_data_dir": str(gens),
        **settings,
    }
    return run(tiny_overrides(tmp_path / "run", 2, **overrides)).history, gens


def test_a_user_loop_trains_on_its_own_tokens_only(tmp_path):
    """The documented two-turn loop (docs/agents.md) (``agent_loops:TwoTurns``): two generated turns of up to 16
    tokens around an 8-token observation, at DP=2 with pruning on."""
    history, gens = _two_turns_run(tmp_path, **{"trainer.n_gpus_per_node": 2})
    for row in history:
        assert row["rollout/logprob_abs_diff"] <= 1e-4, row  # generated tokens only, fp32
        assert row["agent/num_turns/mean"] == 2.0 and row["agent/num_turns/max"] == 2.0
        assert row["agent/observation_tokens/mean"] == 8.0
        assert row["agent/tool_calls/mean"] == 0.0 and row["agent/engine_calls"] == 2.0
        assert row["response_length/max"] <= 32.0  # generated tokens: observations excluded
        records = _records(gens, row["step"])
        assert len(records) == 8
        for record in records:
            kinds = [turn["trained"] for turn in record["turns"]]
            assert kinds == [True, False, True], record
            assert record["turns"][1]["text"] == OBSERVATION
            assert "".join(t["text"] for t in record["turns"]).count("Observation: 42") == 1
        mean = sum(r["reward"] for r in records) / len(records)
        assert mean == pytest.approx(row["critic/rewards/mean"], abs=1e-6)
    assert any(row["actor/grad_norm"] > 0 for row in history)


def test_a_loop_that_sets_the_reward_replaces_the_datasets(tmp_path):
    gens = tmp_path / "gens"
    overrides = {
        "rollout.agent.loop": "agent_loops:OwnReward",
        "rollout.max_new_tokens": 40,
        "trainer.rollout_data_dir": str(gens),
        "trainer.val_interval": 1,
    }
    [row] = run(tiny_overrides(tmp_path / "run", 1, **overrides)).history
    # OwnReward scores every trajectory 0.75; the dataset's reward (char parity) gives 0 or 1
    assert {r["reward"] for r in _records(gens, 1)} == {0.75}
    assert row["critic/rewards/mean"] == 0.75 and row["agent/num_turns/mean"] == 2.0
    # the validation runs the loops too, and says so under verl's names
    assert row["val-aux/num_turns/min"] == row["val-aux/num_turns/max"] == 2.0
    assert row["val-aux/agent/tool_calls/mean"] == 0.0


def test_the_tool_agent_recipe_trains_with_the_calculator_described(tmp_path, monkeypatch):
    """``recipe=gsm8k_tool_agent`` as a user starts it from the repository root: rows in verl's
    multi-turn schema, the tool loop, the calculator described in the system message (the
    tokenizer's template has no tool support)."""
    monkeypatch.chdir(REPO)
    gens = tmp_path / "gens"
    overrides = {
        "recipe": "gsm8k_tool_agent",
        "rollout.max_new_tokens": 24,
        "trainer.rollout_data_dir": str(gens),
        "data.val_files": "null",
        "data.reward": "auto",
    }
    [row] = run(tiny_overrides(tmp_path / "run", 1, **overrides)).history
    assert row["rollout/logprob_abs_diff"] <= 1e-4
    assert row["agent/num_turns/mean"] >= 1.0 and "agent/tool_errors" in row
    # the calculator's schema and the calling convention in the system message: ~310 tokens a
    # prompt, against ~70 for the question alone
    assert row["prompt_length/mean"] > 250, row["prompt_length/mean"]
    records = _records(gens, 1)
    assert len(records) == 8 and all(r["turns"][0]["trained"] for r in records)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"rollout.agent.loop": "agent_loops:Missing"},
            "rollout.agent.loop='agent_loops:Missing': module 'agent_loops' has no 'Missing'",
        ),
        (
            {"rollout.agent.loop": "tool", "rollout.agent.tool_config_path": "/nonexistent.yaml"},
            "/nonexistent.yaml",
        ),
    ],
)
def test_a_bad_loop_or_tool_config_stops_the_start_in_one_line(tmp_path, overrides, message):
    run_dir = tmp_path / "run"
    with pytest.raises(StartupError) as refused:
        run(tiny_overrides(run_dir, 1, **overrides))
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert not run_dir.exists() or not any(run_dir.iterdir())


def test_a_user_loop_on_vllm_matches_the_trainer_on_every_generated_token(tmp_path):
    """vLLM takes each turn as token ids (prefix caching on, its default: the second turn
    reuses the first's KV) and reports the logprobs the trainer recomputes."""
    pytest.importorskip("vllm")
    history, gens = _two_turns_run(
        tmp_path, **{"rollout.engine": "vllm", "export.checksum_interval": 1}
    )
    for row in history:
        assert row["rollout/logprob_abs_diff"] <= 1e-4, row
        assert row["export/checksum_ok"] == 1.0
        assert row["agent/num_turns/mean"] == 2.0 and row["agent/observation_tokens/mean"] == 8.0
        records = _records(gens, row["step"])
        assert all([t["trained"] for t in r["turns"]] == [True, False, True] for r in records)


def test_a_row_naming_a_loop_that_does_not_exist_is_named_by_file_and_row(tmp_path):
    data = tmp_path / "train.jsonl"
    rows = [
        {"prompt": "What is 1 + 1?", "reward_model": {"ground_truth": "2"}},
        {
            "prompt": "What is 2 + 2?",
            "reward_model": {"ground_truth": "4"},
            "agent_name": "agent_loops:Nope",
        },
    ]
    data.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    run_dir = tmp_path / "run"
    with pytest.raises(StartupError) as refused:
        run(tiny_overrides(run_dir, 1, **{"data.train_files": str(data)}))
    assert str(refused.value).startswith(f"{data}:2: ")
    assert "agent_name='agent_loops:Nope': module 'agent_loops' has no 'Nope'" in str(refused.value)
    assert not run_dir.exists() or not any(run_dir.iterdir())


@pytest.mark.parametrize(
    ("loop", "raised"),
    [
        ("ExitsZero", "SystemExit(0)"),
        ("Interrupts", "KeyboardInterrupt"),
        ("QuitsProcess", "os._exit(0) called"),
    ],
)
def test_a_loop_that_exits_or_interrupts_itself_fails_the_run_in_one_line(
    train_cli, tmp_path, loop, raised
):
    """``sys.exit(0)``, ``os._exit(0)`` or a ``KeyboardInterrupt`` raised inside a user's loop
    (no signal): exit 1, the line names the loop, the sample and where, the traceback goes to
    the log; not exit 0 with "no steps ran" (or nothing at all), nor exit 130 as if Ctrl-C had
    been pressed."""
    run_dir = tmp_path / "run"
    overrides = {"rollout.agent.loop": f"agent_loops:{loop}", "rollout.max_new_tokens": 40}
    done = train_cli.run(*tiny_overrides(run_dir, 1, **overrides), cwd=tmp_path)
    errors = [line for line in done.stderr.splitlines() if line.startswith("megarl-train: error")]
    assert done.returncode == 1, done.stderr[-3000:]
    assert len(errors) == 1, done.stderr[-3000:]
    assert f"agent loop {loop}: run (sample 2) raised {raised} (at " in errors[0]
    assert "agent_loops.py:" in errors[0]
    assert raised.split("(")[0] in (run_dir / "logs" / "error-rank0.txt").read_text()
