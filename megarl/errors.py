"""The one error type a user reads: a message of one line and the exit code it ends the run with.

Bottom of the package (imports nothing of megarl). Anything that knows what went wrong and
where -- a key, a file, an engine that could not start -- raises a :class:`MegarlError`; the
command line prints ``megarl-train: error: <message>`` and exits with its code, whichever
process it was raised in. Everything else is a bug, reported with its traceback.
"""

from __future__ import annotations

import errno
import os
import signal

EXIT_RUNTIME = 1
EXIT_BAD_INPUT = 2


class MegarlError(Exception):
    """A failure explained in one line; ``exit_code`` 1 (runtime) unless a subclass says 2."""

    exit_code = EXIT_RUNTIME

    def __str__(self) -> str:
        return " ".join(super().__str__().split())  # one line, whatever the message held


class StartupError(Exception):
    """A user error found before training starts (``megarl-train``'s checks); printed as one
    line, exit 2."""


class BadInputError(MegarlError):
    """Bad input (config, model, data, checkpoint, argument): exit 2, nothing run or written."""

    exit_code = EXIT_BAD_INPUT


class RunAborted(MegarlError):
    """The run is being ended from outside the code that is running: raised wherever the main
    thread is, user code included (a reward function, a tool). Every place that catches the
    user's exceptions lets it through, so it is never counted as the user's failure."""


class RunStopped(RunAborted):
    """The launcher was sent SIGTERM or SIGINT: the run was stopped on purpose. The exit code is
    the shell's convention for a process ended by that signal, 128 + its number (SIGINT 130,
    SIGTERM 143). Raised by the signal handler (:class:`RunAborted`)."""

    def __init__(self, signum: int):
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


class StorageError(MegarlError):
    """A write the run needs failed because of the storage, not the code: no space, a quota, a
    read-only or failing file system, or the run directory removed under the run (exit 1)."""


STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG})
"""Errors that are the storage's wherever they come from."""
STORAGE_ERRNOS_IN_RUN_DIR = frozenset({errno.ENOENT, errno.EACCES, errno.ESTALE})
"""Errors that are the storage's when they come from a path in the run directory (a folder
removed, or made unwritable, under a running run); elsewhere they may be anything (a missing
model file is bad input, not a full disk)."""


def storage_error(exc: OSError, run_dir: str, during: str | None) -> StorageError | None:
    """The one-line :class:`StorageError` for ``exc``, or None when it is not the storage's.

    Writes through an open file (a metrics line, a checkpoint shard) raise without a file name;
    the line then names the run directory, which is where every such write goes."""
    path = exc.filename if isinstance(exc.filename, str) else None
    in_run_dir = path is None or _is_within(path, run_dir)
    if exc.errno not in STORAGE_ERRNOS and not (
        exc.errno in STORAGE_ERRNOS_IN_RUN_DIR and in_run_dir
    ):
        return None
    assert exc.errno is not None
    name = errno.errorcode.get(exc.errno, str(exc.errno))
    where = path or f"a file in {run_dir}"
    when = f" during {during}" if during else ""
    return StorageError(
        f"cannot write {where}: {exc.strerror or os.strerror(exc.errno)} (errno {name}){when}; "
        "the checkpoints saved before it are intact: fix the storage (free space), then run "
        "again with trainer.resume=auto to go on from the newest one"
    )


def _is_within(path: str, folder: str) -> bool:
    path, folder = os.path.abspath(path), os.path.abspath(folder)
    return os.path.commonpath([path, folder]) == folder
