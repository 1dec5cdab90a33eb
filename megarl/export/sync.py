"""One weight sync of a run: stream the trainer's weights into the engine and report on it.

Every rank calls :func:`sync_engine_weights` (the exporter is a protocol over all ranks); rank 0
feeds the buckets to the engine. Metrics (rank 0): ``export/bytes``, ``export/buckets``,
``export/peak_bytes`` (the largest per-rank high-water mark of the exporter's own buffers) and,
on checksum steps, ``export/checksum_ok`` -- a mismatch is an error naming the tensor, because a
silently stale engine is the failure this check exists to catch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.export.checksum import checksums_digest, compare_checksums
from megarl.export.stream import BucketStream, open_stream
from megarl.models.spec import TransformerSpec

MIB = 1 << 20


class ExportChecksumError(RuntimeError):
    """The engine does not hold the bits the trainer sent."""


@dataclass(frozen=True)
class SyncResult:
    metrics: dict[str, float]
    """The export metrics (rank 0; ``export/peak_bytes`` on every rank)."""
    checksum: str | None = None
    """Rank 0, on a checksum step: the digest of the tensors sent, which the engine matched."""


def is_checksum_step(step: int, interval: int) -> bool:
    return interval > 0 and step % interval == 0


def sync_engine_weights(
    local_params: Iterable,
    spec: TransformerSpec,
    bucket_mb: int,
    vpp: int,
    checksum: bool,
    engine=None,
    on_bucket: Callable[[int, int], None] | None = None,
    megatron_layout: bool = False,
) -> SyncResult:
    """Stream weights to ``engine`` (rank 0 passes it; other ranks ``None``); metrics on rank 0.
    ``on_bucket(sent, total)`` is called on rank 0 as each bucket has been handed over.
    ``megatron_layout``: whole Megatron parameters under Megatron names (a Megatron engine's
    rollout-side copy), not HF tensors; every rank must agree."""
    stream = open_stream(
        local_params,
        spec,
        bucket_mb * MIB,
        vpp=vpp,
        checksums=checksum,
        megatron_layout=megatron_layout,
    )
    metrics: dict[str, float] = {}
    digest = None
    if engine is not None:
        engine.update_weights(stream.named_tensors(on_bucket), record_checksums=checksum)
        metrics = {
            "export/bytes": float(stream.num_bytes),
            "export/buckets": float(stream.num_buckets),
        }
        if checksum:
            verify_engine_checksums(stream, engine)
            metrics["export/checksum_ok"] = 1.0
            digest = checksums_digest(stream.sent_checksums)
    else:
        stream.run_to_end()
    metrics["export/peak_bytes"] = float(_max_over_ranks(stream.peak_bytes))
    return SyncResult(metrics, digest)


def verify_engine_checksums(stream: BucketStream, engine) -> None:
    bad = compare_checksums(stream.sent_checksums, engine.weight_checksums(stream.dtype))
    if bad:
        raise ExportChecksumError(
            f"export checksum mismatch: the engine's {bad[0]!r} differs from what the trainer "
            f"sent ({len(bad)} of {len(stream.sent_checksums)} tensors differ)"
        )


def _max_over_ranks(value: int) -> int:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())
