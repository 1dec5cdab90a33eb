"""Save and restore everything the next training step depends on, from inside the rank loop.

What a step of the loop depends on, and where it is saved:

- weights and AdamW state (``exp_avg``, ``exp_avg_sq``, ``step``) of every shard: model/optim
  files, one pair per (TP, PP) rank, written by the DP-rank-0 replica (DP replicas are equal);
  with LoRA also every adapter factor's shard and its AdamW state (the optimizer holds only
  adapters then), keyed as in :mod:`megarl.checkpoint.lora_shards`, and the adapters' dropout
  generators (in the RNG files);
- torch / numpy / python RNG states of every rank (nothing in the CPU loop draws from them
  today -- dropout is 0 and sampling has its own generator -- but a future consumer must not
  silently break resume); on CUDA also the CUDA and Megatron TP RNG-tracker states;
- the data position (rank 0's :class:`PromptStream`) and the step counter (the marker);
- the algorithm's own state (``algo_state.json``): the adaptive KL controller's ``beta``, which
  depends on every KL observed so far (:mod:`megarl.algo.kl_reward`);
- with a critic (``algo.adv_estimator=gae``) its weights and AdamW state in the same model and
  optim files under the ``critic/`` key prefix (so its trunk reshards like the actor's), and
  its replicated value head under ``critic/value_head``.

Everything else is a pure function of ``(config, step)`` and so needs no saving: the rollout
sampling seed (:func:`megarl.trainer.rollout.sampling_seed`), the pass gates and the batch plan,
and the learning rate (constant). The reference model is the initial model, reloaded from
``model.path``. After a restore the rollout engine receives the restored weights.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megarl.checkpoint import layout
from megarl.checkpoint.resume import config_tree
from megarl.checkpoint.shards import (
    ShardReader,
    load_rank_adapter_optimizer_state,
    load_rank_adapters,
    load_rank_optimizer_state,
    load_rank_shards,
    rank_adapter_optimizer_state,
    rank_adapter_shards,
    rank_optimizer_state,
    rank_shards,
    save_tensors,
    saved_state_keys,
)
from megarl.models import mapping

MODEL_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "chat_template.jinja",
    *layout.TOKENIZER_FILES,
)


def copy_model_side_files(model_dir: str | Path, out: Path) -> list[str]:
    """HF config and tokenizer files, so a checkpoint folder is also a loadable model."""
    copied = []
    for name in MODEL_SIDE_FILES:
        source = Path(model_dir) / name
        if source.is_file():
            shutil.copyfile(source, out / name)
            copied.append(name)
    return copied


def _parallel_ranks() -> tuple[int, int, int, int, int]:
    from megatron.core import parallel_state as ps

    return (
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_data_parallel_rank(),
    )


def _expert_ranks() -> tuple[int, int, int]:
    """(expert-parallel rank, size, replica index among ranks holding the same experts)."""
    from megatron.core import parallel_state as ps

    return (
        ps.get_expert_model_parallel_rank(),
        ps.get_expert_model_parallel_world_size(),
        ps.get_expert_data_parallel_rank(),
    )


ALGO_STATE_FILE = "algo_state.json"
CRITIC_PREFIX = "critic/"
"""Key prefix of the critic's tensors in the model and optim files."""
VALUE_HEAD_KEY = "critic/value_head"
"""The critic's value head (replicated: every TP rank's file holds the same tensor)."""


