"""Config validation is pure and names the offending key."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.config import config_refusal

from megarl.algo.advantages import ADVANTAGE_ESTIMATOR_NAMES
from megarl.algo.dapo import FILTER_GROUP_METRICS
from megarl.algo.kl_reward import KL_CTRL_TYPES
from megarl.algo.length_penalty import LENGTH_PENALTY_TYPES
from megarl.algo.losses import AGG_MODES, KL_PENALTY_KINDS
from megarl.algo.policy_losses import POLICY_LOSS_NAMES
from megarl.algo.rollout_correction import ROLLOUT_IS_LEVELS, ROLLOUT_RS_LEVELS, CorrectionSettings
from megarl.config.rollout import ROLLOUT_SLEEP_LEVELS
from megarl.config.schema import ConfigError, RunConfig, build_run_config
from megarl.config.trainer import LOGGER_NAMES
from megarl.engines.factory import ENGINE_NAMES
from megarl.planner.gates import OldLogProbMode
from megarl.planner.pruning import CRITIC_ESTIMATORS, PRUNE_SETTINGS


def test_defaults_build():
    cfg = build_run_config({})
    assert isinstance(cfg, RunConfig)
    assert cfg.dp == 1 and cfg.num_seqs_per_step == cfg.data.prompts_per_step * cfg.rollout.n


@pytest.mark.parametrize(
    ("tree", "needle"),
    [
        ({"actor": {"tpp": 2}}, "unknown config key actor.tpp"),
        ({"bogus": {}}, "unknown config key bogus"),
        ({"actor": {"tp": 0}}, "actor.tp=0"),
        ({"actor": {"tp": "two"}}, "actor.tp='two': expected an integer"),
        ({"actor": {"lr": -1.0}}, "actor.lr=-1.0"),
        ({"actor": {"moe_aux_loss_coef": -0.01}}, "actor.moe_aux_loss_coef=-0.01: must be"),
        ({"actor": {"moe_aux_loss_coef": float("nan")}}, "actor.moe_aux_loss_coef=nan"),
        ({"rollout": {"n": 1}}, "rollout.n=1"),
        ({"rollout": {"top_p": 1.5}}, "rollout.top_p=1.5"),
        ({"trainer": {"device": "tpu"}}, "trainer.device='tpu'"),
        ({"data": {"task": "jsonl"}}, "data.path must be set"),
        ({"actor": {"loss_agg": "mean"}}, "actor.loss_agg='mean'"),
        ({"actor": {"ppo_mini_batches": 3}}, "actor.ppo_mini_batches=3"),
        ({"actor": {"tp": 2}, "trainer": {"n_gpus_per_node": 3}}, "does not divide"),
        ({"trainer": {"nnodes": 2}}, "trainer.launcher=ray"),
        ({"planner": {"prune_zero_adv": "yes"}}, "planner.prune_zero_adv='yes'"),
        ({"trainer": {"log_console": "yes"}}, "trainer.log_console='yes': expected true or false"),
        ({"trainer": {"progress": "yes"}}, "trainer.progress='yes': must be auto, true or false"),
        ({"trainer": {"progress": 1}}, "trainer.progress=1: must be auto, true or false"),
        (
            {"trainer": {"progress": True, "logger": ["jsonl"]}},
            "trainer.progress=true needs console in trainer.logger",
        ),
    ],
)
def test_bad_values_name_the_key(tree, needle):
    assert needle in config_refusal(tree)


@pytest.mark.parametrize("value", ["auto", True, False])
def test_progress_takes_auto_or_a_boolean(value):
    assert build_run_config({}).trainer.progress == "auto"
    progress = build_run_config({"trainer": {"progress": value}}).trainer.progress
    assert progress == value and type(progress) is type(value)


def test_a_bad_progress_value_on_the_command_line_is_one_line_exit_2(tmp_path, capsys):
    from megarl.train import EXIT_BAD_INPUT, main

    run_dir = tmp_path / "run"
    assert main([f"trainer.run_dir={run_dir}", "trainer.progress=sometimes"]) == EXIT_BAD_INPUT
    assert capsys.readouterr().err == (
        "megarl-train: error: trainer.progress='sometimes': must be auto, true or false\n"
    )
    assert not run_dir.exists()


def test_dp_from_world_and_model_parallel():
    cfg = build_run_config({"actor": {"tp": 2, "pp": 2}, "trainer": {"n_gpus_per_node": 8}})
    assert cfg.dp == 2


def test_nested_optim_section_and_tuple_coercion():
    cfg = build_run_config(
        {"actor": {"optim": {"betas": [0.8, 0.9], "grad_clip": 0.5}}, "data": {"ops": ["+", "-"]}}
    )
    assert cfg.actor.optim.betas == (0.8, 0.9)
    assert cfg.data.ops == ("+", "-")


def test_reward_accepts_import_path():
    cfg = build_run_config({"data": {"reward": "my_pkg.rewards:score"}})
    assert cfg.data.reward == "my_pkg.rewards:score"  # imported when the run starts


def _main_keys_row(key: str) -> str:
    page = Path(__file__).resolve().parents[2] / "docs" / "getting-started.md"
    [row] = [line for line in page.read_text().splitlines() if line.startswith(f"| `{key}`")]
    return row


@pytest.mark.parametrize(
    ("key", "choices"),
    [
        ("rollout.engine", ENGINE_NAMES),
        ("rollout.sleep_level", ROLLOUT_SLEEP_LEVELS),
        ("algo.adv_estimator", (*ADVANTAGE_ESTIMATOR_NAMES, *CRITIC_ESTIMATORS)),
        ("actor.loss_agg", AGG_MODES),
        ("actor.kl_estimator", KL_PENALTY_KINDS),
        ("algo.kl_penalty", KL_PENALTY_KINDS),
        ("algo.kl_ctrl.type", KL_CTRL_TYPES),
        ("algo.length_penalty.type", LENGTH_PENALTY_TYPES),
        ("planner.prune_zero_adv", PRUNE_SETTINGS),
        ("actor.policy_loss", POLICY_LOSS_NAMES),
        ("algo.filter_groups.enable", FILTER_GROUP_METRICS),
        ("planner.old_log_prob", tuple(mode.value for mode in OldLogProbMode)),
        ("algo.rollout_correction.rollout_is", ROLLOUT_IS_LEVELS),
        ("algo.rollout_correction.rollout_rs", ROLLOUT_RS_LEVELS),
        ("trainer.logger", LOGGER_NAMES),
    ],
)
def test_main_keys_table_lists_every_choice(key, choices):
    """The main-keys table (docs/getting-started.md) names every value the schema accepts (the
    lists live in code)."""
    row = _main_keys_row(key)
    missing = [choice for choice in choices if f"`{choice}`" not in row]
    assert not missing, f"the main-keys row for {key} lacks {missing}"


RC = "algo.rollout_correction"


@pytest.mark.parametrize(
    ("section", "needle"),
    [
        (
            {"rollout_is": "geometric"},
            f"{RC}.rollout_is='geometric': must be one of token, sequence",
        ),
        ({"rollout_rs": "seq"}, f"{RC}.rollout_rs='seq'"),
        ({"rollout_is_threshold": 0.0}, f"{RC}.rollout_is_threshold=0.0"),
        ({"rollout_rs_threshold": "high"}, f"{RC}.rollout_rs_threshold='high'"),
        ({"rollout_rs": "token", "rollout_rs_threshold": 0.9}, f"{RC}.rollout_rs_threshold=0.9"),
        (
            {"rollout_rs": "token", "rollout_is_threshold": 0.5},
            f"{RC}.rollout_rs_threshold=None: the upper rejection bound (0.5) must be >= 1",
        ),
        (
            {"rollout_rs": "geometric", "rollout_rs_threshold_lower": 1.5},
            f"{RC}.rollout_rs_threshold_lower=1.5",
        ),
        ({"bogus": 1}, f"unknown config key {RC}.bogus"),
        (
            {"rollout_token_veto_threshold": 0},
            f"{RC}.rollout_token_veto_threshold=0: must be in (0, 1), or null (off)",
        ),
        ({"rollout_token_veto_threshold": 1.0}, f"{RC}.rollout_token_veto_threshold=1.0: must"),
        ({"rollout_token_veto_threshold": -1e-4}, f"{RC}.rollout_token_veto_threshold=-0.0001"),
        (
            {"rollout_token_veto_threshold": "1e-4"},
            f"{RC}.rollout_token_veto_threshold='1e-4': expected a number, or null",
        ),
        ({"rollout_token_veto_threshold": True}, f"{RC}.rollout_token_veto_threshold=True"),
    ],
)
def test_rollout_correction_bad_values_name_the_key(section, needle):
    assert needle in config_refusal({"algo": {"rollout_correction": section}})


def test_rollout_correction_defaults_off_and_resolves_bounds_as_verl():
    off = build_run_config({}).algo.rollout_correction
    assert not off.enabled and off.settings == CorrectionSettings()
    on = build_run_config(
        {"algo": {"rollout_correction": {"rollout_is": "token", "rollout_rs": "geometric"}}}
    ).algo.rollout_correction
    assert on.enabled
    assert on.settings == CorrectionSettings(
        rollout_is="token", is_threshold=2.0, rollout_rs="geometric", rs_upper=2.0, rs_lower=0.5
    )
    explicit = build_run_config(
        {"algo": {"rollout_correction": {"rollout_rs": "token", "rollout_rs_threshold": 4}}}
    ).algo.rollout_correction
    assert explicit.rs_bounds == (4.0, 0.25)


def test_rollout_token_veto_threshold_alone_turns_the_correction_on():
    """The veto changes the loss by itself, so it needs the trainer's own old log-probs too."""
    from megarl.config.planning import run_facts

    cfg = build_run_config({"algo": {"rollout_correction": {"rollout_token_veto_threshold": 1e-4}}})
    veto = cfg.algo.rollout_correction
    assert veto.enabled and run_facts(cfg).rollout_correction
    assert veto.settings == CorrectionSettings(veto_threshold=1e-4)
    assert build_run_config({}).algo.rollout_correction.settings.veto_threshold is None


