#!/usr/bin/env bash
# GRPO of SmolLM2-135M-Instruct on the shipped GSM8K sample (examples/data/gsm8k: 64 train and
# 32 test problems in verl's parquet schema), validated on the test problems before training,
# every 3 steps and after the last. CPU is enough: on 2 shared cores a step (16 responses of up to
# 200 tokens) took 2-4 minutes and each validation (32 greedy answers) about 3.
#
#   examples/gsm8k_smollm2.sh                       # installs .venv on first use, then trains
#   examples/gsm8k_smollm2.sh trainer.total_steps=20 rollout.engine=vllm   # any override
#
# The rows' data_source (openai/gsm8k) picks the reward: the number after the last "####".
# Output: runs/gsm8k_smollm2/ (metrics.jsonl, TensorBoard, val_generations/<step>.jsonl).
source "$(dirname "$0")/run_example.sh"
run_example gsm8k_smollm2 \
    data.train_files=examples/data/gsm8k/train.parquet \
    data.val_files=examples/data/gsm8k/test.parquet \
    trainer.val_before_train=true \
    trainer.val_interval=3 \
    trainer.total_steps=6 \
    rollout.max_new_tokens=200 \
    trainer.validation_data_dir=runs/gsm8k_smollm2/val_generations \
    "$@"
