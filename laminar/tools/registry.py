"""The registry of tools: plain Python callables, named in `tools.tools`.

    registry = Registry.from_entries(["python", "calculator", "mypkg.tools:lookup"])
    tool = registry.get("calculator")        # None when unknown -> error_kind unknown_tool
    problem = tool.check({"expression": "1+2"})   # None, or why the call is bad -> bad_call

An entry is a built-in name (laminar/tools/builtin.py) or `module:function`, imported when
the registry is built (the tools node at start, and each sandbox worker again: functions never
cross a process boundary, names do). A function's signature is its schema: arguments are a
JSON object whose keys must be its parameters, required ones present, and values of the
annotated JSON type (str, int, float, bool, list, dict; anything else is not checked).

A user tool says how it behaves with `@tool(side_effects=False, description=...)`; an
undecorated function counts as side-effecting (the cache journals its start, so it is never
run twice, not even across a tools-node crash).
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from laminar.resolve import resolve_spec
from laminar.tools.builtin import BUILTINS

F = TypeVar("F", bound=Callable[..., Any])

_JSON_TYPES: dict[Any, tuple[type, ...]] = {
    str: (str,),
    int: (int,),
    float: (int, float),
    bool: (bool,),
    list: (list,),
    dict: (dict,),
}


def tool(side_effects: bool = True, description: str = "") -> Callable[[F], F]:
    """Mark a function as a tool and say whether it has side effects (the default: it has)."""

    def mark(fn: F) -> F:
        fn.__laminar_tool__ = {"side_effects": side_effects, "description": description}  # type: ignore[attr-defined]
        return fn

    return mark


@dataclass
class Tool:
    name: str
    fn: Callable[..., Any]
    side_effects: bool
    description: str = ""
    schema: dict[str, Any] = field(default_factory=dict)
    """{"required": [...], "optional": [...], "types": {arg: type name}} from the signature."""
    _types: dict[str, tuple[type, ...]] = field(default_factory=dict, repr=False)
    _extra_ok: bool = field(default=False, repr=False)

    @classmethod
    def from_function(
        cls, name: str, fn: Callable[..., Any], side_effects: bool, description: str = ""
    ) -> Tool:
        sig = inspect.signature(fn)
        try:
            hints = typing.get_type_hints(fn)
        except Exception:  # noqa: BLE001 - unresolvable annotations: skip type checks
            hints = {}
        required: list[str] = []
        optional: list[str] = []
        types: dict[str, tuple[type, ...]] = {}
        type_names: dict[str, str] = {}
        extra_ok = False
        for p in sig.parameters.values():
            if p.kind is p.VAR_KEYWORD:
                extra_ok = True
                continue
            if p.kind in (p.VAR_POSITIONAL, p.POSITIONAL_ONLY):
                continue
            (required if p.default is p.empty else optional).append(p.name)
            hint = typing.get_origin(hints.get(p.name)) or hints.get(p.name)
            if hint is not None and hint in _JSON_TYPES:
                types[p.name] = _JSON_TYPES[hint]
                type_names[p.name] = getattr(hint, "__name__", str(hint))
        schema = {"required": required, "optional": optional, "types": type_names}
        return cls(
            name,
            fn,
            side_effects,
            description or (fn.__doc__ or "").strip(),
            schema,
            types,
            extra_ok,
        )

    def check(self, arguments: Any) -> str | None:
        """Why a call with these arguments is bad (error_kind bad_call), or None if it is fine."""
        if not isinstance(arguments, dict):
            return f"{self.name}: arguments must be a JSON object, got {type(arguments).__name__}"
        missing = [a for a in self.schema["required"] if a not in arguments]
        if missing:
            return f"{self.name}: missing argument(s) {', '.join(missing)}"
        known = set(self.schema["required"]) | set(self.schema["optional"])
        extra = sorted(str(a) for a in arguments if a not in known)
        if extra and not self._extra_ok:
            return f"{self.name}: unexpected argument(s) {', '.join(extra)}"
        for arg, types in self._types.items():
            if arg in arguments:
                val = arguments[arg]
                bad = not isinstance(val, types) or (isinstance(val, bool) and bool not in types)
                if bad:
                    want = self.schema["types"][arg]
                    return f"{self.name}: argument {arg} must be {want}, got {type(val).__name__}"
        return None


class ToolLoadError(ValueError):
    """A `tools.tools` entry could not be resolved."""


def load_tool(entry: str) -> Tool:
    """A built-in name or `module:function`; the error names the entry and the fix."""
    if entry in BUILTINS:
        builtin_fn, side_effects, description = BUILTINS[entry]
        return Tool.from_function(entry, builtin_fn, side_effects, description)
    if ":" not in entry:
        raise ToolLoadError(
            f"tools.tools entry {entry!r}: not a built-in ({', '.join(BUILTINS)}) "
            "and not module:function"
        )
    fn = resolve_spec(entry, "tools.tools entry", "'package.module:function'", ToolLoadError)
    attr = entry.partition(":")[2]
    meta = getattr(fn, "__laminar_tool__", {})
    return Tool.from_function(
        attr, fn, bool(meta.get("side_effects", True)), str(meta.get("description", ""))
    )


class Registry:
    """Tools by name (a `module:function` tool is named by its function)."""

    def __init__(self, tools: list[Tool]):
        self.tools: dict[str, Tool] = {}
        for t in tools:
            if t.name in self.tools:
                raise ToolLoadError(f"two tools named {t.name!r} in tools.tools")
            self.tools[t.name] = t
        self.entries: list[str] = []

    @classmethod
    def from_entries(cls, entries: list[str]) -> Registry:
        reg = cls([load_tool(e) for e in entries])
        reg.entries = list(entries)
        return reg

    def get(self, name: str) -> Tool | None:
        return self.tools.get(name)

    def names(self) -> list[str]:
        return list(self.tools)
