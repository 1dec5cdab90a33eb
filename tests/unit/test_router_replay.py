"""Router replay's pure parts on hand-made numbers: per-sequence routing in Megatron's
router-input token order (padded and packed), the engine's rows joined into input routing, and
the config refusals."""

from __future__ import annotations

import pytest
import torch

from megarl.algo.router_replay import (
    FREE,
    MicroBatchLayout,
    dense_model_problem,
    filler_ids,
    input_routing,
    micro_batch_targets,
    replay_plan,
    response_rows,
    router_replay_problem,
    stage_layers,
    stage_routing,
)


def _ids(rows: list[list[list[int]]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.uint8)


# two layers, top-2, 4 experts; sequence 7 of length 3, sequence 2 of length 2
SEQ7 = _ids([[[0, 1], [2, 3]], [[1, 2], [0, 3]], [[2, 3], [1, 2]]])
SEQ2 = _ids([[[3, 1], [3, 0]], [[0, 2], [1, 3]]])
FILL = [0, 1]
OWN = [FREE, FREE]
"""A row the router routes on its own: each sequence's last position, padding, no routing."""


def test_padded_targets_are_sequence_first_with_free_last_positions_and_padding():
    layout = MicroBatchLayout(seq_indices=(7, 2), seq_lens=(3, 2), width=3, packed=False)
    targets = micro_batch_targets({7: SEQ7, 2: SEQ2}, layout, num_layers=2, top_k=2)
    assert targets.shape == (2, 6, 2) and targets.dtype == torch.long
    # rows s * B + b: (s0,b0) (s0,b1) (s1,b0) (s1,b1 = last of 2) (s2,b0 = last of 7) (padding)
    assert targets[0].tolist() == [[0, 1], [3, 1], [1, 2], OWN, OWN, OWN]
    assert targets[1].tolist() == [[2, 3], [3, 0], [0, 3], OWN, OWN, OWN]


def test_packed_targets_are_the_sequences_in_order():
    layout = MicroBatchLayout(seq_indices=(2, 7), seq_lens=(2, 3), width=5, packed=True)
    targets = micro_batch_targets({7: SEQ7, 2: SEQ2}, layout, num_layers=2, top_k=2)
    assert targets[0].tolist() == [[3, 1], OWN, [0, 1], [1, 2], OWN]
    assert targets[1].tolist() == [[3, 0], OWN, [2, 3], [0, 3], OWN]


def test_a_sequence_without_routing_routes_on_its_own_and_shapes_are_checked():
    layout = MicroBatchLayout(seq_indices=(7, 2), seq_lens=(3, 2), width=5, packed=True)
    targets = micro_batch_targets({7: SEQ7}, layout, num_layers=2, top_k=2)
    assert targets[0].tolist() == [[0, 1], [1, 2], OWN, OWN, OWN]
    with pytest.raises(ValueError, match="sequence 2: routing"):
        micro_batch_targets({7: SEQ7, 2: SEQ7}, layout, num_layers=2, top_k=2)
    # a padding tail (sequence parallelism) routes on its own
    tailed = MicroBatchLayout(seq_indices=(7,), seq_lens=(3,), width=4, packed=True)
    assert micro_batch_targets({7: SEQ7}, tailed, 2, 2)[0].tolist() == [[0, 1], [1, 2], OWN, OWN]
    short = MicroBatchLayout(seq_indices=(7,), seq_lens=(3,), width=2, packed=True)
    with pytest.raises(ValueError, match="packed routing of 3 tokens"):
        micro_batch_targets({7: SEQ7}, short, num_layers=2, top_k=2)


def test_input_routing_joins_prompt_and_response_rows_and_fills_the_last_position():
    # P = 3 (prompt rows 0..1 from the prefill), R = 2 (rows 2..3 scored the response tokens)
    prompt = _ids([[[0, 1]], [[1, 2]]])
    response = _ids([[[2, 3]], [[0, 3]]])
    full = input_routing(prompt, response)
    assert full.dtype == torch.uint8
    assert full[:, 0].tolist() == [[0, 1], [1, 2], [2, 3], [0, 3], FILL]
    assert torch.equal(response_rows(full, prompt_len=3), response)
    assert filler_ids(3, 2).tolist() == [[0, 1, 2], [0, 1, 2]]


def _problem(mode, engine="hf", recompute="none", old_log_prob="auto"):
    return router_replay_problem(
        mode, engine=engine, recompute=recompute, old_log_prob=old_log_prob
    )


def test_config_refusals():
    assert _problem("disabled", engine="vllm", recompute="full", old_log_prob="rollout") is None
    assert _problem("R3") is None and _problem("R2", engine="vllm") is None
    assert _problem("R2", recompute="selective") is None
    assert "must be one of disabled, R2, R3" in str(_problem("r3"))
    r3_vllm = _problem("R3", engine="vllm")
    assert r3_vllm is not None and r3_vllm.startswith("actor.router_replay.mode=R3 needs")
    assert "rollout.engine=vllm" in r3_vllm
    assert "actor.recompute=full" in str(_problem("R2", recompute="full"))
    for old in ("rollout", "never"):
        assert f"planner.old_log_prob={old} never runs" in str(_problem("R2", old_log_prob=old))
    assert _problem("R3", old_log_prob="rollout") is None  # R3 needs no trainer recording
    assert dense_model_problem("disabled", "llama") is None
    assert "dense" in str(dense_model_problem("R2", "llama"))
    for message in (r3_vllm, dense_model_problem("R3", "llama")):
        assert "\n" not in str(message)


def test_sequence_ids_inverts_the_targets_and_layout_reads_micro_batches():
    from megarl.algo.router_replay import layout_of, sequence_ids
    from megarl.batch import RolloutBatch, build_micro_batch

    batch = RolloutBatch(
        tokens=(torch.arange(5), torch.arange(3)),
        prompt_lens=(2, 1),
        group_ids=torch.zeros(2),
        rewards=torch.zeros(2),
        advantages=torch.zeros(2),
        engine_logprobs=(torch.zeros(3), torch.zeros(2)),
    )
    routing = {0: torch.randint(0, 4, (5, 2, 2)), 1: torch.randint(0, 4, (3, 2, 2))}
    for packed in (False, True):
        layout = layout_of(build_micro_batch(batch, (1, 0), pad_id=0, packed=packed))
        assert layout == MicroBatchLayout((1, 0), (3, 5), width=8 if packed else 5, packed=packed)
        targets_LTK = micro_batch_targets(routing, layout, num_layers=2, top_k=2)
        back = sequence_ids(targets_LTK.permute(1, 0, 2), layout)
        assert all(torch.equal(back[i][:-1], routing[i][:-1]) for i in (0, 1))
        assert all((back[i][-1] == FREE).all() for i in (0, 1))


def test_r2_refuses_kl_in_reward_and_makes_the_old_logprob_gate_run_on_policy():
    from megarl.planner.gates import RunFacts, StepFacts, decide_old_log_prob

    assert "algo.use_kl_in_reward" in str(
        _problem("R2")
        or router_replay_problem(
            "R2", engine="hf", recompute="none", old_log_prob="auto", kl_in_reward=True
        )
    )
    slices = ((0, 1, 2, 3),)  # one mini-batch, one epoch: on-policy
    plain = decide_old_log_prob(StepFacts(RunFacts(1, 1, 2), 0, slices))
    assert not plain.run and plain.reason == "on-policy"
    r2 = decide_old_log_prob(StepFacts(RunFacts(1, 1, 2, router_replay_r2=True), 0, slices))
    assert r2.run and r2.seq_indices == (0, 1, 2, 3)
    assert r2.reason == "actor.router_replay.mode=R2 records the routing to replay"


def test_replay_plan_says_what_each_forward_records_and_replays():
    r3, r2, off = replay_plan("R3"), replay_plan("R2"), replay_plan("disabled")
    assert (r3.old_log_prob_replays_engine, r3.training_replays) == (True, "engine")
    assert not r3.old_log_prob_records_for_training
    assert (r2.old_log_prob_replays_engine, r2.training_replays) == (False, "old_log_prob")
    assert r2.old_log_prob_records_for_training
    assert off == replay_plan("disabled")
    assert (off.old_log_prob_replays_engine, off.old_log_prob_records_for_training) == (
        False,
        False,
    )
    assert off.training_replays == "none"
    with pytest.raises(ValueError, match="R4"):
        replay_plan("R4")


def test_a_pipeline_stage_takes_its_own_layers_of_every_sequence():
    """Megatron numbers layers from 1 across the whole model: a second stage of a 4-layer model
    holds layers 3 and 4, which are rows 2:4 of the engine's per-position routing."""
    assert stage_layers([3, 4]) == range(2, 4)
    assert stage_layers([1]) == range(1)
    with pytest.raises(ValueError, match="not consecutive"):
        stage_layers([1, 3])
    routing = {7: torch.arange(3 * 4 * 2).reshape(3, 4, 2), 2: torch.zeros(2, 4, 2)}
    staged = stage_routing(routing, range(2, 4))
    assert sorted(staged) == [2, 7]
    assert torch.equal(staged[7], routing[7][:, 2:4]) and staged[2].shape == (2, 2, 2)
