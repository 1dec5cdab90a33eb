"""The real `slurm/megarl.sbatch` on a real (single-host, 2 emulated nodes) Slurm cluster.

Submits a 2-step tiny run with ``trainer.launcher=ray trainer.nnodes=2`` from a directory that is
not the repo, waits with a bound, and checks the job COMPLETED, metrics.jsonl has both steps, the
ranks sat on two different Ray nodes, logs landed under the run dir, and no Ray process of the
job outlived it. Skips, saying why, where Slurm/munge are not installed or we are not root
(`.ci/run` installs them).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from local_cluster import LocalSlurm, missing_requirements

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "slurm" / "megarl.sbatch"
JOB_TIMEOUT_S = 420

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


@pytest.fixture(scope="module")
def slurm():
    reason = missing_requirements()
    if reason:
        pytest.skip(reason)
    cluster = LocalSlurm(num_nodes=2).start()
    try:
        yield cluster
    finally:
        cluster.stop()


def _ray_processes_of(job_tmp: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if job_tmp in line and "ps -eo" not in line]


def test_sbatch_two_nodes_ray_run_completes(slurm, tmp_path):
    submit_dir = tmp_path / "elsewhere"  # not the repo: the script must find it itself
    submit_dir.mkdir()
    overrides = [
        "model=tiny_llama",
        "trainer.launcher=ray",
        "trainer.nnodes=2",
        "trainer.n_gpus_per_node=1",
        "trainer.device=cpu",
        "trainer.total_steps=2",
        "rollout.n=4",
        "data.prompts_per_step=2",
        "rollout.max_new_tokens=6",
        "trainer.log_console=false",
        "trainer.tensorboard=false",
        "trainer.run_dir=runs/t",
        # the tiny model's rewards are all equal, so pruning would train nothing and leave
        # rollout/logprob_abs_diff (trainer vs engine on trained sequences) empty
        "planner.prune_zero_adv=off",
    ]
    start = time.monotonic()
    job = slurm.sbatch(
        ["--nodes=2", str(SBATCH), *overrides],
        cwd=submit_dir,
        env={"MEGARL_RAY_JOIN_TIMEOUT_S": "90", "MEGARL_RAY_OBJECT_STORE_BYTES": str(256 * 2**20)},
    )
    state = slurm.wait(job, JOB_TIMEOUT_S)
    elapsed = time.monotonic() - start
    out = (submit_dir / f"megarl-{job}.out").read_text()
    print(f"sbatch to done: {elapsed:.1f} s")
    print("\n".join(line for line in out.splitlines() if line.startswith("megarl.sbatch:")))
    assert state == "COMPLETED", f"job {job} ended {state}:\n{out[-3000:]}"

    run_dir = submit_dir / "runs" / "t"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rollout/logprob_abs_diff"] <= 1e-3 for r in rows)
    train_log = (run_dir / "logs" / "train.log").read_text()
    assert "2 rank(s) on 2 node(s)" in train_log
    assert {p.name for p in (run_dir / "logs").iterdir()} >= {
        "train.log",
        "ray-head-n1.log",
        "ray-worker-n2.log",
    }
    assert not _ray_processes_of(f"/tmp/megarl-ray-{job}"), "Ray processes outlived the job"


def test_node_that_does_not_join_fails_fast_naming_it(slurm, tmp_path):
    """n2's ray start points at a dead address: the job fails fast (join timeout, or n2's ray
    start exiting), the one-line error names n2, and no Ray process of the job is left."""
    submit_dir = tmp_path / "elsewhere"
    submit_dir.mkdir()
    join_timeout_s = 20
    start = time.monotonic()
    job = slurm.sbatch(
        [
            "--nodes=2",
            str(SBATCH),
            "model=tiny_llama",
            "trainer.launcher=ray",
            "trainer.nnodes=2",
            "trainer.run_dir=runs/bad",
        ],
        cwd=submit_dir,
        env={
            "MEGARL_RAY_JOIN_TIMEOUT_S": str(join_timeout_s),
            "MEGARL_RAY_OBJECT_STORE_BYTES": str(256 * 2**20),
            "MEGARL_RAY_WORKER_ARGS": "--address=127.0.0.1:9",
        },
    )
    state = slurm.wait(job, JOB_TIMEOUT_S)
    elapsed = time.monotonic() - start
    out = (submit_dir / f"megarl-{job}.out").read_text()
    print(f"bad node: job {state} after {elapsed:.1f} s")
    print("\n".join(line for line in out.splitlines() if line.startswith("megarl.sbatch:")))
    assert state == "FAILED", out[-3000:]
    errors = [line for line in out.splitlines() if "megarl.sbatch: error" in line]
    # either the join timeout fired or n2's `ray start` gave up first: both name the node
    assert errors and "Slurm node n2 " in errors[0], out[-3000:]
    assert (
        "did not join the Ray cluster" in errors[0] and f"within {join_timeout_s} s" in errors[0]
    ) or "stopped before joining" in errors[0], errors[0]
    assert not (submit_dir / "runs" / "bad" / "metrics.jsonl").exists()  # training never began
    assert not _ray_processes_of(f"/tmp/megarl-ray-{job}"), "Ray processes outlived the job"
