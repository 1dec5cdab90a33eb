"""The logprob guard's decision (pure): thresholds by engine and dtype, the verdict and its line."""

from __future__ import annotations

import math

import pytest

from megarl.config.checks import ConfigError
from megarl.config.rollout import RolloutConfig
from megarl.config.schema import build_run_config
from megarl.errors import EXIT_RUNTIME
from megarl.export.checksum import checksums_digest
from megarl.planner.logprob_guard import (
    DEFAULT_MAX_LOGPROB_DIFF,
    FALLBACK_MAX_LOGPROB_DIFF,
    PROBE_SAMPLES,
    LogprobCheck,
    LogprobGuardError,
    SyncRecord,
    decide_logprob_guard,
    default_max_logprob_diff,
    probe_micro_batches,
    resolve_max_logprob_diff,
)

SYNC = SyncRecord("full weights", 4, 269_060_096, "0123456789abcdef")


def test_defaults_by_engine_and_dtype_and_the_fallback_for_an_unnamed_engine() -> None:
    assert default_max_logprob_diff("hf", "float32") == DEFAULT_MAX_LOGPROB_DIFF[("hf", "float32")]
    assert (
        default_max_logprob_diff("vllm", "bfloat16")
        == DEFAULT_MAX_LOGPROB_DIFF[("vllm", "bfloat16")]
    )
    # an engine the table does not name (one merged later) is guarded by its dtype's fallback
    assert default_max_logprob_diff("megatron", "float32") == FALLBACK_MAX_LOGPROB_DIFF["float32"]
    assert default_max_logprob_diff("megatron", "bfloat16") == FALLBACK_MAX_LOGPROB_DIFF["bfloat16"]
    for engine in ("hf", "vllm"):  # bf16 rounds more than fp32
        bf16, fp32 = (DEFAULT_MAX_LOGPROB_DIFF[(engine, d)] for d in ("bfloat16", "float32"))
        assert bf16 > fp32


def test_setting_resolves_auto_a_number_and_off() -> None:
    assert resolve_max_logprob_diff("auto", "hf", "float32") == 1e-3
    assert resolve_max_logprob_diff(0.2, "hf", "float32") == 0.2
    assert resolve_max_logprob_diff(None, "vllm", "bfloat16") is None


def test_within_the_threshold_goes_on() -> None:
    verdict = decide_logprob_guard(LogprobCheck("step 5", 2e-5, 300), 1e-3, "hf", SYNC)
    assert not verdict.stop
    assert verdict.line == "step 5: 2.0e-05 <= 1e-03"


def test_exactly_at_the_threshold_goes_on_above_it_stops() -> None:
    assert not decide_logprob_guard(LogprobCheck("step 1", 1e-3, 10), 1e-3, "hf", SYNC).stop
    assert decide_logprob_guard(LogprobCheck("step 1", 1.0001e-3, 10), 1e-3, "hf", SYNC).stop


def test_the_stop_line_names_engine_sync_and_diff() -> None:
    verdict = decide_logprob_guard(
        LogprobCheck("step 5", 0.25, 352), 1e-3, "vllm", SYNC, consequence="not applied"
    )
    assert verdict.stop
    assert verdict.line == (
        "rollout engine vllm does not run the trainer's weights: at step 5 its logprobs differ "
        "from the trainer's by 2.50e-01 on average over 352 tokens "
        "(rollout.max_logprob_diff=1e-03); last weight sync: full weights after step 4, "
        "256.6 MiB, checksum 0123456789abcdef (matched the engine's); not applied"
    )
    assert "\n" not in verdict.line


def test_a_sync_without_checksum_and_the_start_are_named_as_such() -> None:
    unchecked = SyncRecord("LoRA adapter", 3)
    start = SyncRecord("the model's own weights", 0)
    assert (
        unchecked.describe()
        == "LoRA adapter after step 3, no checksum taken (export.checksum_interval)"
    )
    assert start.describe().startswith("the model's own weights at start")
    line = decide_logprob_guard(LogprobCheck("x", 1.0, 1), 1e-3, "hf", None).line
    assert line.endswith("last weight sync: none recorded")


