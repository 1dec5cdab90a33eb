"""``megarl-train`` as a real process, without paying Python's start-up for every run.

The bad-input tests start dozens of runs that stop within a second of their imports (torch,
transformers, Hydra: ~3 s each on a 2-core machine). This module, run as a script, imports all
that once and then forks one child per requested run. The child is a process of its own with its
own working directory, environment, exit code, stdout and stderr: what a user's shell sees,
minus the start-up. Ranks the child starts are spawned as usual (fresh interpreters).

Protocol, one JSON line each way: request ``{"args", "cwd", "env", "stdout", "stderr",
"new_session"}``;
replies ``{"pid"}`` when the child started, then ``{"returncode"}`` when it ended.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Finished:
    """What a finished ``megarl-train`` left, in :class:`subprocess.CompletedProcess`'s names."""

    returncode: int
    stdout: str
    stderr: str


class ForkedTrain:
    """A warm interpreter that runs ``megarl-train`` in forked children, one at a time."""

    def __init__(self, env: dict[str, str], scratch: Path):
        self._scratch = scratch
        self._count = 0
        self._server = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        assert self._reply(timeout_s=300) == {"ready": True}

    def run(
        self, *args: str, cwd: Path, env: dict[str, str] | None = None, timeout_s: float = 300
    ) -> Finished:
        """Run to its end; stdout and stderr apart, as ``subprocess.run(capture_output=True)``."""
        out = self._scratch / f"run{self._count + 1}.stdout"
        err = self._scratch / f"run{self._count + 1}.stderr"
        started = self.start(*args, cwd=cwd, env=env, stdout=out, stderr=err)
        try:
            returncode = started.wait(timeout_s)
        except TimeoutError:
            os.kill(started.pid, signal.SIGKILL)
            started.wait(timeout_s=30)
            raise
        return Finished(returncode, out.read_text(), err.read_text())

    def start(
        self,
        *args: str,
        cwd: Path,
        stdout: Path,
        stderr: Path | None = None,
        env: dict[str, str] | None = None,
        new_session: bool = False,
    ) -> ForkedRun:
        """Start a run and return at once, as ``subprocess.Popen``; ``stderr`` None: into
        ``stdout``; ``new_session``: the child leads a process group of its own (``killpg``)."""
        self._count += 1
        request = {
            "args": list(args),
            "cwd": str(cwd),
            "env": env or {},
            "stdout": str(stdout),
            "stderr": str(stderr or stdout),
            "new_session": new_session,
        }
        assert self._server.stdin is not None
        self._server.stdin.write(json.dumps(request) + "\n")
        self._server.stdin.flush()
        return ForkedRun(self, self._reply(timeout_s=30)["pid"])

    def close(self) -> None:
        if self._server.stdin is not None:
            self._server.stdin.close()
        self._server.wait(timeout=30)

    def _reply(self, timeout_s: float) -> dict:
        assert self._server.stdout is not None
        ready, _, _ = select.select([self._server.stdout], [], [], timeout_s)
        if not ready:
            raise TimeoutError(f"megarl-train gave no answer within {timeout_s} s")
        line = self._server.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server exited with {self._server.wait()}")
        return json.loads(line)


class ForkedRun:
    """A started run, read as a ``subprocess.Popen``: ``pid``, ``poll()``, ``wait()``. The server
    answers its exit code once it ended; the next run starts after that."""

    def __init__(self, server: ForkedTrain, pid: int):
        self._server = server
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(TimeoutError):
                self.returncode = self._server._reply(timeout_s=0)["returncode"]
        return self.returncode

    def wait(self, timeout_s: float) -> int:
        if self.returncode is None:
            self.returncode = self._server._reply(timeout_s)["returncode"]
        return self.returncode


def _child(request: dict) -> None:
    """Become ``megarl-train <args>`` in ``cwd``; never returns."""
    code = 1
    try:
        if request["new_session"]:
            os.setsid()
        stdin = os.open(os.devnull, os.O_RDONLY)
        stdout = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        stderr = stdout
        if request["stderr"] != request["stdout"]:
            stderr = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
            os.dup2(fd, target)
        os.chdir(request["cwd"])
        os.environ.update(request["env"])
        extra_paths = request["env"].get("PYTHONPATH", "").split(os.pathsep)
        sys.path[:0] = [p for p in extra_paths if p]  # what a fresh interpreter would do
        sys.argv = ["megarl-train", *request["args"]]
        from megarl.distributed import heap
        from megarl.train import main

        heap.own_this_process()  # as the command does when it reads its own sys.argv
        code = main(request["args"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001  as the interpreter would: traceback on stderr, exit 1
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve() -> None:
    import hydra  # noqa: F401  the imports every run pays for, paid once here
    import transformers  # noqa: F401

    import megarl.models.random_init
    import megarl.train
    import megarl.trainer.rank_loop  # noqa: F401

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    _serve()
