"""Every config key that megarl's messages name exists in the schema.

Advice that names a key the user cannot set ("set planner.mode=off" when the key is
``planner.prune_zero_adv``) sends them looking for something that is not there. The messages
are read from the source: every string literal in ``megarl/`` (f-string parts included), so a
message counts whether or not a test can reach the situation that raises it.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from megarl.config.schema import RunConfig

PACKAGE = Path(__file__).resolve().parents[2] / "megarl"

SECTIONS = tuple(f.name for f in dataclasses.fields(RunConfig))

KEY_LIKE = re.compile(rf"(?<![\w./-])(?:{'|'.join(SECTIONS)})(?:\.[A-Za-z_]\w*)+")
"""``actor.optim.grad_clip``: a section name, then dotted names (not inside a path or a word)."""

NOT_CONFIG_KEYS = frozenset(
    {
        "model.safetensors",
        "model.gguf",
        "model.safetensors.index.json",
        "model.layers",
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.generate",
        "model.load_weights",
    }
)
"""Hugging Face file names, parameter names and method calls that also start with ``model.``."""


def schema_keys(cls: type = RunConfig, prefix: str = "") -> set[str]:
    """Every dotted key of the schema, sections included (``actor``, ``actor.optim``, ...)."""
    keys: set[str] = set()
    for fld in dataclasses.fields(cls):
        key = prefix + fld.name
        keys.add(key)
        factory = fld.default_factory
        if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory):
            keys |= schema_keys(factory, key + ".")  # pyright: ignore[reportArgumentType]
    return keys


def unknown_keys(text: str, known: set[str]) -> list[str]:
    return [k for k in KEY_LIKE.findall(text) if k not in known and k not in NOT_CONFIG_KEYS]


def _string_literals(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]


def test_the_scan_finds_a_key_that_does_not_exist():
    known = schema_keys()
    assert unknown_keys("set planner.mode='off' or actor.optim.grad_clip=0", known) == [
        "planner.mode"
    ]
    assert unknown_keys("see data/foo.data.path and metadata.model", known) == []


def test_every_key_named_in_a_message_exists():
    known = schema_keys()
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {key}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, text in _string_literals(path)
        for key in unknown_keys(text, known)
    ]
    assert not found, "keys that are not in the schema:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "tree",
    [
        {"actor": {"tpp": 1}},
        {"actor": {"optim": {"grad_clip": -1.0}}},
        {"rollout": {"max_model_len": 8, "max_new_tokens": 16}},
        {"rollout": {"n_gpus": 1}},
        {"trainer": {"nnodes": 2}},
        {"data": {"prompts_per_step": 3}, "actor": {"ppo_mini_batches": 5}},
        {"actor": {"tp": 3}, "trainer": {"n_gpus_per_node": 2}},
    ],
)
def test_keys_in_reachable_schema_messages_exist(tree):
    """The assembled messages too (a key can be built from parts, e.g. ``{prefix}{name}``)."""
    from megarl.config.schema import ConfigError, build_run_config

    with pytest.raises(ConfigError) as info:
        build_run_config(tree)
    message = str(info.value)
    assert KEY_LIKE.search(message), message
    known = schema_keys()
    bad = [k for k in unknown_keys(message, known) if k != "actor.tpp"]  # the user's typo
    assert not bad, message


DOCS = [PACKAGE.parent / "README.md", *sorted((PACKAGE.parent / "docs").glob("*.md"))]


def test_every_key_named_in_the_docs_exists():
    """The README and every page of docs/ name only keys a user can set (a renamed key must be
    renamed there too)."""
    known = schema_keys()
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{number}: {key}"
        for path in DOCS
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        for key in unknown_keys(line, known)
    ]
    assert not found, "keys that are not in the schema:\n" + "\n".join(found)
