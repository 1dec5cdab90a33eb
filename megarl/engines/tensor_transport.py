"""Hand named tensors to another process on the same machine through one shared-memory file.

vLLM runs its model in processes of its own (its engine core, or worker processes beside it),
and the arguments of ``collective_rpc`` travel as msgpack: tensors inside plain arguments arrive
as lists, not tensors. So the rollout host writes a bucket of tensors into a file in
``/dev/shm`` (page-cache backed, never on disk) and sends only :class:`TensorMeta` records; the
worker maps the same file and reads each tensor as a view, with no copy until the model loads
it. The file is reused for every bucket of a sync (the call is synchronous, so the worker is
done with a bucket before the next is written) and grows when a bucket does not fit.

Pure torch and the standard library: used on both sides of the process boundary.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

SHM_DIR = Path("/dev/shm")
ALIGN = 64
"""Each tensor starts at a multiple of this, so every dtype can view its bytes (and reads are
cache-line aligned)."""


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lies in the shared file."""

    name: str
    dtype: str
    """``torch`` dtype name without the prefix, e.g. ``float32``."""
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def to_wire(self) -> tuple:
        """A plain tuple (msgpack carries tuples, not dataclasses)."""
        return (self.name, self.dtype, list(self.shape), self.offset, self.nbytes)

    @classmethod
    def from_wire(cls, record: Sequence) -> TensorMeta:
        name, dtype, shape, offset, nbytes = record
        return cls(str(name), str(dtype), tuple(int(s) for s in shape), int(offset), int(nbytes))


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def _shm_folder() -> Path:
    """``/dev/shm`` where it exists and is writable, else the temp folder (still page cache)."""
    if SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK):
        return SHM_DIR
    return Path(tempfile.gettempdir())


class SharedTensorFile:
    """The writer's side: pack tensors into one shared file, return their records."""

    def __init__(self, prefix: str = "megarl-weights-") -> None:
        handle, name = tempfile.mkstemp(prefix=prefix, dir=_shm_folder())
        os.close(handle)
        self.path = name
        self._capacity = 0
        self._buffer: torch.Tensor | None = None

    def _ensure_capacity(self, nbytes: int) -> torch.Tensor:
        if self._buffer is None or nbytes > self._capacity:
            self._capacity = max(nbytes, 2 * self._capacity)
            with open(self.path, "r+b") as handle:
                handle.truncate(self._capacity)
            self._buffer = torch.from_file(
                self.path, shared=True, size=self._capacity, dtype=torch.uint8
            )
        return self._buffer

    def write(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> list[TensorMeta]:
        """Copy the tensors into the file, back to back; their records in the same order."""
        total = sum(_aligned(tensor_nbytes(t)) for _, t in named_tensors)
        buffer = self._ensure_capacity(max(total, 1))
        records, offset = [], 0
        for name, tensor in named_tensors:
            nbytes = tensor_nbytes(tensor)
            flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            buffer[offset : offset + nbytes].copy_(flat)
            records.append(
                TensorMeta(
                    name,
                    str(tensor.dtype).removeprefix("torch."),
                    tuple(tensor.shape),
                    offset,
                    nbytes,
                )
            )
            offset = _aligned(offset + nbytes)
        return records

    def close(self) -> None:
        """Unmap and delete the file (the reader maps it only during a call)."""
        self._buffer = None
        Path(self.path).unlink(missing_ok=True)


def read_tensors(path: str, records: Sequence[TensorMeta]) -> Iterator[tuple[str, torch.Tensor]]:
    """The reader's side: each record as a tensor view into the shared file."""
    if not records:
        return
    size = max(r.offset + r.nbytes for r in records)
    buffer = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    for record in records:
        raw = buffer[record.offset : record.offset + record.nbytes]
        yield record.name, raw.view(getattr(torch, record.dtype)).view(record.shape)
