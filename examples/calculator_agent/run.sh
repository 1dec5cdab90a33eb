#!/usr/bin/env bash
# A tool-calling agent that learns on a 2-core CPU: SmolLM2-135M-Instruct never calls a tool, so
# RL alone has nothing to reinforce. Stage 1 fine-tunes it on 320 traces that call the
# calculator (recipe=sft); stage 2 trains GRPO with the tool loop from that checkpoint, on
# questions of a kind the traces never show (two operations, worded as problems). Each model is
# measured on the same 64 held-out questions (evaluate.py: greedy, the tool loop): the share of
# trajectories with a well-formed tool call, and the accuracy.
#
#   examples/calculator_agent/run.sh          # installs .venv on first use (~4 min), ~17 min more
#
# Writes runs/calculator_agent/{sft,rl}/ (metrics.jsonl, checkpoints) and results.json, and
# prints the table at the end. SFT_STEPS / RL_STEPS override the stages' lengths.
set -euo pipefail
cd "$(dirname "$0")/../.."
make --no-print-directory install
OUT=${OUT:-runs/calculator_agent}
SFT_STEPS=${SFT_STEPS:-5}
RL_STEPS=${RL_STEPS:-10}
PY=.venv/bin/python
EVAL="$PY examples/calculator_agent/evaluate.py --out $OUT/results.json"
mkdir -p "$OUT"

$EVAL --label base
.venv/bin/megarl-train recipe=sft \
    trainer.run_dir="$OUT/sft" trainer.total_steps="$SFT_STEPS" trainer.save_interval="$SFT_STEPS" \
    data.prompts_per_step=8 actor.lr=5e-5 trainer.val_interval="$SFT_STEPS"
$EVAL --label sft --model "$OUT/sft"
.venv/bin/megarl-train model.path="$OUT/sft" \
    data.train_files=[examples/calculator_agent/data/rl_train.parquet] \
    rollout.agent.loop=tool rollout.agent.tool_config_path=examples/tools/calculator.yaml \
    rollout.agent.max_turns=3 rollout.agent.max_tool_response_tokens=32 \
    rollout.max_new_tokens=96 rollout.n=4 data.prompts_per_step=8 actor.lr=3e-5 \
    trainer.run_dir="$OUT/rl" trainer.total_steps="$RL_STEPS" trainer.save_interval="$RL_STEPS" \
    trainer.rollout_data_dir="$OUT/rl/generations"
$EVAL --label rl --model "$OUT/rl"
$PY examples/calculator_agent/evaluate.py --table "$OUT/results.json"
