"""Split placement (``rollout.n_gpus > 0``): the rollout driver -- engine, data, metrics -- in its
own Ray actor on devices of its own, instead of inside rank 0.

:class:`RolloutWorker` is a plain class wrapping the same :class:`~megarl.trainer.driver.Driver`
rank 0 builds in the colocated layout (the Ray actor is ``ray.remote(RolloutWorker)``).
:class:`RemoteDriver` is what rank 0 holds instead of a local Driver: the same methods, each one
Ray round trip, so the step loop in ``worker.py`` does not know which placement it runs in.
Data crosses as the same typed objects (RolloutBatch, StepPlan, StepGates, PhaseTimer); weights
cross as one HF-named state dict per step through Ray's object store.
"""

from __future__ import annotations

import os
import sys
from typing import Any


class RolloutWorker:
    """The rollout Driver in its own process. Plain class: tests can build it without Ray."""

    def __init__(self, cfg, model_dir: str, device: str, env: dict[str, str], sys_path: list[str]):
        os.environ.update(env)
        sys.path.extend(p for p in sys_path if p not in sys.path)
        import torch

        from megarl.models.hf_io import load_hf_config, load_hf_tokenizer
        from megarl.models.spec import spec_from_hf_config
        from megarl.trainer.driver import Driver

        if device == "cpu":  # the thread budget rank 0 would give it when colocated
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.trainer.world_size))
        spec = spec_from_hf_config(load_hf_config(model_dir))
        self.driver = Driver(cfg, model_dir, device, load_hf_tokenizer(model_dir), spec=spec)

    def call(self, method: str, *args: Any, **kwargs: Any):
        """Run one :class:`Driver` method here (rank 0's :class:`RemoteDriver` forwards them)."""
        return getattr(self.driver, method)(*args, **kwargs)

    def history(self) -> list[dict]:
        return self.driver.history

    def engine_update_weights(self, named_tensors: list) -> int:
        return self.driver.engine.update_weights(named_tensors)

    def engine_base_weights(self) -> dict:
        return dict(self.driver.engine.base_weights())


class RemoteDriver:
    """Rank 0's stand-in for a Driver that lives in a :class:`RolloutWorker` actor."""

    def __init__(self, handle):
        self._actor = handle

    def __getattr__(self, method: str):
        """Every public Driver method (rollout, engine sleep/wake, weight and adapter updates,
        record_step, state_dict, close, ...) is one Ray round trip to the rollout actor."""
        if method.startswith("_"):
            raise AttributeError(method)

        def remote_call(*args: Any, **kwargs: Any):
            import ray

            return ray.get(self._actor.call.remote(method, *args, **kwargs))

        return remote_call

    @property
    def history(self) -> list[dict]:
        import ray

        return ray.get(self._actor.history.remote())

    @property
    def engine(self) -> RemoteEngine:
        return RemoteEngine(self._actor)


class RemoteEngine:
    """What the weight stream needs of the rollout actor's engine, over Ray.

    The exporter hands over one bucket at a time; each bucket becomes one Ray call, so the
    byte budget also bounds what crosses the object store at once.
    """

    def __init__(self, handle):
        self._actor = handle

    def update_weights(self, named_tensors) -> int:
        import ray

        loaded, bucket = 0, []
        for name, tensor in named_tensors:
            bucket.append((name, tensor))
            if len(bucket) >= self.TENSORS_PER_CALL:
                loaded += ray.get(self._actor.engine_update_weights.remote(bucket))
                bucket = []
        if bucket:
            loaded += ray.get(self._actor.engine_update_weights.remote(bucket))
        return loaded

    def base_weights(self) -> dict:
        import ray

        return ray.get(self._actor.engine_base_weights.remote())

    TENSORS_PER_CALL = 16
