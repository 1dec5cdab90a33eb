"""The Megatron engine on the rollout side (split placement, Ray, the tiny model on CPU).

The rollout actor holds a TP=1 copy that the weight sync feeds in Megatron layout: in the
synchronous loop its logprobs are the trainer's to fp32 rounding at every step although the
policy moves (lr 5e-2), the sync is real (``timing_s/update_weights`` > 0, the checksum
verified, the gates' line says full weights, or the adapter alone under LoRA) and the guard's
probe runs on it -- for a mixture-of-experts trainer at EP=2 too, whose experts the copy holds
all at EP=1 (the row vLLM's CPU build cannot serve), and for TP=2 with LoRA; ``fully_async``
with partial rollouts trains within the staleness bound.

Whether a sync lands mid-generation in a real run is a matter of timing, so the interruption
itself is checked on the asynchronous rollout side alone (no Ray, the trainer played by the
test, as ``test_async_rollout.py`` does for the HF engine): two weight syncs interrupt step 1's
generation; under unchanged weights each response goes on to the uninterrupted tokens, under
new weights it goes on from its tokens so far with the new version's, every token tagged with
the version that sampled it.
"""

from __future__ import annotations

import pytest
import torch
from helpers.engines import first_batch_under_pushes
from helpers.runs import metrics_rows, one_ray, tiny_overrides  # noqa: F401 - one_ray: autouse

from megarl.train import run

pytestmark = pytest.mark.slow

SPLIT = {"trainer.launcher": "ray", "rollout.n_gpus": 1, "rollout.engine": "megatron"}


@pytest.mark.parametrize(
    ("overrides", "sync_line"),
    [
        (
            {"model": "tiny_qwen3_moe", "actor.ep": 2},
            "sync: full weights (no LoRA: full weights)",
        ),
        (
            {"actor.tp": 2, "actor.lora.rank": 4, "actor.lora.alpha": 8},
            "sync: adapter only (engine kept base)",
        ),
    ],
    ids=["qwen3_moe-ep2-full", "tp2-lora"],
)
def test_a_split_run_syncs_the_rollout_sides_copy_every_step(overrides, sync_line, tmp_path):
    run_dir = tmp_path / "run"
    settings = {
        **SPLIT,
        "trainer.n_gpus_per_node": 2,
        "actor.lr": 5e-2,
        "export.checksum_interval": 1,
        **overrides,
    }
    run(tiny_overrides(run_dir, steps=2, **settings))
    rows = metrics_rows(run_dir)
    assert [row["step"] for row in rows] == [1, 2]
    full = "actor.lora.rank" not in overrides
    for row in rows:
        assert row["rollout/logprob_abs_diff"] <= 1e-5, row["rollout/logprob_abs_diff"]
        assert row["timing_s/update_weights"] > 0
        assert row["gates/base_weight_sync"] == float(full)
        assert sync_line in row["gates/summary"], row["gates/summary"]
        if full:
            assert row["export/checksum_ok"] == 1.0
    assert rows[0]["sync/probe_logprob_diff"] <= 1e-5


@pytest.mark.parametrize(
    "mode",
    [
        {
            "async_training.mode": "fully_async",
            "async_training.max_staleness": 2,
            "async_training.partial_rollout": True,
        },
        {"async_training.mode": "one_step_off"},
    ],
    ids=["fully_async-partial", "one_step_off"],
)
def test_asynchronous_modes_train_within_their_bound(mode, tmp_path):
    settings = {**SPLIT, **mode, "actor.lr": 5e-2}
    history = run(tiny_overrides(tmp_path / "run", 3, **settings)).history
    assert [row["step"] for row in history] == [1, 2, 3]
    bound = mode.get("async_training.max_staleness", 1)
    assert all(row["async/staleness/max"] <= bound for row in history)
    assert all(row["timing_s/update_weights"] > 0 for row in history)


# --- the asynchronous rollout side alone ----------------------------------------------------


def _host(tmp_path, name: str, **extra):
    from megarl.models.hf_io import load_hf_tokenizer
    from megarl.train import compose_config, resolve_model_dir
    from megarl.trainer.rollout_host import RolloutHost

    overrides = {**SPLIT, "rollout.max_new_tokens": 12, **extra}
    cfg = compose_config(tiny_overrides(tmp_path / name, steps=2, **overrides))
    model_dir = resolve_model_dir(cfg)
    return cfg, RolloutHost(cfg, model_dir, "cpu", load_hf_tokenizer(model_dir)), model_dir


