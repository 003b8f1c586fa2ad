"""Strict configuration: YAML -> typed, frozen dataclasses.

Every config section is a frozen dataclass whose fields are declared with `option(...)`, which
carries the key's documentation. Loading is strict: an unknown key, a wrong type or a missing
required key raises `ConfigError` naming the file and the dotted key path. Dotted `key=value`
overrides (values parsed as YAML) are applied before validation, so they are checked too.
`dump_config` writes a resolved config that `load_config` reads back to an equal object.

The JSON schema Snakemake validates `config/config.yaml` with is generated from the same
dataclasses (`json_schema`), so the documentation, the loader and the schema cannot drift.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

from a2tgpo.io import atomic_write_text

# yaml is imported where files are read or written: declaring configs (a2tgpo.algo.methods)
# needs the standard library only

T = TypeVar("T")
_FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")

_MISSING = dataclasses.MISSING


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the file and the dotted key."""


class InvalidKey(ValueError):
    """Raised by a config's `__post_init__` about one of its keys: the loader reports it under
    that key's dotted path (`key` may itself be dotted or indexed: "rollout.topk",
    "train[1].repo")."""

    def __init__(self, key: str, msg: str):
        super().__init__(f"{key}: {msg}")
        self.key, self.msg = key, msg


def refuse_repeats(key: str, values: tuple) -> None:
    """InvalidKey naming the first value of `values` (the list at `key`) that repeats one."""
    for i, v in enumerate(values):
        if v in values[:i]:
            raise InvalidKey(f"{key}[{i}]", f"{v!r} is listed twice ({key}[{values.index(v)}])")


def check_device(key: str, name: str) -> None:
    """InvalidKey unless `name` is "auto" or a device torch can parse (a known type, maybe with
    an index), whether or not this machine has one."""
    if name == "auto":
        return
    import torch

    try:
        torch.device(name)
    except (RuntimeError, ValueError) as e:
        raise InvalidKey(key, f"{name!r} is not a torch device ({e}); use auto, cpu, cuda or "
                              "cuda:<index>") from None


# seeds reach numpy's legacy seeding (vLLM's LLM(seed=), Optuna's grid sampler), which takes
# 0 <= seed < 2**32; torch.manual_seed takes more, random.Random any int
SEED_LIMIT = 2**32

# Names the config turns into paths. NAME: the study, grid sets, training tracks and regimes,
# sweeps: folders of the results, words of the DAG's shell commands, Snakemake targets (sets,
# sweeps). FILE_NAME: one file or folder name that an id elsewhere also spells (a backbone id, a
# dataset, a downloaded file). Neither can be '.', '..', hidden, absolute or hold a separator.
NAME = re.compile(r"[a-z][a-z0-9_]*")
FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def name_error(name: Any) -> str | None:
    """Why `name` is not a NAME (None: it is one)."""
    if isinstance(name, str) and NAME.fullmatch(name):
        return None
    return (f"{name!r}: use lowercase letters, digits and _, starting with a letter (the name "
            "is a folder of the results and a word of the workflow's shell commands)")


def file_name_error(name: Any) -> str | None:
    """Why `name` is not a FILE_NAME (None: it is one)."""
    if isinstance(name, str) and FILE_NAME.fullmatch(name):
        return None
    return (f"{name!r}: use letters, digits, '.', '_' and '-', starting with a letter or digit "
            "(one file or folder name: no path)")


_BOUNDS = {"ge": (">=", lambda v, b: v >= b), "gt": (">", lambda v, b: v > b),
           "le": ("<=", lambda v, b: v <= b), "lt": ("<", lambda v, b: v < b)}
_SCHEMA_BOUNDS = {"ge": "minimum", "gt": "exclusiveMinimum", "le": "maximum",
                  "lt": "exclusiveMaximum"}


def option(default: Any = _MISSING, doc: str = "", *, factory: Any = _MISSING,
           ge: float | None = None, gt: float | None = None, le: float | None = None,
           lt: float | None = None) -> Any:
    """Declare a config key with its documentation (no default = required key) and, for a
    number (or each number of a list or mapping), its range: `ge`/`gt`/`le`/`lt` = the value
    must be >=, >, <=, < the bound (checked at load, and in the JSON schema)."""
    if not doc:
        raise TypeError("every config key must be documented")
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    kwargs: dict[str, Any] = {"metadata": {"doc": doc, "bounds": bounds}}
    if default is not _MISSING:
        kwargs["default"] = default
    if factory is not _MISSING:
        kwargs["default_factory"] = factory
    return dataclasses.field(**kwargs)