def test_not_a_number_stops_and_nothing_compared_or_off_goes_on() -> None:
    assert decide_logprob_guard(LogprobCheck("step 2", math.nan, 10), 1e-3, "hf", SYNC).stop
    assert decide_logprob_guard(LogprobCheck("step 2", math.inf, 10), 1e-3, "hf", SYNC).stop
    # a ghost step (every sequence pruned) compares nothing: no evidence either way
    assert not decide_logprob_guard(LogprobCheck("step 2", 0.0, 0), 1e-3, "hf", SYNC).stop
    assert not decide_logprob_guard(LogprobCheck("step 2", 5.0, 10), None, "hf", SYNC).stop


def test_the_error_is_one_line_and_exit_1() -> None:
    error = LogprobGuardError("a\nb")
    assert str(error) == "a b" and error.exit_code == EXIT_RUNTIME


@pytest.mark.parametrize("value", ["auto", None, 0.05, 1])
def test_config_accepts_auto_a_positive_number_or_null(value) -> None:
    assert RolloutConfig(max_logprob_diff=value).max_logprob_diff == value
    cfg = build_run_config({"rollout": {"max_logprob_diff": value}})
    assert cfg.rollout.max_logprob_diff == value


@pytest.mark.parametrize("value", [0, -1e-3, "often", True])
def test_config_refuses_other_values_in_one_line(value) -> None:
    with pytest.raises(ConfigError, match=r"^rollout\.max_logprob_diff=.*must be a number > 0"):
        RolloutConfig(max_logprob_diff=value)


def test_config_refuses_nan() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.max_logprob_diff=nan: must be a finite"):
        build_run_config({"rollout": {"max_logprob_diff": math.nan}})


def test_checksum_digest_depends_on_every_tensor_and_not_on_order() -> None:
    a = {"x": (1, 2), "y": (3, 4)}
    assert checksums_digest(a) == checksums_digest(dict(reversed(list(a.items()))))
    assert checksums_digest(a) != checksums_digest({"x": (1, 2), "y": (3, 5)})
    assert len(checksums_digest(a)) == 16


@pytest.mark.parametrize(
    ("section", "step_check", "probed"),
    [
        ({}, True, True),
        ({"actor": {"lora": {"rank": 4, "alpha": 8, "dropout": 0.1}}}, False, True),
        ({"rollout": {"engine": "megatron"}}, True, False),
        (
            {"rollout": {"engine": "megatron", "n_gpus": 1}, "trainer": {"launcher": "ray"}},
            True,
            True,
        ),
        (
            {
                "rollout": {"engine": "megatron", "n_gpus": 1},
                "trainer": {"launcher": "ray"},
                "async_training": {"mode": "fully_async"},
            },
            True,
            False,
        ),
    ],
    ids=["plain", "lora_dropout", "megatron_engine", "megatron_rollout_side", "megatron_async"],
)
def test_what_the_guard_checks_follows_the_run(section, step_check, probed) -> None:
    """Dropout makes the training forward differ from any engine by design, so the step check
    is off with LoRA dropout (the probes, scored without dropout, still run); the colocated
    Megatron engine is the actor's own model, so there is no copy to probe, while on the rollout
    side it is a copy, probed as any engine in the synchronous loop (the asynchronous loop
    generates while the trainer trains: no probe there, for any engine)."""
    from megarl.trainer.engine_guard import build_engine_guard

    guard = build_engine_guard(build_run_config(section), "float32", sleep_level=1)
    assert guard is not None and guard.threshold == 1e-3
    assert guard.step_check is step_check
    assert guard.probe_on is probed and guard.probe_after_wake is probed


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
def test_the_probe_fills_one_micro_batch_per_pipeline_stage(pp) -> None:
    micro_batches = probe_micro_batches(pp)
    samples = [i for mb in micro_batches for i in mb]
    assert len(micro_batches) == pp  # one without a pipeline; as many as an interleaved one needs
    assert len({len(mb) for mb in micro_batches}) == 1
    assert samples == list(range(len(samples)))  # every sample scored once, in order
    assert PROBE_SAMPLES <= len(samples) < PROBE_SAMPLES + pp
