"""Build typed config dataclasses from plain dicts (YAML), with errors that name the key.

One mechanism for every section: `build(cls, data, "stages.ingest")` checks unknown keys, types
(int, float, str, bool, Optional, list, Literal, nested dataclasses) and then calls the section's
own `validate()` if it has one. `apply_override(d, "a.b.c=5")` edits the raw dict before building.
"""
from __future__ import annotations

import dataclasses
import difflib
import sys
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from .errors import ConfigError, UserError

# a config file is read whole by the driver, and may come from elsewhere (a run folder's own
# config.yaml): bounded before it is parsed and after (aliases expand without bound: "billion laughs")
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_VALUES = 100_000


class _UniqueKeys(yaml.SafeLoader):
    """safe_load, with a key given twice in one mapping refused (PyYAML keeps the last, silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _values(obj, budget: list[int]) -> None:
    """Counts the values `obj` expands to (an alias once per use), stopping past the budget."""
    budget[0] -= 1
    if budget[0] < 0:
        return
    for v in (obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list) else ()):
        _values(v, budget)


def parse_yaml(text: str | bytes, what: str):
    """YAML text from a file or a --set value -> its value, or a one-line UserError naming `what`:
    over MAX_CONFIG_BYTES, not UTF-8, not YAML (python tags included: safe_load), a key given twice,
    nested past Python's recursion limit, or expanding to more than MAX_CONFIG_VALUES values."""
    if len(text) > MAX_CONFIG_BYTES:
        raise UserError(f"{what}: more than the {MAX_CONFIG_BYTES >> 20} MiB a config may be")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as err:
            raise UserError(f"{what}: not UTF-8 text (byte {err.start}: {text[err.start:err.start + 1]!r}); "
                            "save it as UTF-8") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeys)   # noqa: S506 - a SafeLoader
        budget = [MAX_CONFIG_VALUES]
        _values(data, budget)
    except yaml.YAMLError as err:
        raise UserError(f"{what}: not valid YAML ({' '.join(str(err).split())[:300]})") from None
    except RecursionError:
        raise UserError(f"{what}: nested too deeply to be a config") from None
    except ValueError:     # Python refuses to convert an integer of more than 4,300 digits
        raise UserError(f"{what}: holds a number of thousands of digits") from None
    if budget[0] < 0:
        raise UserError(f"{what}: expands to more than {MAX_CONFIG_VALUES:,} values (YAML aliases used as a bomb?)")
    return data


def _type_name(tp) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if origin is list:
        return f"a list of {_type_name(get_args(tp)[0])}"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false",
            type(None): "null"}.get(tp, str(tp))


