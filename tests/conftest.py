"""Loaded first by every run of the tests: puts this folder on ``sys.path``, so test modules
(and the rank processes they start, which inherit ``sys.path``) import the shared set-ups of
``tests/helpers/`` as ``helpers``. Fixtures more than one folder uses are here; the others in
their folder's ``conftest.py``."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

TESTS = str(Path(__file__).resolve().parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

# Several test workers, their ranks and engines share a few cores: OpenMP's idle threads sleep
# instead of spinning for the next parallel region, which on an oversubscribed machine burns
# the time the other processes wait for (measured: ~8% of a module's CPU). Read by OpenMP when
# torch loads, so before any test module imports it; inherited by every process a test starts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture
def vllm_not_installed(monkeypatch):
    """``importlib.util.find_spec("vllm")`` answers ``None``, as where vLLM is not installed."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "vllm" else real_find_spec(name, *args),
    )
