"""`package.module:attr` settings (reward.fn, env.fn, agent.fn, tools.tools, buffer.sampling)
resolved to the object they name, with an error that names the setting and the fix.

    fn = resolve_spec("my_reward:score", "reward.fn", "'package.module:function'", RewardSpecError)

A leaf: the standard library only, so config checks (laminar/preflight.py) and every node
resolve the same way.
"""

from __future__ import annotations

import importlib
import os
from typing import Any


def _module_functions(module: Any) -> str:
    """The public callables a module defines (for an error that shows what is there)."""
    home = getattr(module, "__name__", None)
    names = sorted(
        n
        for n, v in vars(module).items()
        if not n.startswith("_") and callable(v) and getattr(v, "__module__", None) == home
    )[:12]
    return ", ".join(names)


def resolve_spec(
    spec: str, key: str, shape: str, error: type[Exception], what: str = "a function"
) -> Any:
    """The callable `package.module:attr` names (attr may be dotted). Every failure raises
    `error` with a message that starts with the setting `key`: a spec not of the form `shape`,
    a module that cannot be imported (or raised while importing), a missing attribute, or one
    that is not callable (not `what`)."""
    if (
        not isinstance(spec, str)
        or spec.count(":") != 1
        or spec.startswith(":")
        or spec.endswith(":")
    ):
        raise error(f"{key} must look like {shape}, got {spec!r}")
    mod_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(mod_name)
    except ModuleNotFoundError as exc:
        if exc.name and mod_name.startswith(exc.name):
            raise error(
                f"{key} {spec!r}: cannot import module {mod_name!r}: no module named "
                f"{exc.name!r} (importable from {os.getcwd()} or PYTHONPATH; a file "
                "my_reward.py here is 'my_reward:fn')"
            ) from None
        raise error(f"{key} {spec!r}: cannot import module {mod_name!r} ({exc})") from exc
    except Exception as exc:  # the module ran and raised: say so, with its error
        raise error(
            f"{key} {spec!r}: importing {mod_name!r} raised {type(exc).__name__}: {exc}"
        ) from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise error(
                f"{key} {spec!r}: module {mod_name!r} has no {attr!r} "
                f"(it has: {_module_functions(obj)})"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise error(f"{key} {spec!r} is a {type(obj).__name__}, not {what}")
    return obj
