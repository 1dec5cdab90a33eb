#!/usr/bin/env python
"""Write docs/configuration.md, the configuration reference, from the typed schema.

python tools/gen_config_reference.py            # (re)write docs/configuration.md
python tools/gen_config_reference.py --check    # exit 1 if the committed page is stale
make docs                                       # the same as the first

The schema (:class:`megarl.config.schema.RunConfig` in megarl/config/schema.py and the
sections it nests, wherever they are defined: the section modules of megarl/config/, and
``rollout.agent`` in megarl/agent/loop.py) is the one source: every key's dotted name, type and
default come from the dataclasses, its description from the attribute docstring that follows
the field in the source of the class that declares it (read with :mod:`ast`: attribute
docstrings do not exist at run time), a section's introduction from its class docstring (and
the docstring of the field that holds it). A string key's choices are read from its section's
validation, the ``_choice(key, value, CHOICES)`` calls (and ``value in CHOICES`` tests) of its
methods, with ``CHOICES`` evaluated in the module that defines the method (a section and the
section it inherits from may live in different modules), so the page lists what the code
accepts. Where ``configs/config.yaml`` (what ``megarl-train`` starts from) sets another value
than the schema's default, the page says so.

The output depends only on the source tree: the same checkout always writes the same bytes.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import re
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # this checkout's megarl, whatever is installed

import yaml  # noqa: E402

from megarl.config import schema  # noqa: E402

PAGE = REPO / "docs" / "configuration.md"
RUN_CONFIG = REPO / "configs" / "config.yaml"
REGENERATE = "python tools/gen_config_reference.py"


@dataclass(frozen=True)
class Key:
    """One leaf setting, as the page shows it."""

    name: str
    """Dotted name, ``actor.optim.grad_clip``."""
    type: str
    default: str
    """The schema's default, as YAML writes it."""
    run_default: str | None
    """``configs/config.yaml``'s value where it differs from the schema's default, else None."""
    doc: str


@dataclass(frozen=True)
class Section:
    name: str
    """Dotted name, ``actor.optim``."""
    intro: tuple[str, ...]
    keys: tuple[Key, ...]
    subsections: tuple[str, ...]


# --- reading the source ---------------------------------------------------------------------


@functools.cache
def _module_tree(path: str) -> ast.Module:
    return ast.parse(Path(path).read_text(), filename=path)


def _class_def(cls: type) -> ast.ClassDef:
    path = inspect.getsourcefile(cls)
    assert path is not None, f"{cls.__qualname__}: no source file"
    for node in _module_tree(path).body:
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return node
    raise LookupError(f"{cls.__qualname__}: no top-level class of that name in {path}")


def _own_classes(cls: type) -> list[type]:
    """``cls`` and the dataclasses it inherits fields from, base first."""
    return [base for base in reversed(cls.__mro__) if dataclasses.is_dataclass(base)]


def _string(node: ast.stmt) -> str | None:
    if (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    ):
        return node.value.value
    return None


def attribute_docs(cls: type) -> dict[str, str]:
    """Each field's attribute docstring (the string literal right after it), inherited too."""
    docs: dict[str, str] = {}
    for base in _own_classes(cls):
        body = _class_def(base).body
        for node, after in zip(body, [*body[1:], None], strict=True):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and after is not None
                and (doc := _string(after)) is not None
            ):
                docs[node.target.id] = doc
    return docs


def field_annotations(cls: type) -> dict[str, ast.expr]:
    """Each field's annotation as written (the source's spelling, not a runtime object)."""
    found: dict[str, ast.expr] = {}
    for base in _own_classes(cls):
        for node in _class_def(base).body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                found[node.target.id] = node.annotation
    return found


def class_doc(cls: type) -> str | None:
    """The class's own docstring as written (a dataclass without one gets a generated one)."""
    return ast.get_docstring(_class_def(cls), clean=True)


# --- choices from the validation ------------------------------------------------------------


