"""Everything megarl does to make Megatron-Core run on a CPU, in one place.

Megatron-Core is written for CUDA. On CPU (gloo) it works once these things are handled
(measured in ``shared/GUIDE.md`` section 1):

1. ``DotProductAttention`` from the local spec takes scratch memory on the current CUDA device.
   We replace the spec's ``core_attention`` with :class:`SDPACoreAttention`
   (``torch.nn.functional.scaled_dot_product_attention``), which is also a sensible fast core on
   GPU when transformer-engine is absent.
2. Code calls ``torch.cuda.current_device()`` (rotary embedding, p2p) and
   ``torch.cuda.synchronize()``: patched to ``0`` and a no-op while the shims are active.
3. Pipeline schedules and DDP buffers create tensors with ``device="cuda"``, and tied
   embeddings across pipeline stages call ``weight.data.cuda()``: :class:`CudaToCpuMode`, a
   ``TorchFunctionMode``, rewrites such a ``device`` keyword to CPU and makes ``Tensor.cuda`` a
   no-op. A mode switches itself off while its own handler runs, so a backward entered through
   ``torch.autograd.backward`` would run unshimmed; the model config has Megatron's schedule call
   the autograd engine directly instead (``deallocate_pipeline_outputs``), which MoE's backward
   gathers need.
4. Megatron's MoE router calls transformer-engine's GEMM whenever TE imports: set to None.
5. Megatron's alltoall token dispatcher (the one that takes a different number of tokens on
   each expert-parallel rank) copies its split sizes to the host on a side CUDA stream: on CPU
   the stream is a no-op stand-in, and the split sizes become the numpy arrays the copy would
   have made (the copy is skipped for tensors already on the CPU, leaving tensors that
   ``all_to_all_single`` refuses as split sizes).
6. Under TP the alltoall dispatcher gathers and reduce-scatters token slices of different sizes
   over the TP group (``all_gather`` / ``reduce_scatter`` with tensor lists), which gloo takes
   only in equal sizes: the slices are zero-padded to the largest, and the reduce-scatter is an
   all-reduce of the padded stack (:func:`_uneven_collectives`).
7. Sequence-parallel layers fork Megatron's model-parallel CUDA RNG state around their dropout
   (probability 0 in megarl's models): on CPU the fork is a no-op.
8. Megatron's optimizers check a parameter's or gradient's type by name before they make its
   fp32 main copy or clip it (``param.type() == 'torch.cuda.FloatTensor'`` in
   ``optimizer.py``'s and ``distrib_optimizer.py``'s main-parameter set-up and in
   ``clip_grads.clip_grad_by_total_norm_fp32``): under :class:`CudaToCpuMode` a CPU tensor's
   argument-less ``.type()`` answers its CUDA name (``torch.cuda.FloatTensor``), the only
   question those checks ask. Their norms, scaling and Adam then run on the CPU tensors
   (Megatron falls back to its local multi-tensor kernels and torch's Adam without
   transformer-engine or apex).
9. A CPU without bf16 instructions (AVX2; no ``avx512_bf16`` or AMX) multiplies bf16
   matrices ~100x slower than fp32 (torch's reference kernel: 23 s against 0.19 s for the
   tiny model's 49152-wide output-layer backward on the development machine), which made
   ``model.dtype=bfloat16`` unusable on CPU. There :class:`Bf16MatmulInFp32Mode` multiplies
   bf16 matrices in fp32 and rounds the product to bf16: a GPU's bf16 GEMM also multiplies
   exactly and accumulates in fp32 before its one rounding, so the results are a GPU's up to
   summation order, at fp32 speed.

Nothing here is entered on a CUDA device. The equivalence tests
(``tests/integration/test_megatron_equivalence.py``, dense and MoE, forward and backward at
TP/PP/EP > 1) fail loudly if a Megatron upgrade breaks an assumption, rather than letting
training hang or crash obscurely.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

from megarl.distributed import batch_invariant

_CUDA_DEVICE_NAMES = ("cuda",)


def _is_cuda_device_arg(device: object) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] in _CUDA_DEVICE_NAMES
    return False


class CudaToCpuMode(TorchFunctionMode):
    """Send ``device="cuda"`` / ``"cuda:N"`` / int device keywords and ``.cuda()`` to the CPU;
    a CPU tensor's ``.type()`` names its CUDA type (item 8 of the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if "cuda" not in name else name
        if "device" in kwargs and _is_cuda_device_arg(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


_MATRIX_PRODUCTS = frozenset(
    {
        torch.matmul,
        torch.Tensor.matmul,
        torch.Tensor.__matmul__,
        torch.mm,
        torch.Tensor.mm,
        torch.bmm,
        torch.Tensor.bmm,
        torch.addmm,
        torch.Tensor.addmm,
        torch.baddbmm,
        torch.nn.functional.linear,
    }
)


def _cpu_bf16(value) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.dtype == torch.bfloat16
        and value.device.type == "cpu"
    )


