"""Mixture-of-experts training on CPU: experts split over expert-parallel ranks train like one
rank holding them all (and route alike: ``actor/moe_*``), and a checkpoint saved at one
expert-parallel size resumes at another. The trainer routes every response token as the engine
did (``rollout/moe_routing_mismatch`` is 0 in fp32), and a mismatch injected into the engine's
reported routing is counted exactly.

Tiny random-init Qwen3-MoE and Qwen2-MoE (4 experts, top-2; Qwen2-MoE with a gated shared
expert, which every rank holds) with the HF engine, 2 ranks (DP=2).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers.batches import random_batch
from helpers.ranks import loss_settings, start_cpu_rank
from helpers.runs import tiny_overrides
from safetensors import safe_open

from megarl.checkpoint.convert import write_hf_folder
from megarl.checkpoint.layout import read_checkpoint
from megarl.models.hf_io import load_hf_state_dict
from megarl.train import run

pytestmark = pytest.mark.slow

MOE = {"trainer.n_gpus_per_node": 2, "export.checksum_interval": 1}
ROUTING = "rollout/moe_routing_mismatch"


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("model", ["tiny_qwen3_moe", "tiny_qwen2_moe"])
def test_ep2_trains_like_ep1_and_resumes_at_ep1(model, tmp_path):
    # 3 prompts x 3 samples over 2 ranks: the expert-parallel ranks hold different numbers of
    # tokens, which the token dispatcher must take
    moe = dict(MOE, model=model, **{"data.prompts_per_step": 3, "rollout.n": 3})
    split_dir = tmp_path / "ep2"
    split = run(
        tiny_overrides(split_dir, 2, **moe, **{"actor.ep": 2, "trainer.save_interval": 2}),
        return_final_state=True,
    )
    whole = run(tiny_overrides(tmp_path / "ep1", 2, **moe), return_final_state=True)

    initial = load_hf_state_dict(split_dir / "init_model")
    assert any(".mlp.experts.3.down_proj." in name for name in initial)
    assert _max_diff(split.final_state, initial) > 1e-4, "training barely moved the weights"
    # the same training up to float rounding (experts computed on other ranks, sums reordered)
    assert _max_diff(split.final_state, whole.final_state) <= 1e-5
    for a, b in zip(split.history, whole.history, strict=True):
        assert a["critic/rewards/mean"] == b["critic/rewards/mean"]
        assert a["actor/grad_norm"] == pytest.approx(b["actor/grad_norm"], rel=1e-6)
        # the engine serves exactly the trainer's weights, gathered from both expert ranks
        assert a["export/checksum_ok"] == 1.0
        assert a["rollout/logprob_abs_diff"] <= 1e-4
        # the same tokens reach the same experts whichever rank holds them
        assert 1.0 <= a["actor/moe_load_imbalance"] <= 4 / 2  # at most experts / top_k
        assert a["actor/moe_load_imbalance"] == pytest.approx(b["actor/moe_load_imbalance"])
        assert a["actor/moe_aux_loss"] == pytest.approx(b["actor/moe_aux_loss"], rel=1e-6)
        # fp32, the engine on the trainer's weights: every token reaches the same experts
        assert a[ROUTING] == b[ROUTING] == 0.0

    saved = read_checkpoint(split_dir / "checkpoints" / "step_000002")
    assert saved.ep == 2
    with safe_open(str(saved.path / "model_tp0_pp0_ep1.safetensors"), "pt") as f:
        # expert rank 1's file: its routed experts only; the shared expert is in rank 0's
        assert all(".local_experts.2." in n or ".local_experts.3." in n for n in f.keys())  # noqa: SIM118
    (tmp_path / "hf").mkdir()
    write_hf_folder(saved, tmp_path / "hf", progress=False)
    resharded = load_hf_state_dict(tmp_path / "hf")
    assert all(torch.equal(split.final_state[k], resharded[k]) for k in split.final_state)

    resumed = run(tiny_overrides(split_dir, 3, **moe), return_final_state=True)
    assert [row["step"] for row in resumed.history] == [1, 2, 3]
    assert resumed.history[-1][ROUTING] == 0.0
    assert _max_diff(resharded, resumed.final_state) > 0, "the resumed step trained nothing"


SPLIT_MOE = dict(MOE, model="tiny_qwen3_moe", **{"data.prompts_per_step": 3, "rollout.n": 3})
"""3 prompts x 3 samples: the expert-parallel ranks hold different token counts."""


def _four_ranks_train_like_ep2(tmp_path, layout: dict):
    """2 steps on 4 ranks at ``layout`` (saved at step 2) against 2 ranks at EP=2, both DP=2 so
    they see the same rollouts: the same rewards, grad norms to rel 1e-6, the engine serving
    the trainer's bits, no routing mismatch; final weights within 5e-5 (Adam's first steps
    move a weight by about lr * g / (|g| + eps): where a gradient entry is near 0, rounding of
    the split sums moves it by a few percent of actor.lr = 1e-3). Returns both runs; the
    4-rank run's folder is ``tmp_path / "four"``."""
    four = {**SPLIT_MOE, **layout, "trainer.n_gpus_per_node": 4, "trainer.save_interval": 2}
    split = run(tiny_overrides(tmp_path / "four", 2, **four), return_final_state=True)
    whole = run(
        tiny_overrides(tmp_path / "two", 2, **SPLIT_MOE, **{"actor.ep": 2}),
        return_final_state=True,
    )
    initial = load_hf_state_dict(tmp_path / "four" / "init_model")
    assert _max_diff(split.final_state, initial) > 1e-4, "training barely moved the weights"
    for a, b in zip(split.history, whole.history, strict=True):
        assert a["critic/rewards/mean"] == b["critic/rewards/mean"]
        assert a["actor/grad_norm"] == pytest.approx(b["actor/grad_norm"], rel=1e-6)
        assert a["export/checksum_ok"] == 1.0
        assert a["rollout/logprob_abs_diff"] <= 1e-4
        assert a[ROUTING] == b[ROUTING] == 0.0
    assert _max_diff(split.final_state, whole.final_state) <= 5e-5
    return split, whole


