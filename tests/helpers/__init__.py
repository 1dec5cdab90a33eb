"""Set-ups the tests share (tiny models, engine references, rank start-up, run overrides).

``tests/conftest.py`` puts ``tests/`` on ``sys.path``: import these as ``from helpers.models
import ...``. They import torch, transformers and megarl lazily where they can, so a test that
skips (no CUDA, no vLLM) still imports them for nothing.
"""
