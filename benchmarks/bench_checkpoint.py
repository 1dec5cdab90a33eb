"""Save / load time and size of a training checkpoint of SmolLM2-135M-Instruct on CPU.

Run: ``python benchmarks/bench_checkpoint.py [--tp 1]`` (one process per rank,
fp32). Builds the Megatron actor, gives AdamW a state (one step on zero gradients), then times
:func:`save_training_checkpoint` and :func:`restore_training_checkpoint`, and checks the restored
weights are bitwise equal.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch


class _FakeDriver:
    """The rank-0 data position without an engine."""

    def __init__(self, cfg):
        self.cfg = cfg

    def state_dict(self) -> dict:
        return {"stream": {"epoch": 0, "position": 0, "num_problems": 0, "seed": 0}}

    def load_state_dict(self, state, history) -> None:
        pass


def _worker(ctx, overrides: list[str], folder: str):
    import torch.distributed as dist

    from megarl.actor.megatron_actor import MegatronActor
    from megarl.checkpoint.trainer_state import (
        restore_training_checkpoint,
        save_training_checkpoint,
    )
    from megarl.distributed import parallel
    from megarl.distributed.platform import enter_cpu_shims
    from megarl.models.hf_io import load_hf_config, open_hf_tensors, resolve_model_path
    from megarl.models.spec import spec_from_hf_config
    from megarl.train import compose_config

    enter_cpu_shims()
    cfg = compose_config([*overrides, f"trainer.run_dir={folder}"])
    model_dir = str(resolve_model_path(cfg.model.path))
    parallel.join_launched_group(ctx, "cpu")
    parallel.init_model_parallel(cfg.actor.tp, 1)
    spec = spec_from_hf_config(load_hf_config(model_dir))
    actor = MegatronActor(spec, cfg.actor, "cpu", torch.float32, open_hf_tensors(model_dir), 0)
    for p in actor.optimizer.params:
        p.main_grad = torch.zeros_like(p)
    actor.optimizer.step()
    dist.barrier()
    save_s = save_training_checkpoint(cfg, 1, actor, spec, _FakeDriver(cfg), model_dir)
    before = {id(p): p.detach().clone() for _, _, p in actor.local_params()}
    for _, _, p in actor.local_params():
        p.data.zero_()
    dist.barrier()
    start = time.perf_counter()
    restore_training_checkpoint(
        str(Path(folder) / "checkpoints" / "step_000001"), actor, spec, None
    )
    dist.barrier()
    load_s = time.perf_counter() - start
    exact = all(torch.equal(before[id(p)], p) for _, _, p in actor.local_params())
    parallel.destroy()
    return save_s, load_s, exact


def main() -> None:
    from megarl.distributed.launcher import launch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        overrides = [f"actor.tp={args.tp}", f"trainer.n_gpus_per_node={args.tp}"]
        results = launch(_worker, args.tp, args=(overrides, folder))
        size = sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())
    save_s, load_s, exact = results[0]
    print(
        f"SmolLM2-135M TP={args.tp}: save {save_s:.2f} s, load {load_s:.2f} s, "
        f"size {size / 2**20:.0f} MiB, restored weights bitwise equal: {exact}"
    )


if __name__ == "__main__":
    main()
