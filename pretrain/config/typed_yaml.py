"""The typed-YAML loader of recipes, cluster profiles and eval suites; torch-free."""

from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal, Union

import yaml


class _DuplicateKey(yaml.MarkedYAMLError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that names a key twice (it would keep the last, silently)."""

    def construct_mapping(self, node, deep=False):
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen and key != "<<":
                raise _DuplicateKey(problem=f"key {key!r} appears twice", problem_mark=key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def parse_yaml(text: str, where: str) -> Any:
    """``yaml.safe_load(text)``, a key given twice refused; a syntax error is a ValueError naming ``where`` and the
    line."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader
    except _DuplicateKey as error:
        mark = error.problem_mark
        raise ValueError(
            f"{where}, line {mark.line + 1}: {error.problem} in one mapping (YAML would keep the last silently); "
            "keep one"
        ) from None
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        at = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = error.problem or error.context or "syntax error"
        # the context's earlier line is often the mistake (an unclosed [)
        context = ""
        if error.context and error.context_mark is not None and error.context_mark is not mark:
            context = f" ({error.context} that starts at line {error.context_mark.line + 1})"
        raise ValueError(
            f"{where}{at}: invalid YAML: {problem}{context}; fix the syntax there (close brackets and quotes, "
            "indent nested keys, quote values that contain ': ' or start with [ { * & !)"
        ) from None
    except yaml.YAMLError as error:  # a control character: a position, no line mark
        position, at = getattr(error, "position", None), ""
        if isinstance(position, int):
            line = text[:position].count("\n") + 1
            at = f", line {line}"
        reason = str(error).splitlines()[0]
        raise ValueError(f"{where}{at}: invalid YAML: {reason}; remove it (plain UTF-8 text only)") from None


def read_yaml(path: str | Path, what: str) -> Any:
    """The YAML file ``path`` parsed (None when empty); ``what`` names it in errors."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{what} {path} is not a text file (byte {error.start} is not UTF-8); point at a YAML file"
        ) from None
    except OSError as error:
        raise ValueError(f"cannot read {what} {path}: {error.strerror or error}; give a readable YAML file") from None
    return parse_yaml(text, f"{what} {path}")


def read_mapping(path: str | Path, what: str, fix: str) -> dict[str, Any]:
    """:func:`read_yaml` of a mapping ({} when empty); ``fix`` ends the error otherwise."""
    data = read_yaml(path, what)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{what} {path} must be a YAML mapping, got a {type(data).__name__}; {fix}")
    return data


def read_with_base(path: Path, what: str, fix: str, find: Callable[[str], Path], _seen: tuple = ()) -> dict[str, Any]:
    """:func:`read_mapping` over its ``base:`` file (``find``: name → path), recursively."""
    if path in _seen:
        raise ValueError(f"{what} {path} inherits from itself via 'base:' ({' -> '.join(map(str, _seen))})")
    data = read_mapping(path, what, fix)
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str) or not base:
        raise ValueError(f"{what} {path}: base={base!r} must be a {what} name or YAML path; {fix}")
    return deep_merge(read_with_base(find(base), what, fix, find, _seen + (path,)), data)


def deep_merge(
    base: dict[str, Any], top: dict[str, Any], opaque: tuple[str, ...] = ("options", "builtin_options")
) -> dict[str, Any]:
    """``top`` over ``base``, mapping by mapping; a key in ``opaque`` is replaced whole."""
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict) and key not in opaque:
            merged[key] = deep_merge(merged[key], value, opaque)
        else:
            merged[key] = value
    return merged


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"optim.lr=3e-4"`` → (["optim", "lr"], 0.0003); the value is YAML."""
    key, sep, raw = text.partition("=")
    keys = key.strip().split(".")
    if not sep or not all(k.strip() for k in keys):
        raise ValueError(f"override {text!r} is not key=value; write e.g. optim.lr=3e-4 or model.name=vit_s16")
    value = parse_yaml(raw, f"override {text!r}: the value") if raw.strip() else ""
    return [k.strip() for k in keys], value


def apply_overrides(d: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """A copy of ``d`` with each ``key=value`` set, creating missing mappings."""
    out = copy.deepcopy(d)
    for text in overrides:
        keys, value = parse_override(text)
        node = out
        for key in keys[:-1]:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[keys[-1]] = value
    return out


T = typing.TypeVar("T")


def build(cls: type[T], data: Any, where: str = "", prefix: str = "") -> T:
    """The frozen dataclass ``cls`` from a mapping; a bad key's ValueError names it, with the field's "hint"."""
    try:
        return _build(cls, data, prefix)
    except ValueError as error:
        raise ValueError(f"{where}: {error}" if where else str(error)) from None


def coerce(value: Any, hint: Any, path: str) -> Any:
    """``value`` checked against the type ``hint`` and converted (list → tuple, "1e-3" → 0.001)."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _build(hint, value, path + ".")
    origin = typing.get_origin(hint)
    if origin is Literal:
        allowed = typing.get_args(hint)
        # True must not pass for 1, nor 1 for True
        if not any(value == a and type(value) is type(a) for a in allowed):
            raise ValueError(f"{path}={value!r} is unknown; use one of {', '.join(map(str, allowed))}")
        return value
    if origin in (Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None and len(options) < len(typing.get_args(hint)):
            return None
        if len(options) == 1:  # X | None: X's message says more
            if value in ("None", "none") and options[0] is not str:
                raise ValueError(f"{path}={value!r} is a string to YAML; write null for no value")
            return coerce(value, options[0], path)
        for option in options:
            try:
                return coerce(value, option, path)
            except ValueError:
                continue
        raise ValueError(f"{path}={value!r} has the wrong type; expected {_type_name(hint)}")
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{path} must be a mapping, got {value!r}")
        return dict(value)
    if origin is tuple:
        args = typing.get_args(hint)
        variadic = args[-1] is Ellipsis
        if not isinstance(value, (list, tuple)) or (not variadic and len(value) != len(args)):
            raise ValueError(f"{path} must be a list{'' if variadic else f' of {len(args)} items'}, got {value!r}")
        items = args[:1] * len(value) if variadic else args
        return tuple(coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, items)))
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{path} must be true or false, got {value!r}")
        return value
    if hint in (int, float) and isinstance(value, str):
        # YAML 1.1 reads "1e-3" as a string
        value = _number(value, path, "an integer" if hint is int else "a number")
    if hint is int:
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not math.isfinite(value) or int(value) != value:
            raise ValueError(f"{path} must be an integer, got {value!r}")
        return int(value)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{path} must be a finite number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{path} must be a string, got {value!r}; quote it")
        return value
    raise TypeError(f"internal: no coercion for {hint} at {path}")


def _build(cls: type, data: Any, prefix: str) -> Any:
    section = prefix.rstrip(".")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if not isinstance(data, dict):
        keys = ", ".join(prefix + name for name in list(fields)[:3])
        fix = f"; set its keys one by one ({keys}, ...)" if section else ""
        raise ValueError(f"{section + ' must be' if section else 'expected'} a mapping of keys, got {data!r:.60}{fix}")
    unknown = sorted(prefix + str(key) for key in set(data) - set(fields))  # keys may be numbers or null
    if unknown:
        raise ValueError(f"unknown key(s) {unknown}{' in ' + section if section else ''}; valid keys: {list(fields)}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, f in fields.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ValueError(f"missing required key {prefix + name!r}")
            continue
        try:
            kwargs[name] = coerce(data[name], hints[name], prefix + name)
        except ValueError as error:
            hint = f.metadata.get("hint")
            raise ValueError(f"{error} ({hint})" if hint else str(error)) from None
    return cls(**kwargs)


def _number(text: str, path: str, kind: str) -> float | int:
    try:
        number = float(text)
    except ValueError:
        raise ValueError(f"{path} must be {kind}, got {text!r}") from None
    return int(number) if number.is_integer() and "e" not in text.lower() and "." not in text else number


def _type_name(hint: Any) -> str:
    args = typing.get_args(hint)
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(map(str, args))
    if not args:
        return getattr(hint, "__name__", str(hint))
    return " or ".join("null" if a is type(None) else _type_name(a) for a in args)