def _resumes_at_ep2(run_dir) -> None:
    """The 4-rank checkpoint resumes on 2 ranks at EP=2 and trains a third step."""
    resumed = run(tiny_overrides(run_dir, 3, **SPLIT_MOE, **{"actor.ep": 2}))
    assert [row["step"] for row in resumed.history] == [1, 2, 3]
    assert resumed.history[-1][ROUTING] == 0.0


def test_tp2_sequence_parallel_trains_like_tp1_and_resumes_there(tmp_path):
    """TP=2 x EP=2 on 4 ranks against EP=2 on 2: under TP the MoE model runs
    sequence-parallel, each TP rank routing a slice of every micro-batch (padded to an even
    length) through half of each expert's intermediate size; the TP ranks' slices are gathered
    back into each sequence's routing (no mismatch)."""
    sp, _ = _four_ranks_train_like_ep2(tmp_path, {"actor.tp": 2, "actor.ep": 2})
    for a in sp.history:
        # the router statistics count the padding to an even length too, as Megatron routes it
        assert 1.0 <= a["actor/moe_load_imbalance"] <= 4 / 2
    _resumes_at_ep2(tmp_path / "four")


def test_pp2_trains_like_pp1_replays_each_stages_layers_and_resumes_at_pp1(tmp_path):
    """PP=2 x EP=2 on 4 ranks against EP=2 on 2: each stage holds 2 of the 4 layers with their
    experts. Under R3 every stage replays its own layers of the engine's routing (another
    stage's layers would route other experts and move the logprobs far from the engine's);
    the router statistics, placed at their model layers, and the routing comparison, merged
    over the stages, equal the one-stage run's."""
    layout = {"actor.pp": 2, "actor.ep": 2, "actor.router_replay.mode": "R3"}
    staged, whole = _four_ranks_train_like_ep2(tmp_path, layout)
    for a, b in zip(staged.history, whole.history, strict=True):
        assert a["rollout/moe_routing_mismatch_tokens"] == 0.0
        assert a["actor/moe_load_imbalance"] == pytest.approx(b["actor/moe_load_imbalance"])
        assert a["actor/moe_aux_loss"] == pytest.approx(b["actor/moe_aux_loss"], rel=1e-6)
    saved = read_checkpoint(tmp_path / "four" / "checkpoints" / "step_000002")
    assert (saved.pp, saved.ep) == (2, 2)
    _resumes_at_ep2(tmp_path / "four")


