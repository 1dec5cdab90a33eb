"""A disk that fills while a run trains: one line naming the path and the error, exit 1, no
traceback chain from any rank; the earlier checkpoint intact, and the resume trains on once
there is space again.

The run directory lives on a small tmpfs of its own, filled by this test once step 1's
checkpoint is published, so the run's next write (a metrics line, a checkpoint, a log) finds
no space, as on a real full disk. Mounting needs root (CAP_SYS_ADMIN): the test is skipped
where it cannot mount.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.runs import run_env, tiny_overrides

ENV = run_env()
pytestmark = pytest.mark.serial  # mounts a file system and fills it
TMPFS_SIZE = "700m"  # the init model (~55 MB) and three tiny-model checkpoints (~155 MB each)


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path) -> Path:
    """Write zeros until the file system is full; the file that holds them."""
    filler = disk / "filler"
    block = b"\0" * (1 << 20)
    with open(filler, "wb") as handle:
        try:
            while True:
                handle.write(block)
                handle.flush()
        except OSError:
            pass
    return filler


def start(run_dir: Path, steps: int, cwd: Path) -> subprocess.Popen:
    args = tiny_overrides(
        run_dir,
        steps=steps,
        **{"trainer.n_gpus_per_node": 2, "actor.tp": 2, "trainer.save_interval": 1},
    )
    return subprocess.Popen(
        [sys.executable, "-m", "megarl.train", *args],
        cwd=cwd,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_disk_that_fills_mid_run_is_one_line_and_the_resume_trains_on(tmp_path, small_disk):
    run_dir = small_disk / "run"
    launcher = start(run_dir, steps=4, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "checkpoints" / "step_000001").exists():
            assert launcher.poll() is None, launcher.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "step 1's checkpoint was not published in time"
            time.sleep(0.05)
        filler = fill(small_disk)
        _, stderr = launcher.communicate(timeout=300)
    finally:
        launcher.kill()
    assert launcher.returncode == 1, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    [line] = [x for x in stderr.splitlines() if x.startswith("megarl-train: error:")]
    assert "No space left on device (errno ENOSPC)" in line, line
    assert str(run_dir) in line, line
    assert json.loads(
        (run_dir / "checkpoints" / "step_000001" / "megarl_checkpoint.json").read_text()
    )
    print(f"disk full after step 1 -> {line}")

    filler.unlink()  # space is back: the run resumes from its last complete checkpoint
    resumed = start(run_dir, steps=4, cwd=tmp_path)
    _, stderr = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, stderr[-3000:]
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4], steps