def test_rollout_correction_reaches_the_gates():
    from megarl.config.planning import run_facts

    cfg = build_run_config({"algo": {"rollout_correction": {"rollout_rs": "sequence"}}})
    assert run_facts(cfg).rollout_correction
    assert not run_facts(build_run_config({})).rollout_correction


def test_loggers_default_to_console_jsonl_tensorboard_and_keep_their_order():
    assert build_run_config({}).trainer.logger == ("console", "jsonl", "tensorboard")
    cfg = build_run_config({"trainer": {"logger": ["wandb", "console", "wandb"]}})
    assert cfg.trainer.logger == ("wandb", "console")


def test_an_unknown_logger_is_one_line_listing_the_choices():
    with pytest.raises(ConfigError) as info:
        build_run_config({"trainer": {"logger": ["console", "mlflow"]}})
    assert str(info.value) == (
        "trainer.logger: unknown logger 'mlflow'; choose from console, jsonl, tensorboard, wandb"
    )
    with pytest.raises(ConfigError, match=r"^trainer.logger=7: expected a list$"):
        build_run_config({"trainer": {"logger": 7}})
    assert build_run_config({"trainer": {"logger": "wandb"}}).trainer.logger == ("wandb",)


@pytest.mark.parametrize(
    ("trainer", "loggers"),
    [
        ({"log_console": False}, ("jsonl", "tensorboard")),
        ({"tensorboard": False, "log_console": True}, ("console", "jsonl")),
        ({"logger": ["jsonl"], "tensorboard": True}, ("jsonl", "tensorboard")),
        ({"logger": ["jsonl"], "log_console": None}, ("jsonl",)),
    ],
)
def test_the_older_booleans_add_or_remove_their_logger(trainer, loggers):
    assert build_run_config({"trainer": trainer}).trainer.logger == loggers