def test_router_aux_loss_run_trains_every_sequence_and_says_why(tmp_path):
    """One step with actor.moe_aux_loss_coef > 0 through the whole run: the plan keeps every
    sequence and its summary names the key, and actor/moe_aux_loss still reports the loss
    without its coefficient (about 1, not 0.05). What the coefficient adds to the gradient is
    checked exactly below."""
    coef = {"actor.moe_aux_loss_coef": 0.05, "actor.ep": 2}  # EP=2 trains like EP=1 (above)
    aux = run(tiny_overrides(tmp_path / "aux", 1, **MOE, model="tiny_qwen3_moe", **coef)).history[0]

    assert "no pruning: actor.moe_aux_loss_coef=0.05" in aux["planner/summary"]
    assert aux["planner/kept_seq_frac"] == 1.0
    assert math.isfinite(aux["actor/grad_norm"]) and aux["actor/grad_norm"] > 0
    assert 1.0 <= aux["actor/moe_aux_loss"] < 4 / 2  # 1 when balanced, at most experts / top_k
    assert aux["export/checksum_ok"] == 1.0


def _complement_first_layer(batch):
    """The batch with the engine's layer-0 experts of every response token replaced by the two
    experts it did not pick (4 experts, top-2): a set that differs from the one the engine used,
    whatever that was."""
    return dataclasses.replace(batch, engine_routing=_unused_in_layer_0(batch.engine_routing))


def _unused_in_layer_0(routing):
    """Each ``[positions, layers, 2]`` tensor with layer 0's experts replaced, at every
    position, by the two of the 4 it did not pick."""
    swapped = []
    for ids in routing:
        ids = ids.clone()
        for pos in range(len(ids)):
            unused = sorted(set(range(4)) - set(ids[pos, 0].tolist()))
            ids[pos, 0] = torch.tensor(unused, dtype=ids.dtype)
        swapped.append(ids)
    return tuple(swapped)


def _alter_rollouts(monkeypatch, reported: str, alter) -> None:
    """Every rollout batch of runs in this process goes through ``alter`` before training; the
    engine must have reported the ``reported`` routing field."""
    from megarl.trainer.rollout_host import RolloutHost

    produce = RolloutHost.rollout

    def rollout(self, step):
        batch, metrics, phases = produce(self, step)
        assert getattr(batch, reported) is not None
        return alter(batch), metrics, phases

    monkeypatch.setattr(RolloutHost, "rollout", rollout)


def test_injected_routing_mismatch_is_counted_exactly(tmp_path, monkeypatch):
    """One rank (in this process, so the patch reaches the rollout host), one step: the engine's
    reported layer-0 experts are swapped for the unused ones after sampling. The trainer matches
    the engine everywhere else, so exactly 1 of 4 layers differs on every response token, both
    for the sequences whose routing comes from the old-logprob pass (two mini-batches: the
    second one's are recomputed) and for those of the first optimizer step's forward, in padded
    micro-batches (several sequences per forward: Megatron's sequence-first token order)."""
    _alter_rollouts(monkeypatch, "engine_routing", _complement_first_layer)
    extra = {"actor.ppo_mini_batches": 2, "actor.pack_sequences": "false"}
    [step] = run(tiny_overrides(tmp_path / "run", 1, model="tiny_qwen3_moe", **extra)).history
    assert step["gates/summary"].startswith("old_lp: 4/8 recompute, rest train forward")
    assert step[ROUTING] == 0.25  # layer 0 of 4, on every token
    assert step["rollout/moe_routing_mismatch_tokens"] == 1.0


def _complement_first_layer_inputs(batch):
    """:func:`_complement_first_layer` of the engine's input routing too (every position),
    which R3 replays."""
    batch = _complement_first_layer(batch)
    return dataclasses.replace(
        batch, engine_input_routing=_unused_in_layer_0(batch.engine_input_routing)
    )