def _self_field(node: ast.expr) -> str | None:
    """``self.name`` (also inside ``str(...)``) -> ``name``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) == 1:
        node = node.args[0]
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    ):
        return node.attr
    return None


def _is_property(func: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "property" for d in func.decorator_list)


def _local_values(func: ast.FunctionDef, namespace: dict[str, Any]) -> dict[str, Any]:
    """Names a method binds to constants (``known = ("a", "b")``), for the choices that use them."""
    values: dict[str, Any] = {}
    for node in ast.walk(func):
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
        ):
            try:
                values[node.targets[0].id] = _evaluate(node.value, {**namespace, **values})
            except Exception:  # noqa: BLE001 - only constants matter; anything else is skipped
                continue
    return values


def _evaluate(node: ast.expr, namespace: dict[str, Any]) -> Any:
    code = compile(ast.Expression(body=node), "<choices>", "eval")
    return eval(code, dict(namespace))


def _loop_fields(func: ast.FunctionDef) -> dict[str, str]:
    """``for name in self.field:`` -> {``name``: ``field``} (a list's items are checked there)."""
    return {
        node.target.id: field
        for node in ast.walk(func)
        if isinstance(node, ast.For)
        and isinstance(node.target, ast.Name)
        and (field := _self_field(node.iter)) is not None
    }


def _open_ended(func: ast.FunctionDef, call: ast.Call, field: str) -> bool:
    """The check sits under an ``if`` on the field itself (``if ":" not in self.reward``): the
    key takes other values too, which the listed choices do not cover."""
    return any(
        isinstance(node, ast.If)
        and any(call is inner for inner in ast.walk(node))
        and any(
            isinstance(part, ast.expr) and _self_field(part) == field
            for part in ast.walk(node.test)
        )
        for node in ast.walk(func)
    )


def choices(cls: type) -> dict[str, tuple[tuple[Any, ...], bool]]:
    """Each field's accepted values, and whether others are accepted too, as its section's
    methods (not its properties) check them: ``_choice(key, self.field, CHOICES)``,
    ``_optional_choice(...)``, ``self.field in CHOICES``, or the same for each item of a list
    field (``for op in self.ops: _choice(..., op, CHOICES)``). Each method's names are looked
    up in its own class's module (``critic.optim`` inherits ``actor.optim``'s checks)."""
    found: dict[str, tuple[tuple[Any, ...], bool]] = {}
    for base in _own_classes(cls):
        namespace = vars(sys.modules[base.__module__])
        for func in _class_def(base).body:
            if not isinstance(func, ast.FunctionDef) or _is_property(func):
                continue
            local = {**namespace, **_local_values(func, namespace)}
            loops = _loop_fields(func)
            for node in ast.walk(func):
                target: ast.expr | None = None
                options: ast.expr | None = None
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id in ("_choice", "_optional_choice")
                    and len(node.args) == 3
                ):
                    target, options = node.args[1], node.args[2]
                elif (
                    isinstance(node, ast.Compare)
                    and len(node.ops) == 1
                    and isinstance(node.ops[0], ast.In)
                ):
                    target, options = node.left, node.comparators[0]
                if target is None or options is None:
                    continue
                field = _self_field(target)
                if field is None and isinstance(target, ast.Name):
                    field = loops.get(target.id)
                if field is None or field in found:
                    continue
                try:
                    values = tuple(_evaluate(options, local))
                except Exception:  # noqa: BLE001 - not a constant list: the type alone is shown
                    continue
                open_ended = isinstance(node, ast.Call) and _open_ended(func, node, field)
                found[field] = (values, open_ended)
    return found


# --- rendering values and types -------------------------------------------------------------


def yaml_value(value: Any) -> str:
    """``value`` as YAML writes it (flow style: ``[0.9, 0.999]``, ``1.0e-06``, ``null``)."""
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, Mapping):
        value = dict(value)
    text = yaml.safe_dump(value, default_flow_style=True, width=1000)
    return text.removesuffix("\n...\n").strip()


