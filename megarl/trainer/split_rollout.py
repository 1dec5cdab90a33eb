"""Split placement (``rollout.n_gpus > 0``): the rollout host -- engine, data, metrics -- in its
own Ray actor on devices of its own, instead of inside rank 0.

:class:`RolloutActor` is a plain class wrapping the same :class:`~megarl.trainer.rollout_host.RolloutHost`
rank 0 builds in the colocated layout (the Ray actor is ``ray.remote(RolloutActor)``).
:class:`RemoteRolloutHost` is what rank 0 holds instead of a local RolloutHost: the same methods, each one
Ray round trip, so the step loop in ``rank_loop.py`` does not know which placement it runs in.
Data crosses as the same typed objects (RolloutBatch, StepPlan, StepGates, PhaseTimer); weights
cross as one HF-named state dict per step through Ray's object store.
If the actor dies (OOM, SIGKILL) or raises, the proxy call raises
:class:`~megarl.distributed.ray_launcher.SideActorFailed` naming the actor and its node, so the
run's one error line blames the rollout actor, not rank 0 that noticed.

In the asynchronous modes the actor serves an :class:`~megarl.trainer.async_rollout.AsyncRollout`
instead (the host behind a background rollout loop, same methods) and Ray runs its methods on
several threads (:data:`ASYNC_CONCURRENCY`), so rank 0 can take a batch, stream weights and
record metrics while the loop generates.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from megarl.distributed import heap, quiet
from megarl.distributed.fault_injection import ROLLOUT, maybe_die
from megarl.distributed.ray_launcher import (
    ActorPlacement,
    SideActorFailed,
    get_from_side_actor,
    in_ray_actor,
)

if TYPE_CHECKING:
    from megarl.trainer.async_rollout import AsyncRollout

ROLE = "rollout"
ASYNC_CONCURRENCY = 4
"""Ray threads of an asynchronous rollout actor: the trainer's calls run beside the loop."""
ANSWER_GRACE_S = 30.0
"""How much longer than its own timeout rank 0 waits for an asynchronous batch call to answer."""


class RolloutActor:
    """The rollout RolloutHost in its own process. Plain class: tests can build it without Ray."""

    def __init__(
        self,
        cfg,
        model_dir: str,
        device: str,
        env: dict[str, str],
        sys_path: list[str],
        cores: tuple[int, ...] | None = None,
    ):
        """``cores``: on one CPU machine, the cores this actor has to itself (the ranks have
        the others); None: it shares them, with the thread budget rank 0 would give it."""
        quiet.install(device)  # a Ray worker is a fresh interpreter, without the driver's filters
        os.environ.update(env)
        sys.path.extend(p for p in sys_path if p not in sys.path)
        if cores is not None:
            from megarl.distributed.execution import pin_to_cores

            pin_to_cores(cores)
        import torch

        from megarl.models.hf_io import load_hf_config, load_hf_tokenizer
        from megarl.models.spec import spec_from_hf_config
        from megarl.trainer.rollout_host import RolloutHost

        self.where = ActorPlacement.here(ROLE)
        if cores is not None:
            torch.set_num_threads(len(cores))
        elif device == "cpu":  # the thread budget rank 0 would give it when colocated
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.trainer.world_size))
        spec = spec_from_hf_config(load_hf_config(model_dir))
        self.host = RolloutHost(cfg, model_dir, device, load_hf_tokenizer(model_dir), spec=spec)
        self.stream: AsyncRollout | None = None
        if cfg.async_training.is_async:
            from megarl.trainer.async_rollout import AsyncRollout

            self.stream = AsyncRollout(self.host, cfg)
        if in_ray_actor():  # built by a test without Ray, it runs in the test's process
            heap.own_this_process()

    def placement(self) -> ActorPlacement:
        return self.where

    def call(self, method: str, *args: Any, **kwargs: Any):
        """Run one :class:`RolloutHost` method here (rank 0's :class:`RemoteRolloutHost` forwards
        them), on the asynchronous rollout when there is one."""
        if method == "rollout":
            maybe_die(ROLLOUT, *args)  # test-only hook
        return getattr(self.stream or self.host, method)(*args, **kwargs)

    def history(self) -> list[dict]:
        return self.host.history

    def engine_update_weights(self, named_tensors: list, record_checksums: bool) -> int:
        if self.stream is not None:
            return self.stream.engine_update_weights(named_tensors, record_checksums)
        return self.host.engine.update_weights(named_tensors, record_checksums)

    def engine_weight_checksums(self, dtype) -> dict:
        if self.stream is not None:
            return self.stream.engine_weight_checksums(dtype)
        return dict(self.host.engine.weight_checksums(dtype))


class RemoteRolloutHost:
    """Rank 0's stand-in for a RolloutHost that lives in a :class:`RolloutActor` actor."""

    def __init__(self, handle):
        self._actor = handle
        self._where = get_from_side_actor(handle.placement.remote(), f"{ROLE} actor").describe()
        self._failure: SideActorFailed | None = None

    def _get(self, ref, call: str, timeout_s: float | None = None):
        """One call's result. The first failure is kept and raised again by every later call
        (the step loop's ``close()`` in a ``finally``), so the report names the call that found
        the actor dead, not the cleanup after it."""
        if self._failure is not None:
            raise self._failure
        try:
            return get_from_side_actor(ref, self._where, call, timeout_s)
        except SideActorFailed as failure:
            self._failure = failure
            raise

    def next_batch(self, step: int, timeout_s: float):
        """The asynchronous rollout's step ``step``: it gives up after ``timeout_s`` itself
        (saying what its loop was doing); the wait here also ends, a little later, if the whole
        actor stopped answering."""
        ref = self._actor.call.remote("next_batch", step, timeout_s)
        return self._get(ref, "next_batch", timeout_s + ANSWER_GRACE_S)

    def __getattr__(self, method: str):
        """Every other public RolloutHost method (rollout, engine sleep/wake, weight and adapter updates,
        record_step, state_dict, close, ...) is one Ray round trip to the rollout actor."""
        if method.startswith("_"):
            raise AttributeError(method)

        def remote_call(*args: Any, **kwargs: Any):
            return self._get(self._actor.call.remote(method, *args, **kwargs), method)

        return remote_call

    @property
    def history(self) -> list[dict]:
        return self._get(self._actor.history.remote(), "history")

    @property
    def engine(self) -> RemoteEngine:
        return RemoteEngine(self._actor, self._get)


class RemoteEngine:
    """What the weight stream needs of the rollout actor's engine, over Ray.

    The exporter hands over one bucket at a time; each bucket becomes one Ray call, so the
    byte budget also bounds what crosses the object store at once.
    """

    def __init__(self, handle, get: Callable[[Any, str], Any]):
        self._actor, self._get = handle, get  # ``get``: the RemoteRolloutHost's failure-keeping get

    def update_weights(self, named_tensors, record_checksums: bool = False) -> int:
        loaded, bucket = 0, []
        for name, tensor in named_tensors:
            bucket.append((name, tensor))
            if len(bucket) >= self.TENSORS_PER_CALL:
                loaded += self._send(bucket, record_checksums)
                bucket = []
        if bucket:
            loaded += self._send(bucket, record_checksums)
        return loaded

    def _send(self, bucket: list, record_checksums: bool) -> int:
        return self._get(
            self._actor.engine_update_weights.remote(bucket, record_checksums),
            "engine update_weights",
        )

    def weight_checksums(self, dtype) -> dict:
        return self._get(
            self._actor.engine_weight_checksums.remote(dtype), "engine weight_checksums"
        )

    TENSORS_PER_CALL = 16