def test_r3_replays_injected_routing_and_the_metric_keeps_the_routers_own_choice(
    tmp_path, monkeypatch
):
    """R3 with the engine's layer-0 experts swapped at every position: the trainer's forwards
    run the injected experts, so its logprobs leave the engine's (which used the real ones)
    by far more than rounding, while ``rollout/moe_routing_mismatch`` still compares the
    engine with the router's own choice (before replay)."""
    _alter_rollouts(monkeypatch, "engine_input_routing", _complement_first_layer_inputs)
    extra = {
        "actor.ppo_mini_batches": 2,
        "actor.pack_sequences": "false",
        "actor.router_replay.mode": "R3",
        "rollout.max_logprob_diff": "null",  # the injected routing would stop the run there
    }
    [step] = run(tiny_overrides(tmp_path / "run", 1, model="tiny_qwen3_moe", **extra)).history
    # layer 0 always differs; the replayed layer-0 experts also change the hidden states the
    # later routers see, so some of their own choices leave the engine's too (without replay
    # exactly 0.25: test_injected_routing_mismatch_is_counted_exactly)
    assert 0.25 < step[ROUTING] < 1.0
    assert step["rollout/logprob_abs_diff"] > 1e-3  # without replay: <= 1e-4 (fp32)


def test_replaying_the_routers_own_choice_trains_bitwise_alike(tmp_path):
    """fp32 on CPU: engine and trainer pick the same experts, and with one optimizer step per
    rollout every forward runs on the weights the engine generated with, so R3 (the engine's
    routing) and R2 (the old-logprob pass's) replay the router's own choice: 2 steps train
    bitwise like no replay, so the plumbing does not perturb the math. All three recompute the
    old logprobs (R2 needs that pass), so they differ in replay alone. Packed micro-batches (the
    injected-routing tests run padded ones). With more optimizer steps per rollout replay rightly
    trains otherwise: a later step's forward runs on moved weights, and a tiny random router's
    near-ties flip under the smallest update."""
    extra = {"model": "tiny_qwen3_moe", "planner.old_log_prob": "always"}
    settings = {
        "disabled": {},
        "R3": {"actor.router_replay.mode": "R3"},
        "R2": {"actor.router_replay.mode": "R2"},
    }
    runs = {
        name: run(tiny_overrides(tmp_path / name, 2, **extra, **more), return_final_state=True)
        for name, more in settings.items()
    }
    plain = runs["disabled"]
    assert any(m["actor/grad_norm"] > 0 for m in plain.history), "nothing trained"
    for mode in ("R3", "R2"):
        replayed = runs[mode]
        assert all(
            torch.equal(plain.final_state[k], replayed.final_state[k]) for k in plain.final_state
        ), mode
        for a, b in zip(plain.history, replayed.history, strict=True):
            for key in ("actor/pg_loss", "actor/grad_norm", "critic/rewards/mean"):
                assert a[key] == b[key], (mode, key)
            assert b[ROUTING] == 0.0


# ----------------------------------------------------------------------------- router aux loss

TINY_MOE = {
    "model_type": "qwen3_moe",
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}
AUX_SEQ_LENS = (9, 13, 6, 11, 7, 6)
AUX_PROMPT_LENS = (3, 4, 2, 4, 3, 2)
AUX_TRAINED = (0, 1, 2, 3, 4)
"""Two DP ranks train (0, 1), (2,) and (3, 4), (5,); sequence 5 is a filler (loss weight 0).
Every micro-batch holds an even number of tokens: at TP=2 none is padded."""
AUX_COEF = 0.5


def _aux_batch():
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0, 0.0])
    groups = torch.arange(len(AUX_SEQ_LENS)) // 2
    return random_batch(AUX_SEQ_LENS, AUX_PROMPT_LENS, 384, advantages, seed=11, group_ids=groups)


