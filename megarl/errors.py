"""The one error type a user reads: a message of one line and the exit code it ends the run with.

Bottom of the package (imports nothing of megarl). Anything that knows what went wrong and
where -- a key, a file, an engine that could not start -- raises a :class:`MegarlError`; the
command line prints ``megarl-train: error: <message>`` and exits with its code, whichever
process it was raised in. Everything else is a bug, reported with its traceback.
"""

from __future__ import annotations

import signal

EXIT_RUNTIME = 1
EXIT_BAD_INPUT = 2


class MegarlError(Exception):
    """A failure explained in one line; ``exit_code`` 1 (runtime) unless a subclass says 2."""

    exit_code = EXIT_RUNTIME

    def __str__(self) -> str:
        return " ".join(super().__str__().split())  # one line, whatever the message held


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
