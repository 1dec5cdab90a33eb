"""The known third-party warnings are hidden by message, category and module; every other
warning (the user's own, an unknown one from the same library) still shows."""

from __future__ import annotations

import warnings

import pytest

from megarl.distributed import launcher, quiet

KNOWN = [
    (
        (
            "Transformer Engine and Apex are not installed. Falling back to local "
            "implementations of multi_tensor_applier and multi_tensor_scale"
        ),
        "megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision",
    ),
    (
        "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
        "megatron.core.optimizer",
    ),
    ("Apex is not installed. Falling back to Torch Norm", "megatron.core.models.backends"),
    (
        "full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer.",
        "megatron.core.transformer.transformer_config",
    ),
    (
        (
            "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed. Its "
            ".grad attribute won't be populated during autograd.backward()."
        ),
        "megatron.core.optimizer.distrib_optimizer",
    ),
    (
        "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed.",
        "megarl.distributed.platform",  # on CPU, through the shims' TorchFunctionMode
    ),
]
CPU_ONLY = (
    (
        "When using async grad allreduce it is recommended to set the environment variable "
        "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup"
    ),
    "megatron.core.tensor_parallel.layers",
)


def _shown(message: str, module: str, device: str | None = None, category=UserWarning) -> bool:
    """Whether ``message``, issued from ``module``, is shown once :func:`quiet.install` ran."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet.install(device)
        warnings.warn_explicit(message, category, f"{module}.py", 1, module=module)
    return len(seen) == 1


@pytest.mark.parametrize(("message", "module"), KNOWN)
def test_the_known_warnings_are_hidden(message, module):
    assert not _shown(message, module)
    assert not _shown(message, module, device="cpu")


def test_torchs_deprecation_of_the_collectives_megatron_calls_is_hidden():
    for name in ("reduce_scatter_tensor", "all_gather_into_tensor"):
        message = f"`torch.distributed.{name}` is deprecated. Please use `...single` instead."
        assert not _shown(message, "torch.distributed.c10d_logger", category=FutureWarning)


def test_a_cuda_hint_is_hidden_on_cpu_only():
    assert not _shown(*CPU_ONLY, device="cpu")
    assert _shown(*CPU_ONLY, device="cuda")
    assert _shown(*CPU_ONLY)  # the launcher and the fork server: the device is not known yet


@pytest.mark.parametrize(
    ("message", "module", "category"),
    [
        ("my reward function is slow", "__main__", UserWarning),  # the user's own
        ("Apex is not installed. Falling back to Torch Norm", "my_rewards", UserWarning),
        ("an unknown Megatron-Core warning", "megatron.core.optimizer", UserWarning),
        ("Apex is not installed. Falling back to Torch Norm", "megatron.core", FutureWarning),
        ("a deprecated transformers argument", "transformers.modeling_utils", FutureWarning),
    ],
)
def test_every_other_warning_still_shows(message, module, category):
    assert _shown(message, module, device="cpu", category=category)


def test_installing_twice_adds_no_second_filter():
    with warnings.catch_warnings():
        quiet.install("cpu")
        count = len(warnings.filters)
        quiet.install("cpu")
        assert len(warnings.filters) == count


def test_the_fork_server_installs_the_filters_before_it_imports_anything_else():
    """The server is a fresh interpreter: the launcher's filters do not reach it; importing
    :mod:`megarl.distributed.quiet` installs them, so it is the first module of its preload."""
    assert launcher.WARM_MODULES[0] == quiet.__name__ == "megarl.distributed.quiet"