def _aux_step():
    from megarl.planner.step_plan import MicroBatch, OptimizerStepPlan, RankPlan

    def micro_batch(seqs, weight=1.0):
        return MicroBatch(seqs, (weight,) * len(seqs), sum(AUX_SEQ_LENS[i] for i in seqs))

    ranks = (
        RankPlan((micro_batch((0, 1)), micro_batch((2,)))),
        RankPlan((micro_batch((3, 4)), micro_batch((5,), weight=0.0))),
    )
    normaliser = sum(AUX_SEQ_LENS[i] - AUX_PROMPT_LENS[i] for i in AUX_TRAINED)
    return OptimizerStepPlan(0, 0, (0,), ranks, float(normaliser), is_ghost=False)


def _switch_loss_grads(model, mbs, num_experts: int, top_k: int, total_tokens: int):
    """d/dθ of ``sum_mb T_mb / T * sum_layers switch(mb, layer)``, written out here from the
    Switch-Transformer formula ``E / (k T_mb^2) * sum_e P_e f_e`` on the routers' inputs (no
    Megatron aux-loss code), as the gradient of this rank's micro-batches."""
    from megarl.actor.megatron_actor import packed_seq_params
    from megarl.actor.router_stats import find_routers

    routers = find_routers([model])
    params = list(model.parameters())
    loss = torch.zeros((), dtype=torch.float64)
    seen: list[torch.Tensor] = []
    handles = [r.register_forward_hook(lambda _m, a, _o: seen.append(a[0])) for r in routers]
    for mb in mbs:
        seen.clear()
        model(mb.tokens_BL, mb.position_ids_BL, None, packed_seq_params=packed_seq_params(mb))
        for router, hidden in zip(routers, seen, strict=True):
            hidden = hidden.reshape(-1, hidden.shape[-1]).float()
            scores = torch.softmax(hidden @ router.weight.float().t(), dim=-1)
            top = scores.topk(top_k, dim=-1).indices
            counts = torch.zeros(num_experts).index_add_(
                0, top.reshape(-1), torch.ones(top.numel())
            )
            tokens = hidden.shape[0]
            switch = num_experts / (top_k * tokens * tokens) * (scores.sum(0) * counts).sum()
            loss = loss + tokens / total_tokens * switch.double()
    for handle in handles:
        handle.remove()
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]


def _aux_gradients(spec, state, tp: int, coef: float, dp_rank: int):
    """One optimizer step of :func:`_aux_step` at ``actor.moe_aux_loss_coef=coef``: every
    parameter's gradient (this rank's shard) and the grad norm."""
    from megarl.actor.megatron_actor import MegatronActor
    from megarl.config.actor import ActorConfig, OptimConfig
    from megarl.models.chunk import unwrap

    loss = loss_settings()
    cfg = ActorConfig(tp=tp, lr=1e-4, moe_aux_loss_coef=coef, optim=OptimConfig(grad_clip=0.0))
    actor = MegatronActor(spec, cfg, "cpu", torch.float32, state, 0, trainable=True)
    result = actor.train_step(_aux_batch(), _aux_step(), dp_rank, None, None, loss)
    named = unwrap(actor.model).named_parameters()
    return {n: p.main_grad.detach().clone() for n, p in named}, result.grad_norm


def _aux_worker(ctx, hf_config: dict, state):
    import torch.distributed as dist

    from megarl.actor.megatron_actor import MegatronActor
    from megarl.config.actor import ActorConfig
    from megarl.distributed import parallel
    from megarl.models.spec import spec_from_hf_config

    start_cpu_rank(ctx, 1)
    spec = spec_from_hf_config(hf_config)
    batch, step = _aux_batch(), _aux_step()
    without, norm_without = _aux_gradients(spec, state, 1, 0.0, ctx.rank)
    with_aux, norm_with = _aux_gradients(spec, state, 1, AUX_COEF, ctx.rank)

    reference = MegatronActor(spec, ActorConfig(), "cpu", torch.float32, state, 0, trainable=False)
    for p in reference.model.parameters():
        p.requires_grad_(True)
    mine = [m for m in step.ranks[ctx.rank].micro_batches if m.num_trained]
    mbs = [reference._micro_batch(batch, m.seq_indices) for m in mine]
    total_tokens = sum(AUX_SEQ_LENS[i] for i in AUX_TRAINED)  # packed rows: no pad tokens
    expected = _switch_loss_grads(
        reference.model, mbs, spec.num_experts, spec.moe_top_k, total_tokens
    )
    for g in expected:
        dist.all_reduce(g)  # the DP ranks' micro-batches add up, as DDP sums the gradient
    names = [n for n, _ in reference.model.named_parameters()]
    parallel.destroy()
    return {
        "names": names,
        "measured": [((with_aux[n] - without[n]) / AUX_COEF) for n in names],
        "expected": expected,
        "grad_norms": (norm_without, norm_with),
    }


