"""Environments registered by name, and which one a prompt record asks for.

Selection, first match wins:
  1. ``extra_info["env"]`` (a registered name; ``extra_info["env_kwargs"]`` its keyword arguments);
  2. verl's multi-turn layout: ``extra_info["interaction_kwargs"]["name"]``, the other keys of
     ``interaction_kwargs`` being the keyword arguments;
  3. ``by_data_source[record["data_source"]]`` (config);
  4. ``default`` (config).
verl's ``tools_kwargs`` (per-tool create/execute kwargs) are passed to the environment as
``tools_kwargs`` when the environment accepts it; verl's tool *classes* are not loaded: a tool
here is part of an Environment. ``sandbox`` (env.sandbox) likewise reaches only the environments
that take it.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

from laminar_jax.env.base import Environment

EnvFactory = Callable[..., Environment]
_REGISTRY: dict[str, EnvFactory] = {}


def register_env(name: str, factory: EnvFactory) -> None:
    if not name or not callable(factory):
        raise ValueError(f"register_env: need a non-empty name and a callable, got {name!r}, {factory!r}")
    _REGISTRY[name] = factory


# The built-in environments, imported on first use so that `laminar_jax.env` stays cheap to import;
# they do not import this module (a name registered with register_env takes precedence).
BUILTINS = ("calculator", "latency", "python")


def registered() -> list[str]:
    return sorted(set(_REGISTRY) | set(BUILTINS))


def _factory(name: str) -> Optional[EnvFactory]:
    """The factory registered as `name`, else the built-in of that name, else None."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name == "calculator":
        from laminar_jax.env.calculator import CalculatorEnv
        return CalculatorEnv
    if name == "latency":
        from laminar_jax.env.latency import LatencyEnv
        return LatencyEnv
    if name == "python":
        from laminar_jax.env.python_sandbox import PythonEnv
        return PythonEnv
    return None


def select_env(record: dict[str, Any], default: Optional[str] = None,
               by_data_source: Optional[dict[str, str]] = None) -> tuple[str, dict]:
    """(env name, kwargs) for a prompt record (see the module docstring); raises naming the record."""
    extra = record.get("extra_info") or {}
    if extra.get("env"):
        name, kwargs = extra["env"], dict(extra.get("env_kwargs") or {})
    elif isinstance(extra.get("interaction_kwargs"), dict) and extra["interaction_kwargs"].get("name"):
        kwargs = dict(extra["interaction_kwargs"])
        name = kwargs.pop("name")
    elif by_data_source and record.get("data_source") in by_data_source:
        name, kwargs = by_data_source[record["data_source"]], {}
    elif default:
        name, kwargs = default, {}
    else:
        raise ValueError(f"record data_source={record.get('data_source')!r}: no environment named "
                         "(extra_info.env, extra_info.interaction_kwargs.name, env.by_data_source or env.default)")
    if extra.get("tools_kwargs"):
        kwargs.setdefault("tools_kwargs", extra["tools_kwargs"])
    return name, kwargs


def accepts(name: str, keyword: str) -> bool:
    """Whether registered environment `name` names `keyword` among its parameters (False for unknown names)."""
    factory = _factory(name)
    if factory is None:
        return False
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    return keyword in params


def make_env(name: str, **kwargs: Any) -> Environment:
    """Build a registered environment; unknown names and keyword arguments are refused by name."""
    factory = _factory(name)
    if factory is None:
        raise ValueError(f"environment {name!r} is not registered (have {registered()})")
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    for optional in ("tools_kwargs", "sandbox"):  # given to every environment; used by those that take it
        if optional in kwargs and optional not in params and not takes_any:
            kwargs.pop(optional)
    return factory(**kwargs)
