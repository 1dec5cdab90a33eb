"""vLLM's one-process executor under a name of megarl's (``distributed_executor_backend``).

The host names it by its path; vLLM resolves it in the host and in its engine-core process.
Nothing but vLLM's own ``UniProcExecutor`` is imported here, so resolving it costs the host no
import it has not already made.

Why a name of our own: on CPU vLLM replaces ``distributed_executor_backend="uni"`` with its
multiprocess executor, so that the model worker starts in a process of its own whose OpenMP
threads are bound to cores through that process's environment. That worker process imports vLLM
a third time (the host and the engine core already did) and loads the model only then: ~12 s of
a ~26 s start of SmolLM2 on the 2-core machine. With the worker inside the engine core the
engine starts in ~14 s and generates as fast, bit for bit the same (the binding gained nothing
here: measured side by side, ``benchmarks/RESULTS.md``). vLLM's CPU platform swaps only the string
``"uni"``, so this subclass keeps the engine core's own executor.
"""

from __future__ import annotations

from vllm.v1.executor.uniproc_executor import UniProcExecutor


class InEngineCoreExecutor(UniProcExecutor):
    """vLLM's ``UniProcExecutor``: the model worker runs in the engine-core process."""