def test_experiment_name_defaults_to_the_run_dirs_folder():
    assert (
        build_run_config({"trainer": {"run_dir": "runs/gsm8k-a"}}).trainer.experiment == "gsm8k-a"
    )
    named = build_run_config({"trainer": {"run_dir": "runs/x/", "experiment_name": "b"}})
    assert named.trainer.experiment == "b" and named.trainer.project_name == "megarl"
    with pytest.raises(ConfigError, match="trainer.project_name: empty"):
        build_run_config({"trainer": {"project_name": " "}})


def test_val_before_train_is_off_by_default_and_needs_validation_files():
    assert build_run_config({}).trainer.val_before_train is False
    no_held_out = {"val_before_train": True}, {"val_problems": 0}
    with pytest.raises(ConfigError, match=r"^trainer.val_before_train=true needs data.val_files"):
        build_run_config({"trainer": no_held_out[0], "data": no_held_out[1]})
    on_files = {"trainer": {"val_before_train": True}, "data": {"train_files": "t.jsonl"}}
    with pytest.raises(ConfigError, match=r"^trainer.val_before_train=true needs data.val_files"):
        build_run_config(on_files)
    arithmetic = build_run_config({"trainer": {"val_before_train": True}})
    assert arithmetic.data.val_problems == 32  # the built-in task's held-out problems
    cfg = build_run_config(
        {"trainer": {"val_before_train": True}, "data": {"val_files": "v.jsonl"}}
    )
    assert cfg.trainer.val_before_train


