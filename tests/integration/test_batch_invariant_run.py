"""True on-policy: under ``batch_invariant_mode`` the Megatron model gives every sampled token
the same logprob, bit for bit, whether it is decoded one token at a time against a KV cache or
recomputed by the trainer's forward, packed or padded, in micro-batches of any size, at TP=1 and
TP=2, on the tiny model and on SmolLM2.

The decoder here is a reference: Megatron's own static KV cache (``StaticInferenceContext``)
over the actor's model, sampling from the same vocab-parallel logprobs the trainer computes
(:func:`megarl.models.vocab_parallel.token_logprobs_and_entropy`).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.models import TINY_HF_CONFIG
from helpers.ranks import start_cpu_rank

from megarl.distributed.launcher import launch
from megarl.models.random_init import build_random_hf_model

pytestmark = pytest.mark.slow

TEMPERATURE = 0.7
PROMPT_LEN = 5
NEW_TOKENS = 6
TINY = {**TINY_HF_CONFIG, "head_dim": 32, "hidden_size": 128}
"""The tiny Llama at head size 32 (the size the CPU engines serve)."""


def _state(hf_config: dict, seed: int = 0) -> dict:
    model = build_random_hf_model(hf_config, seed)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _decode(actor, prompts: torch.Tensor, new_tokens: int, seed: int):
    """Sample ``new_tokens`` per row of ``prompts`` with a KV cache (prefill, then one token per
    step); returns the full sequences and each sampled token's logprob."""
    from megatron.core import parallel_state as ps
    from megatron.core.inference.contexts import StaticInferenceContext

    from megarl.models.vocab_parallel import token_logprobs_and_entropy

    model = actor.model
    model.eval()
    batch, prompt_len = prompts.shape
    context = StaticInferenceContext(batch, prompt_len + new_tokens)
    generator = torch.Generator().manual_seed(seed)
    tokens, logps = prompts, []
    step_ids = prompts
    for _ in range(new_tokens):
        offset = context.sequence_len_offset
        positions = torch.arange(offset, offset + step_ids.shape[1]).expand(batch, -1)
        # Megatron's inference gathers the vocabulary over TP; the logprob takes this rank's
        # slice of it (exact copies), through the trainer's own vocab-parallel reduction
        full = model(
            step_ids, positions, None, inference_context=context, runtime_gather_output=True
        )[:, -1:]
        context.sequence_len_offset += step_ids.shape[1]
        probs = torch.softmax(full[..., : actor.spec.vocab_size] / TEMPERATURE, -1).squeeze(1)
        sampled = torch.multinomial(probs, 1, generator=generator)  # same on every TP rank
        local = full.shape[-1] // ps.get_tensor_model_parallel_world_size()
        start = actor.vocab_shard.start
        logp, _ = token_logprobs_and_entropy(
            full[..., start : start + local],
            sampled,
            actor.vocab_shard,
            TEMPERATURE,
            with_entropy=False,
        )
        logps.append(logp[:, 0])
        tokens = torch.cat([tokens, sampled], dim=1)
        step_ids = sampled
    return tokens, torch.stack(logps, dim=1)


def _rollouts(sequences: list[torch.Tensor], prompt_lens: list[int]):
    from megarl.batch import RolloutBatch

    num = len(sequences)
    return RolloutBatch(
        tokens=tuple(sequences),
        prompt_lens=tuple(prompt_lens),
        group_ids=torch.zeros(num),
        rewards=torch.zeros(num),
        advantages=torch.zeros(num),
        engine_logprobs=tuple(
            torch.zeros(len(s) - p) for s, p in zip(sequences, prompt_lens, strict=True)
        ),
    )


