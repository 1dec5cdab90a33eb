"""The process questions the launcher, run lock, sandbox and fault injection share (/proc)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from megarl.distributed.processes import (
    command_line,
    descendants,
    kill_all,
    process_lives,
    process_start,
    processes_of_uid,
)


def test_a_grandchild_is_found_named_and_killed_with_its_parent():
    """A shell that starts a long sleep: both are below this process, the sleep's command line
    is readable, and ``kill_all`` ends both (what the launcher does to a stopped rank)."""
    shell = subprocess.Popen(["/bin/sh", "-c", "sleep 300 & wait"])
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the shell's fork reads as the shell until it execs
            below = descendants(os.getpid())
            sleeps = [pid for pid in below if command_line(pid) == "sleep 300"]
            if sleeps:
                break
            time.sleep(0.02)
        assert shell.pid in below
        assert len(sleeps) == 1, [(pid, command_line(pid)) for pid in below]
        kill_all([shell.pid, sleeps[0]])
        shell.wait(timeout=10)
        deadline = time.monotonic() + 10
        while process_lives(sleeps[0]) and time.monotonic() < deadline:
            time.sleep(0.02)  # reaped by init once its parent is gone
        assert not process_lives(sleeps[0])
    finally:
        kill_all(descendants(os.getpid()))
        shell.wait(timeout=10)


def test_a_start_time_tells_a_recycled_pid_from_its_first_owner():
    here = process_start(os.getpid())
    assert isinstance(here, int) and here > 0
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    assert process_start(child.pid) >= here  # started later (clock ticks since boot)
    child.wait()
    assert process_start(child.pid) is None  # reaped: gone
    assert command_line(child.pid) == ""
    kill_all([child.pid])  # a gone pid is no error


def test_kill_engine_sigkills_the_engine_core_below_this_process(monkeypatch):
    """``MEGARL_FAULT_AT=...:kill-engine`` finds vLLM's engine core by its title and kills it,
    leaving this process and its other children running."""
    from megarl.distributed import fault_injection

    code = "import time; time.sleep(300)"
    core = subprocess.Popen([sys.executable, "-c", code, "VLLM::EngineCore"])
    other = subprocess.Popen([sys.executable, "-c", code])
    try:
        monkeypatch.setenv(fault_injection.AT_ENV, "0:3:rollout:kill-engine")
        monkeypatch.setattr(fault_injection, "_fired_at", False)
        fault_injection.at_phase(0, 3, "update_actor")  # another phase: nothing
        assert core.poll() is None
        fault_injection.at_phase(0, 3, "rollout")
        assert core.wait(timeout=10) == -9
        assert other.poll() is None
    finally:
        kill_all([core.pid, other.pid])
        core.wait(timeout=10)
        other.wait(timeout=10)


def test_the_processes_of_a_uid_are_found_and_a_zombie_is_not():
    """What the sandbox sweeps after a tool call: every live process of its private uid (here
    this test's own uid, whose processes include this one), never an exited one."""
    child = subprocess.Popen(["/bin/true"])
    deadline = time.monotonic() + 10
    while process_lives(child.pid) and time.monotonic() < deadline:
        time.sleep(0.02)  # a zombie until waited for
    try:
        mine = processes_of_uid(os.getuid())
        assert os.getpid() in mine
        assert child.pid not in mine
        assert processes_of_uid(2**31 - 2) == []  # no process has that uid
    finally:
        child.wait(timeout=10)