def _convert(tp, value: Any, key: str):
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, key)
            except ConfigError:
                continue
        raise ConfigError(key, f"expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(key, f"{value!r} is not allowed; choose one of {_type_name(tp)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(key, f"expected {_type_name(tp)}, got {value!r}")
        (item,) = get_args(tp)
        return [_convert(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a mapping, got {value!r}")
        kt, vt = get_args(tp)
        return {_convert(kt, k, key): _convert(vt, v, f"{key}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return build(tp, value, key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(key, f"expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(key, f"expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            import math

            if not math.isfinite(value):   # YAML reads .nan and .inf: no setting means either
                raise ConfigError(key, f"expected a finite number, got {value!r}")
            return float(value)
        raise ConfigError(key, f"expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(key, f"expected a string, got {value!r}")
    if tp is Any:
        return value
    raise TypeError(f"configtools cannot build {tp} (key {key})")


def build(cls, data: Any, prefix: str = ""):
    """Instantiate dataclass `cls` from `data`, rejecting unknown keys and wrong types."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(prefix, f"expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    removed = getattr(cls, "REMOVED", {})   # keys an older capline took: said once, then ignored
    for key in [k for k in data if k in removed and k not in fields]:
        full = f"{prefix}.{key}" if prefix else str(key)
        print(f"note: config key '{full}' is no longer used ({removed[key]}); remove it", file=sys.stderr)
        data = {k: v for k, v in data.items() if k != key}
    unknown = [k for k in data if k not in fields]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(str(key), fields, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        full = f"{prefix}.{key}" if prefix else str(key)
        raise ConfigError(full, f"unknown key; {hint}allowed here: {', '.join(sorted(fields))}")
    kwargs = {}
    for name, value in data.items():
        full = f"{prefix}.{name}" if prefix else name
        kwargs[name] = _convert(hints[name], value, full)
    for name in fields:
        if name not in kwargs and dataclasses.is_dataclass(hints[name]):
            kwargs[name] = build(hints[name], {}, f"{prefix}.{name}" if prefix else name)  # defaults, checked
    obj = cls(**kwargs)
    # Defaults skip _convert: make `x: float = 2` a float too, so a config and its JSON round trip
    # (a manifest) hash the same.
    for name in fields:
        if hints[name] is float and isinstance(getattr(obj, name), int):
            setattr(obj, name, float(getattr(obj, name)))
    validate = getattr(obj, "validate", None)
    if validate is not None:      # the section's own checks first: their messages say more
        validate(prefix)
    # a number whose default is not negative is a count, size, time, rate or share: never negative
    # (but where the class names it in SIGNED: a sentinel such as max_failures' -1, "no limit")
    for name, f in fields.items():
        value = getattr(obj, name)
        if name in getattr(cls, "SIGNED", ()):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or isinstance(f.default, bool):
            continue
        if isinstance(f.default, (int, float)) and f.default >= 0 and value < 0:
            raise ConfigError(f"{prefix}.{name}" if prefix else name, f"must be >= 0, got {value!r}")
    return obj


def to_dict(obj) -> dict:
    return dataclasses.asdict(obj)


def apply_override(data: dict, assignment: str) -> None:
    """`a.b.c=VALUE` sets data['a']['b']['c']; VALUE is parsed as YAML (5, 0.5, true, [a, b], text)."""
    if "=" not in assignment:
        raise ConfigError("", f"--set takes KEY=VALUE with a dotted key, got {assignment!r}")
    key, raw = assignment.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError("", f"--set needs a key before '=': {assignment!r}")
    try:
        value = parse_yaml(raw, f"--set {key}") if raw.strip() else ""
    except UserError as err:
        raise ConfigError(key, f"cannot parse value {raw[:80]!r}: {err}") from None
    node = data
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(".".join(parts[: i + 1]), "is not a section, cannot set a key inside it")
        node = child
    node[parts[-1]] = value


def require(cond: bool, key: str, message: str) -> None:
    """Validation helper for the sections' validate() methods."""
    if not cond:
        raise ConfigError(key, message)


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


# -- what the settings are, for a person (`capline config`) ----------------------------------------
def _comments(cls) -> dict[str, str]:
    """field name -> the comment beside it, or the comment lines just above it, in the class's source."""
    import inspect
    import re

    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return {}
    out, above = {}, []
    for line in lines:
        text = line.strip()
        if text.startswith("#"):
            above.append(text.lstrip("# ").strip())
            continue
        m = re.match(r"^\s{4}(\w+)\s*:[^#]*?(?:#\s*(.*))?$", line) if not text.startswith(("def ", "@")) else None
        if m and m.group(1) not in out and not line.startswith("        "):
            out[m.group(1)] = (m.group(2) or " ".join(above)).strip()
        if text:
            above = []
    return out


def describe_settings(cls, prefix: str = "", instance=None) -> list[tuple[str, Any, str]]:
    """Every setting of a config dataclass, nested sections flattened: (dotted key, default, meaning).
    Defaults are a default instance's (a section may default a nested one differently from its class)."""
    instance = instance if instance is not None else cls()
    hints = typing.get_type_hints(cls)
    notes = _comments(cls)
    if cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}("):   # documented as a whole: the
        whole = cls.__doc__.strip().split(". ")[0].rstrip(".")           # docstring, for fields without a note
        notes = {f.name: notes.get(f.name) or f"{whole}: {f.name}" for f in dataclasses.fields(cls)}
    out = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(hints.get(f.name)) and dataclasses.is_dataclass(value):
            out += describe_settings(type(value), key, value)
        else:
            how = f.name in getattr(cls, "HOW", ())
            out.append((key, value, ("[how the work runs; decides nothing] " if how else "") + notes.get(f.name, "")))
    return out
