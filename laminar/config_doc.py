"""docs/config.md, generated from the pydantic config tree (laminar/config.py).

    python -m laminar.config_doc > docs/config.md      # regenerate after changing a field
    python -m laminar.config_doc --check docs/config.md  # exit 1 when the file is out of date

Every section of `LaminarConfig` becomes a heading and every field a table row: its dotted
name, type, default, bounds (from `Field(ge=..., gt=..., le=..., lt=...)`) and its docstring.
Field docstrings are the string literal right after the field (read from the class source
with ast), falling back to `Field(description=...)`; a section without a field docstring is
described by its class docstring. tests/test_docs.py fails when docs/config.md differs from
what this prints. Imports no torch (laminar.config does not either).
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import sys
import textwrap
import types
from functools import cache
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from laminar.config import LaminarConfig

REGENERATE = "python -m laminar.config_doc > docs/config.md"

_BOUNDS = ((at.Ge, "ge", ">="), (at.Gt, "gt", ">"), (at.Le, "le", "<="), (at.Lt, "lt", "<"))


@cache
def field_docstrings(cls: type) -> dict[str, str]:
    """{field: docstring} from the string literal after each annotated field of cls."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.ClassDef)
    out: dict[str, str] = {}
    body = node.body
    for stmt, nxt in zip(body, body[1:], strict=False):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            if isinstance(nxt.value.value, str):
                out[stmt.target.id] = nxt.value.value
    return out


def one_line(text: str) -> str:
    """A docstring as one table cell: whitespace collapsed, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def type_name(tp: Any) -> str:
    """A readable type: `int`, `float \\| null`, `"a" \\| "b"`, `dict[str, int]`."""
    origin = get_origin(tp)
    if tp is type(None):
        return "null"
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in get_args(tp))
    if origin is not None:
        args = ", ".join("..." if a is Ellipsis else type_name(a) for a in get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if tp is Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


def default_text(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value) if not isinstance(value, str) else value


def bounds_text(info: FieldInfo) -> str:
    out = []
    for meta in info.metadata:
        for kind, attr, sign in _BOUNDS:
            if isinstance(meta, kind):
                out.append(f"{sign} {getattr(meta, attr)}")
    return ", ".join(out)


def section_of(info: FieldInfo) -> type[BaseModel] | None:
    tp = info.annotation
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def optional_section_of(info: FieldInfo) -> type[BaseModel] | None:
    """X of a `X | None` field whose X is a section (off when null): its fields get a table too."""
    args = get_args(info.annotation)
    subs = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
    return subs[0] if len(subs) == 1 and type(None) in args else None


def doc_of(cls: type[BaseModel], name: str, info: FieldInfo) -> str:
    return field_docstrings(cls).get(name) or info.description or ""


def render_section(cls: type[BaseModel], prefix: str, intro: str, depth: int) -> list[str]:
    title = f"`{prefix}`" if prefix else "top level"
    lines = ["#" * depth + " " + title, ""]
    intro = intro or inspect.cleandoc(cls.__doc__ or "")
    if intro:
        lines += [" ".join(intro.split()), ""]
    rows, subsections = [], []
    for name, info in cls.model_fields.items():
        key = f"{prefix}.{name}" if prefix else name
        sub = section_of(info)
        if sub is not None:
            subsections.append((sub, key, doc_of(cls, name, info)))
            continue
        cells = [
            f"`{key}`",
            f"`{type_name(info.annotation)}`".replace("|", "\\|"),
            f"`{default_text(info)}`".replace("|", "\\|"),
            bounds_text(info),
            one_line(doc_of(cls, name, info)),
        ]
        rows.append("| " + " | ".join(cells) + " |")
        optional = optional_section_of(info)
        if optional is not None:
            subsections.append((optional, key, doc_of(cls, name, info)))
    if rows:
        lines += ["| field | type | default | bounds | what it does |", "|---|---|---|---|---|"]
        lines += [*rows, ""]
    for sub, key, doc in subsections:
        lines += render_section(sub, key, doc, min(depth + 1, 4) if prefix else depth)
    return lines


def render() -> str:
    """The whole of docs/config.md."""
    head = [
        "# Configuration reference",
        "",
        f"Generated from `laminar/config.py` by `{REGENERATE}`; do not edit by hand",
        "(`tests/test_docs.py` fails when this file is out of date). A run's config is one YAML",
        "file of these sections; `laminar run FILE key=value ...` overrides any field by its",
        "dotted name (the value is parsed as YAML), and the resolved config is written to",
        "`run_dir/config.yaml`. Unknown fields are refused.",
        "",
    ]
    body = render_section(LaminarConfig, "", "", 2)
    return "\n".join(head + body).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m laminar.config_doc", description=__doc__)
    p.add_argument("--check", metavar="FILE", help="exit 1 if FILE differs from the output")
    args = p.parse_args(argv)
    text = render()
    if args.check is None:
        sys.stdout.write(text)
        return 0
    path = Path(args.check)
    if path.exists() and path.read_text() == text:
        return 0
    print(f"{path} is out of date: run `{REGENERATE}`", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