def save_training_checkpoint(
    cfg,
    step: int,
    actor,
    spec,
    host,
    model_dir: str,
    algo_state: dict | None = None,
    critic=None,
) -> float:
    """Collective: every rank writes its part; rank 0 publishes and prunes. Returns seconds.

    The marker records each file's size (a truncated copy is then recognisably damaged) and this
    run directory's id, so rotation (``trainer.keep_last``) removes only checkpoints of this run.
    """
    start = time.perf_counter()
    rank = dist.get_rank()
    root = layout.checkpoints_dir(cfg.trainer.run_dir)
    name = layout.step_dir_name(step)
    if rank == 0:
        layout.prepare_staging(root, name)
    dist.barrier()
    staging = layout.staging_dir(root, name)
    tp_rank, tp, pp_rank, pp, dp_rank = _parallel_ranks()
    ep_rank, ep, expert_dp_rank = _expert_ranks()
    sites = _adapter_sites(actor, spec)
    # collective (Megatron's distributed optimizer gathers onto each group's writing rank)
    states = actor.optimizer.param_states()
    critic_states = critic.optimizer.param_states() if critic is not None else {}
    if dp_rank == 0:
        save_tensors(
            {
                **rank_shards(actor.local_params()),
                **rank_adapter_shards(sites),
                **_critic_shards(critic),
            },
            staging / layout.model_file(tp_rank, pp_rank),
        )
        save_tensors(
            {
                **rank_optimizer_state(actor.local_params(), states),
                **rank_adapter_optimizer_state(sites, states),
                **_critic_optimizer_state(critic, critic_states),
            },
            staging / layout.optim_file(tp_rank, pp_rank),
        )
    elif expert_dp_rank == 0:  # the first replica of expert-parallel rank ep_rank > 0
        experts = [item for item in actor.local_params() if mapping.expert_of(item[0]) is not None]
        save_tensors(rank_shards(experts), staging / layout.model_file(tp_rank, pp_rank, ep_rank))
        save_tensors(
            rank_optimizer_state(experts, states),
            staging / layout.optim_file(tp_rank, pp_rank, ep_rank),
        )
    torch.save({**_rng_state(), **_adapter_rng_state(sites)}, staging / layout.rng_file(rank))
    if rank == 0:
        (staging / layout.HOST_STATE_FILE).write_text(
            json.dumps(host.state_dict()), encoding="utf-8"
        )
        copy_model_side_files(model_dir, staging)
        if algo_state is not None:
            (staging / ALGO_STATE_FILE).write_text(json.dumps(algo_state), encoding="utf-8")
    dist.barrier()
    if rank == 0:
        marker = {
            "format": layout.FORMAT_VERSION,
            "kind": "training",
            "step": step,
            "layout": {"tp": tp, "pp": pp, "ep": ep, "world_size": dist.get_world_size()},
            "config": config_tree(cfg),
            "spec": dataclasses.asdict(spec),
            "files": sorted(p.name for p in staging.iterdir()),
            "sizes": layout.file_sizes(staging),
            "run_id": layout.run_id(cfg.trainer.run_dir),
        }
        moved = layout.publish(staging, root / name, marker)
        if moved is not None:
            print(f"megarl-train: warning: {name} already existed; set aside as {moved.name}")
        layout.prune(cfg.trainer.run_dir, cfg.trainer.keep_last, marker["run_id"])
    dist.barrier()
    return time.perf_counter() - start


def restore_training_checkpoint(
    path: str, actor, spec, host, critic=None, run_dir: str | None = None
) -> int:
    """Load a checkpoint into this rank (at this run's layout); returns the checkpoint's step.

    Rank 0 passes its rollout host (or, in split placement, the proxy to it) and the run's
    ``run_dir``, whose ``metrics.jsonl`` holds the history the host continues."""
    info = layout.read_checkpoint(path)
    tp_rank, tp, _, _, _ = _parallel_ranks()
    reader = ShardReader(info, spec, optimizer=True)
    sites = _adapter_sites(actor, spec)
    # weights first: a GPU optimizer refreshes its fp32 main copies from them, then the
    # optimizer state (with the main copies a mixed-precision run saved) goes on top
    load_rank_shards(reader, actor.local_params(), tp_rank, tp)
    load_rank_adapters(reader, sites, tp_rank, tp)
    if critic is not None:
        _load_critic_weights(reader, critic, tp_rank, tp)
    actor.optimizer.reload_model_params()
    load_rank_optimizer_state(reader, actor.local_params(), actor.optimizer, tp_rank, tp)
    load_rank_adapter_optimizer_state(reader, sites, actor.optimizer, tp_rank, tp)
    if critic is not None:
        critic.optimizer.reload_model_params()
        _load_critic_optimizer_state(reader, critic, tp_rank, tp)
    rank = dist.get_rank()
    rng_path = info.path / layout.rng_file(rank)
    if info.marker["layout"].get("world_size") == dist.get_world_size() and rng_path.is_file():
        state = torch.load(rng_path, weights_only=False)
        _set_rng_state(state)
        _set_adapter_rng_state(sites, state)
    if host is not None:
        if run_dir is None:
            raise ValueError("restoring the rollout host's state needs the run's run_dir")
        state = json.loads((info.path / layout.HOST_STATE_FILE).read_text(encoding="utf-8"))
        metrics_path = Path(run_dir) / "metrics.jsonl"
        host.load_state_dict(state, layout.read_metrics(metrics_path))
    return info.step


