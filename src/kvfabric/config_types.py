"""The typed conversion behind kvfabric.config: a frozen dataclass tree built from plain dicts (YAML, environment
variables), every value converted to its field's type and checked, every mistake one ConfigError naming its key.

Contract:
- `build(cls, data, prefix)`: `cls(**converted data)`; an unknown key, a wrong type or a value outside a Literal's
  choices raises ConfigError naming the key (with `prefix`) and what is allowed. Nested dataclasses are built from
  nested mappings; `ByteSize` fields take ints or strings such as "512MiB", "4GiB", "1.5GB"; tuples take lists or
  comma-separated strings; bools take true/false, yes/no, on/off, 1/0.
- `env_overrides(environ, prefix, reserved, reserved_prefixes)`: PREFIX_A__B=v -> {"a": {"b": "v"}} (values stay
  strings: `build` converts them). `merge(base, over)`: nested mappings merged key by key, `over` wins.
"""
from __future__ import annotations

import dataclasses
import re
import typing
from typing import Any, Literal


class ConfigError(ValueError):
    pass


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
ByteSize = typing.Annotated[int, "bytes"]
ByteSizeOrZero = typing.Annotated[int, "bytes or 0"]


def parse_bytes(value: Any, key: str, allow_zero: bool = False) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not match or match.group(2).lower() not in _UNITS:
            raise ConfigError(f"{key}: expected a byte size like 4GiB or 512MB, got {value!r}")
        number = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if number < 0 or (number == 0 and not allow_zero):
        raise ConfigError(f"{key}: must be {'0 or more' if allow_zero else 'positive'}, got {value!r}")
    return number


def env_overrides(environ: dict[str, str], prefix: str, reserved: set[str] | frozenset[str] = frozenset(),
                  reserved_prefixes: tuple[str, ...] = ()) -> dict[str, Any]:
    """PREFIX_A__B=v -> {"a": {"b": "v"}} (values stay strings; `build` converts and checks them)."""
    out: dict[str, Any] = {}
    for name, value in environ.items():
        if not name.startswith(prefix) or name in reserved or name.startswith(reserved_prefixes):
            continue
        path = name[len(prefix):].lower().split("__")
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{name}: conflicts with another variable")
        node[path[-1]] = value
    return out


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if key not in fields:
            raise ConfigError(f"unknown config key {name!r}; allowed here: {', '.join(sorted(fields))}")
        kwargs[key] = _convert(hints[key], value, name)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(str(exc)) from None


def _convert(hint: Any, value: Any, name: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return build(hint, value, name + ".")
    if typing.get_origin(hint) is typing.Annotated:
        return parse_bytes(value, name, allow_zero=hint.__metadata__[0] == "bytes or 0")
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ConfigError(f"{name}: {value!r} is not one of {', '.join(map(str, choices))}")
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("1", "true", "yes", "on"):
            return True
        if str(value).lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name}: expected true or false, got {value!r}")
    if hint in (int, float):
        try:
            if isinstance(value, bool) or (hint is int and isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return hint(value)
        except (TypeError, ValueError):
            kind = "an integer" if hint is int else "a number"
            raise ConfigError(f"{name}: expected {kind}, got {value!r}") from None
    if hint is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{name}: expected a string, got {value!r}")
        return str(value)
    if typing.get_origin(hint) is tuple:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{name}: expected a list, got {value!r}")
        return tuple(str(item).strip() for item in items if str(item).strip())
    raise ConfigError(f"{name}: unsupported field type {hint}")  # pragma: no cover