def _policy(model_dir: str, version: int) -> dict[tuple[str, int | None], torch.Tensor]:
    """Policy ``version`` as whole TP=1 Megatron parameters by (rule, layer): the initial
    weights moved by a perturbation seeded by the version (none at version 0)."""
    from safetensors.torch import load_file

    from megarl.models import mapping

    spec = _spec(model_dir)
    hf = load_file(f"{model_dir}/model.safetensors")
    generator = torch.Generator().manual_seed(version)
    out = {}
    for rule in mapping.rules_for(spec):
        if rule.mcore == "output_layer.weight" and spec.tie_embeddings:
            continue
        for layer in range(spec.num_layers) if rule.per_layer else [None]:
            parts = [hf[name] for name in rule.hf_names(layer)]
            shard = mapping.to_mcore_shard(rule, parts, spec, 0, 1)
            full = mapping.to_mcore_full(rule, [shard], spec)
            out[rule.mcore, layer] = full + 0.05 * version * torch.randn(
                full.shape, generator=generator
            )
    return out


def _spec(model_dir: str):
    from megarl.models.hf_io import load_hf_config
    from megarl.models.spec import spec_from_hf_config

    return spec_from_hf_config(load_hf_config(model_dir))


def _megatron_named(model_dir: str, version: int) -> list[tuple[str, torch.Tensor]]:
    """What the exporter sends the Megatron engine for policy ``version``."""
    from megarl.models import mapping

    rules = mapping.rule_index(_spec(model_dir))
    return [
        (rules[mcore].mcore_name(layer), t)
        for (mcore, layer), t in _policy(model_dir, version).items()
    ]


def _hf_model(model_dir: str, version: int):
    """The ``transformers`` model holding policy ``version`` (the scorer of its tokens)."""
    from megarl.models import mapping
    from megarl.models.hf_io import load_hf_model

    spec = _spec(model_dir)
    rules = mapping.rule_index(spec)
    model, _ = load_hf_model(model_dir, device="cpu")
    state = {}
    for (mcore, layer), full in _policy(model_dir, version).items():
        rule = rules[mcore]
        state.update(zip(rule.hf_names(layer), mapping.to_hf(rule, [full], spec), strict=True))
    model.load_state_dict(state, strict=False)
    return model.eval()


def _step_1(tmp_path, name: str, moved: bool | None):
    """Step 1's batch from ``fully_async`` (partial rollouts, K = 2) with the Megatron engine's
    rollout-side copy; unless ``moved`` is None its first two engine calls each start with a
    push of versions 1 and 2 (moved weights, or the initial ones again).
    ``(batch, engine calls, model_dir)``."""
    cfg, host, model_dir = _host(
        tmp_path,
        name,
        **{"async_training.mode": "fully_async", "async_training.max_staleness": 2},
        **{"async_training.partial_rollout": True},
    )
    batch, _, pusher = first_batch_under_pushes(
        host,
        cfg,
        {
            "weights": lambda version: _megatron_named(model_dir, version if moved else 0),
            "pushes": 0 if moved is None else 2,
            "record_checksums": True,
        },
    )
    return batch, pusher.calls, model_dir


@pytest.fixture
def world_of_one():
    """The process's Megatron world of one, which the rollout-side copy takes as its own."""
    from helpers.engines import megatron_world

    with megatron_world():
        yield


@pytest.mark.usefixtures("world_of_one")
def test_partial_rollouts_resume_each_response_under_the_synced_weights(tmp_path):
    expected, _, _ = _step_1(tmp_path, "plain", moved=None)
    same, calls, _ = _step_1(tmp_path, "same", moved=False)
    assert calls >= 3
    assert [t.tolist() for t in same.tokens] == [t.tolist() for t in expected.tokens]
    for x, y in zip(same.engine_logprobs, expected.engine_logprobs, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-5)
    versions = [v.tolist() for v in same.behaviour_versions or ()]
    assert all(v == sorted(v) for v in versions)  # a response's versions never go back
    assert any(len(set(v)) == 3 for v in versions)  # pieces under versions 0, 1 and 2

    # under moved weights each token's logprob is its own version's: scored by that policy
    new, _, model_dir = _step_1(tmp_path, "moved", moved=True)
    scorers = {v: _hf_model(model_dir, v) for v in (0, 1, 2)}
    mixed = 0
    for tokens_T, prompt_len, logprobs_R, versions_R in zip(
        new.tokens, new.prompt_lens, new.engine_logprobs, new.behaviour_versions or (), strict=True
    ):
        mixed += len(set(versions_R.tolist())) > 1
        for version, scorer in scorers.items():
            with torch.no_grad():
                logits_TV = scorer(tokens_T.unsqueeze(0)).logits[0].float()
            scored_R = (
                torch.log_softmax(logits_TV[prompt_len - 1 : -1], dim=-1)
                .gather(-1, tokens_T[prompt_len:].unsqueeze(-1))
                .squeeze(-1)
            )
            mine = versions_R == version
            torch.testing.assert_close(logprobs_R[mine], scored_R[mine], rtol=0, atol=1e-5)
    assert mixed > 0
