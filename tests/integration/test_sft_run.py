"""Supervised fine-tuning end to end on the tiny model (``recipe=sft``): the loss falls on the
assistant tokens, validation reports loss and perplexity, no rollout engine is built or synced;
the split over data-parallel ranks and micro-batches trains what one big batch trains; a stopped
run resumes bitwise; bad rows stop the start in one line; RL continues from the run folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.runs import tiny_overrides

from megarl.train import StartupError, run

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "calculator_agent" / "data"
SFT = {
    "recipe": "sft",
    "data.train_files": f"[{DATA / 'sft_train.jsonl'}]",
    "data.val_files": f"[{DATA / 'sft_val.jsonl'}]",
    "data.prompts_per_step": 4,
    "actor.lr": 1e-3,
}


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_sft_lowers_the_loss_on_assistant_tokens_without_an_engine(tmp_path):
    gens = tmp_path / "gens"
    overrides = {**SFT, "trainer.val_interval": 3, "trainer.rollout_data_dir": str(gens)}
    history = run(tiny_overrides(tmp_path / "run", 3, **overrides)).history
    assert history[-1]["sft/loss"] < history[0]["sft/loss"]
    assert history[-1]["sft/val_loss"] > 0 and "sft/val_ppl" in history[-1]
    for row in history:
        assert row["gates/base_weight_sync"] == 0.0
        assert "sync: no rollout engine" in row["gates/reasons"]
        assert row["timing_s/update_weights"] < 0.01
        assert "rollout/logprob_abs_diff" not in row and "critic/rewards/mean" not in row
    record = json.loads((gens / "1.jsonl").read_text().splitlines()[0])
    trained = [t["text"] for t in record["turns"] if t["trained"]]
    assert trained[0].startswith("<tool_call>") and trained[-1].endswith("<|im_end|>")
    assert all("<tool_response>" not in text for text in trained)


def test_the_data_parallel_split_trains_what_one_big_batch_trains(tmp_path):
    """Token-mean over the step's assistant tokens is exact under the split: DP=2 with
    micro-batches of at most 512 tokens ends where DP=1 with the whole batch in one
    micro-batch ends (fp32; only the summation order differs)."""
    one = run(
        tiny_overrides(tmp_path / "one", 2, **SFT, **{"actor.micro_batch_tokens": 100_000}),
        return_final_state=True,
    )
    split = run(
        tiny_overrides(
            tmp_path / "split",
            2,
            **SFT,
            **{"trainer.n_gpus_per_node": 2, "actor.micro_batch_tokens": 512},
        ),
        return_final_state=True,
    )
    assert (
        split.history[0]["planner/num_micro_batches"] > one.history[0]["planner/num_micro_batches"]
    )
    for a, b in zip(one.history, split.history, strict=True):
        assert a["sft/loss"] == pytest.approx(b["sft/loss"], rel=1e-5)
    diff = max(
        (one.final_state[k] - split.final_state[k]).abs().max().item() for k in one.final_state
    )
    assert diff < 1e-5, diff


def test_a_stopped_sft_run_resumes_bitwise(tmp_path):
    straight = run(tiny_overrides(tmp_path / "straight", 4, **SFT), return_final_state=True)
    resumed_dir = tmp_path / "resumed"
    run(tiny_overrides(resumed_dir, 2, **SFT, **{"trainer.save_interval": 2}))
    resumed = run(
        tiny_overrides(resumed_dir, 4, **SFT, **{"trainer.save_interval": 2}),
        return_final_state=True,
    )
    losses = [row["sft/loss"] for row in _rows(resumed_dir)]
    assert losses == [row["sft/loss"] for row in straight.history]
    for name, tensor in straight.final_state.items():
        assert torch.equal(tensor, resumed.final_state[name]), name


def test_rl_continues_from_the_sft_run_folder(tmp_path):
    sft_dir = tmp_path / "sft"
    run(tiny_overrides(sft_dir, 2, **SFT, **{"trainer.save_interval": 2}))
    rl_dir = tmp_path / "rl"
    overrides = tiny_overrides(rl_dir, 1)
    overrides = [o for o in overrides if not o.startswith("model=")] + [f"model.path={sft_dir}"]
    [row] = run(overrides).history
    source = json.loads((rl_dir / "init_model" / "megarl_source.json").read_text())
    assert source["step"] == 2 and "step_000002" in source["source"]
    assert row["rollout/logprob_abs_diff"] <= 1e-4


def test_a_bad_row_stops_the_start_naming_file_and_row_or_is_skipped(tmp_path):
    data = tmp_path / "sft.jsonl"
    good = {"prompt": "Say hi.", "response": "Hi!"}
    rows = [good, {"messages": [{"role": "user", "content": "no answer"}]}, good]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = {**SFT, "data.train_files": f"[{data}]", "data.val_files": "null"}
    run_dir = tmp_path / "run"
    with pytest.raises(StartupError) as refused:
        run(tiny_overrides(run_dir, 1, **overrides))
    assert str(refused.value).startswith(f"{data}:2: no assistant turn")
    assert not run_dir.exists() or not any(run_dir.iterdir())
    [row] = run(tiny_overrides(run_dir, 1, **overrides, **{"data.skip_bad_rows": "true"})).history
    assert row["sft/trained_tokens"] > 0


@pytest.mark.parametrize(
    "layout",
    [{"actor.lora.rank": 8, "actor.lora.alpha": 16}, {"actor.tp": 2, "trainer.n_gpus_per_node": 2}],
    ids=["lora", "tp2"],
)
def test_sft_trains_with_lora_and_tensor_parallel(tmp_path, layout):
    history = run(tiny_overrides(tmp_path / "run", 2, **SFT, **layout)).history
    assert history[-1]["sft/loss"] < history[0]["sft/loss"]
    assert all(row["actor/grad_norm"] > 0 for row in history)
    assert all("sync: no rollout engine" in row["gates/reasons"] for row in history)
