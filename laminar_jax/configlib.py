"""Typed config plumbing: dataclass sections <-> ml_collections.ConfigDict <-> JSON.

Each plane owns a frozen dataclass (its *section*) whose docstring documents every field
under an ``Attributes:`` heading and whose optional ``validate(prefix)`` method raises
:class:`ConfigError` naming the dotted key. This module only converts and checks types;
it knows nothing about the planes.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any

import ml_collections
from ml_collections import config_dict


class ConfigError(ValueError):
    """A config value is wrong; the message names the dotted key, the value and what was expected."""


def expect(cond: bool, key: str, value: Any, expected: str) -> None:
    """Raise ConfigError('<key>=<value>: must be <expected>') unless cond."""
    if not cond:
        raise ConfigError(f"{key}={value!r}: must be {expected}")


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _base_type(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return type(typing.get_args(tp)[0])
    return origin or tp


def to_config_dict(obj: Any) -> ml_collections.ConfigDict:
    """Dataclass instance -> ConfigDict (nested sections become nested ConfigDicts).

    Optional fields whose default is None become typed placeholders, so a command-line
    override such as ``--config.model.path=/x`` is accepted and type-checked.
    """
    hints = typing.get_type_hints(type(obj))
    out = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            out[f.name] = to_config_dict(v)
            continue
        tp, optional = _unwrap_optional(hints[f.name])
        if v is None and optional:
            base = _base_type(tp)
            out[f.name] = config_dict.placeholder(base if isinstance(base, type) else object)
        elif isinstance(v, dict):
            out[f.name] = ml_collections.ConfigDict(v)
        else:
            out[f.name] = v
    return ml_collections.ConfigDict(out)


def _coerce(key: str, value: Any, tp: Any) -> Any:
    tp, optional = _unwrap_optional(tp)
    if value is None:
        expect(optional, key, value, f"a value of type {tp}")
        return None
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        expect(value in allowed, key, value, f"one of {list(allowed)}")
        return value
    if origin in (tuple, list):
        expect(isinstance(value, (tuple, list)), key, value, "a list")
        args = typing.get_args(tp)
        elem = args[0] if args else Any
        items = [_coerce(f"{key}[{i}]", x, elem) for i, x in enumerate(value)]
        return tuple(items)
    if origin is dict or tp is dict:
        if isinstance(value, ml_collections.ConfigDict):
            value = value.to_dict()
        expect(isinstance(value, dict), key, value, "a mapping")
        return dict(value)
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is bool:
        expect(isinstance(value, bool), key, value, "a bool (true/false)")
        return value
    if tp is int:
        expect(isinstance(value, int) and not isinstance(value, bool), key, value, "an int")
        return value
    if isinstance(tp, type):
        expect(isinstance(value, tp), key, value, f"of type {tp.__name__}")
    return value


def from_config_dict(cls: type, cd: Any, prefix: str = "") -> Any:
    """ConfigDict (or plain dict) -> dataclass ``cls``; unknown keys and wrong types are errors."""
    if isinstance(cd, ml_collections.ConfigDict):
        cd = cd.to_dict()
    if not isinstance(cd, dict):
        raise ConfigError(f"{prefix or '<root>'}={cd!r}: must be a section (mapping)")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in cd:
        if k not in names:
            key = f"{prefix}.{k}" if prefix else k
            raise ConfigError(f"{key}: unknown key; {cls.__name__} has {sorted(names)}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in cd:
            continue
        key = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = from_config_dict(tp, cd[f.name], key)
        else:
            kwargs[f.name] = _coerce(key, cd[f.name], tp)
    return cls(**kwargs)


def validate_tree(obj: Any, prefix: str = "") -> None:
    """Call ``validate(prefix)`` on every section that defines it, depth first."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            validate_tree(v, f"{prefix}.{f.name}" if prefix else f.name)
    if hasattr(obj, "validate"):
        obj.validate(prefix)


def to_json(obj: Any) -> str:
    return json.dumps(dataclasses.asdict(obj), indent=2, sort_keys=True)


def field_docs(cls: type) -> dict[str, str]:
    """Parse the ``Attributes:`` block of a section's docstring into {field: text}."""
    doc = cls.__doc__ or ""
    out: dict[str, str] = {}
    in_attrs, current = False, None
    for line in doc.splitlines():
        s = line.strip()
        if s == "Attributes:":
            in_attrs = True
            continue
        if not in_attrs or not s:
            continue
        name, sep, text = s.partition(":")
        if sep and name.isidentifier() and line.startswith(" " * 4) and not line.startswith(" " * 8):
            current = name
            out[name] = text.strip()
        elif current:
            out[current] += " " + s
    return out
