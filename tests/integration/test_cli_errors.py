"""Bad input: one line naming the key or file, exit code 2, no traceback, nothing written."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
from forked_cli import Finished
from helpers.models import edit_config, save_llama_folder

_VLLM_CASES = (
    []
    if importlib.util.find_spec("vllm") is None
    else [
        (
            [
                "rollout.engine=vllm",
                "model=tiny_llama",
                "model.hf_config.num_attention_heads=8",
                "model.hf_config.num_key_value_heads=4",
            ],
            "head size 16 is not supported",
        ),
        (["rollout.engine=vllm", "rollout.kv_cache_gb=100000"], "rollout.kv_cache_gb=100000"),
        (
            ["rollout.engine=vllm", "model=tiny_llama", "rollout.max_model_len=50"],
            "rollout.max_new_tokens=12 > 50 tokens (rollout.max_model_len=50); lower",
        ),
        (
            ["rollout.engine=vllm", "rollout.temperature=0.7", "rollout.top_p=0.9"],
            "rollout.top_p=0.9 with rollout.temperature=0.7",
        ),
    ]
)
"""vLLM settings it cannot honour (where vLLM is installed; without it, a test below)."""


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["actor.tpp=2"], "actor.tpp"),
        (["actor.tp=0"], "actor.tp=0"),
        (
            ["model=tiny_llama", "actor.tp=3", "trainer.n_gpus_per_node=3"],
            "actor.tp=3 does not divide the model's 4 attention heads",
        ),
        (
            ["model=tiny_llama", "actor.pp=3", "trainer.n_gpus_per_node=3"],
            "actor.pp=3 does not divide the model's 4 layers",
        ),
        (["actor.ppo_mini_batches=5"], "actor.ppo_mini_batches=5"),
        (["actor.ep=2", "trainer.n_gpus_per_node=2"], "actor.ep=2 needs a mixture-of-experts"),
        (["actor.ep=2"], "actor.ep=2 does not divide the 1 data-parallel ranks"),
        (["model=tiny_qwen3_moe", "actor.lora.rank=8"], "LoRA on a mixture-of-experts model"),
        (["model=tiny_qwen3_moe", "recipe=ppo"], "a critic for a mixture-of-experts model"),
        (["actor.moe_aux_loss_coef=-0.1"], "actor.moe_aux_loss_coef=-0.1: must be"),
        (
            ["model=tiny_llama", "actor.moe_aux_loss_coef=0.01"],
            "actor.moe_aux_loss_coef=0.01: the model (llama) is dense",
        ),
        (
            [
                "model=tiny_qwen3_moe",
                "actor.moe_aux_loss_coef=0.01",
                "planner.prune_zero_adv=match_loss_curve",
            ],
            "planner.prune_zero_adv=match_loss_curve cannot prune: actor.moe_aux_loss_coef=0.01",
        ),
        (
            ["model=tiny_llama", "actor.router_replay.mode=R3"],
            "actor.router_replay.mode=R3: the model (llama) is dense and has no router",
        ),
        (
            ["model=tiny_qwen3_moe", "actor.router_replay.mode=R2", "actor.recompute=full"],
            "actor.router_replay.mode=R2 with actor.recompute=full is not supported",
        ),
        (["model.path=/nonexistent/model"], "model.path=/nonexistent/model"),
        (["data.task=jsonl", "data.path=/nonexistent/data.jsonl"], "/nonexistent/data.jsonl"),
        (["planner.prune_zero_adv=match_loss_curve", "actor.kl_coef=0.1"], "actor.kl_coef"),
        (["planner.ref_log_prob=never", "actor.kl_coef=0.1"], "planner.ref_log_prob"),
        (
            ["planner.old_log_prob=rollout", "algo.rollout_correction.rollout_is=token"],
            "planner.old_log_prob=rollout makes the engine's logprobs the old ones",
        ),
        (
            ["algo.rollout_correction.rollout_rs=geo"],
            "algo.rollout_correction.rollout_rs='geo': must be one of token, sequence, geometric",
        ),
        (
            ["algo.rollout_correction.rollout_token_veto_threshold=2"],
            "algo.rollout_correction.rollout_token_veto_threshold=2: must be in (0, 1), or null",
        ),
        (["trainer.resume=/nonexistent/ckpt"], "checkpoint /nonexistent/ckpt: no such directory"),
        (["actor.optim.grad_clip=-1"], "actor.optim.grad_clip=-1.0: must be >= 0 (0 = no clip"),
        (["rollout.temperature=0"], "rollout.temperature=0.0: must be > 0"),
        (["actor.lr=inf"], "actor.lr=inf: must be a finite number"),
        (["data.reward_error=ignore"], "data.reward_error='ignore': must be one of raise, zero"),
        (
            ["model=tiny_llama", "model.hf_config.max_position_embeddings=48"],
            "80 of 80 prompts do not fit: the longest has 46 tokens, + rollout.max_new_tokens=12",
        ),
        (
            [
                "rollout.engine=megatron",
                "rollout.batch_invariant=true",
                "rollout.n_gpus=1",
                "trainer.launcher=ray",
            ],
            "rollout.batch_invariant=true with rollout.n_gpus=1: the rollout side's copy",
        ),
        (
            [
                "model=tiny_qwen3_moe",
                "rollout.engine=megatron",
                "actor.tp=2",
                "trainer.n_gpus_per_node=2",
            ],
            "rollout.engine=megatron with actor.tp=2: a mixture-of-experts model",
        ),
        *_VLLM_CASES,
    ],
)
def test_bad_input_is_one_line_and_exit_2(train_cli, tmp_path, args, needle):
    """Checked before any worker starts or anything is written."""
    _assert_one_line_exit_2(train_cli, tmp_path, args, needle)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (
            ["recipe=ppo", "planner.prune_zero_adv=fast"],
            "planner.prune_zero_adv=fast cannot prune: algo.adv_estimator=gae",
        ),
        (["recipe=ppo", "algo.lam=2"], "algo.lam=2.0: must be in [0, 1]"),
        (["recipe=ppo", "critic.cliprange_value=0"], "critic.cliprange_value=0.0: must be > 0"),
    ],
    ids=["prune", "lam", "cliprange"],
)
def test_bad_ppo_settings_are_one_line_and_exit_2(train_cli, tmp_path, args, needle):
    _assert_one_line_exit_2(train_cli, tmp_path, args, needle)


def _assert_one_line_exit_2(train_cli, tmp_path, args, needle):
    run_dir = tmp_path / "run"
    proc = train_cli.run(f"trainer.run_dir={run_dir}", *args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("megarl-train")]
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (run_dir / "metrics.jsonl").exists()


_BAD_MODELS = {
    "truncated weights": (
        lambda f: (f / "model.safetensors").write_bytes(
            (f / "model.safetensors").read_bytes()[:1000]
        ),
        "model.safetensors is not a readable safetensors file",
    ),
    "config not json": (
        lambda f: (f / "config.json").write_text("{not json"),
        "config.json is not valid JSON",
    ),
    "vocab disagreeing with the weights": (
        lambda f: edit_config(f, vocab_size=400),
        "config.json vocab_size=400 but model.embed_tokens.weight has 384 rows",
    ),
    "no tokenizer": (lambda f: (f / "tokenizer.json").unlink(), "folder has no tokenizer"),
}


def _assert_one_line_exit_2_nothing_written(proc, needle: str, run_dir: Path) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("megarl-train")]
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not run_dir.exists() or not any(run_dir.iterdir()), list(run_dir.iterdir())


@pytest.mark.parametrize("case", sorted(_BAD_MODELS))
def test_bad_model_folder_is_one_line_and_writes_nothing(train_cli, tmp_path, case):
    corrupt, needle = _BAD_MODELS[case]
    model = save_llama_folder(tmp_path / "model")
    corrupt(model)
    run_dir = tmp_path / "run"
    proc = train_cli.run(f"trainer.run_dir={run_dir}", f"model.path={model}", cwd=tmp_path)
    _assert_one_line_exit_2_nothing_written(proc, f"model.path={model}: {needle}", run_dir)


def _critic_folder(folder: Path, **changes) -> Path:
    """A value model of ``model=tiny_llama``'s architecture, with ``changes`` to its HF config
    (``num_labels`` and ``bias`` go to its score head)."""
    from helpers.models import tiny_llama_hf_config, value_model_folder

    head = {k: changes.pop(k) for k in ("num_labels", "bias") if k in changes}
    value_model_folder(folder, {**tiny_llama_hf_config(), **changes}, seed=1, **head)
    return folder


_BAD_CRITICS = {
    "missing": (lambda f: f / "nope", "no such folder"),
    "no config": (
        lambda f: (_critic_folder(f), (f / "config.json").unlink())[0],
        "folder has no config.json",
    ),
    "no weights": (
        lambda f: (_critic_folder(f), (f / "model.safetensors").unlink())[0],
        "folder has no *.safetensors weights",
    ),
    "other width": (
        lambda f: _critic_folder(f, hidden_size=64),
        "hidden_size 64 differs from the actor's 128",
    ),
    "other depth": (
        lambda f: _critic_folder(f, num_hidden_layers=2),
        "num_layers 2 differs from the actor's 4",
    ),
    "two labels": (
        lambda f: _critic_folder(f, num_labels=2),
        "score.weight has shape [2, 128]; a value head needs [1, 128]",
    ),
    "score bias": (lambda f: _critic_folder(f, bias=0.5), "score.bias is nonzero ([0.5])"),
}


@pytest.mark.parametrize("case", sorted(_BAD_CRITICS))
def test_bad_critic_model_path_is_one_line_and_writes_nothing(train_cli, tmp_path, case):
    """``critic.model.path`` must hold the actor's architecture (it is built through the
    actor's code at the actor's layout) and a scalar head if any: refused at start-up."""
    make, needle = _BAD_CRITICS[case]
    folder = make(tmp_path / "critic")
    run_dir = tmp_path / "run"
    proc = train_cli.run(
        f"trainer.run_dir={run_dir}",
        "model=tiny_llama",
        "recipe=ppo",
        f"critic.model.path={folder}",
        cwd=tmp_path,
    )
    _assert_one_line_exit_2_nothing_written(proc, f"critic.model.path={folder}: {needle}", run_dir)


def test_unparsable_gguf_is_one_line(train_cli, tmp_path):
    gguf = tmp_path / "random.gguf"
    gguf.write_bytes(bytes(range(256)) * 64)
    run_dir = tmp_path / "run"
    proc = train_cli.run(f"trainer.run_dir={run_dir}", f"model.path={gguf}", cwd=tmp_path)
    _assert_one_line_exit_2_nothing_written(
        proc, f"model.path={gguf}: not a readable .gguf", run_dir
    )


def test_random_init_refused_by_a_later_check_leaves_run_dir_untouched(train_cli, tmp_path):
    """The init model is written to a staging folder and moved in only once every check passed."""
    run_dir = tmp_path / "run"
    proc = train_cli.run(
        f"trainer.run_dir={run_dir}",
        "model=tiny_llama",
        "actor.pp=3",
        "trainer.n_gpus_per_node=3",
        cwd=tmp_path,
    )
    _assert_one_line_exit_2_nothing_written(proc, "actor.pp=3 does not divide", run_dir)


def test_malformed_dataset_row_names_file_and_line(train_cli, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": "no answer"}\n')
    proc = train_cli.run(
        f"trainer.run_dir={tmp_path / 'run'}", "data.task=jsonl", f"data.path={data}", cwd=tmp_path
    )
    assert proc.returncode == 2
    assert f"{data}:2:" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("second_row", "needle"),
    [
        (
            {"prompt": "2+2?", "reward_model": {"ground_truth": "four"}},
            "reward_model.ground_truth='four' is not a number",
        ),
        (
            {"data_source": "acme/code", "prompt": "f?", "reward_model": {"ground_truth": "x"}},
            "data_source 'acme/code' has no built-in reward",
        ),
    ],
    ids=["not-a-number", "unknown-data-source"],
)
def test_bad_parquet_row_names_file_and_row(train_cli, tmp_path, second_row, needle):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "train.parquet"
    rows = [
        {"data_source": "openai/gsm8k", "prompt": "1+1?", "reward_model": {"ground_truth": "2"}}
    ]
    pq.write_table(pa.Table.from_pylist([*rows, second_row]), data)
    run_dir = tmp_path / "run"
    proc = train_cli.run(f"trainer.run_dir={run_dir}", f"data.train_files={data}", cwd=tmp_path)
    _assert_one_line_exit_2_nothing_written(proc, f"{data}:2: {needle}", run_dir)


def test_overlong_prompts_are_refused_or_filtered_by_the_key(train_cli, tmp_path):
    """GSM8K in a 128-token context: 14 of the 64 sample prompts cannot fit. Refused with one
    line that names the key; with it, left out and counted, and the run trains on the rest."""
    data = Path(__file__).resolve().parents[2] / "examples" / "data" / "gsm8k" / "train.parquet"
    common = [
        "model=tiny_llama",
        "model.hf_config.max_position_embeddings=128",
        f"data.train_files={data}",
        "rollout.max_new_tokens=6",
    ]
    refused = train_cli.run(f"trainer.run_dir={tmp_path / 'refused'}", *common, cwd=tmp_path)
    _assert_one_line_exit_2_nothing_written(
        refused, "14 of 64 prompts do not fit", tmp_path / "refused"
    )
    assert "data.filter_overlong_prompts=true" in refused.stderr
    filtered = train_cli.run(
        f"trainer.run_dir={tmp_path / 'filtered'}",
        *common,
        "data.filter_overlong_prompts=true",
        "trainer.total_steps=1",
        "trainer.tensorboard=false",
        "rollout.n=2",
        "data.prompts_per_step=2",
        cwd=tmp_path,
    )
    assert filtered.returncode == 0, filtered.stderr[-2000:]
    assert "left out 14 of 64 prompts that do not fit" in filtered.stdout
    [row] = [
        json.loads(r) for r in (tmp_path / "filtered" / "metrics.jsonl").read_text().splitlines()
    ]
    assert row["prompt_length/mean"] <= 128 - 6


_REWARD_MODULE = """
def returns_nan(response, answer):
    return float("nan")


