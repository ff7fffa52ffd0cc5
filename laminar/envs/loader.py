"""Load the configured environment: `env.fn` as module:Class or module:function.

    env = load_env(cfg.env)      # None when env.fn is null (single-turn prompts)

    module:Class      instantiated with env.kwargs; must subclass laminar.envs.base.Environment
    module:function   called with env.kwargs; must return an Environment

A bad entry raises EnvSpecError (a ConfigError) whose message names the entry and the fix.
"""

from __future__ import annotations

import inspect
from typing import Any

from laminar.config import ConfigError, EnvConfig
from laminar.envs.base import Environment
from laminar.resolve import resolve_spec


class EnvSpecError(ConfigError):
    """cfg.env.fn does not name an importable environment; the message says what to fix."""


def _resolve(spec: str) -> Any:
    return resolve_spec(
        spec,
        "env.fn",
        "'package.module:Class' or 'package.module:function'",
        EnvSpecError,
        what="a class or function",
    )


def load_env(cfg: EnvConfig) -> Environment | None:
    """The environment cfg.env names, built with cfg.env.kwargs; None for single-turn runs."""
    if cfg.fn is None:
        return None
    spec = cfg.fn
    obj = _resolve(spec)
    if isinstance(obj, type):
        if not issubclass(obj, Environment):
            raise EnvSpecError(
                f"env.fn {spec!r} is a class that does not subclass laminar.envs.base.Environment; "
                "subclass it (reset / step / score)"
            )
    try:
        inspect.signature(obj).bind(**cfg.kwargs)
    except TypeError as exc:
        raise EnvSpecError(
            f"env.fn {spec!r} does not accept env.kwargs {sorted(cfg.kwargs)} ({exc}); "
            "fix env.kwargs or the signature"
        ) from None
    except ValueError:  # no signature to check (a builtin); the call itself will tell
        pass
    env = obj(**cfg.kwargs)
    if not isinstance(env, Environment):
        raise EnvSpecError(
            f"env.fn {spec!r} returned a {type(env).__name__}, not an Environment; "
            "return an instance of a laminar.envs.base.Environment subclass"
        )
    return env
