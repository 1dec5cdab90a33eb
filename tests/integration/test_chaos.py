"""Chaos: one seeded fault in a tiny 2-rank run, at a phase the seed draws, under each engine.

The seed (``MEGARL_CHAOS_SEED``, 0 in CI; any other explores) draws what fails -- a rank killed
(SIGKILL) or frozen, a reward call that never returns, or (vLLM) the engine-core process killed
-- and where: rank 0 or 1, and the phase of step 2 it happens in (``MEGARL_FAULT_AT`` acts as
that rank's main loop enters the phase). Whatever is drawn, the run must:

- end non-zero within its bound (a death: seconds; a freeze: the collective timeout plus the
  launcher's grace), with exactly one error line naming the component (and, for a freeze, the
  phase and step);
- leave no process behind (every process the run started, ranks and engine processes, gone);
- resume with ``trainer.resume=auto`` and finish with per-step metrics equal to an
  uninterrupted run's, exactly.

The deterministic versions of each fault are ordinary tests elsewhere (``test_run_lifecycle``,
``test_launcher_failures``, ``test_vllm_engine``); this one checks they hold wherever they hit.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
from helpers.runs import run_env, tiny_overrides

from megarl.train import run

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # timed: a hang is found within seconds
ENV = run_env()
SEED = int(os.environ.get("MEGARL_CHAOS_SEED", "0"))
TIMEOUT_S = {"hf": 8, "vllm": 120}
"""``trainer.collective_timeout_s``: rank 1 waits in a collective while rank 0 starts vLLM."""
PHASES = ("rollout", "scatter", "update_actor", "update_weights", "record_metrics", "save")
"""Phases every rank enters in each step of this run (no reference model, no critic)."""
COMPARED = (
    "critic/rewards/mean",
    "actor/pg_loss",
    "actor/grad_norm",
    "response_length/mean",
    "rollout/logprob_abs_diff",
)
ENGINES = {
    "hf": {},
    "vllm": {"rollout.engine": "vllm"},
}


@dataclass(frozen=True)
class Fault:
    """One drawn fault: what the test injects, and what the one error line must say."""

    name: str
    env: dict[str, str] = field(default_factory=dict)
    overrides: dict[str, object] = field(default_factory=dict)
    says: tuple[str, ...] = ()
    bound_s: float = 15.0


def draw(rng: random.Random, engine: str) -> Fault:
    kinds = ["kill rank", "freeze rank", "hang reward"] + (["kill engine"] * (engine == "vllm"))
    kind = rng.choice(kinds)
    rank, phase = rng.choice([0, 1]), rng.choice(PHASES)
    where = f"{'actor+rollout' if rank == 0 else 'actor'} rank {rank} on node"
    stuck_bound = TIMEOUT_S[engine] + 10 + 15  # the launcher's grace; a loaded 2-core machine
    if kind == "kill rank":
        return Fault(
            f"rank {rank} killed in {phase} of step 2",
            env={"MEGARL_FAULT_AT": f"{rank}:2:{phase}:die"},
            says=(where, "failed (exit code 137): killed or crashed without a Python error"),
        )
    if kind == "freeze rank":
        return Fault(
            f"rank {rank} frozen in {phase} of step 2",
            env={"MEGARL_FAULT_AT": f"{rank}:2:{phase}:freeze"},
            says=(where, "failed: stopped responding", f"during {phase} of step 2"),
            bound_s=stuck_bound,
        )
    if kind == "hang reward":
        return Fault(
            "a reward call that never returns in step 2",
            overrides={"data.reward": "synthetic_rewards:hangs_at_step_2"},
            says=("actor+rollout rank 0 on node", "stopped responding", "during rollout of step 2"),
            bound_s=stuck_bound,
        )
    return Fault(
        "vLLM's engine core killed as step 2's rollout begins",
        env={"MEGARL_FAULT_AT": "0:2:rollout:kill-engine"},
        says=("actor+rollout rank 0 on node", "vLLM's engine core process", "killed by SIGKILL"),
    )


def overrides(run_dir: Path, engine: str, **extra: object) -> list[str]:
    return tiny_overrides(
        run_dir,
        steps=3,
        **{
            "trainer.n_gpus_per_node": 2,
            "actor.tp": 2,
            "trainer.save_interval": 1,
            "trainer.collective_timeout_s": TIMEOUT_S[engine],
            **ENGINES[engine],
            **extra,
        },
    )


def curve(run_dir: Path) -> list[tuple]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(row["step"], *(row[key] for key in COMPARED)) for row in rows]


def run_faulted(run_dir: Path, engine: str, fault: Fault, cwd: Path) -> tuple[int, str, float]:
    """Start ``megarl-train`` with the fault; its exit code, stderr and seconds from the fault
    to the exit, after checking that every process it started is gone."""
    mark, log = cwd / "fault_at", cwd / "faulted.stderr"
    with open(log, "w") as stderr_file:  # a file: a pipe nobody reads while polling could fill
        launcher = subprocess.Popen(
            [sys.executable, "-m", "megarl.train", *overrides(run_dir, engine, **fault.overrides)],
            cwd=cwd,
            env={**ENV, **fault.env, "MEGARL_FAULT_INJECT_MARK": str(mark)},
            stdout=subprocess.DEVNULL,
            stderr=stderr_file,
        )
    seen: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + 600
    try:
        parent = psutil.Process(launcher.pid)
        while launcher.poll() is None:
            assert time.monotonic() < deadline, "the faulted run did not end"
            with contextlib.suppress(psutil.NoSuchProcess):
                seen.update({child.pid: child for child in parent.children(recursive=True)})
            time.sleep(0.5)
    finally:
        launcher.kill()
    ended_at = time.time()
    stderr = log.read_text()
    deadline = time.monotonic() + 10
    while left := [p for p in seen.values() if alive(p)]:
        assert time.monotonic() < deadline, f"left running: {[p.cmdline() for p in left]}"
        time.sleep(0.2)
    assert mark.exists(), f"the fault never fired: {stderr[-3000:]}"
    return launcher.returncode, stderr, ended_at - float(mark.read_text())


def alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_seeded_fault_is_named_cleaned_up_and_resumed_exactly(engine, tmp_path):
    if engine == "vllm":
        pytest.importorskip("vllm")
    fault = draw(random.Random(f"{SEED}:{engine}"), engine)
    print(f"chaos seed {SEED}, {engine}: {fault.name}")

    straight = tmp_path / "straight"
    run(overrides(straight, engine))

    run_dir = tmp_path / "run"
    code, stderr, detect_s = run_faulted(run_dir, engine, fault, tmp_path)
    assert code not in (0, None), stderr[-3000:]
    [line] = [x for x in stderr.splitlines() if x.startswith("megarl-train: error:")]
    for text in fault.says:
        assert text in line, (fault.name, line)
    assert detect_s < fault.bound_s, (fault.name, detect_s, line)
    print(f"-> exit {code} {detect_s:.1f} s after the fault: {line}")

    run(overrides(run_dir, engine))  # trainer.resume=auto (the default), no fault
    assert curve(run_dir) == curve(straight)
