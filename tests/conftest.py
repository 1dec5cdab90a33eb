"""Loaded first by every run of the tests: puts this folder on ``sys.path``, so test modules
(and the rank processes they start, which inherit ``sys.path``) import the shared set-ups of
``tests/helpers/`` as ``helpers``. Fixtures stay in each folder's own ``conftest.py``."""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = str(Path(__file__).resolve().parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
