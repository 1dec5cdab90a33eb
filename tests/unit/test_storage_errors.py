"""Storage faults are one line: which errors are the storage's, what the line says, and the
error path's own log write falling back to stderr. End to end on a real full disk:
``tests/integration/test_storage_faults.py``."""

from __future__ import annotations

import errno
from types import SimpleNamespace

from megarl.distributed.launcher import WorkerFailed
from megarl.errors import StorageError, storage_error
from megarl.train import _log_traceback


def test_a_full_disk_through_an_open_file_names_the_run_dir_errno_and_phase():
    exc = OSError(errno.ENOSPC, "No space left on device")
    failure = storage_error(exc, "/runs/a", "record_metrics of step 2")
    assert isinstance(failure, StorageError) and failure.exit_code == 1
    message = str(failure)
    assert message.startswith(
        "cannot write a file in /runs/a: No space left on device (errno ENOSPC) during "
        "record_metrics of step 2; "
    )
    assert "trainer.resume=auto" in message and "\n" not in message


def test_a_read_only_file_system_names_the_file():
    exc = OSError(errno.EROFS, "Read-only file system", "/runs/a/checkpoints/.tmp-step_000002")
    message = str(storage_error(exc, "/runs/a", None))
    assert message.startswith(
        "cannot write /runs/a/checkpoints/.tmp-step_000002: Read-only file system (errno EROFS);"
    )


def test_a_missing_file_is_the_storages_only_inside_the_run_dir():
    removed = OSError(errno.ENOENT, "No such file or directory", "/runs/a/checkpoints")
    assert isinstance(storage_error(removed, "/runs/a", "save of step 3"), StorageError)
    elsewhere = OSError(errno.ENOENT, "No such file or directory", "/models/x/config.json")
    assert storage_error(elsewhere, "/runs/a", "save of step 3") is None
    beside = OSError(errno.ENOENT, "No such file or directory", "/runs/ab/model.safetensors")
    assert storage_error(beside, "/runs/a", "save of step 3") is None
    assert storage_error(OSError(errno.EPIPE, "Broken pipe"), "/runs/a", None) is None


def test_an_error_log_that_cannot_be_written_goes_to_stderr_instead(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cfg = SimpleNamespace(trainer=SimpleNamespace(run_dir=str(blocker / "run"), debug=False))
    failed = WorkerFailed(0, None, "KeyError: 'x'")
    _log_traceback(cfg, failed, "Traceback (most recent call last):\nKeyError: 'x'\n")
    assert "KeyError: 'x'" in capsys.readouterr().err
    assert str(failed).endswith("could not be written: Not a directory)")
    assert "traceback above" in str(failed)


def test_the_launchers_own_start_up_writes_are_one_line_too():
    """The run directory's lock, the placed model, the resume check's tidying: written by the
    launcher before any rank starts, and named the same way; other errors pass unchanged."""
    import pytest

    from megarl.train import _storage_errors_named

    full = OSError(errno.ENOSPC, "No space left on device", "/runs/a/init_model/x")
    with pytest.raises(StorageError) as named, _storage_errors_named("/runs/a", "start-up"):
        raise full
    assert str(named.value).startswith(
        "cannot write /runs/a/init_model/x: No space left on device (errno ENOSPC) during start-up;"
    )
    missing = OSError(errno.ENOENT, "No such file or directory", "/models/x/config.json")
    with pytest.raises(OSError) as raised, _storage_errors_named("/runs/a", "start-up"):
        raise missing
    assert raised.value is missing
