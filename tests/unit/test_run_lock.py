"""One run per run directory: the lock file's refusal, stale takeover and release."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from megarl.distributed.processes import process_start
from megarl.distributed.run_lock import (
    LOCK_NAME,
    RunDirBusy,
    acquire,
    release,
    run_lock,
)
from megarl.errors import EXIT_BAD_INPUT


def _write_lock(run_dir, host: str, pid: int, pid_start: int | None = None) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOCK_NAME).write_text(json.dumps({"host": host, "pid": pid, "pid_start": pid_start}))


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_lock_holds_host_and_pid_and_is_removed_on_exit(tmp_path):
    run_dir = tmp_path / "new" / "run"
    with run_lock(run_dir) as path:
        held = json.loads(path.read_text())
        assert held["host"] == socket.gethostname() and held["pid"] == os.getpid()
        assert held["pid_start"] == process_start(os.getpid())
    assert not path.exists()


def test_live_holder_is_refused_with_its_host_and_pid(tmp_path, capsys):
    _write_lock(tmp_path, socket.gethostname(), os.getpid(), process_start(os.getpid()))
    with pytest.raises(RunDirBusy) as info:
        acquire(tmp_path)
    message = str(info.value)
    assert f"host {socket.gethostname()}, pid {os.getpid()}" in message, message
    assert f"trainer.run_dir={tmp_path}" in message and "\n" not in message
    assert info.value.exit_code == EXIT_BAD_INPUT
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()  # untouched


def test_holder_on_another_host_is_refused(tmp_path):
    _write_lock(tmp_path, "elsewhere-node", 1)
    with pytest.raises(RunDirBusy, match="host elsewhere-node, pid 1.*another host"):
        acquire(tmp_path)


@pytest.mark.parametrize("reused_pid", [False, True])
def test_stale_lock_is_taken_over_with_a_warning(tmp_path, capsys, reused_pid):
    """A dead holder, or a pid now running another process (different start time), is stale."""
    if reused_pid:
        dead, start = os.getpid(), (process_start(os.getpid()) or 0) + 1
    else:
        dead, start = _dead_pid(), None
    _write_lock(tmp_path, socket.gethostname(), dead, start)
    path = acquire(tmp_path)
    assert json.loads(path.read_text())["pid"] == os.getpid()
    [warning] = capsys.readouterr().err.splitlines()
    assert "warning: taking over the stale lock" in warning and f"pid {dead}" in warning
    release(path)
    assert not path.exists()


def test_unreadable_lock_is_refused_naming_the_file(tmp_path):
    (tmp_path / LOCK_NAME).write_text("")
    with pytest.raises(RunDirBusy, match="unreadable; remove it"):
        acquire(tmp_path)


def test_release_leaves_a_lock_another_run_took_over(tmp_path):
    path = acquire(tmp_path)
    _write_lock(tmp_path, socket.gethostname(), 1)
    release(path)
    assert path.exists()
