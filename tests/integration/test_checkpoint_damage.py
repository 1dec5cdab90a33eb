"""A damaged newest checkpoint: ``trainer.resume=auto`` stops with one line (exit 2) and changes
nothing; resuming from the older checkpoint by path then works, sets the damaged one aside
intact, repairs a torn metrics line and leaves one metrics line per step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.runs import tiny_overrides

from megarl.checkpoint.layout import model_file
from megarl.train import main

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_damaged_newest_checkpoint_is_named_never_skipped(train_cli, tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = tiny_overrides(run_dir, 2, **{"trainer.save_interval": 1})
    assert main(args) == 0
    root = run_dir / "checkpoints"
    older, newest = root / "step_000001", root / "step_000002"
    shard = newest / model_file(0, 0)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a torn copy
    with open(run_dir / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 3, "actor/pg')  # a write cut by a kill
    before = _tree(run_dir)
    capsys.readouterr()

    proc = train_cli.run(*args, cwd=REPO)  # the CLI as a user runs it: exit code and stderr
    assert proc.returncode == 2, proc.stderr[-2000:]
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"megarl-train: error: checkpoint {newest}: {shard.name} is damaged")
    assert f"trainer.resume={older}" in line and "trainer.resume=never" in line
    assert _tree(run_dir) == before, "a refused resume must leave the run directory as it was"

    assert main([*args, f"trainer.resume={older}"]) == 0
    out = capsys.readouterr().out
    assert f"resuming from {older} (step 1)" in out and "later checkpoints set aside" in out
    [aside] = root.glob("abandoned-*-step_000002")
    assert _tree(aside) == {k.split("/", 2)[2]: v for k, v in before.items() if "step_000002" in k}
    assert _tree(older) == {k.split("/", 2)[2]: v for k, v in before.items() if "step_000001" in k}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