def test_router_aux_loss_adds_coef_times_the_switch_loss_gradient(tmp_path):
    """With actor.moe_aux_loss_coef > 0 one optimizer step's gradient is the coefficient-0
    gradient plus coef x the gradient of the token-weighted Switch loss of the step's
    micro-batches (summed over layers, a filler micro-batch left out), to float rounding."""
    from megarl.distributed.launcher import launch
    from megarl.models.random_init import save_random_hf_model

    folder = save_random_hf_model(TINY_MOE, 5, tmp_path / "init")
    results = launch(_aux_worker, 2, args=(TINY_MOE, load_hf_state_dict(folder)), timeout_s=300)
    for r in results:
        scale = max(g.abs().max().item() for g in r["expected"])
        assert scale > 1e-5, "the Switch loss has no gradient: nothing would be measured"
        for name, measured, expected in zip(r["names"], r["measured"], r["expected"], strict=True):
            error = (measured - expected).abs().max().item()
            assert error <= 1e-4 * scale, (name, error, scale)  # seen: 2e-6 * scale
        router = [i for i, n in enumerate(r["names"]) if n.endswith("mlp.router.weight")]
        assert len(router) == TINY_MOE["num_hidden_layers"]
        assert all(r["measured"][i].abs().max().item() > 1e-3 * scale for i in router)
        norm_without, norm_with = r["grad_norms"]
        assert norm_with != pytest.approx(norm_without, rel=1e-6)


def _aux_router_worker(ctx, tp: int, hf_config: dict, state):
    """What the load-balancing loss adds to each router's gradient, per unit coefficient."""
    from megatron.core import parallel_state as ps

    from megarl.distributed import parallel
    from megarl.models.spec import spec_from_hf_config

    start_cpu_rank(ctx, tp)
    spec = spec_from_hf_config(hf_config)
    dp_rank = ps.get_data_parallel_rank()
    without, _ = _aux_gradients(spec, state, tp, 0.0, dp_rank)
    with_aux, _ = _aux_gradients(spec, state, tp, AUX_COEF, dp_rank)
    parallel.destroy()
    routers = [n for n in without if n.endswith("mlp.router.weight")]
    return {n: (with_aux[n] - without[n]) / AUX_COEF for n in routers}


def test_router_aux_loss_gradient_at_tp2_equals_tp1(tmp_path):
    """Sequence-parallel (TP=2, 4 ranks), each TP rank's router routes half of every
    micro-batch and Megatron weighs its share of the loss by half the tokens: the coefficient
    makes up for it, so the routers' load-balancing gradient equals TP=1's (proven exact
    above). The routers' weights are whole on every TP rank, so they compare directly."""
    from megarl.distributed.launcher import launch
    from megarl.models.random_init import save_random_hf_model

    state = load_hf_state_dict(save_random_hf_model(TINY_MOE, 5, tmp_path / "init"))
    one = launch(_aux_router_worker, 2, args=(1, TINY_MOE, state), timeout_s=300)[0]
    two = launch(_aux_router_worker, 4, args=(2, TINY_MOE, state), timeout_s=300)[0]
    assert sorted(one) == sorted(two) and len(one) == TINY_MOE["num_hidden_layers"]
    for name, expected in one.items():
        scale = expected.abs().max().item()
        assert scale > 1e-3, name
        # seen: 5e-6 relative; without the TP factor, half
        assert (two[name] - expected).abs().max().item() <= 1e-4 * scale, name
