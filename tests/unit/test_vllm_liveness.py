"""How a dead vLLM engine core is described, and how the watch turns a waiter's error into it
(the real kill: ``tests/integration/test_vllm_engine.py``)."""

from __future__ import annotations

import queue
import signal
import warnings
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from megarl.engines.vllm_liveness import EngineCoreDied, EngineCoreWatch, describe_exit, exit_code

NOT_FOUND = "vLLM's engine-core processes were not found"
pytestmark = pytest.mark.filterwarnings(f"ignore:{NOT_FOUND}")  # the fakes have no process


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


class ReapedElsewhere:
    """A dead process another thread is reaping: its exit code appears after a few reads."""

    def __init__(self, reads_before_code: int) -> None:
        self.reads_left = reads_before_code

    def join(self, timeout: float | None = None) -> None:
        pass  # the other thread won ``waitpid``: this join finds nothing to reap

    @property
    def exitcode(self) -> int | None:
        self.reads_left -= 1
        return -signal.SIGKILL if self.reads_left < 0 else None


def test_the_exit_code_is_awaited_while_another_thread_reaps_the_process():
    assert describe_exit(exit_code(ReapedElsewhere(reads_before_code=5))) == (
        "killed by SIGKILL (as the out-of-memory killer does)"
    )
    assert exit_code(ReapedElsewhere(reads_before_code=10**9), wait_s=0.05) is None  # bounded


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


def test_a_client_without_processes_is_said_unless_it_runs_the_core_in_process():
    """If vLLM renames what the watch reads, the run says the watch is blind, not nothing."""
    with pytest.warns(UserWarning, match=NOT_FOUND):
        EngineCoreWatch(fake_llm())

    class InprocClient:  # VLLM_ENABLE_V1_MULTIPROCESSING=0: the core runs in this process
        pass

    in_process = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=InprocClient()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        EngineCoreWatch(in_process)
