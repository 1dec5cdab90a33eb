"""Unmodified agents (the ``openai`` SDK) trained through the gateway on the tiny model: the
interface's two-turn example on both engines (observation untrained, the engine's logprobs the
trainer's), a compacting agent's two branches per session at DP=2, and what start-up refuses."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.runs import REPO, run_env, tiny_overrides

from megarl.train import StartupError, run

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:.*made no request")]

OBSERVATION = "Observation: 42. Answer again."


def _records(folder: Path, step: int) -> list[dict]:
    return [json.loads(line) for line in (folder / f"{step}.jsonl").read_text().splitlines()]


def _gateway(agent: str, **extra: object) -> dict[str, object]:
    return {
        "rollout.agent.loop": "openai",
        "rollout.agent.entrypoint": f"helpers.gateway_agents:{agent}",
        "rollout.max_new_tokens": 48,
        **extra,
    }


def _check_two_turns(history: list[dict], gens: Path) -> None:
    for row in history:
        assert row["rollout/logprob_abs_diff"] <= 1e-4, row  # fp32, generated tokens only
        assert row["agent/num_turns/mean"] == 2.0, row
        assert row["agent/branches/mean"] == 1.0
        assert row["agent/gateway/requests"] == 16.0 and row["agent/gateway/errors"] == 0.0
        assert row["agent/gateway/stream_requests"] == 8.0
        for record in _records(gens, row["step"]):
            turns = record["turns"]
            assert [t["trained"] for t in turns] == [True, False, True], record
            assert OBSERVATION in turns[1]["text"]
            assert all(OBSERVATION not in t["text"] for t in turns if t["trained"])


def test_the_two_turn_openai_agent_trains_with_the_observation_untrained(tmp_path):
    gens = tmp_path / "gens"
    overrides = _gateway(
        "two_turns", **{"trainer.rollout_data_dir": str(gens), "trainer.val_interval": 2}
    )
    history = run(tiny_overrides(tmp_path / "run", 2, **overrides)).history
    _check_two_turns(history, gens)
    assert any(row["actor/grad_norm"] > 0 for row in history)
    # validation runs the same agent through the gateway (greedy: the run's val sampling)
    assert history[-1]["val-aux/num_turns/mean"] == 2.0


def test_the_two_turn_openai_agent_on_vllm(tmp_path):
    pytest.importorskip("vllm")
    gens = tmp_path / "gens"
    overrides = _gateway(
        "two_turns", **{"trainer.rollout_data_dir": str(gens), "rollout.engine": "vllm"}
    )
    _check_two_turns(run(tiny_overrides(tmp_path / "run", 2, **overrides)).history, gens)


def test_a_compacting_agent_trains_both_branches_of_every_session_at_dp2(tmp_path):
    """Each session answers, then starts over from a summary: two sequences per sample (16 in
    the step), both with the agent's reward (1.0), split over two data-parallel ranks."""
    gens = tmp_path / "gens"
    overrides = _gateway(
        "compacting",
        **{"trainer.rollout_data_dir": str(gens), "trainer.n_gpus_per_node": 2},
    )
    [row] = run(tiny_overrides(tmp_path / "run", 1, **overrides)).history
    assert row["agent/branches/mean"] == 2.0
    assert row["critic/rewards/mean"] == 1.0
    records = _records(gens, 1)
    assert len(records) == 16
    assert [r["branch"] for r in records] == [0, 1] * 8
    assert all(r["reward"] == 1.0 and [t["trained"] for t in r["turns"]] == [True] for r in records)
    groups = [r["group"] for r in records]
    assert groups == [g for g in range(2) for _ in range(8)]
    assert row["rollout/logprob_abs_diff"] <= 1e-4


def test_start_up_refuses_the_gateway_with_several_mini_batches(tmp_path):
    run_dir = tmp_path / "run"
    overrides = _gateway("two_turns", **{"actor.ppo_mini_batches": 2})
    with pytest.raises(StartupError, match="ppo_mini_batches") as refused:
        run(tiny_overrides(run_dir, 1, **overrides))
    assert "\n" not in str(refused.value)
    assert not run_dir.exists() or not any(run_dir.iterdir())


def test_a_missing_entrypoint_stops_the_start_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    overrides = _gateway("no_such_agent")
    with pytest.raises(StartupError, match="has no function 'no_such_agent'"):
        run(tiny_overrides(run_dir, 1, **overrides))
    assert not run_dir.exists() or not any(run_dir.iterdir())


def test_the_gateway_recipe_runs_from_the_repository_root(tmp_path, monkeypatch):
    """``recipe=gsm8k_openai_agent`` as a user starts it: the example agent by file path, its
    own system prompt and calculator tool, on GSM8K rows."""
    monkeypatch.chdir(REPO)
    overrides = {"recipe": "gsm8k_openai_agent", "rollout.max_new_tokens": 24}
    [row] = run(tiny_overrides(tmp_path / "run", 1, **overrides)).history
    assert row["agent/gateway/requests"] >= 8 and row["agent/gateway/errors"] == 0
    assert row["agent/gateway/agent_errors"] == 0
    assert row["rollout/logprob_abs_diff"] <= 1e-4


def test_python_m_gateway_serves_a_model_until_interrupted():
    """The standalone gateway as a user starts it: the URL and key printed, a real client's
    request answered, Ctrl-C ends it with status 0."""
    import openai

    process = subprocess.Popen(
        [sys.executable, "-m", "megarl.agent.gateway", "--port", "0", "--max-new-tokens", "4"],
        stdout=subprocess.PIPE,
        text=True,
        env=run_env(),
    )
    try:
        assert process.stdout is not None
        url_line, key_line = process.stdout.readline(), process.stdout.readline()
        base = url_line.split()[2].replace("<id>", "try")
        client = openai.OpenAI(base_url=base, api_key=key_line.split()[-1], max_retries=0)
        reply = client.chat.completions.create(
            model="megarl-policy", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
        )
        assert reply.usage.completion_tokens <= 3
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
    finally:
        process.kill()
