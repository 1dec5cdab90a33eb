"""A process the run owns freezes its long-lived objects; a caller's process is left alone."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import gc
from megarl.distributed import heap
heap.freeze_after_startup()
print(heap.owned(), gc.get_freeze_count())
heap.own_this_process()
imports = gc.get_freeze_count()
built = [[] for _ in range(1000)]  # what a rank builds at start-up
heap.freeze_after_startup()
print(heap.owned(), imports > 0, gc.get_freeze_count() >= imports + 1000)
"""


def test_only_an_owned_process_freezes_and_it_freezes_what_start_up_built():
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.split("\n")[:2] == ["False 0", "True True True"], done.stdout


def test_the_command_called_from_python_leaves_the_callers_process_alone(capsys):
    from megarl.distributed import heap
    from megarl.train import main

    assert main(["--help"]) == 0
    assert "usage: megarl-train" in capsys.readouterr().out
    assert not heap.owned()
