"""The CPU shims stand in for what Megatron's alltoall token dispatcher asks of CUDA, and undo
themselves on exit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megarl.distributed.platform import cpu_shims


def test_streams_are_one_host_stand_in_while_active():
    saved = (torch.cuda.Stream, torch.cuda.current_stream, torch.cuda.stream)
    with cpu_shims():
        side = torch.cuda.Stream()
        assert side is torch.cuda.current_stream()  # "on a side stream?" reads no
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            event = side.record_event()
        event.synchronize()
        annotation = torch.cuda.Stream | None  # modules imported meanwhile write this
        assert annotation is not None
    assert (torch.cuda.Stream, torch.cuda.current_stream, torch.cuda.stream) == saved


def test_split_sizes_reach_the_host_as_numpy_arrays():
    dispatcher = pytest.importorskip("megatron.core.transformer.moe.token_dispatcher")
    saved = dispatcher.maybe_move_tensor_to_cpu
    splits = torch.tensor([3, 5])
    with cpu_shims():
        host = dispatcher.maybe_move_tensor_to_cpu(splits, as_numpy=True)
        assert isinstance(host, np.ndarray) and host.tolist() == [3, 5]
        assert dispatcher.maybe_move_tensor_to_cpu(splits) is splits
    assert dispatcher.maybe_move_tensor_to_cpu is saved


def test_the_model_parallel_rng_fork_is_a_no_op():
    random = pytest.importorskip("megatron.core.tensor_parallel.random")
    tracker = random.CudaRNGStatesTracker()
    with cpu_shims(), tracker.fork():  # no CUDA state was ever added
        pass
    with pytest.raises(Exception, match="is not added"), tracker.fork():
        pass
