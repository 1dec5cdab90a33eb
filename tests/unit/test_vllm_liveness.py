"""How a dead vLLM engine core is described, and how the watch turns a waiter's error into it
(the real kill: ``tests/integration/test_vllm_engine.py``)."""

from __future__ import annotations

import queue
import signal
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from megarl.engines.vllm_liveness import EngineCoreDied, EngineCoreWatch, describe_exit


@pytest.mark.parametrize(
    ("exitcode", "text"),
    [
        (-signal.SIGKILL, "killed by SIGKILL (as the out-of-memory killer does)"),
        (-signal.SIGSEGV, "killed by SIGSEGV"),
        (1, "exit code 1"),
        (None, "ended"),
    ],
)
def test_an_exit_is_described_by_its_signal_or_code(exitcode, text):
    assert describe_exit(exitcode) == text


def fake_llm() -> SimpleNamespace:
    """An ``LLM`` whose client has an output queue and one pending utility call, no process."""
    client = SimpleNamespace(
        outputs_queue=queue.Queue(),
        utility_results={7: Future()},
        resources=SimpleNamespace(engine_manager=SimpleNamespace(processes=[])),
    )
    return SimpleNamespace(llm_engine=SimpleNamespace(engine_core=client))


def test_a_death_wakes_every_waiter_and_replaces_the_error_they_raise():
    llm = fake_llm()
    watch = EngineCoreWatch(llm)
    death = EngineCoreDied("vLLM's engine core process EngineCore (pid 1) killed by SIGKILL")
    watch._fail_waiters(death)
    client = llm.llm_engine.engine_core
    assert client.outputs_queue.get_nowait() is death
    assert client.utility_results[7].exception() is death
    with pytest.raises(EngineCoreDied) as raised, watch.named("a weight update"):
        raise RuntimeError("EngineDeadError: EngineCore encountered an issue")
    assert raised.value is death
    with pytest.raises(EngineCoreDied), watch.named("generation of 4 requests"):
        pytest.fail("a call after the death must not run")


def test_without_a_death_errors_pass_through_unchanged():
    watch = EngineCoreWatch(fake_llm())
    with pytest.raises(ValueError, match="bad request"), watch.named("generation"):
        raise ValueError("bad request")
    assert watch.death is None and watch.activity == "idle"
