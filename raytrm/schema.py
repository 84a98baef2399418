"""The machinery of raytrm's typed configs: fields with their rules, checked loading from mappings, YAML files.

A config is a dataclass whose fields come from spec(): a default, a one-line description and a validation rule.
from_dict rejects unknown keys, wrong types and out-of-range values with one line naming the file, the field path,
what was received, what was expected and how to fix it. raytrm.config holds the configs themselves.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import json
import math
import os
import tempfile
import types
import typing
from dataclasses import field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from raytrm import __version__
from raytrm.errors import ConfigError, UserError

T = TypeVar("T")


def spec(
    default: Any,
    doc: str,
    *,
    choices: tuple | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    when: tuple[str, ...] | None = None,
) -> Any:
    """A dataclass field with its description and validation rule.

    when: the values of the config's `name` (model family, dataset kind) the field applies to; None = all.
    """
    rules = {"doc": doc, "choices": choices, "ge": ge, "gt": gt, "le": le, "when": when}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=rules)
    if dataclasses.is_dataclass(default):
        return field(default_factory=lambda: dataclasses.replace(default), metadata=rules)
    return field(default=default, metadata=rules)


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def applies(f: dataclasses.Field, name: str) -> bool:
    """Whether the field applies to a config whose `name` (model family, dataset kind) is name."""
    when = f.metadata.get("when")
    return when is None or name in when


def check_applies(obj: Any, source: str, prefix: str) -> None:
    """Refuse a field set away from its default where it does not apply (to this model family, dataset kind)."""
    for f in dataclasses.fields(obj):
        if not applies(f, obj.name) and getattr(obj, f.name) != _default(f):
            when = f.metadata["when"]
            raise ConfigError(
                source,
                f"{prefix}.{f.name}",
                getattr(obj, f.name),
                f"no value: it applies to {' and '.join(when)}, not {obj.name}",
                f"remove it, or set {prefix}.name to {when[0]}",
            )


# ---------------------------------------------------------------------------------------------------------------
# Validation


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    names = {
        int: "an integer",
        float: "a finite number",
        str: "a string",
        bool: "true or false",
        list: "a list",
        dict: "a mapping",
    }
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def _coerce(value: Any, tp: Any, source: str, path: str) -> Any:
    """Check value against the annotation tp; returns the value (dataclasses built, ints widened to float)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, source, path)
            except ConfigError:
                pass
        raise ConfigError(source, path, value, _type_name(tp))
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, source, path)
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        # YAML's .inf and .nan are floats, but no field means them: an infinite rate or budget is a typo.
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, tp)
    if not ok:
        raise ConfigError(source, path, value, _type_name(tp))
    return value


def _check_rules(value: Any, meta: typing.Mapping, source: str, path: str) -> None:
    if value is None:
        return
    if meta.get("choices") is not None and value not in meta["choices"]:
        raise ConfigError(source, path, value, "one of " + ", ".join(map(str, meta["choices"])))
    for key, ok, word in (
        ("ge", lambda v, b: v >= b, ">="),
        ("gt", lambda v, b: v > b, ">"),
        ("le", lambda v, b: v <= b, "<="),
    ):
        bound = meta.get(key)
        if bound is not None and not ok(value, bound):
            raise ConfigError(source, path, value, f"a value {word} {bound}")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """A config class's resolved field types: resolving them is most of the time of checking a small config, and a
    space's check builds thousands."""
    return typing.get_type_hints(cls)


def from_dict(cls: type[T], data: Any, source: str = "<config>", prefix: str = "") -> T:
    """Build the dataclass cls from a mapping, rejecting unknown keys and invalid values with one clear line."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(source, prefix or "(top level)", data, "a mapping of field: value")
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"did you mean '{close[0]}'?" if close else "remove it"
            raise UserError(f"{source}: {path}: unknown field; {hint} (known: {', '.join(fields)})")
        value = _coerce(value, hints[key], source, path)
        _check_rules(value, fields[key].metadata, source, path)
        kwargs[key] = value
    obj = cls(**kwargs)
    if hasattr(obj, "validate"):
        obj.validate(source, prefix or cls.__name__)
    return obj


def to_dict(obj: Any) -> dict:
    """A plain dict (YAML-ready) of a config dataclass, without the fields that do not apply to it.

    A field that does not apply (a transformer field in a TRM config, a Sudoku field of a text dataset) is always at
    its default, so leaving it out loses nothing and keeps profiles and run configs to what matters.
    """
    out = {}
    for f in dataclasses.fields(obj):
        if hasattr(obj, "name") and not applies(f, obj.name):
            continue
        value = getattr(obj, f.name)
        out[f.name] = to_dict(value) if dataclasses.is_dataclass(value) else copy.deepcopy(value)
    return out


def describe(cls: type) -> dict[str, str]:
    """Field name -> one-line description, for help texts and docs."""
    return {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(cls)}


# ---------------------------------------------------------------------------------------------------------------
# YAML files


#: Bounds of a YAML file's data. No raytrm file comes near them; deeper or larger data (an alias bomb: each use of
#: an alias counts) would exhaust the stack or the time of the code that walks it.
MAX_DEPTH, MAX_VALUES = 64, 100_000


def read_yaml(path: str | os.PathLike) -> Any:
    """Parse a YAML file; a missing or malformed file is a UserError naming the file and the line."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: no such file; check the path")
    too_big = (
        f"{p}: data nested deeper than {MAX_DEPTH} levels or of more than {MAX_VALUES} values (each use of an alias"
        " counts); no raytrm file needs that: check the file"
    )
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or "invalid YAML"
        raise UserError(f"{p}: malformed YAML{where}: {problem}; fix the syntax there") from None
    except UnicodeDecodeError:
        raise UserError(f"{p}: not a text file; expected UTF-8 YAML") from None
    except RecursionError:
        raise UserError(too_big) from None
    except OSError as e:
        raise UserError(f"{p}: cannot read it ({e.strerror}); check its permissions") from None
    stack, count = [(data, 1)], 0
    while stack:  # iterative, so the check itself cannot exhaust the stack
        node, depth = stack.pop()
        count += 1
        if depth > MAX_DEPTH or count > MAX_VALUES:
            raise UserError(too_big)
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children)
    return data


