"""The project's rule for bad config, as the config tests check it: one line, naming the key."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from megarl.config.schema import ConfigError, build_run_config


def config_refusal(tree: Mapping[str, Any]) -> str:
    """The message ``build_run_config(tree)`` refuses ``tree`` with, checked to be one line."""
    with pytest.raises(ConfigError) as refused:
        build_run_config(dict(tree))
    message = str(refused.value)
    assert "\n" not in message, message
    return message
