"""SIGTERM and SIGINT reach the launcher's clean-up the same way; only the exit code differs.

The end-to-end check (workers stopped, lock released, one line) runs once, with SIGTERM, in
``tests/integration/test_run_lifecycle.py``; this proves SIGINT takes the same path."""

from __future__ import annotations

import os
import signal

import pytest

from megarl.distributed.launcher import RunStopped, stop_on_signals


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_raises_run_stopped_with_the_shell_exit_code(sig, code):
    before = signal.getsignal(sig)
    with pytest.raises(RunStopped) as stopped, stop_on_signals():  # noqa: PT012
        os.kill(os.getpid(), sig)  # the handler runs at the next bytecode, inside the block
        signal.sigtimedwait([], 0)
    assert stopped.value.exit_code == code
    assert str(stopped.value) == f"stopped by {sig.name}"
    assert signal.getsignal(sig) is before, "the previous handler is restored"
