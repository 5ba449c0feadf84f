"""Value coercion for arguments: CLI strings, YAML/JSON values and Python values all go through `coerce`, so
"2e-5", 2e-05 and "true" mean the same wherever they come from (the parser, a config file, or a constructor).

`coerce(name, value, annotation, choices)` converts a value to a field's annotation (unions are tried in the
order bool, int, float, dict, list, str; a non-string value that already has a member type keeps it) or raises
`ConfigError`, whose one-line message names the argument and what it expected. Beside it: `choose` (one of a
fixed set, with a close-match hint), `check` (a condition with its message), `check_keys` (dict keys against a
schema), `load_mapping` (a dict given as a dict, JSON or a .json/.yaml path) and `read_config_file`.

This module is the ground floor of the arguments: `trainer.config.arg_parser` and `trainer.config.args` build on it,
and it imports neither. Test: `python -m pytest tests/trainer/config/test_args.py -q`.
"""

import difflib
import json
import os
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import InitVar
from typing import Any

import yaml


class ConfigError(ValueError):
    """A user error in the arguments; its message is one line naming the argument and what is allowed."""


TRUE_WORDS = ("true", "1", "yes", "y", "on", "t")
FALSE_WORDS = ("false", "0", "no", "n", "off", "f")


def annotation_members(tp: Any) -> tuple[list[Any], bool]:
    """Non-None members of a (possibly union) annotation, and whether None is allowed."""
    if isinstance(tp, InitVar):
        tp = tp.type
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        return [a for a in args if a is not type(None)], type(None) in args
    return [tp], tp is Any


def annotation_base(member: Any) -> Any:
    return typing.get_origin(member) or member


def describe_type(tp: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", dict: "a JSON object"}
    members, nullable = annotation_members(tp)
    words = []
    for m in members:
        if annotation_base(m) is list:
            (elem,) = typing.get_args(m) or (Any,)
            words.append(f"a list of {getattr(elem, '__name__', 'any')} values")
        else:
            words.append(names.get(m, getattr(m, "__name__", str(m))))
    return " or ".join(words + (["null"] if nullable else []))


def to_bool(value: str) -> bool:
    s = value.strip().lower()
    if s in TRUE_WORDS:
        return True
    if s in FALSE_WORDS:
        return False
    raise ValueError(value)


def _convert(value: Any, member: Any) -> Any:
    """Convert `value` to one annotation member or raise ValueError/TypeError."""
    base = annotation_base(member)
    if member is Any:
        return value
    if base is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str):
            return to_bool(value)
        raise TypeError(value)
    if base is int:
        if isinstance(value, bool):
            raise TypeError(value)
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            return int(value.strip())
        raise TypeError(value)
    if base is float:
        if isinstance(value, bool):
            raise TypeError(value)
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            return float(value.strip())
        raise TypeError(value)
    if base is dict:
        if isinstance(value, Mapping):
            return dict(value)
        if isinstance(value, str) and value.strip().startswith("{"):
            loaded = json.loads(value)
            if isinstance(loaded, dict):
                return loaded
        raise TypeError(value)
    if base is list:
        (elem,) = typing.get_args(member) or (Any,)
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        return [_convert(v, elem) for v in items]
    if base is str:
        if isinstance(value, str):
            return value
        raise TypeError(value)
    if isinstance(value, base):
        return value
    if isinstance(value, str) and isinstance(base, type):
        return base(value)  # class-typed fields of the CLI's dataclasses (pathlib.Path, enums)
    raise TypeError(value)


def coerce(name: str, value: Any, tp: Any, choices: Sequence[str] | None = None) -> Any:
    """`value` converted to annotation `tp` (unions tried bool, int, float, dict, list, str), or ConfigError."""
    members, nullable = annotation_members(tp)
    if value is None or (nullable and isinstance(value, str) and value.strip().lower() in ("none", "null")):
        if nullable:
            return None
        raise ConfigError(f"{name}: expected {describe_type(tp)}, got None")
    if choices is not None and value is False and "no" in choices:
        # YAML 1.1 reads a bare `no` (as in `eval_strategy: no`) as False.
        value = "no"
    # A non-string value that already has one of the member types keeps it (a dict stays a dict, 3 stays an
    # int); strings always go through the ordered conversion so that "true" means True for `str | bool`.
    if not isinstance(value, str):
        for m in members:
            base = annotation_base(m)
            if m is Any or (base not in (float, list) and isinstance(value, base)):
                if not (base is int and isinstance(value, bool)):
                    return _convert(value, m)
    order = {bool: 0, int: 1, float: 2, dict: 3, list: 4, str: 5}
    for m in sorted(members, key=lambda m: order.get(annotation_base(m), 6)):
        try:
            return _convert(value, m)
        except (ValueError, TypeError):
            continue
    raise ConfigError(f"{name}: expected {describe_type(tp)}, got {value!r}")


def choose(name: str, value: Any, choices: Sequence[str], what: str = "") -> str:
    if value in choices:
        return value
    close = difflib.get_close_matches(str(value), choices, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(f"{name}={value!r}{what}: expected one of {', '.join(choices)}{hint}")


def check(ok: bool, name: str, value: Any, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{name}={value!r}: {expected}")


def load_mapping(name: str, value: Any) -> dict:
    """A dict given as a dict, a JSON string, or a path to a .json/.yaml/.yml file."""
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, str):
        s = value.strip()
        if s.startswith("{"):
            try:
                loaded = json.loads(s)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{name}: invalid JSON ({e.msg} at column {e.colno})") from None
        elif s.endswith((".json", ".yaml", ".yml")):
            loaded = read_config_file(s, name)
        else:
            raise ConfigError(f"{name}={value!r}: expected a dict, a JSON object or a .json/.yaml file path")
        if isinstance(loaded, dict):
            return loaded
    raise ConfigError(f"{name}={value!r}: expected a dict, a JSON object or a .json/.yaml file path")


def read_config_file(path: str, what: str = "config file") -> Any:
    if not os.path.isfile(path):
        raise ConfigError(f"{what}: file not found: {path}")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{what}: cannot parse {path}: {e.msg} at line {e.lineno}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or "invalid YAML"
        raise ConfigError(f"{what}: cannot parse {path}: {problem}{where}") from None


def check_keys(name: str, given: Mapping[str, Any], allowed: Mapping[str, Any], owner: str) -> None:
    for key in given:
        if key not in allowed:
            close = difflib.get_close_matches(key, list(allowed), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            accepted = ", ".join(allowed) if allowed else "none"
            raise ConfigError(f"{name}: unknown key {key!r} for {owner}{hint}; accepted keys: {accepted}")