class Bf16MatmulInFp32Mode(TorchFunctionMode):
    """bf16 matrix products on the CPU computed in fp32 and rounded to bf16 (item 9 of the
    module docstring). Differentiable: the casts sit in the autograd graph, so the backward's
    products run in fp32 too."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MATRIX_PRODUCTS and "out" not in kwargs and any(map(_cpu_bf16, args)):
            wide = [a.float() if _cpu_bf16(a) else a for a in args]
            return func(*wide, **kwargs).to(torch.bfloat16)
        return func(*args, **kwargs)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), from /proc/cpuinfo;
    True where it cannot be read (no rewrite is the safe default)."""
    try:
        with open("/proc/cpuinfo") as info:
            flags = next((line for line in info if line.startswith("flags")), None)
    except OSError:
        return True
    if flags is None:
        return True
    names = set(flags.split(":", 1)[1].split())
    return bool(names & {"avx512_bf16", "amx_bf16"})


@contextlib.contextmanager
def _no_te_router_gemm() -> Iterator[None]:
    """Megatron's MoE router uses transformer-engine's GEMM whenever TE imports, which on a CPU
    tensor fails; without it the router is a plain matmul."""
    try:
        from megatron.core.transformer.moe import moe_utils
    except ImportError:
        yield
        return
    saved = getattr(moe_utils, "te_general_gemm", None)
    moe_utils.te_general_gemm = None
    try:
        yield
    finally:
        moe_utils.te_general_gemm = saved


class _HostStream:
    """Stands in for ``torch.cuda.Stream`` (and its events) where everything runs on the host:
    one instance, so "am I on a side stream?" reads no. A class, not a function, because
    modules imported meanwhile write ``torch.cuda.Stream | None`` in their annotations."""

    _instance: _HostStream | None = None

    def __new__(cls, *_args: object, **_kwargs: object) -> _HostStream:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def wait_stream(self, _other: object) -> None:
        return None

    def record_event(self, *_args: object, **_kwargs: object) -> _HostStream:
        return self

    def synchronize(self) -> None:
        return None


