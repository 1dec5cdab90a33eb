"""A cheap, exact checksum of a tensor's bits, to prove the engine holds what the trainer sent.

Two integer sums over the tensor's raw words (read as int16/int32/int64 by element size): the
plain sum catches changed values, the position-weighted sum catches moved ones. Integer maths is
exact on every device, so sender and receiver agree bit for bit or the weights differ. Worked in
chunks so the temporary stays small.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 20
_MODULUS = 65521


def tensor_checksum(tensor: torch.Tensor) -> tuple[int, int]:
    """``(sum of words, position-weighted sum of words)``, both as Python ints (mod 2**64)."""
    words = tensor.detach().contiguous().reshape(-1).view(_WORD[tensor.element_size()])
    plain = torch.zeros((), dtype=torch.int64, device=words.device)
    weighted = torch.zeros((), dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), _CHUNK):
        chunk = words[start : start + _CHUNK].to(torch.int64)
        positions = torch.arange(start, start + chunk.numel(), device=words.device) % _MODULUS + 1
        plain += chunk.sum()
        weighted += (chunk * positions).sum()
    return int(plain), int(weighted)


def compare_checksums(
    sent: Mapping[str, tuple[int, int]], held: Mapping[str, tuple[int, int]]
) -> list[str]:
    """Names the engine does not hold, or holds with other bits than the trainer sent.

    ``held`` comes from the engine's ``weight_checksums(dtype)``, read in the dtype the trainer
    sent (an engine may keep a wider one: bf16 -> fp32 is exact).
    """
    return [name for name, expected in sent.items() if tuple(held.get(name, ())) != expected]


def checksums_digest(checksums: Mapping[str, tuple[int, int]]) -> str:
    """One short hex digest of every tensor's checksum (sorted by name): a sync named in one
    word, the same on both sides when they agree."""
    text = ";".join(
        f"{name}:{plain}:{weighted}" for name, (plain, weighted) in sorted(checksums.items())
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]
