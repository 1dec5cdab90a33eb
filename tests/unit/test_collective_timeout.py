"""``trainer.collective_timeout_s``: validated up front, and what the process group is given."""

from __future__ import annotations

import pytest
from helpers.config import config_refusal

from megarl.config.schema import build_run_config


def test_default_and_override():
    assert build_run_config({}).trainer.collective_timeout_s == 600.0
    cfg = build_run_config({"trainer": {"collective_timeout_s": 15}})
    assert cfg.trainer.collective_timeout_s == 15.0


@pytest.mark.parametrize("value", [0, -5, "soon"])
def test_bad_timeout_names_the_key(value):
    refusal = config_refusal({"trainer": {"collective_timeout_s": value}})
    assert refusal.startswith("trainer.collective_timeout_s=")
