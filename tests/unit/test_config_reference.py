"""docs/configuration.md is what tools/gen_config_reference.py writes from the typed schema, and
it documents every key: the schema's docstrings are the configuration's one documentation."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from megarl.algo.advantages import ADVANTAGE_ESTIMATOR_NAMES
from megarl.config.schema import RunConfig
from megarl.config.trainer import LOGGER_NAMES
from megarl.engines.factory import ENGINE_NAMES
from megarl.planner.pruning import CRITIC_ESTIMATORS

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "gen_config_reference.py"
PAGE = REPO / "docs" / "configuration.md"


@pytest.fixture(scope="module")
def tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_config_reference", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def leaf_keys(cls: type = RunConfig, prefix: str = "") -> list[str]:
    """Every settable key of the schema, dotted, walked here independently of the tool."""
    keys: list[str] = []
    for fld in dataclasses.fields(cls):
        factory = fld.default_factory
        if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory):
            keys += leaf_keys(factory, f"{prefix}{fld.name}.")  # pyright: ignore[reportArgumentType]
        else:
            keys.append(prefix + fld.name)
    return keys


def test_the_committed_page_is_what_the_tool_writes(tool):
    assert PAGE.read_text() == tool.render(), (
        "docs/configuration.md is stale: run python tools/gen_config_reference.py"
    )


def test_every_key_of_the_schema_has_a_row(tool):
    page = PAGE.read_text()
    keys = leaf_keys()
    assert len(keys) > 100 and sorted(keys) == sorted(tool.all_keys())
    missing = [key for key in keys if f"\n| `{key}` | " not in page]
    assert not missing, f"keys without a row in docs/configuration.md: {missing}"


def test_every_key_and_section_is_documented(tool):
    """A field added without an attribute docstring would get an empty description."""
    sections = list(tool.sections())
    undocumented = [key.name for s in sections for key in s.keys if not key.doc.strip()]
    assert not undocumented, f"fields without a docstring in the schema: {undocumented}"
    no_intro = [s.name for s in sections if not s.intro]
    assert not no_intro, f"sections without a class docstring: {no_intro}"


def _row(page: str, key: str) -> list[str]:
    [line] = [line for line in page.splitlines() if line.startswith(f"| `{key}` |")]
    return [cell.strip() for cell in line.replace("\\|", "\x00").split("|")[1:-1]]


@pytest.mark.parametrize(
    ("key", "type_", "default"),
    [
        ("actor.lr", "`float`", "`1.0e-06` (*config.yaml:* `1.0e-05`)"),
        ("rollout.max_model_len", "`int | None`", "`null`"),
        ("model.dtype", "`auto | float32 | bfloat16`", "`auto`"),
        ("data.task", "`auto | arithmetic | jsonl | files`", "`auto`"),
        ("rollout.sleep_level", "`0 | 1 | 2`", "`0`"),
        ("trainer.progress", "`auto | true | false`", "`auto`"),
        ("actor.optim.betas", "`[float, float]`", "`[0.9, 0.999]`"),
        ("data.ops", "`list[+ | - | *]`", "`[+]`"),
        ("critic.optim.eps", "`float`", "`1.0e-08`"),
        ("rollout.agent.tool_timeout_s", "`float`", "`30.0`"),
    ],
)
def test_types_and_defaults_read_as_yaml(key, type_, default):
    row = [cell.replace("\x00", "|") for cell in _row(PAGE.read_text(), key)]
    assert row[1:3] == [type_, default]


@pytest.mark.parametrize(
    ("key", "choices"),
    [
        ("rollout.engine", ENGINE_NAMES),
        ("algo.adv_estimator", (*ADVANTAGE_ESTIMATOR_NAMES, *CRITIC_ESTIMATORS)),
        ("trainer.logger", LOGGER_NAMES),
    ],
)
def test_choices_are_the_lists_the_code_validates_against(key, choices):
    type_ = _row(PAGE.read_text(), key)[1]
    listed = type_.strip("`").removeprefix("list[").removesuffix("]").split("\x00")
    assert [choice.strip() for choice in listed] == list(choices)


def test_check_mode_flags_a_stale_page(tool, tmp_path, capsys):
    assert tool.main(["--check"]) == 0
    stale = tmp_path / "configuration.md"
    stale.write_text(PAGE.read_text().replace("| `actor.lr` |", "| `actor.learning_rate` |"))
    assert tool.main(["--check", "--out", str(stale)]) == 1
    assert "stale; run python tools/gen_config_reference.py" in capsys.readouterr().err