def test_gae_builds_a_critic_with_verls_keys_and_defaults():
    cfg = build_run_config({"algo": {"adv_estimator": "gae"}, "actor": {"ppo_mini_batches": 2}})
    assert cfg.algo.uses_critic
    assert (cfg.algo.gamma, cfg.algo.lam) == (1.0, 1.0)
    assert (cfg.critic.cliprange_value, cfg.critic.loss_agg) == (0.5, "token-mean")
    # null follows the actor
    assert (cfg.critic_ppo_mini_batches, cfg.critic_ppo_epochs) == (2, 1)
    assert not build_run_config({}).algo.uses_critic


@pytest.mark.parametrize(
    ("tree", "key"),
    [
        ({"algo": {"gamma": 1.5}}, "algo.gamma"),
        ({"algo": {"lam": -0.1}}, "algo.lam"),
        ({"critic": {"cliprange_value": 0.0}}, "critic.cliprange_value"),
        ({"critic": {"loss_agg": "sum"}}, "critic.loss_agg"),
        ({"critic": {"lr": 0.0}}, "critic.lr"),
        ({"critic": {"ppo_mini_batches": 3}}, "critic.ppo_mini_batches"),
    ],
)
def test_critic_and_gae_keys_are_validated(tree, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build_run_config(tree)


def test_critic_optimizer_errors_name_the_critics_key():
    with pytest.raises(ConfigError, match=r"^critic\.optim\.grad_clip=-1"):
        build_run_config({"algo": {"adv_estimator": "gae"}, "critic": {"optim": {"grad_clip": -1}}})
    with pytest.raises(ConfigError, match=r"^actor\.optim\.grad_clip=-1"):
        build_run_config({"actor": {"optim": {"grad_clip": -1}}})
    assert build_run_config({"critic": {"optim": {"eps": 1e-6}}}).critic.optim.eps == 1e-6


def test_moe_aux_loss_coef_defaults_off_and_turns_pruning_off():
    """The planner rule, read from the config as every rank and the start-up check read it."""
    from megarl.config.planning import planner_inputs, prune_mode

    assert build_run_config({}).actor.moe_aux_loss_coef == 0.0
    assert prune_mode(build_run_config({}))[0] == "match_loss_curve"
    cfg = build_run_config({"actor": {"moe_aux_loss_coef": 0.01}})
    mode, reason = prune_mode(cfg)
    assert mode == "off" and "actor.moe_aux_loss_coef=0.01" in reason
    inputs = planner_inputs(cfg, [10, 10], [5, 5], [0.0, 0.0], [0, 0])
    assert inputs.loss_terms.moe_aux_loss_coef == 0.01 and inputs.mode == "off"


def test_one_sample_per_prompt_is_judged_by_the_estimator():
    """A group baseline needs a group; a critic (PPO's usual setting) or a batch baseline
    does not."""
    for estimator in ("gae", "reinforce_plus_plus"):
        cfg = build_run_config({"algo": {"adv_estimator": estimator}, "rollout": {"n": 1}})
        assert cfg.rollout.n == 1
    for estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        with pytest.raises(ConfigError) as refused:
            build_run_config({"algo": {"adv_estimator": estimator}, "rollout": {"n": 1}})
        assert str(refused.value).startswith(
            f"rollout.n=1: algo.adv_estimator={estimator} compares the samples"
        )


def test_batch_invariant_defaults_off_and_needs_the_megatron_engine():
    assert build_run_config({}).rollout.batch_invariant is False
    for engine in ("hf", "vllm"):
        with pytest.raises(ConfigError) as info:
            build_run_config({"rollout": {"engine": engine, "batch_invariant": True}})
        message = str(info.value)
        assert "rollout.batch_invariant=true needs rollout.engine=megatron" in message
        assert f"engine={engine}" in message and "\n" not in message
    on = build_run_config({"rollout": {"engine": "megatron", "batch_invariant": True}})
    assert on.rollout.batch_invariant is True
    with pytest.raises(ConfigError) as info:
        build_run_config(
            {
                "rollout": {"engine": "megatron", "batch_invariant": True},
                "actor": {"pp": 2},
                "trainer": {"n_gpus_per_node": 2},
            }
        )
    assert str(info.value).startswith("rollout.batch_invariant=true with actor.pp=2")


SPLIT_TREE = {"rollout": {"n_gpus": 1}, "trainer": {"launcher": "ray"}}


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        (
            {"actor": {"pp": 2, "vpp": 2}, "trainer": {"n_gpus_per_node": 2}},
            "rollout.engine=megatron colocated runs one model chunk per rank: actor.vpp=2",
        ),
        (
            {**SPLIT_TREE, "rollout": {"n_gpus": 1, "batch_invariant": True}},
            "rollout.batch_invariant=true with rollout.n_gpus=1: the rollout side's copy",
        ),
        (
            {**SPLIT_TREE, "rollout": {"n_gpus": 1, "tp": 2}},
            "on the rollout side (rollout.n_gpus=1) runs its copy at TP=1: rollout.tp=2",
        ),
    ],
)
def test_the_megatron_engine_refuses_what_it_cannot_serve_in_one_line(tree, message):
    tree = {**tree, "rollout": {"engine": "megatron", **tree.get("rollout", {})}}
    with pytest.raises(ConfigError) as refused:
        build_run_config(tree)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert build_run_config({"rollout": {"engine": "megatron"}}).rollout.engine == "megatron"


@pytest.mark.parametrize(
    "extra",
    [{}, {"async_training": {"mode": "fully_async"}}, {"async_training": {"mode": "one_step_off"}}],
    ids=["split-sync", "fully_async", "one_step_off"],
)
def test_the_megatron_engine_runs_on_the_rollout_side_as_a_copy(extra):
    """Split placement and the asynchronous modes are served by a rollout-side copy: accepted,
    and it is not the actor's model (the gates sync it); colocated it is."""
    cfg = build_run_config({**SPLIT_TREE, **extra, "rollout": {"engine": "megatron", "n_gpus": 1}})
    assert cfg.rollout.engine == "megatron" and not cfg.rollout.engine_is_actor
    assert build_run_config({"rollout": {"engine": "megatron"}}).rollout.engine_is_actor
    assert not build_run_config({}).rollout.engine_is_actor
    assert cfg.rollout.takes_megatron_layout  # the copy is fed whole Megatron parameters
    assert not build_run_config({}).rollout.takes_megatron_layout