def _worker(ctx, tp: int, hf_config: dict, state: dict | None, invariant: bool):
    """Decode 3 prompts together and one alone; then the trainer's logprobs of those sequences
    among others of other lengths, in several packings and micro-batchings, padded too."""
    from megarl.actor.megatron_actor import MegatronActor
    from megarl.config.actor import ActorConfig
    from megarl.distributed import parallel
    from megarl.distributed.batch_invariant import batch_invariant_mode
    from megarl.models.spec import spec_from_hf_config

    start_cpu_rank(ctx, tp)
    spec = spec_from_hf_config(hf_config)
    if state is None:
        from megarl.models.hf_io import load_hf_state_dict, resolve_model_path

        state = load_hf_state_dict(resolve_model_path(None))
    cfg = ActorConfig(tp=tp)
    # batch_invariant: the run's switch (rollout.batch_invariant)
    actor = MegatronActor(
        spec, cfg, "cpu", torch.float32, state, 0, trainable=False, batch_invariant=invariant
    )
    padded = MegatronActor(
        spec,
        cfg,
        "cpu",
        torch.float32,
        state,
        0,
        trainable=False,
        execution=dataclasses.replace(actor.execution, packed_attention="none"),
        batch_invariant=invariant,
    )
    gen = torch.Generator().manual_seed(3)
    prompts = torch.randint(3, spec.vocab_size, (4, PROMPT_LEN), generator=gen)
    with batch_invariant_mode(invariant):
        together, logp_together = _decode(actor, prompts[:3], NEW_TOKENS, seed=1)
        alone, logp_alone = _decode(actor, prompts[3:], NEW_TOKENS, seed=2)
    sequences = [*together, *alone]
    engine = [*logp_together, *logp_alone]
    # others of other lengths share the trainer's micro-batches
    sequences += [torch.randint(3, spec.vocab_size, (n,), generator=gen) for n in (9, 23, 70)]
    batch = _rollouts(sequences, [PROMPT_LEN] * 4 + [2, 7, 30])
    groupings = {
        "one micro-batch": [list(range(7))],
        "one each": [[i] for i in range(7)],
        "mixed": [[6, 0], [4, 1, 5], [3, 2]],
    }
    found: dict[str, float] = {}
    trainer: dict[str, dict[int, torch.Tensor]] = {}
    with torch.no_grad():  # the actor enters the mode itself
        for name, groups in groupings.items():
            for layout, model in (("packed", actor), ("padded", padded)):
                logp = trainer[f"{layout}, {name}"] = model.compute_logprobs(
                    batch, groups, TEMPERATURE
                )
                found[f"{layout}, {name}"] = max(
                    float((logp[i] - engine[i]).abs().max()) for i in range(4)
                )
    first = trainer["packed, one micro-batch"]
    spread = max(
        float((logp[i] - first[i]).abs().max()) for logp in trainer.values() for i in range(7)
    )
    parallel.destroy()
    return {"decode vs trainer": found, "trainer spread": spread}


def _run(tp: int, hf_config: dict, state: dict | None, invariant: bool = True) -> dict:
    results = launch(_worker, tp, args=(tp, hf_config, state, invariant))
    assert all(r == results[0] for r in results), results  # every TP rank the same
    return results[0]


def _assert_bitwise(result: dict) -> None:
    found = result["decode vs trainer"]
    assert found == dict.fromkeys(found, 0.0), result
    assert result["trainer spread"] == 0.0, result


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_decode_and_trainer_forward_agree_bitwise_tiny(tp):
    _assert_bitwise(_run(tp, TINY, _state(TINY)))


def test_default_trainer_forward_is_not_invariant_here():
    """The control: without the mode the trainer's own logprobs of one sequence differ between
    packings and micro-batchings (so the test above can fail). The default core attention
    does not read a KV cache (it is causal from the first key), so its decode is not compared."""
    spread = _run(2, TINY, _state(TINY), invariant=False)["trainer spread"]
    assert 0.0 < spread < 1e-4, spread


def test_decode_and_trainer_forward_agree_bitwise_smollm2():
    from megarl.models.hf_io import load_hf_config

    hf_config = load_hf_config(None).to_dict()
    _assert_bitwise(_run(1, hf_config, None))


def test_a_run_with_the_megatron_engine_has_zero_logprob_difference(tmp_path):
    """Two steps at TP=2 with ``rollout.batch_invariant=true``: every sampled token's logprob
    from the engine equals the trainer's bitwise, after the update too (lr 5e-2 moves the
    policy in step 1), so the difference is 0.0 and the token-level IS weights are exactly 1."""
    import json

    from helpers.runs import tiny_overrides

    from megarl.train import run

    run_dir = tmp_path / "run"
    settings = {
        "rollout.engine": "megatron",
        "rollout.batch_invariant": "true",
        "trainer.n_gpus_per_node": 2,
        "actor.tp": 2,
        "actor.lr": 5e-2,
        "algo.rollout_correction.rollout_is": "token",
    }
    run(tiny_overrides(run_dir, steps=2, **settings))
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rows = [row for row in map(json.loads, lines) if row["step"] >= 1]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["rollout/logprob_abs_diff"] == 0.0, row
        assert row["rollout_corr/rollout_is_min"] == row["rollout_corr/rollout_is_max"] == 1.0
        assert row["rollout_corr/kl"] == 0.0, row
