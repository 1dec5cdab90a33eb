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


def test_bf16_matrix_products_run_in_fp32_and_round_once():
    """What a GPU's bf16 GEMM computes (exact products, fp32 sums, one rounding), forward and
    backward, at fp32 speed on a CPU without bf16 instructions; other dtypes pass through."""
    from megarl.distributed.platform import Bf16MatmulInFp32Mode

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 40, generator=gen).bfloat16()
    w = torch.randn(24, 40, generator=gen).bfloat16().requires_grad_()
    with Bf16MatmulInFp32Mode():
        y = torch.nn.functional.linear(x, w)
        z = x @ w.t()
        y.float().square().sum().backward()
        plain = torch.randn(3, 4) @ torch.randn(4, 2)
    expected = (x.float() @ w.detach().float().t()).bfloat16()
    assert y.dtype == z.dtype == torch.bfloat16 and plain.dtype == torch.float32
    assert torch.equal(y, expected) and torch.equal(z, expected)
    grad_y = 2 * y.detach().float()  # d(sum y^2)/dy, y already rounded
    assert torch.equal(w.grad, (grad_y.t() @ x.float()).bfloat16())
