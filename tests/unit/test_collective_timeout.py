"""``trainer.collective_timeout_s``: validated up front, and what the process group is given."""

from __future__ import annotations

import pytest

from megarl.config.schema import ConfigError, build_run_config


def test_default_and_override():
    assert build_run_config({}).trainer.collective_timeout_s == 600.0
    cfg = build_run_config({"trainer": {"collective_timeout_s": 15}})
    assert cfg.trainer.collective_timeout_s == 15.0


@pytest.mark.parametrize("value", [0, -5, "soon"])
def test_bad_timeout_names_the_key(value):
    with pytest.raises(ConfigError) as info:
        build_run_config({"trainer": {"collective_timeout_s": value}})
    assert str(info.value).startswith("trainer.collective_timeout_s=")
    assert "\n" not in str(info.value)