def read_algo_state(path: str) -> dict:
    """The algorithm state a checkpoint saved; empty when it saved none (e.g. no KL in the
    reward then), so such a run starts its controllers afresh."""
    state_path = layout.read_checkpoint(path).path / ALGO_STATE_FILE
    if not state_path.is_file():
        return {}
    return json.loads(state_path.read_text(encoding="utf-8"))


# --- the critic ---------------------------------------------------------------------------------


def _critic_shards(critic) -> dict[str, torch.Tensor]:
    """The critic's trunk shards and (last stage) its value head; empty without a critic."""
    if critic is None:
        return {}
    out = rank_shards(critic.local_params(), CRITIC_PREFIX)
    head = critic.value_head_param()
    if head is not None:
        out[VALUE_HEAD_KEY] = head.detach()
    return out


def _critic_optimizer_state(critic, states: dict) -> dict[str, torch.Tensor]:
    """The critic's optimizer state, keyed like the actor's under the critic's prefix."""
    if critic is None:
        return {}
    out = rank_optimizer_state(critic.local_params(), states, CRITIC_PREFIX)
    head = critic.value_head_param()
    if head is not None:
        for key, value in states.get(head, {}).items():
            out[f"{key}/{VALUE_HEAD_KEY}"] = value.reshape(1) if value.dim() == 0 else value
    return out


@torch.no_grad()
def _load_critic_weights(reader: ShardReader, critic, tp_rank: int, tp: int) -> None:
    if not reader.has(VALUE_HEAD_KEY):
        raise layout.CheckpointError(
            f"checkpoint {reader.info.path} has no critic: it was saved by a run without "
            "algo.adv_estimator=gae"
        )
    load_rank_shards(reader, critic.local_params(), tp_rank, tp, CRITIC_PREFIX)
    head = critic.value_head_param()
    if head is not None:
        head.copy_(reader.read(VALUE_HEAD_KEY, 0).to(head.dtype))


def _load_critic_optimizer_state(reader: ShardReader, critic, tp_rank: int, tp: int) -> None:
    load_rank_optimizer_state(
        reader, critic.local_params(), critic.optimizer, tp_rank, tp, CRITIC_PREFIX
    )
    head = critic.value_head_param()
    if head is None or not reader.has(f"step/{VALUE_HEAD_KEY}"):
        return  # off the last stage, or saved before the critic's first step
    state = {"step": reader.read(f"step/{VALUE_HEAD_KEY}", 0).reshape(())}
    for key in saved_state_keys(reader, VALUE_HEAD_KEY):
        state[key] = reader.read(f"{key}/{VALUE_HEAD_KEY}", 0)
    critic.optimizer.load_param_state(head, state)


# --- LoRA adapters (megarl.checkpoint.lora_shards) --------------------------------------------


def _adapter_sites(actor, spec) -> list:
    """``(SavedSite, LoraAdapter)`` of this rank's adapters; empty without LoRA."""
    if getattr(actor, "lora", None) is None:
        return []
    from megarl.checkpoint.lora_shards import SavedSite
    from megarl.models.lora import iter_adapters

    return [
        (SavedSite(s.rule, s.layer, s.adapter.parallel), s.adapter)
        for s in iter_adapters(actor.model, spec)
    ]


def _adapter_rng_state(sites) -> dict:
    """Dropout generators of the adapters (``actor.lora.dropout > 0``), by adapter key."""
    from megarl.checkpoint.lora_shards import adapter_key

    if not sites:
        return {}
    return {
        "lora_dropout": {
            adapter_key(s.rule, s.layer, "lora_A"): a.dropout_rng_state() for s, a in sites
        }
    }


def _set_adapter_rng_state(sites, state: dict) -> None:
    from megarl.checkpoint.lora_shards import adapter_key

    saved = state.get("lora_dropout", {})
    for site, adapter in sites:
        key = adapter_key(site.rule, site.layer, "lora_A")
        if key in saved:
            adapter.set_dropout_rng_state(saved[key])


def _rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        state["cuda"] = torch.cuda.get_rng_state_all()
        tracker = get_cuda_rng_tracker()  # unannotated in Megatron; never None once returned
        state["megatron_tracker"] = tracker.get_states()  # pyright: ignore[reportOptionalMemberAccess]
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        torch.cuda.set_rng_state_all(state["cuda"])
        tracker = get_cuda_rng_tracker()  # unannotated in Megatron; never None once returned
        tracker.set_states(state["megatron_tracker"])  # pyright: ignore[reportOptionalMemberAccess]