def check_version(data: Any, source: str, key: str, version: int, missing: str, again: str) -> None:
    """The one rule of every versioned file (profile, space, tier table, tuning run): its `key` is a schema version
    this raytrm reads.

    missing: the fix where the key is absent (the file is likely not of this kind); again: how to get a file of this
    version from the file's origin (export it again, tune again), offered beside upgrading raytrm.
    """
    if not isinstance(data, dict) or key not in data:  # an empty file too: not a profile of all defaults
        raise ConfigError(source, key, None, f"schema version {version}", missing)
    found = data[key]
    if isinstance(found, bool) or not isinstance(found, int) or found < 1:
        raise ConfigError(
            source,
            key,
            found,
            f"a schema version, a whole number >= 1 (this raytrm reads {version})",
            f"set {key}: {version}, or {again}",
        )
    if found > version:
        raise UserError(
            f"{source}: {key} {found} is newer than this raytrm ({__version__}) reads ({version}); upgrade raytrm "
            f"(`pip install -U raytrm`), or {again}"
        )
    if found != version:
        raise UserError(f"{source}: {key} {found} is older than this raytrm ({__version__}) reads ({version}); {again}")


def read_versioned_yaml(path: str | os.PathLike, key: str, version: int, missing: str, again: str) -> Any:
    """Parse a YAML file that must carry `key: version` (a profile, a space); see check_version."""
    data = read_yaml(path)
    check_version(data, str(path), key, version, missing, again)
    return data


def read_json(path: str | os.PathLike, fix: str) -> dict[str, Any]:
    """Parse a JSON file raytrm wrote (a run's summary, a trial's result) that must hold one JSON object; anything
    else is a UserError naming the file, what was found and fix (what to do with a damaged file)."""
    p = Path(path)
    try:
        data = json.loads(p.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise UserError(f"{p}: no such file; check the path") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{p}: not a text file (invalid UTF-8 at byte {e.start}); expected JSON; {fix}") from None
    except ValueError as e:  # json.JSONDecodeError
        where = f" at line {e.lineno}, column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        msg = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
        raise UserError(f"{p}: not JSON{where} ({msg}); {fix}") from None
    except RecursionError:
        raise UserError(f"{p}: data nested too deep to be a raytrm file; {fix}") from None
    except OSError as e:
        raise UserError(f"{p}: cannot read it ({e.strerror}); check its permissions") from None
    if not isinstance(data, dict):
        raise ConfigError(str(p), "(top level)", data, "a JSON object of field: value", fix)
    return data


#: The kinds of field check_fields knows, as an error names them.
KINDS = {"number": "a number", "int": "an integer", "str": "a string", "list": "a list", "dict": "a mapping"}


def _is(value: Any, kind: str) -> bool:
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)  # NaN: a measurement that failed
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, {"str": str, "list": list, "dict": dict}[kind])


def check_fields(
    data: dict,
    source: str,
    kinds: dict[str, str],
    prefix: str = "",
    required: tuple = (),
    fix: str = "",
) -> None:
    """Check the fields raytrm reads of a record it wrote (a trial's result, a run's summary; other fields pass):
    each of `kinds` (number, int, str, list, dict) where present, null standing for not measured; the `required`
    ones present and not null. fix: what to do with a damaged record."""
    for name, kind in kinds.items():
        path = f"{prefix}{name}"
        if name not in data:
            if name in required:
                raise ConfigError(source, path, None, KINDS[kind], fix)
            continue
        value = data[name]
        if value is None and name not in required:
            continue
        if not _is(value, kind):
            raise ConfigError(source, path, value, KINDS[kind], fix)


def load(cls: type[T], path: str | os.PathLike) -> T:
    """Read and validate one config file."""
    return from_dict(cls, read_yaml(path), str(path))


def dump_yaml(data: Any) -> str:
    """YAML text of a config dataclass or plain data, in field order."""
    if dataclasses.is_dataclass(data):
        data = to_dict(data)
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def write_text_atomic(text: str, path: str | os.PathLike) -> Path:
    """Write a file atomically: a reader, or a process killed mid-write, never leaves a half-written one."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


def write_yaml(data: Any, path: str | os.PathLike) -> Path:
    """Write YAML atomically."""
    return write_text_atomic(dump_yaml(data), path)
