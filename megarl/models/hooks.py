"""Forward hooks scoped to a block: how megarl reads what modules compute without changing them.

The routers of a mixture-of-experts model are read this way on both sides of the logprob
comparison: the transformers engine reads the experts each of its routers picks
(:class:`megarl.engines.hf.RouterTap`) and the actor the experts Megatron's routers pick
(:class:`megarl.actor.routing_recorder.RoutingRecorder`). A hook left behind would keep reading
(and keep its tensors alive) in every later forward, so each is removed when its block ends,
also when the block raises.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch


@contextmanager
def forward_hooks(
    modules: Iterable[torch.nn.Module], hook: Callable[[torch.nn.Module, Any, Any], Any]
) -> Iterator[None]:
    """``hook`` on the forward of every module of ``modules`` while the block runs."""
    handles = [module.register_forward_hook(hook) for module in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
