"""Algorithm presets in configs/recipe/: each composes into a valid run whose settings are the
file's, the command line still wins, and docs/algorithms.md names every one."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from megarl.train import StartupError, compose_config

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted(p.stem for p in (REPO / "configs" / "recipe").glob("*.yaml"))


def _leaves(tree: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _resolved(cfg, dotted: str) -> object:
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def test_the_recipes_the_readme_promises_exist():
    assert {"grpo", "dr_grpo", "gspo", "rloo", "dapo", "ppo"} <= set(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_composes_to_its_own_settings(name):
    settings = _leaves(yaml.safe_load((REPO / "configs" / "recipe" / f"{name}.yaml").read_text()))
    cfg = compose_config([f"recipe={name}"])
    default = compose_config([])
    for key, value in settings.items():
        resolved = _resolved(cfg, key)
        if value is None:  # null resolves to a derived default, the same as without the recipe
            assert resolved == _resolved(default, key), key
        else:  # a list (data.train_files) is kept as a tuple
            assert resolved == (tuple(value) if isinstance(value, list) else value), key
    assert any(_resolved(cfg, k) != _resolved(default, k) for k in settings), "changes nothing"


def test_the_command_line_wins_over_a_recipe():
    cfg = compose_config(["recipe=gspo", "actor.clip_ratio_high=5e-4"])
    assert (cfg.actor.policy_loss, cfg.actor.clip_ratio_high) == ("gspo", 5e-4)


def test_dr_grpo_is_grpo_without_std_and_with_the_constant_normaliser():
    cfg = compose_config(["recipe=dr_grpo", "rollout.max_new_tokens=64"])
    assert cfg.algo.estimator == "grpo_no_std"
    assert (cfg.loss_agg, cfg.loss_scale_factor) == ("seq-mean-token-sum-norm", 64.0)


def test_an_unknown_recipe_names_the_ones_there_are():
    with pytest.raises(
        StartupError,
        match=r"recipe=nope: no such recipe .*available: clip_cov, dapo, dppo_kl, dppo_tv, dr_grpo",
    ):
        compose_config(["recipe=nope"])


@pytest.mark.parametrize("name", RECIPES)
def test_the_docs_name_every_recipe(name):
    assert f"`recipe={name}`" in (REPO / "docs" / "algorithms.md").read_text()


def test_ppo_trains_a_critic_on_gae_advantages_and_never_prunes():
    cfg = compose_config(["recipe=ppo"])
    assert cfg.algo.uses_critic and cfg.algo.adv_estimator == "gae"
    assert (cfg.algo.gamma, cfg.algo.lam, cfg.critic.cliprange_value) == (1.0, 1.0, 0.5)
    from megarl.config.planning import prune_mode

    mode, reason = prune_mode(cfg)
    assert mode == "off" and "algo.adv_estimator=gae" in reason
