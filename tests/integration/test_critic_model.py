"""The Megatron critic (value model): the actor's trunk loaded from HF, a scalar head, an update.

Checks, at TP=2 and at PP=2 (tied embeddings), with the tiny random Llama:

* a zero-initialised head gives values of exactly 0 (the default start);
* with the head set to row ``k`` of the HF output matrix, the critic's value of every response
  token equals the HF model's logit of token ``k`` at the position before it: the trunk, the
  final norm and the value/logprob alignment are the actor's;
* a few updates on the value loss against fixed returns lower it, and the replicated head
  stays bitwise equal on the TP ranks;
* with ``critic.model.path`` (another folder of the same shape, with a scalar ``score`` head)
  the critic's trunk and head are that folder's and the actor's logits stay the actor's.
"""

from __future__ import annotations

import pytest
import torch
from helpers.models import TINY_HF_CONFIG, value_model_folder
from helpers.ranks import start_cpu_rank

from megarl.distributed.launcher import launch
from megarl.models.random_init import build_random_hf_model

pytestmark = pytest.mark.slow

PROMPT_LEN = 4
HEAD_ROW = 5


def _reference(hf_config: dict, seed: int):
    model = build_random_hf_model(hf_config, seed)
    ids = torch.randint(
        0, hf_config["vocab_size"], (3, 11), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        logits = model(ids).logits
    state = {k: v.clone() for k, v in model.state_dict().items()}
    head_row = model.get_output_embeddings().weight[HEAD_ROW].detach().clone()
    if hf_config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    return ids, logits[:, PROMPT_LEN - 1 : -1, HEAD_ROW], state, head_row


def _head_param(critic):
    return critic.model.module.output_layer.value_weight


def _worker(ctx, tp: int, pp: int, hf_config: dict, ids, ref_values, state, head_row):
    from logits_probe import probe_batch
    from megatron.core import parallel_state as ps

    from megarl.config.actor import ActorConfig
    from megarl.critic.megatron_critic import MegatronCritic, ValueLossSettings
    from megarl.distributed import parallel
    from megarl.models.spec import spec_from_hf_config
    from megarl.planner.step_plan import OptimizerStepPlan

    start_cpu_rank(ctx, tp, pp)
    spec = spec_from_hf_config(hf_config)
    cfg = ActorConfig(tp=tp, pp=pp, lr=1e-2)
    critic = MegatronCritic(spec, cfg, "cpu", torch.float32, state, pad_id=0)
    batch = probe_batch(ids, PROMPT_LEN)
    everything = [list(range(batch.num_seqs))]
    out: dict = {"last": critic.is_last_stage}

    zero = critic.compute_values(batch, everything)
    if critic.is_last_stage:
        out["zero_max"] = max(v.abs().max().item() for v in zero.values())
        with torch.no_grad():
            _head_param(critic).copy_(head_row.unsqueeze(0))
    probed = critic.compute_values(batch, everything)
    if critic.is_last_stage:
        got = torch.stack([probed[i] for i in range(batch.num_seqs)])
        out["probe_diff"] = (got - ref_values).abs().max().item()

    returns = {i: torch.ones(len(ids[i]) - PROMPT_LEN) for i in range(batch.num_seqs)}
    old = {i: torch.zeros(len(ids[i]) - PROMPT_LEN) for i in range(batch.num_seqs)}
    if critic.is_last_stage:
        old = {i: probed[i] for i in range(batch.num_seqs)}
    num_response_tokens = sum(len(r) for r in returns.values())
    step = OptimizerStepPlan.by_hand(everything, batch.seq_lens, num_response_tokens)
    settings = ValueLossSettings(cliprange_value=100.0)
    out["losses"] = [
        critic.train_values(batch, step, 0, old, returns, settings).stats.vf_loss for _ in range(4)
    ]
    if critic.is_last_stage and tp > 1:
        head = _head_param(critic).detach().contiguous()
        replicas = [torch.empty_like(head) for _ in range(tp)]
        torch.distributed.all_gather(replicas, head, group=ps.get_tensor_model_parallel_group())
        out["replicas_equal"] = all(torch.equal(r, replicas[0]) for r in replicas)
    parallel.destroy()
    return out


@pytest.mark.parametrize(
    ("tp", "pp", "tied"), [(2, 1, False), (1, 2, True)], ids=["tp2", "pp2-tied"]
)
def test_critic_values_come_from_the_actors_trunk_and_train(tp, pp, tied):
    cfg = dict(TINY_HF_CONFIG, tie_word_embeddings=tied)
    ids, ref_values, state, head_row = _reference(cfg, seed=3)
    results = launch(
        _worker, tp * pp, args=(tp, pp, cfg, ids, ref_values, state, head_row), timeout_s=240
    )
    [last, *_] = [r for r in results if r["last"]]
    assert last["zero_max"] == 0.0
    assert last["probe_diff"] <= 1e-4, last
    losses = last["losses"]
    assert losses[-1] < losses[0], losses
    if tp > 1:
        assert all(r["replicas_equal"] for r in results if r["last"])
    print(f"probe_diff={last['probe_diff']:.2e} losses={[round(x, 4) for x in losses]}")


# --- critic.model.path: the critic from another folder -----------------------------------------


def _folder_worker(ctx, tp: int, hf_config: dict, ids, actor_dir: str, critic_dir: str):
    from logits_probe import full_logits, probe_batch
    from megatron.core import parallel_state as ps

    from megarl.actor.megatron_actor import MegatronActor
    from megarl.config.actor import ActorConfig
    from megarl.critic.hf_init import critic_init
    from megarl.critic.megatron_critic import MegatronCritic
    from megarl.distributed import parallel
    from megarl.models.hf_io import open_hf_tensors
    from megarl.models.megatron_gpt import ValueHeadInit
    from megarl.models.spec import spec_from_hf_config

    start_cpu_rank(ctx, tp)
    spec = spec_from_hf_config(hf_config)
    cfg = ActorConfig(tp=tp, pp=1)
    actor_tensors = open_hf_tensors(actor_dir)  # as the rank loop opens the actor's folder
    init = critic_init(critic_dir, actor_tensors, spec, init_std=0.0)
    head = ValueHeadInit(weight=init.head_weight)
    critic = MegatronCritic(spec, cfg, "cpu", torch.float32, init.weights, pad_id=0, head=head)
    actor = MegatronActor(spec, cfg, "cpu", torch.float32, actor_tensors, 0, trainable=False)
    batch = probe_batch(ids, PROMPT_LEN)
    values = critic.compute_values(batch, [list(range(batch.num_seqs))])
    head_param = _head_param(critic).detach().contiguous()
    replicas = [torch.empty_like(head_param) for _ in range(tp)]
    torch.distributed.all_gather(replicas, head_param, group=ps.get_tensor_model_parallel_group())
    out = {
        "values": torch.stack([values[i] for i in range(batch.num_seqs)]),
        "logits": full_logits(actor, batch, tp, hf_config["vocab_size"]),
        "description": init.description,
        "replicas_equal": all(torch.equal(r, replicas[0]) for r in replicas),
    }
    parallel.destroy()
    return out


def test_critic_model_path_loads_the_critics_trunk_and_score_head(tmp_path):
    """``critic.model.path`` = another random Llama of the same shape with a scalar ``score``
    head: the critic's values are that model's (its last hidden state after the final norm
    times ``score.weight``, as transformers computes them), not those of the actor's trunk,
    while the actor built beside it keeps the actor's logits. TP=2: the loaded head is the
    same on both TP ranks."""
    cfg = dict(TINY_HF_CONFIG)
    actor_model = build_random_hf_model(cfg, seed=3)
    actor_model.save_pretrained(tmp_path / "actor", safe_serialization=True)
    value_model = value_model_folder(tmp_path / "critic", cfg, seed=11)
    ids = torch.randint(0, cfg["vocab_size"], (3, 11), generator=torch.Generator().manual_seed(1))
    score = value_model.score.weight.detach()
    with torch.no_grad():
        expected = value_model(ids).logits[:, PROMPT_LEN - 1 : -1, 0]
        by_hand = value_model.model(ids).last_hidden_state @ score.t()
        actor_trunk = actor_model.model(ids).last_hidden_state @ score.t()
        actor_logits = actor_model(ids).logits
    assert (by_hand[:, PROMPT_LEN - 1 : -1, 0] - expected).abs().max() <= 1e-6
    # the test can fail: the actor's trunk under the same head gives other values
    wrong = actor_trunk[:, PROMPT_LEN - 1 : -1, 0]
    assert (wrong - expected).abs().max() > 1e-2

    results = launch(
        _folder_worker,
        2,
        args=(2, cfg, ids, str(tmp_path / "actor"), str(tmp_path / "critic")),
        timeout_s=240,
    )
    for result in results:
        assert result["replicas_equal"]
        value_diff = (result["values"] - expected).abs().max().item()
        assert value_diff <= 1e-4, value_diff
        logit_diff = (result["logits"] - actor_logits).abs().max().item()
        assert logit_diff <= 1e-3, logit_diff
        assert result["description"] == (
            f"critic: trunk from critic.model.path={tmp_path / 'critic'}, value head from "
            f"critic.model.path={tmp_path / 'critic'} (score.weight)"
        )
    print(f"value_diff={value_diff:.2e} logit_diff={logit_diff:.2e}")
