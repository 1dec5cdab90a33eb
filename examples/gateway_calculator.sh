#!/usr/bin/env bash
# An agent you already have: examples/agents/openai_calculator.py is written with the plain
# openai SDK (its own system prompt, a calculator it runs in its own code) and knows nothing of
# megarl. The gateway gives each sample a session URL, renders the agent's messages with the
# chat template, keeps the ids the policy sampled, and GRPO trains them (recipe
# gsm8k_openai_agent, GSM8K sample); the calculator's answers are read, never trained.
#
#   examples/gateway_calculator.sh                   # installs .venv on first use, then trains
#   examples/gateway_calculator.sh model.path=/path/to/Qwen2.5-0.5B-Instruct
#
# Output: runs/gateway_calculator/ (metrics.jsonl with agent/* and agent/gateway/*,
# generations/<step>.jsonl showing each trajectory's turns and which were trained).
source "$(dirname "$0")/run_example.sh"
run_agent_example gateway_calculator gsm8k_openai_agent "$@"