# --------------------------------------------------------------------------------------------
# dict -> dataclass


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if tp is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if origin is tuple:
        return f"list of {_type_name(get_args(tp)[0])}"
    if origin is dict:
        return f"mapping of str to {_type_name(get_args(tp)[1])}"
    if dataclasses.is_dataclass(tp):
        return f"mapping ({tp.__name__})"
    return getattr(tp, "__name__", str(tp))


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """typing.get_type_hints, once per class: it re-evaluates every annotation string, and the
    DAG validates hundreds of nested configs."""
    return typing.get_type_hints(cls)


def _fail(source: str, path: str, msg: str) -> ConfigError:
    return ConfigError(f"{source}: {path or '<root>'}: {msg}")


class _NotFinite(ConfigError):
    """A float key given inf or NaN (kept apart so that `float | None` reports it as such)."""


def _check_bounds(bounds: dict, value: Any, source: str, path: str) -> None:
    """Every number in `value` (a number, or the numbers of a list or mapping) within range."""
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            _check_bounds(bounds, v, source, f"{path}[{i}]")
        return
    if isinstance(value, dict):
        for k, v in value.items():
            _check_bounds(bounds, v, source, f"{path}.{k}")
        return
    if not isinstance(value, (int, float)):
        return
    broken = [k for k, b in bounds.items() if not _BOUNDS[k][1](value, b)]
    if broken or value != value:  # NaN compares false with every bound
        # ints exactly (a seed's 2**32 is not 4.29497e+09)
        need = " and ".join(f"{_BOUNDS[k][0]} {b if isinstance(b, int) else f'{b:g}'}"
                            for k, b in bounds.items()) or "a number"
        raise _fail(source, path, f"{value!r} is out of range: must be {need}")


