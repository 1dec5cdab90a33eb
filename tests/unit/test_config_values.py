"""Values that make no sense are refused by the schema, in one line naming the key; the edge
of each range that does make sense is accepted."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from megarl.config.schema import ConfigError, RunConfig, build_run_config


@pytest.mark.parametrize(
    ("tree", "needle"),
    [
        ({"actor": {"optim": {"grad_clip": -1.0}}}, "actor.optim.grad_clip=-1.0: must be >= 0"),
        ({"actor": {"optim": {"betas": [0.9, 1.0]}}}, "beta2=1.0 must be in [0, 1)"),
        ({"actor": {"optim": {"betas": [-0.1, 0.999]}}}, "beta1=-0.1 must be in [0, 1)"),
        ({"actor": {"optim": {"betas": [0.9]}}}, "actor.optim.betas=[0.9]: must be two numbers"),
        ({"actor": {"optim": {"betas": ["a", 0.9]}}}, "actor.optim.betas=['a', 0.9]"),
        ({"actor": {"optim": {"betas": 0.9}}}, "actor.optim.betas=0.9: expected a list"),
        ({"actor": {"optim": {"eps": 0.0}}}, "actor.optim.eps=0.0: must be > 0"),
        ({"actor": {"optim": {"weight_decay": -0.01}}}, "actor.optim.weight_decay=-0.01"),
        ({"actor": {"lr": 0.0}}, "actor.lr=0.0: must be > 0"),
        ({"actor": {"lr": -1e-5}}, "actor.lr=-1e-05"),
        ({"actor": {"clip_ratio_low": -0.2}}, "actor.clip_ratio_low=-0.2: must be in (0, 1)"),
        ({"actor": {"clip_ratio_low": 1.0}}, "actor.clip_ratio_low=1.0"),
        ({"actor": {"clip_ratio_high": -0.2}}, "actor.clip_ratio_high=-0.2: must be > 0"),
        ({"actor": {"clip_ratio_high": 0.0}}, "actor.clip_ratio_high=0.0"),
        ({"actor": {"policy_loss": "ppo"}}, "actor.policy_loss='ppo': must be one of vanilla,"),
        ({"actor": {"clip_ratio_c": 1.0}}, "actor.clip_ratio_c=1.0: must be > 1"),
        ({"actor": {"loss_agg": "seq-mean"}}, "actor.loss_agg='seq-mean': must be one of"),
        ({"actor": {"loss_scale_factor": 0}}, "actor.loss_scale_factor=0: must be a number > 0"),
        ({"actor": {"policy_loss": "gspo", "clip_ratio_low": 10}}, "actor.clip_ratio_low=10"),
        ({"actor": {"policy_loss": "cispo", "clip_ratio_low": 0}}, "actor.clip_ratio_low=0"),
        ({"actor": {"tau_pos": 0}}, "actor.tau_pos=0.0: must be > 0"),
        ({"actor": {"tau_neg": -1.05}}, "actor.tau_neg=-1.05: must be > 0"),
        ({"actor": {"clip_cov_ratio": 0}}, "actor.clip_cov_ratio=0.0: must be in (0, 1]"),
        ({"actor": {"kl_cov_ratio": 1.5}}, "actor.kl_cov_ratio=1.5: must be in (0, 1]"),
        (
            {"actor": {"clip_cov_lb": 5.0, "clip_cov_ub": 1.0}},
            "actor.clip_cov_lb=5.0: must be below actor.clip_cov_ub=1.0",
        ),
        ({"actor": {"ppo_kl_coef": -0.1}}, "actor.ppo_kl_coef=-0.1: must be a finite number >= 0"),
        ({"actor": {"kl_tau": -1}}, "actor.kl_tau=-1.0: must be a finite number >= 0"),
        ({"actor": {"m2_threshold": 0}}, "actor.m2_threshold=0.0: must be > 0"),
        ({"actor": {"adv_tau": float("inf")}}, "actor.adv_tau=inf: must be a finite"),
        ({"algo": {"filter_groups": {"metric": "acc"}}}, "algo.filter_groups.metric='acc'"),
        (
            {"algo": {"filter_groups": {"max_num_gen_batches": -1}}},
            "algo.filter_groups.max_num_gen_batches=-1: must be >= 0",
        ),
        ({"reward": {"overlong_buffer": {"len": 0}}}, "reward.overlong_buffer.len=0"),
        (
            {"algo": {"length_penalty": {"type": "quadratic"}}},
            "algo.length_penalty.type='quadratic': must be one of linear",
        ),
        (
            {"algo": {"length_penalty": {"type": "linear", "num_turns_weight": -0.1}}},
            "algo.length_penalty.num_turns_weight=-0.1: must be >= 0",
        ),
        (
            {"reward": {"overlong_buffer": {"penalty_factor": -1.0}}},
            "reward.overlong_buffer.penalty_factor=-1.0: must be >= 0",
        ),
        (
            {
                "reward": {"overlong_buffer": {"enable": True, "len": 64}},
                "rollout": {"max_new_tokens": 32},
            },
            "reward.overlong_buffer.len=64 > rollout.max_new_tokens=32",
        ),
        (
            {"trainer": {"val_interval": 2}, "data": {"train_files": "t.parquet"}},
            "trainer.val_interval=2 needs data.val_files",
        ),
        ({"data": {"val_problems": -1}}, "data.val_problems=-1: must be >= 0"),
        ({"data": {"max_prompt_length": 0}}, "data.max_prompt_length=0: must be a number > 0"),
        ({"trainer": {"val_interval": -1}}, "trainer.val_interval=-1: must be >= 0"),
        ({"rollout": {"val": {"n": 0}}}, "rollout.val.n=0: must be > 0"),
        ({"rollout": {"val": {"temperature": -1.0}}}, "rollout.val.temperature=-1.0"),
        ({"data": {"val_files": 3}}, "data.val_files=3: expected a file or a list of files"),
        ({"rollout": {"n": 0}}, "rollout.n=0"),
        ({"rollout": {"n": -4}}, "rollout.n=-4"),
        ({"rollout": {"max_new_tokens": 0}}, "rollout.max_new_tokens=0: must be > 0"),
        ({"rollout": {"temperature": -0.5}}, "rollout.temperature=-0.5: must be > 0"),
        ({"rollout": {"temperature": 0.0}}, "rollout.temperature=0.0: must be > 0 (GRPO"),
        ({"rollout": {"top_p": 0.0}}, "rollout.top_p=0.0: must be in (0, 1]"),
        ({"rollout": {"top_p": 1.01}}, "rollout.top_p=1.01"),
        ({"rollout": {"max_model_len": 16, "max_new_tokens": 16}}, "rollout.max_model_len=16"),
        ({"rollout": {"max_model_len": 0}}, "rollout.max_model_len=0"),
        ({"data": {"prompts_per_step": 0}}, "data.prompts_per_step=0: must be > 0"),
        ({"data": {"max_operand": 0}}, "data.max_operand=0: must be >= 1"),
        ({"data": {"ops": ["/"]}}, "data.ops='/': must be one of +, -, *"),
        ({"data": {"ops": []}}, "data.ops: empty"),
        ({"data": {"reward_error": "ignore"}}, "data.reward_error='ignore': must be one of"),
        ({"trainer": {"run_dir": ""}}, "trainer.run_dir='': empty"),
        ({"trainer": {"run_dir": "  "}}, "trainer.run_dir='  ': empty"),
        ({"trainer": {"run_dir": None}}, "trainer.run_dir=None: expected a string"),
    ],
)
def test_senseless_values_are_refused_naming_the_key(tree, needle):
    with pytest.raises(ConfigError) as info:
        build_run_config(tree)
    message = str(info.value)
    assert needle in message, message
    assert "\n" not in message


@pytest.mark.parametrize(
    "tree",
    [
        {"actor": {"optim": {"grad_clip": 0.0}}},  # 0 = no clipping
        {"actor": {"optim": {"betas": [0.0, 0.0]}}},
        {"actor": {"optim": {"betas": [0, 0.95]}}},  # an integer is a number
        {"actor": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}},  # DAPO's clip-higher
        {"actor": {"policy_loss": "gspo", "clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}},
        {"actor": {"policy_loss": "cispo", "clip_ratio_low": 10}},  # MiniMax: no lower bound
        {"actor": {"clip_ratio_c": 1.001, "loss_scale_factor": 1}},
        {"actor": {"clip_cov_ratio": 1.0, "kl_cov_ratio": 1e-9, "kl_tau": 0, "adv_tau": 0}},
        {"actor": {"clip_cov_lb": -1.0, "clip_cov_ub": -0.5, "ppo_kl_coef": 0.0}},
        {"rollout": {"n": 2, "max_new_tokens": 1, "top_p": 1.0, "temperature": 1e-3}},
        {"rollout": {"max_model_len": 17, "max_new_tokens": 16}},
        {"data": {"prompts_per_step": 1, "max_operand": 1, "ops": ["+", "-", "*"]}},
        {"data": {"reward_error": "zero"}},
    ],
)
def test_the_edge_of_each_range_is_accepted(tree):
    build_run_config(tree)


@pytest.mark.parametrize(
    ("actor", "agg"),
    [
        ({}, "token-mean"),
        ({"policy_loss": "cispo"}, "token-mean"),
        ({"policy_loss": "gspo"}, "seq-mean-token-mean"),  # verl's choice for gspo
        ({"policy_loss": "gspo", "loss_agg": "token-mean"}, "token-mean"),  # explicit wins
        ({"policy_loss": "geo_mean"}, "seq-mean-token-mean"),  # GMPO's per-sequence mean
        ({"policy_loss": "sapo"}, "seq-mean-token-mean"),  # as verl forces it
        ({"policy_loss": "dppo_tv"}, "token-mean"),
        ({"loss_agg": None}, "token-mean"),
    ],
)
def test_unset_loss_agg_is_the_policy_losss_own(actor, agg):
    cfg = build_run_config({"actor": actor})
    assert cfg.actor.loss_agg == agg
    assert cfg.loss_agg == agg


def test_loss_scale_factor_defaults_to_max_new_tokens():
    assert build_run_config({"rollout": {"max_new_tokens": 48}}).loss_scale_factor == 48.0
    cfg = build_run_config({"actor": {"loss_scale_factor": 4096}})
    assert cfg.loss_scale_factor == 4096.0


def _number_settings(cls: type = RunConfig, prefix: str = "") -> dict[str, object]:
    """Every setting of the schema whose type holds a number (``float`` or ``int``, alone,
    optional or in a tuple), by dotted key, with its type: read from the dataclasses, nested
    sections included, so a key added later is covered by itself."""
    found: dict[str, object] = {}
    hints = typing.get_type_hints(cls)
    for fld in dataclasses.fields(cls):
        hint, key = hints[fld.name], f"{prefix}{fld.name}"
        if dataclasses.is_dataclass(hint):
            found.update(_number_settings(hint, f"{key}."))
        elif _number_types(hint):
            found[key] = hint
    return found


def _number_types(hint: object) -> set[object]:
    """``float`` and / or ``int`` where ``hint`` holds them, at any depth."""
    if hint in (int, float):
        return {hint}
    return set().union(*(_number_types(arg) for arg in typing.get_args(hint)))


NUMBER_SETTINGS = _number_settings()
FLOAT_SETTINGS = sorted(k for k, hint in NUMBER_SETTINGS.items() if float in _number_types(hint))
INT_SETTINGS = sorted(set(NUMBER_SETTINGS) - set(FLOAT_SETTINGS))


def _tree(key: str, value: float) -> dict:
    """``{"a": {"b": value}}`` for ``a.b``; a tuple setting gets ``value`` in every place."""
    hint = NUMBER_SETTINGS[key]
    tuples = [h for h in (hint, *typing.get_args(hint)) if typing.get_origin(h) is tuple]
    leaf: object = value
    if tuples:
        leaf = [value for arg in typing.get_args(tuples[0]) if arg is not Ellipsis]
    *sections, name = key.split(".")
    tree: dict = {name: leaf}
    for section in reversed(sections):
        tree = {section: tree}
    return tree


def test_the_number_settings_are_found_in_every_section():
    """The walk reaches nested sections and sections defined outside the schema module."""
    for key in (
        "actor.lr",
        "actor.optim.betas",
        "critic.optim.eps",
        "actor.lora.dropout",
        "rollout.val.top_p",
        "rollout.agent.tool_timeout_s",
        "algo.rollout_correction.rollout_rs_threshold",
        "data.reward_timeout_s",
        "trainer.collective_timeout_s",
    ):
        assert key in FLOAT_SETTINGS, key
    assert "rollout.max_model_len" in INT_SETTINGS


FINITE_REFUSALS = {
    **dict.fromkeys(FLOAT_SETTINGS, ("must be a finite number", "must be finite numbers")),
    # refused by the finiteness rule, or, where the key takes no float, as not an integer
    **dict.fromkeys(INT_SETTINGS, ("must be a finite number", "expected an integer")),
}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=repr)
@pytest.mark.parametrize("key", list(FINITE_REFUSALS))
def test_every_numeric_setting_refuses_nan_and_inf_by_name(key, bad):
    with pytest.raises(ConfigError) as info:
        build_run_config(_tree(key, bad))
    message = str(info.value)
    assert message.startswith(f"{key}="), message
    assert message.endswith(FINITE_REFUSALS[key]), message
    assert "\n" not in message
