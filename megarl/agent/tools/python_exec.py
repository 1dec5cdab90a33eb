"""``python``: the model runs a Python program and reads what it printed.

Every call is a fresh sandbox (:mod:`megarl.agent.sandbox`): a new interpreter in an empty
temporary folder, no network, no environment of the trainer, no file of the run, killed at its
limits. Nothing persists between calls, so the schema tells the model to write complete
programs that ``print`` what they need.

Tool YAML (verl's shape)::

    tools:
      - class_name: megarl.agent.tools.python_exec.PythonExecTool
        config:            # every key optional; see docs/sandbox.md
          timeout_s: 10
          cpu_s: 5
          memory_mb: 512
          max_processes: 16
          max_file_mb: 16
          max_open_files: 64
          max_output_bytes: 16384
          max_code_bytes: 65536
          max_concurrency: 8
          python: /usr/bin/python3
          read_paths: []
          require: [network, filesystem, processes, syscalls]
          cgroup_parent: null   # a delegated cgroup v2 folder (default: the trainer's own)
        tool_schema: ...   # default: PYTHON_EXEC_SCHEMA
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import os
import re
import signal
from typing import Any

from megarl.agent.sandbox import (
    LAYERS,
    REQUIREMENTS,
    SandboxLimits,
    SandboxResult,
    run_python,
)
from megarl.agent.tools.base import Tool, ToolError

PYTHON_EXEC_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "python",
        "description": (
            "Run a complete Python 3 program and return what it prints (stdout; stderr and the "
            "exit status too when it fails). Each call starts a fresh interpreter in an empty "
            "folder: variables, imports and files do not persist between calls. There is no "
            "network and no input; a few seconds of time. Use print() for every value you "
            "need to see."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "The Python program to run."},
            },
            "required": ["code"],
        },
    },
}

# Config keys besides the limits; ``type`` is verl's tool-type tag, accepted and unused.
_OTHER_KEYS = (
    "cgroup_parent",
    "max_code_bytes",
    "max_concurrency",
    "python",
    "read_paths",
    "require",
    "type",
)
_SIGNAL_MEANING = {
    "SIGXCPU": "CPU time limit",
    "SIGKILL": "hard resource limit",
    "SIGSEGV": "segmentation fault",
    "SIGABRT": "aborted",
    "SIGXFSZ": "file size limit",
}


class PythonExecTool(Tool):
    """Runs the model's ``code`` argument in the sandbox; the observation is its output.

    A program that fails is an observation, not an error: the model reads the traceback and
    fixes its code. Only a malformed call (no ``code``, not a string, too long) raises
    :class:`ToolError`. Calls beyond ``max_concurrency`` wait for a slot; their timeout starts
    when they run.
    """

    def __init__(
        self, config: dict[str, Any] | None = None, tool_schema: dict[str, Any] | None = None
    ) -> None:
        super().__init__(config or {}, tool_schema or copy.deepcopy(PYTHON_EXEC_SCHEMA))
        known = (*SandboxLimits.field_names(), *_OTHER_KEYS)
        unknown = sorted(set(self.config) - set(known))
        if unknown:
            raise ValueError(
                f"{type(self).__name__}: unknown config keys {unknown}; known: {known}"
            )
        self.limits = SandboxLimits.from_config(self.config)
        self.max_code_bytes = int(self.config.get("max_code_bytes", 65_536))
        self.max_concurrency = int(self.config.get("max_concurrency", min(os.cpu_count() or 4, 8)))
        self.python: str | None = self.config.get("python")
        self.read_paths = _names(self.config.get("read_paths", ()))
        self.require = _names(self.config.get("require", ()))
        self.cgroup_parent: str | None = self.config.get("cgroup_parent")
        bad = [r for r in self.require if r not in REQUIREMENTS and r not in LAYERS]
        if bad:
            known = [*REQUIREMENTS, *LAYERS]
            raise ValueError(f"{type(self).__name__}: require {bad}; known: {known}")
        self._slots: asyncio.Semaphore | None = None
        self._slots_loop: asyncio.AbstractEventLoop | None = None

    async def execute(self, arguments: dict[str, Any], state: Any) -> str:
        code = arguments.get("code") if isinstance(arguments, dict) else None
        if not isinstance(code, str):
            raise ToolError(
                f"{self.name}: expected a string argument 'code', got {arguments!r:.200}"
            )
        if not code.strip():
            raise ToolError(f"{self.name}: 'code' is empty")
        size = len(code.encode("utf-8", errors="replace"))
        if size > self.max_code_bytes:
            raise ToolError(f"{self.name}: the code is {size} bytes; at most {self.max_code_bytes}")
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots_loop is not loop:  # a semaphore has one loop
            self._slots, self._slots_loop = asyncio.Semaphore(self.max_concurrency), loop
        async with self._slots:
            result = await run_python(
                code,
                self.limits,
                python=self.python,
                read_paths=self.read_paths,
                require=self.require,
                cgroup_parent=self.cgroup_parent,
            )
        return format_observation(result, self.limits)


def _names(value: Any) -> tuple[str, ...]:
    """A YAML list of strings (a lone string is a list of one, not of its characters)."""
    return (value,) if isinstance(value, str) else tuple(str(v) for v in value)


# C0 controls but tab and newline, DEL and C1 controls (U+009B is a one-character CSI).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def escape_controls(text: str) -> str:
    """``text`` with every control character but tab and newline shown as ``\\xNN``: a
    program's output reaches the model's context, logs and terminals, where an escape
    sequence would clear a screen, hide lines or retitle a window and a NUL cut a C string."""
    return _CONTROL.sub(lambda match: f"\\x{ord(match.group()):02x}", text)


def format_observation(result: SandboxResult, limits: SandboxLimits) -> str:
    """What the model reads: stdout alone when the program succeeded; otherwise also stderr
    and how it ended, so that it can fix the program. Control characters are shown escaped
    (:func:`escape_controls`)."""
    result = dataclasses.replace(
        result, stdout=escape_controls(result.stdout), stderr=escape_controls(result.stderr)
    )
    parts = [result.stdout] if result.stdout else []
    if result.truncated:
        parts.append(
            f"\n[output truncated after {limits.max_output_bytes} bytes; the program was stopped]\n"
        )
    if result.stderr and (not result.ok or not result.stdout):
        parts.append(f"\n[stderr]\n{result.stderr}")
    ending = _ending(result, limits)
    if ending:
        parts.append(f"\n[{ending}]")
    text = "".join(parts).strip("\n")
    return text or "[no output]"


def _ending(result: SandboxResult, limits: SandboxLimits) -> str | None:
    if result.timed_out:
        return f"timed out after {limits.timeout_s:g} s; the program was killed"
    if result.killed_by == "output_limit":
        return None  # the truncation note says it
    if result.killed_by:
        meaning = _SIGNAL_MEANING.get(result.killed_by)
        if meaning is None:
            try:
                meaning = signal.strsignal(signal.Signals[result.killed_by]) or ""
            except KeyError:
                meaning = ""
        return f"killed by {result.killed_by}" + (f" ({meaning})" if meaning else "")
    if result.exit_code:
        return f"exit status {result.exit_code}"
    return None