def _convert(tp: Any, value: Any, source: str, path: str) -> Any:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arg in get_args(tp):
            try:
                return _convert(arg, value, source, path)
            except ConfigError as e:
                errors.append(e)
        for e in errors:  # the float branch's reason is more precise than the type list
            if isinstance(e, _NotFinite):
                raise e
        raise _fail(source, path, f"expected {_type_name(tp)}, got {value!r}")
    if tp is type(None):
        if value is None:
            return None
        raise _fail(source, path, f"expected null, got {value!r}")
    if origin is Literal:
        if value in get_args(tp) and type(value) in {type(a) for a in get_args(tp)}:
            return value
        raise _fail(source, path, f"expected {_type_name(tp)}, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _fail(source, path, f"expected bool, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _fail(source, path, f"expected int, got {value!r}")
    if tp is float:
        # YAML 1.1 (PyYAML) reads 1e-6 (no dot) as a string; accept it where a float is due
        if (isinstance(value, (int, float)) and not isinstance(value, bool)
                or isinstance(value, str) and _FLOAT_RE.fullmatch(value.strip())):
            try:
                out = float(value)
            except OverflowError:  # an int beyond the float range
                out = math.inf
            # no key means "unbounded" by .inf, and NaN passes every comparison a job makes
            if not math.isfinite(out):
                raise _NotFinite(str(_fail(source, path, f"{value!r} is not a finite number")))
            return out
        raise _fail(source, path, f"expected float, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise _fail(source, path, f"expected str, got {value!r}")
    if origin is tuple:
        (item,) = [a for a in get_args(tp) if a is not Ellipsis]
        if not isinstance(value, (list, tuple)):
            raise _fail(source, path, f"expected {_type_name(tp)}, got {value!r}")
        return tuple(_convert(item, v, source, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        _, item = get_args(tp)
        if not isinstance(value, dict):
            raise _fail(source, path, f"expected {_type_name(tp)}, got {value!r}")
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise _fail(source, f"{path}.{k}", "keys must be strings")
            out[k] = _convert(item, v, source, f"{path}.{k}" if path else k)
        return out
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, source=source, path=path)
    raise TypeError(f"unsupported config type {tp!r} at {path}")


def from_dict(cls: type[T], data: Any, *, source: str = "<dict>", path: str = "",
              base: Any = None) -> T:
    """Build dataclass `cls` from a plain mapping, strictly (see module docstring).

    `base`: the value keys missing from `data` take (a field's own default, e.g. its
    factory's, rather than the class defaults), so that `a.b.c=1` on a field whose default
    sets other keys of `b` keeps them."""
    if not isinstance(data, dict):
        raise _fail(source, path, f"expected a mapping ({cls.__name__}), got {data!r}")
    hints = _type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            near = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            # a setting another section owns (class attribute ELSEWHERE: key -> its dotted key)
            if (owner := getattr(cls, "ELSEWHERE", {}).get(key)) is not None:
                hint = f" (set it as {owner})"
            where = f"{path}.{key}" if path else str(key)
            raise _fail(source, where, f"unknown key{hint}; valid keys: {', '.join(fields)}")
    kwargs = {}
    for name, f in fields.items():
        where = f"{path}.{name}" if path else name
        if name in data:
            default = (getattr(base, name) if base is not None else
                       f.default_factory() if f.default_factory is not _MISSING else None)
            if (isinstance(data[name], dict) and dataclasses.is_dataclass(hints[name])
                    and isinstance(default, hints[name])):
                kwargs[name] = from_dict(hints[name], data[name], source=source, path=where,
                                         base=default)
            else:
                kwargs[name] = _convert(hints[name], data[name], source, where)
            _check_bounds(f.metadata.get("bounds", {}), kwargs[name], source, where)
        elif base is not None:
            kwargs[name] = getattr(base, name)
        elif f.default is _MISSING and f.default_factory is _MISSING:
            raise _fail(source, where, f"missing required key ({f.metadata.get('doc', '')})")
    try:
        return cls(**kwargs)
    except InvalidKey as e:
        key = e.key if not path else f"{path}{e.key}" if e.key.startswith("[") else \
            f"{path}.{e.key}"
        raise _fail(source, key, e.msg) from e
    except (ValueError, TypeError) as e:  # __post_init__ cross-field checks
        raise _fail(source, path, str(e)) from e


# --------------------------------------------------------------------------------------------
# files and overrides


class DuplicateKey(ValueError):
    """A YAML mapping sets one key twice (PyYAML would keep the last value silently)."""

    def __init__(self, key: str, line: int, first: int):
        super().__init__(f"line {line}: {key}: duplicate key (first set at line {first})")
        self.key, self.line, self.first = key, line, first


@functools.cache
def _strict_loader() -> type:
    """yaml's safe loader, but a key set twice in one mapping is an error. Merge keys (`<<:`)
    still work: the keys they bring in may be overridden, as YAML defines."""
    import yaml

    base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    merge_tag = "tag:yaml.org,2002:merge"

    class StrictLoader(base):  # type: ignore[misc, valid-type]
        def construct_document(self, node):
            self._key_paths = _key_paths(node)
            return super().construct_document(node)

        def construct_mapping(self, node, deep=False):
            seen: dict[Any, int] = {}  # key -> line it was first set on
            for key_node, _ in node.value:  # before the merge keys are expanded
                merge = key_node.tag == merge_tag
                key = "<<" if merge else self.construct_object(key_node)
                line = key_node.start_mark.line + 1
                try:
                    first = seen.get((merge, key))
                except TypeError:  # an unhashable key: the base class reports it
                    continue
                if first is not None:
                    where = self._key_paths.get(id(node), "")
                    raise DuplicateKey(f"{where}.{key}" if where else str(key), line, first)
                seen[(merge, key)] = line
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


def _key_paths(root: Any) -> dict[int, str]:
    """Dotted path of every mapping node under `root` (id -> "a.b[2].c"), for error messages."""
    import yaml

    paths: dict[int, str] = {}
    todo = [(root, "")]
    while todo:  # depth first in document order: an anchor comes before its aliases
        node, path = todo.pop()
        if id(node) in paths:  # an alias: named where its anchor is
            continue
        paths[id(node)] = path
        if isinstance(node, yaml.MappingNode):
            children = [(v, f"{path}.{k.value}" if path else str(k.value))
                        for k, v in node.value]
        elif isinstance(node, yaml.SequenceNode):
            children = [(v, f"{path}[{i}]") for i, v in enumerate(node.value)]
        else:
            continue
        todo.extend(reversed(children))
    return paths


def yaml_load(text: str) -> Any:
    """Parse YAML like yaml.safe_load, except that a duplicate key raises DuplicateKey: every
    config file and override of the project is read through here."""
    import yaml

    return yaml.load(text, Loader=_strict_loader())  # a SafeLoader subclass


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a", "b", "c"], yaml-parsed value)."""
    import yaml

    key, sep, raw = text.partition("=")
    if not sep or not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override {text!r}: expected dotted.key=value")
    try:
        value = yaml_load(raw) if raw.strip() else ""
    except DuplicateKey as e:
        raise ConfigError(f"override {text!r}: {key}.{e.key}: duplicate key") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML: {e}") from e
    return key.split("."), value


def apply_overrides(data: dict, overrides: typing.Iterable[str]) -> dict:
    """Return a copy of `data` with dotted overrides applied (unknown keys fail at validation)."""
    import copy

    out = copy.deepcopy(data)
    for text in overrides:
        keys, value = parse_override(text)
        node = out
        for i, k in enumerate(keys[:-1]):
            nxt = node.setdefault(k, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {text!r}: {'.'.join(keys[: i + 1])} is not a mapping")
            node = nxt
        node[keys[-1]] = value
    return out


def format_value(x: float) -> str:
    """Shortest text that reads back as the same float; integers without '.0' (cell paths and
    the tags that name them)."""
    s = repr(float(x))
    return s[:-2] if s.endswith(".0") else s


def read_yaml(path: str | Path) -> dict:
    import yaml

    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    try:
        data = yaml_load(text)
    except DuplicateKey as e:
        raise ConfigError(f"{path}: line {e.line}: {e.key}: duplicate key (first set at line "
                          f"{e.first}; YAML would keep the last value silently)") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: <root>: expected a mapping, got {type(data).__name__}")
    return data


def load_config(
    cls: type[T], path: str | Path, overrides: typing.Iterable[str] = (), *,
    section: str | None = None
) -> T:
    """Load `path` (optionally only its top-level `section`) into `cls`, with overrides."""
    data = read_yaml(path)
    source = str(path)
    if section is not None:  # dotted: "corpus.download" reads data["corpus"]["download"]
        for i, part in enumerate(section.split(".")):
            where = ".".join(section.split(".")[: i + 1])
            data = data.get(part, {})  # an absent section means "all defaults"
            if not isinstance(data, dict):
                raise ConfigError(f"{path}: {where}: expected a mapping")
    overrides = list(overrides)
    if overrides:
        source = f"{path} (with overrides {' '.join(overrides)})"
        data = apply_overrides(data, overrides)
    return from_dict(cls, data, source=source, path=section or "")


def to_dict(obj: Any) -> Any:
    """Dataclass -> plain YAML-able data (tuples become lists)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def dump_yaml(data: Any) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True)


def dump_config(obj: Any, path: str | Path) -> None:
    """Write a resolved config atomically; `load_config(type(obj), path) == obj`."""
    atomic_write_text(path, dump_yaml(to_dict(obj)))


# --------------------------------------------------------------------------------------------
# documentation and JSON schema (one source of truth: the dataclasses)


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """Rows (dotted key, type, default, doc) for every key of `cls`, nested sections included."""
    rows = []
    hints = _type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            default = "(section, below)"
        elif f.default is not _MISSING:
            default = repr(to_dict(f.default))
        elif f.default_factory is not _MISSING:
            default = repr(to_dict(f.default_factory()))
        else:
            default = "(required)"
        rows.append((key, _type_name(tp), default, f.metadata.get("doc", "")))
        if dataclasses.is_dataclass(tp):
            rows.extend(describe(tp, key + "."))
    return rows


def _schema(tp: Any) -> dict:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [_schema(a) for a in get_args(tp)]}
    if tp is type(None):
        return {"type": "null"}
    if origin is Literal:
        return {"enum": list(get_args(tp))}
    simple = {bool: "boolean", int: "integer", float: "number", str: "string"}
    if tp in simple:
        return {"type": simple[tp]}
    if origin is tuple:
        return {"type": "array", "items": _schema(get_args(tp)[0])}
    if origin is dict:
        return {"type": "object", "additionalProperties": _schema(get_args(tp)[1])}
    if dataclasses.is_dataclass(tp):
        return json_schema(tp)
    raise TypeError(f"unsupported config type {tp!r}")


def _schema_bounds(prop: dict, bounds: dict) -> None:
    """Put a key's range on the number schemas inside `prop` (union branches, list items,
    mapping values)."""
    if not bounds:
        return
    if prop.get("type") in ("integer", "number"):
        prop.update({_SCHEMA_BOUNDS[k]: b for k, b in bounds.items()})
    for sub in prop.get("anyOf", []):
        _schema_bounds(sub, bounds)
    for key in ("items", "additionalProperties"):
        if isinstance(prop.get(key), dict):
            _schema_bounds(prop[key], bounds)


def json_schema(cls: type) -> dict:
    """JSON schema (draft 2020-12 subset) of dataclass `cls`, with each key's doc as description."""
    hints = _type_hints(cls)
    props, required = {}, []
    for f in dataclasses.fields(cls):
        prop = _schema(hints[f.name])
        _schema_bounds(prop, f.metadata.get("bounds", {}))
        prop["description"] = f.metadata.get("doc", "")
        if f.default is _MISSING and f.default_factory is _MISSING:
            required.append(f.name)
        props[f.name] = prop
    out: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        out["required"] = required
    return out