def _type_text(node: ast.expr, element_choices: str | None, key: str) -> str:
    """A readable type: ``float``, ``int | None``, ``list[str]``; a string's (or an int's)
    choices in place of ``str`` (``int``) where the schema knows them."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        parts = [
            _type_text(node.left, element_choices, key),
            _type_text(node.right, element_choices, key),
        ]
        return " | ".join(dict.fromkeys(" | ".join(parts).split(" | ")))
    if isinstance(node, ast.Constant) and node.value is None:
        return "None"
    if isinstance(node, ast.Name):
        if node.id in ("str", "int") and element_choices is not None:
            return element_choices
        return node.id
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
        args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if node.value.id == "tuple":
            if len(args) == 2 and isinstance(args[1], ast.Constant) and args[1].value is ...:
                return f"list[{_type_text(args[0], element_choices, key)}]"
            return "[" + ", ".join(_type_text(arg, None, key) for arg in args) + "]"
        if node.value.id in ("Mapping", "dict"):
            return "mapping"
    return ast.unparse(node)


def type_text(
    key: str, annotation: ast.expr, accepted: tuple[tuple[Any, ...], bool] | None, default: Any
) -> str:
    if key in schema.AUTO_OR_BOOL:
        return "auto | true | false"
    element_choices = None
    if accepted is not None:
        values, open_ended = accepted
        # The default is accepted by definition (``auto`` that construction resolves).
        if (
            isinstance(default, str | int)
            and not isinstance(default, bool)
            and default not in values
        ):
            values = (default, *values)
        listed = [str(v) for v in values if v is not None]
        if open_ended:
            listed.append("str")
        element_choices = " | ".join(listed)
    return _type_text(annotation, element_choices, key)


# --- markdown -------------------------------------------------------------------------------

_ROLE = re.compile(r":(?:mod|func|data|class|meth|attr|obj|exc):`~?([^`]+)`")
_CODE = re.compile(r"``(.+?)``")
_SPANS = re.compile(r"(`[^`]*`)")
_TAG = re.compile(r"<(?=[A-Za-z/!?])")


def _role(match: re.Match[str]) -> str:
    whole = match.group(0)
    target = match.group(1)
    if ":`~" in whole:
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


def markdown(doc: str) -> str:
    """A docstring as one markdown paragraph: reST roles and ``literals`` as code spans."""
    text = " ".join(doc.split())
    text = _ROLE.sub(_role, text)
    return _CODE.sub(lambda m: f"`{m.group(1)}`", text)


def cell(text: str) -> str:
    """Text for a table cell: ``|`` escaped everywhere (code spans too, as GFM tables need),
    ``<`` escaped outside code spans where it would start an HTML tag."""
    parts = _SPANS.split(text)
    out = [part if index % 2 else _TAG.sub("&lt;", part) for index, part in enumerate(parts)]
    return "".join(out).replace("|", "\\|")


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading (lower case, punctuation but ``-`` and ``_`` dropped)."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


# --- the sections ---------------------------------------------------------------------------


def _section_class(fld: dataclasses.Field[Any]) -> type | None:
    factory = fld.default_factory
    if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory):
        return factory  # type: ignore[return-value]
    return None


def _default(fld: dataclasses.Field[Any]) -> Any:
    if fld.default is not dataclasses.MISSING:
        return fld.default
    assert fld.default_factory is not dataclasses.MISSING, f"{fld.name}: no default"
    return fld.default_factory()


@functools.cache
def _run_tree() -> dict[str, Any]:
    """configs/config.yaml with the model default it names (``defaults: - model: NAME``)."""
    tree = yaml.safe_load(RUN_CONFIG.read_text()) or {}
    for entry in tree.pop("defaults", []) or []:
        if isinstance(entry, dict) and entry.get("model"):
            model_file = RUN_CONFIG.parent / "model" / f"{entry['model']}.yaml"
            tree.setdefault("model", {}).update(yaml.safe_load(model_file.read_text()) or {})
    return tree


_MISSING = object()


def _run_value(key: str) -> Any:
    node: Any = _run_tree()
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _same(default: Any, value: Any) -> bool:
    if isinstance(default, tuple) and isinstance(value, list):
        value = tuple(value)
    if isinstance(default, float) and isinstance(value, str):
        try:  # YAML 1.1 reads 1e-5 (no dot) as a string; OmegaConf reads it as a number
            value = float(value)
        except ValueError:
            return False
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    return type(default) is type(value) and default == value


def sections(cls: type = schema.RunConfig, prefix: str = "") -> Iterator[Section]:
    """Every section under ``cls`` in field order, each followed by its own subsections."""
    docs = attribute_docs(cls)
    for fld in dataclasses.fields(cls):
        sub = _section_class(fld)
        if sub is None:
            continue
        name = f"{prefix}{fld.name}"
        intro = tuple(markdown(doc) for doc in (docs.get(fld.name), class_doc(sub)) if doc)
        yield _section(sub, name, intro)
        yield from sections(sub, name + ".")


def _section(cls: type, name: str, intro: tuple[str, ...]) -> Section:
    docs = attribute_docs(cls)
    hints = field_annotations(cls)
    accepted = choices(cls)
    keys: list[Key] = []
    subsections: list[str] = []
    for fld in dataclasses.fields(cls):
        key = f"{name}.{fld.name}"
        if _section_class(fld) is not None:
            subsections.append(key)
            continue
        default = _default(fld)
        run = _run_value(key)
        run_default = None
        if run is not _MISSING and not _same(default, run):
            run_default = yaml_value(run)
        keys.append(
            Key(
                name=key,
                type=type_text(key, hints[fld.name], accepted.get(fld.name), default),
                default=yaml_value(default),
                run_default=run_default,
                doc=markdown(docs.get(fld.name, "")),
            )
        )
    return Section(name, intro, tuple(keys), tuple(subsections))


def _code(text: str) -> str:
    return f"`{text}`"


def render() -> str:
    """The whole page."""
    all_sections = list(sections())
    count = sum(len(s.keys) for s in all_sections)
    lines = [
        "<!-- Generated by tools/gen_config_reference.py from megarl/config/schema.py: do not",
        f"     edit by hand. Regenerate with `{REGENERATE}` (or `make docs`). -->",
        "",
        "# Configuration reference",
        "",
        f"Every key `megarl-train` accepts ({count} keys in {len(all_sections)} sections), with its",
        "type, default and meaning. The page is generated from the typed schema",
        "(`megarl/config/schema.py` and the sections it includes), the one place the",
        "configuration is documented: edit a field's docstring there, then run",
        f"`{REGENERATE}` (or `make docs`); `tests/unit/test_config_reference.py`",
        "fails while the page is stale.",
        "",
        "Set a key on the command line (`megarl-train actor.lr=2e-6 rollout.n=4`), in a recipe",
        "(`configs/recipe/`) or in `configs/config.yaml`. An unknown key or a value outside the",
        "listed choices is refused before anything starts, with one line that names the key.",
        "",
        "- **type**: the YAML value the key takes; `a | b | c` lists the accepted values where",
        "  the schema checks them, `None` is YAML's `null`, `list[...]` a YAML list.",
        "- **default**: the schema's default, as YAML writes it. Where `configs/config.yaml`",
        "  (what `megarl-train` starts from) sets another value, that value follows",
        "  (*config.yaml:* ...), and it is the one a plain `megarl-train` run uses.",
        "",
        "## Sections",
        "",
    ]
    for section in all_sections:
        depth = section.name.count(".")
        lines.append(
            f"{'  ' * depth}- [{section.name}](#{anchor(section.name)}) ({len(section.keys)})"
        )
    for section in all_sections:
        lines += ["", f"## {section.name}", ""]
        for paragraph in section.intro:
            lines += [paragraph, ""]
        if section.subsections:
            links = ", ".join(f"[{s}](#{anchor(s)})" for s in section.subsections)
            lines += [f"Subsections: {links}.", ""]
        if not section.keys:
            lines.pop()
            continue
        lines += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
        for key in section.keys:
            default = _code(key.default)
            if key.run_default is not None:
                default += f" (*config.yaml:* {_code(key.run_default)})"
            row = [_code(key.name), _code(key.type), default, key.doc]
            lines.append("| " + " | ".join(cell(part) for part in row) + " |")
    return "\n".join(lines) + "\n"


def all_keys() -> list[str]:
    """Every leaf key of the schema, dotted, in page order."""
    return [key.name for section in sections() for key in section.keys]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Write docs/configuration.md from the typed schema."
    )
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if the page differs from what would be written"
    )
    parser.add_argument("--out", type=Path, default=PAGE, help=f"default: {PAGE.relative_to(REPO)}")
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != page:
            print(f"{args.out}: stale; run {REGENERATE}", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(page)
    print(f"wrote {args.out} ({len(all_keys())} keys)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