def raises(response, answer):
    raise KeyError("no such answer key")


def exits(response, answer):
    import unittest  # a check through unittest.main(): SystemExit(False) when it passes
    raise SystemExit(False)
"""
"""A user's reward module: written into tmp_path, which goes on the subprocess's PYTHONPATH."""


def _train_with_reward_module(train_cli, tmp_path: Path, *args: str) -> Finished:
    (tmp_path / "user_rewards.py").write_text(_REWARD_MODULE)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    return train_cli.run(*args, cwd=tmp_path, env={"PYTHONPATH": path})


_TINY_RUN = (
    "model=tiny_llama",
    "trainer.total_steps=1",
    "trainer.log_console=false",
    "trainer.tensorboard=false",
    "rollout.n=2",
    "rollout.max_new_tokens=2",
    "data.prompts_per_step=1",
)


@pytest.mark.parametrize(
    ("fn", "ranks", "needle"),
    [
        ("returns_nan", 1, "data.reward=user_rewards:returns_nan: sample 0 (step 1) returned nan"),
        (
            "raises",
            2,  # raised in rank 0 of two: reaches the launcher as the rank's one line
            "data.reward=user_rewards:raises: sample 0 (step 1) raised KeyError: 'no such answer",
        ),
        (
            "exits",
            1,  # never the run's exit 0
            "data.reward=user_rewards:exits: sample 0 (step 1) raised SystemExit(False) (at ",
        ),
    ],
)
def test_failing_reward_function_is_one_line_and_exit_2(train_cli, tmp_path, fn, ranks, needle):
    proc = _train_with_reward_module(
        train_cli,
        tmp_path,
        f"trainer.run_dir={tmp_path / 'run'}",
        f"data.reward=user_rewards:{fn}",
        f"trainer.n_gpus_per_node={ranks}",
        *_TINY_RUN,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("megarl-train")]
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_reward_error_zero_scores_the_sample_zero_and_finishes(train_cli, tmp_path):
    proc = _train_with_reward_module(
        train_cli,
        tmp_path,
        f"trainer.run_dir={tmp_path / 'run'}",
        "data.reward=user_rewards:raises",
        "data.reward_error=zero",
        *_TINY_RUN,
    )
    assert proc.returncode == 0, proc.stderr
    assert "warning: data.reward=user_rewards:raises: sample 0 (step 1) raised" in proc.stderr
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["critic/rewards/failed"] == 2.0
    assert metrics["critic/rewards/mean"] == 0.0


@pytest.mark.parametrize("value", ["''", "notes.txt"])
def test_bad_run_dir_is_one_line_and_touches_nothing(train_cli, tmp_path, value):
    (tmp_path / "notes.txt").write_text("keep me")
    proc = train_cli.run(f"trainer.run_dir={value}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("megarl-train")]
    assert len(lines) == 1 and lines[0].startswith("megarl-train: error: trainer.run_dir="), lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_a_late_refusal_leaves_an_existing_run_dir_as_it_was(train_cli, tmp_path):
    """Refused by the last start-up check (the prompts do not fit): by then the random-init model
    was written to a staging folder, but no init_model, metrics rotation or folder reaches
    run_dir."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    before = {p: p.read_bytes() if p.is_file() else None for p in run_dir.rglob("*")}
    proc = train_cli.run(
        f"trainer.run_dir={run_dir}",
        "model=tiny_llama",
        "model.hf_config.max_position_embeddings=48",
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert "prompts do not fit" in proc.stderr
    assert {p: p.read_bytes() if p.is_file() else None for p in run_dir.rglob("*")} == before
