#!/usr/bin/env bash
# A tool-calling agent: GRPO of SmolLM2-135M-Instruct on the GSM8K sample in verl's multi-turn
# schema (examples/data/gsm8k_calculator: agent_name tool_agent, extra_info.tools_kwargs), with
# the calculator of examples/tools/calculator.yaml (recipe gsm8k_tool_agent). The model's turns
# train; the calculator's answers are read, never trained. SmolLM2's chat template has no tool
# support, so the tool schemas and the <tool_call> convention go into the system message.
#
#   examples/gsm8k_calculator.sh                    # installs .venv on first use, then trains
#   examples/gsm8k_calculator.sh model.path=/path/to/Qwen2.5-0.5B-Instruct   # a tool-trained model
#
# Output: runs/gsm8k_calculator/ (metrics.jsonl with agent/*, generations/<step>.jsonl showing each
# trajectory's turns and which were trained).
source "$(dirname "$0")/run_example.sh"
run_agent_example gsm8k_calculator gsm8k_tool_agent "$@"