@contextlib.contextmanager
def _patched_cuda_queries() -> Iterator[None]:
    saved = (
        torch.cuda.current_device,
        torch.cuda.synchronize,
        torch.cuda.Stream,
        torch.cuda.current_stream,
        torch.cuda.stream,
    )
    torch.cuda.current_device = lambda: 0  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.Stream = _HostStream  # type: ignore[assignment,misc]
    torch.cuda.current_stream = lambda *a, **k: _HostStream()  # type: ignore[assignment]
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
    try:
        yield
    finally:
        (
            torch.cuda.current_device,
            torch.cuda.synchronize,
            torch.cuda.Stream,
            torch.cuda.current_stream,
            torch.cuda.stream,
        ) = saved


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.shape[0] == rows:
        return tensor.contiguous()
    padded = tensor.new_zeros((rows, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    return padded


@contextlib.contextmanager
def _uneven_collectives() -> Iterator[None]:
    """``all_gather`` and ``reduce_scatter`` over tensor lists whose first dimensions differ,
    on gloo (equal sizes go to the originals)."""
    import torch.distributed as dist

    saved = (dist.all_gather, dist.reduce_scatter)
    all_gather, reduce_scatter = saved

    def gather(tensor_list, tensor, group=None, async_op=False):
        rows = [t.shape[0] for t in tensor_list]
        if async_op or len(set(rows)) == 1:
            return all_gather(tensor_list, tensor, group=group, async_op=async_op)
        padded = [tensor.new_empty((max(rows), *tensor.shape[1:])) for _ in rows]
        all_gather(padded, _pad_rows(tensor, max(rows)), group=group)
        for out, got, size in zip(tensor_list, padded, rows, strict=True):
            out.copy_(got[:size])
        return None

    def scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        rows = [t.shape[0] for t in input_list]
        if async_op or op != dist.ReduceOp.SUM:
            return reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)
        stacked = torch.stack([_pad_rows(t, max(rows)) for t in input_list])
        dist.all_reduce(stacked, group=group)
        output.copy_(stacked[dist.get_rank(group)][: output.shape[0]])
        return None

    dist.all_gather, dist.reduce_scatter = gather, scatter  # type: ignore[assignment]
    try:
        yield
    finally:
        dist.all_gather, dist.reduce_scatter = saved  # type: ignore[assignment]


@contextlib.contextmanager
def _no_cuda_rng_fork() -> Iterator[None]:
    try:
        from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
    except ImportError:
        yield
        return
    saved = CudaRNGStatesTracker.fork
    CudaRNGStatesTracker.fork = lambda *_a, **_k: contextlib.nullcontext()  # type: ignore[method-assign]
    try:
        yield
    finally:
        CudaRNGStatesTracker.fork = saved  # type: ignore[method-assign]


@contextlib.contextmanager
def _host_split_sizes() -> Iterator[None]:
    """The alltoall dispatcher's ``maybe_move_tensor_to_cpu(as_numpy=True)`` returns a numpy
    array for a CUDA tensor but leaves a CPU tensor a tensor; give it the array either way."""
    try:
        from megatron.core.transformer.moe import token_dispatcher
    except ImportError:
        yield
        return
    saved = token_dispatcher.maybe_move_tensor_to_cpu

    def to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy() if as_numpy else tensor
        return saved(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = to_host
    try:
        yield
    finally:
        token_dispatcher.maybe_move_tensor_to_cpu = saved


_active_depth = 0
_exit_stack: contextlib.ExitStack | None = None


def enter_cpu_shims() -> None:
    """Activate the shims for the rest of the process (workers call this once at start-up).

    Re-entrant; :func:`exit_cpu_shims` undoes one level.
    """
    global _active_depth, _exit_stack
    if _active_depth == 0:
        _exit_stack = contextlib.ExitStack()
        _exit_stack.enter_context(_patched_cuda_queries())
        _exit_stack.enter_context(_no_te_router_gemm())
        _exit_stack.enter_context(_host_split_sizes())
        _exit_stack.enter_context(_no_cuda_rng_fork())
        _exit_stack.enter_context(_uneven_collectives())
        _exit_stack.enter_context(CudaToCpuMode())
        if not cpu_has_native_bf16():
            _exit_stack.enter_context(Bf16MatmulInFp32Mode())
    _active_depth += 1


def exit_cpu_shims() -> None:
    global _active_depth, _exit_stack
    if _active_depth == 0:
        return
    _active_depth -= 1
    if _active_depth == 0 and _exit_stack is not None:
        _exit_stack.close()
        _exit_stack = None


@contextlib.contextmanager
def cpu_shims(enabled: bool = True) -> Iterator[None]:
    """Context manager form of :func:`enter_cpu_shims`; a no-op when ``enabled`` is False."""
    if not enabled:
        yield
        return
    enter_cpu_shims()
    try:
        yield
    finally:
        exit_cpu_shims()


@contextlib.contextmanager
def shim_modes_in_this_thread() -> Iterator[None]:
    """The shims' torch-function modes, which torch keeps per thread, entered in the calling
    thread for the block while the shims are active (the patches of ``torch.cuda`` hold in every
    thread already): code that runs Megatron in a thread of its own. A mode entered twice in one
    thread does the same as once; a no-op while the shims are off."""
    if not shims_active():
        yield
        return
    with contextlib.ExitStack() as stack:
        stack.enter_context(CudaToCpuMode())
        if not cpu_has_native_bf16():
            stack.enter_context(Bf16MatmulInFp32Mode())
        yield


def shims_active() -> bool:
    return _active_depth > 0


def shims_depth() -> int:
    """How many :func:`enter_cpu_shims` are open: :func:`restore_shims_depth` returns to it."""
    return _active_depth


def restore_shims_depth(depth: int) -> None:
    """Close the levels opened since :func:`shims_depth` answered ``depth``: a rank run in the
    caller's process (a world of one) leaves the caller's tensors on the devices it asked for."""
    while _active_depth > depth:
        exit_cpu_shims()


class SDPACoreAttention(torch.nn.Module):
    """Causal core attention via ``scaled_dot_product_attention``; drop-in for the local spec's.

    Megatron passes ``query [s, b, heads/tp, d]``, ``key``/``value [s, b, groups/tp, d]`` and
    expects ``[s, b, heads/tp * d]`` back. Key/value groups are expanded for GQA.
    An explicit boolean ``attention_mask`` ([b, 1, s, s], True = masked, Megatron's convention) is
    honoured.

    Packed micro-batches (``packed_seq_params`` in THD format: ``[t, heads, d]`` with
    ``cu_seqlens``) get block-diagonal causal attention: each sequence attends only to itself.
    The blocks are evaluated one sequence at a time, which is exactly a block-diagonal causal
    mask over the packed row but costs ``sum(s_i^2)`` instead of ``t^2`` in time and memory
    (a dense ``[heads, t, t]`` mask would dwarf the savings of packing). RoPE positions restart
    per sequence in Megatron's own THD rotary path, driven by the same ``cu_seqlens``.

    Inside :func:`megarl.distributed.batch_invariant.batch_invariant_mode` each block attends
    through :func:`megarl.distributed.batch_invariant.attention` instead: a query's result is
    then the same bits from a KV cache as from a packed or padded causal pass.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__()
        self.config = config
        self.softmax_scale = softmax_scale
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )

    def forward(
        self,
        query,
        key,
        value,
        attention_mask=None,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if packed_seq_params is not None:
            return self._packed_forward(query, key, value, packed_seq_params)
        return self._attend(query, key, value, attention_mask)

    def _packed_forward(self, query, key, value, packed_seq_params):
        if packed_seq_params.qkv_format != "thd":
            raise NotImplementedError(
                f"SDPACoreAttention: packed format {packed_seq_params.qkv_format!r} (only thd)"
            )
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        blocks = [
            self._attend(query[a:b].unsqueeze(1), key[a:b].unsqueeze(1), value[a:b].unsqueeze(1))
            for a, b in itertools.pairwise(bounds)
        ]
        return torch.cat(blocks, dim=0)  # [t, 1, heads * d]; Megatron reshapes to [t, 1, h]

    def _attend(self, query, key, value, attention_mask=None):
        if batch_invariant.enabled():
            if attention_mask is not None:  # the Megatron engine's left-padded rows
                return batch_invariant.left_padded_attention(
                    query, key, value, attention_mask, self.softmax_scale
                )
            return batch_invariant.attention(query, key, value, self.softmax_scale)
        num_heads, num_groups = query.shape[2], key.shape[2]
        if num_heads != num_groups:
            key = key.repeat_interleave(num_heads // num_groups, dim=2)
            value = value.repeat_interleave(num_heads // num_groups, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        dropout = self.dropout_p if self.training else 0.0
        if attention_mask is None:
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=dropout, scale=self.softmax_scale
            )
        else:
            allowed = ~attention_mask.to(torch.bool)
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, dropout_p=dropout, scale=self.softmax_scale
            )
        seq, batch = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)
