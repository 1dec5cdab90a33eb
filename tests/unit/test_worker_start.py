"""How the local launcher starts its workers, and how a forked worker tells that its launcher
is gone (the parts that need no second rank)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.distributed import launcher
from megarl.distributed.processes import process_lives


@pytest.mark.parametrize("forced", ["spawn", "forkserver"])
def test_the_environment_can_force_a_start_method(monkeypatch, forced):
    monkeypatch.setenv(launcher.START_METHOD_ENV, forced)
    assert launcher.start_method() == forced


def test_workers_are_forked_from_the_warm_server_off_cuda_and_spawned_with_it(monkeypatch):
    monkeypatch.delenv(launcher.START_METHOD_ENV, raising=False)
    monkeypatch.setattr(launcher.torch.cuda, "is_available", lambda: False)
    assert launcher.start_method() == "forkserver"
    monkeypatch.setattr(launcher.torch.cuda, "is_available", lambda: True)
    assert launcher.start_method() == "spawn"
    monkeypatch.setenv(launcher.START_METHOD_ENV, "fork")  # not offered: unsafe, ignored
    assert launcher.start_method() == "spawn"


def test_a_zombie_launcher_counts_as_gone_and_a_reaped_one_too():
    """A SIGKILLed launcher stays a zombie until its parent collects it; ``kill(pid, 0)``
    still succeeds then, so only its state tells a worker to stop."""
    assert process_lives(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    stat = Path(f"/proc/{child.pid}/stat")
    while stat.read_text().rpartition(")")[2].split()[0] != "Z":
        pass  # exited, not yet collected: a zombie
    assert not process_lives(child.pid)
    child.wait()
    assert not process_lives(child.pid)


def test_every_warm_module_imports():
    """A name the fork server cannot import is skipped silently there: check them here."""
    import importlib

    for name in launcher.WARM_MODULES:
        importlib.import_module(name)
