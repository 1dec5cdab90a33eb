#!/usr/bin/env python
"""HF <-> Megatron checkpoint conversion; the same command as the ``megarl-convert`` script.

python tools/convert.py hf-to-mcore --hf PATH --out DIR --tp N --pp M
python tools/convert.py mcore-to-hf --ckpt DIR --out DIR
"""

from __future__ import annotations

import sys

from megarl.checkpoint.convert import main

if __name__ == "__main__":
    sys.exit(main())
