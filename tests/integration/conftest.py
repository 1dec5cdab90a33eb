"""Shared fixtures for integration tests (real Megatron ranks on CPU/gloo)."""

from __future__ import annotations

import atexit
import gc
import os
from pathlib import Path

import pytest
from forked_cli import ForkedTrain
from helpers.runs import tiny_overrides

# What the module fixture below froze is handed back at exit: extension modules' leak checks
# (triton's nanobind) otherwise print a page of "leaked" lines as the worker ends.
atexit.register(gc.unfreeze)


@pytest.fixture(scope="module", autouse=True)
def _long_lived_objects_frozen():
    """What this test process imported and kept so far (torch, Megatron-Core, transformers,
    vLLM, the earlier modules' fixtures), out of the garbage collector's walk: the runs a test
    starts in its own process (a world of one) would otherwise walk them all on every full
    collection, as a run's own process avoids with :mod:`megarl.distributed.heap`."""
    gc.collect()
    gc.freeze()


@pytest.fixture
def tiny_run(tmp_path):
    from megarl.train import run

    def _run(steps: int = 2, return_final_state: bool = False, **extra):
        return run(
            tiny_overrides(tmp_path / "run", steps, **extra), return_final_state=return_final_state
        )

    return _run


@pytest.fixture(scope="session")
def train_cli(tmp_path_factory):
    """``train_cli.run(*args, cwd=...)``: ``megarl-train`` in a forked child of a warm
    interpreter (see forked_cli.py), for tests that start many short runs."""
    here = Path(__file__).parent  # the test modules runs name, and tests/ whose helpers they import
    paths = (str(here), str(here.parent), os.environ.get("PYTHONPATH"))
    path = os.pathsep.join(p for p in paths if p)
    server = ForkedTrain({**os.environ, "PYTHONPATH": path}, tmp_path_factory.mktemp("forked"))
    yield server
    server.close()
