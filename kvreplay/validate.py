"""Checks of settings, each written once, and `knob()`: a dataclass field that carries its help,
default and check.

The checks (`check_int`, `check_number`, `check_choice`, `check_bool`, `parse_bytes`) raise a
ValueError that names the setting and the value; they return the value (parsed, for sizes).
A settings class declares each field with `knob(...)` and calls `check_knobs(self)` in its
`__post_init__`: the field's help is then its one description, read by `knob_docs` (the class
docstring) and by kvreplay.commands.flags (the command-line flags). The bottom floor of the
layers: imports nothing from kvreplay.
"""
from __future__ import annotations

import inspect
import re
import textwrap
from dataclasses import MISSING, field, fields
from typing import Any, Callable, Iterable

# check(name, value, owner) -> the value, parsed (owner: the settings object, for checks that
# depend on another field)
Check = Callable[[str, Any, Any], Any]

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(name: str, value, minimum: int | None = None, maximum: int | None = None, *,
              optional: bool = False):
    """`value` is an int (not a bool) in [minimum, maximum], or None when `optional`."""
    if value is None and optional:
        return value
    if not _is_int(value) or (minimum is not None and value < minimum) \
            or (maximum is not None and value > maximum):
        if minimum is not None and maximum is not None:
            what = f"an integer from {minimum} to {maximum}"
        elif minimum == 1:
            what = "a positive integer"
        elif minimum is not None:
            what = f"an integer >= {minimum}"
        else:
            what = "an integer" if maximum is None else f"an integer <= {maximum}"
        raise ValueError(f"{name} must be {what}{' or None' if optional else ''}, got {value!r}")
    return value


def check_number(name: str, value, low: float, high: float | None = None, *, low_open: bool = False,
                 optional: bool = False, what: str | None = None):
    """`value` is an int or float in [low, high] ((low, high] with `low_open`; >= low without
    `high`), or None when `optional`. `what` says what the number is: "a share of attention"."""
    if value is None and optional:
        return value
    above_low = _is_number(value) and (value > low if low_open else value >= low)
    if not above_low or (high is not None and value > high):
        if high is None:
            interval = f"{'>' if low_open else '>='} {low}"
        else:
            interval = f"in {'(' if low_open else '['}{low}, {high}]"
        raise ValueError(f"{name} must be {what + ' ' if what else ''}{interval}"
                         f"{' or None' if optional else ''}, got {value!r}")
    return value


def check_choice(name: str, value, choices: Iterable):
    """`value` is one of `choices`."""
    choices = list(choices)
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; use one of {', '.join(map(str, choices))}")
    return value


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def parse_bytes(value: int | str) -> int:
    """`268435456`, `"256MiB"`, `"1.5GB"` -> bytes (positive)."""
    if isinstance(value, bool):
        raise TypeError(f"expected a size in bytes or a string like '256MiB', got {value!r}")
    if isinstance(value, (int, float)):
        size = int(value)
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot parse size {value!r}: use bytes or a unit like '256MiB', '2GB'")
        size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    else:
        raise TypeError(f"expected a size in bytes or a string like '256MiB', got {type(value).__name__}")
    if size <= 0:
        raise ValueError(f"size must be positive, got {value!r}")
    return size


# Checks for `knob(check=...)`, built from the functions above.

def ints(minimum: int | None = None, maximum: int | None = None, optional: bool = False) -> Check:
    return lambda name, value, owner: check_int(name, value, minimum, maximum, optional=optional)


def numbers(low: float, high: float | None = None, *, low_open: bool = False, optional: bool = False,
            what: str | None = None) -> Check:
    return lambda name, value, owner: check_number(name, value, low, high, low_open=low_open,
                                                   optional=optional, what=what)


def one_of(choices: Iterable) -> Check:
    choices = tuple(choices)
    return lambda name, value, owner: check_choice(name, value, choices)


def boolean(name: str, value, owner) -> bool:
    return check_bool(name, value)


def applying(parse: Callable[[Any], Any]) -> Check:
    """A check from a one-argument parser that raises on a bad value: `applying(parse_bytes)`."""
    return lambda name, value, owner: parse(value)


def knob(default=MISSING, help: str = "", *, default_factory=MISSING, check: Check | None = None,
         parsed: str | None = None, choices: Iterable | None = None, flag: str | None = None,
         type: Callable | None = None, cli: bool = True, cli_default=MISSING,
         default_help: str | None = None):
    """A dataclass field declared with everything said about it.

    help: what the setting means (the docstring line and the flag's help).
    check: validates the value (check_knobs); `parsed` names an attribute that receives the
        check's result ("kv_cache_bytes" for kv_cache_memory).
    choices: the values a flag accepts (default: any, or what `check` accepts).
    flag, type: the flag's name ("--no-prefix-caching") and argparse type, when the field's name
        and default do not say them. cli=False: no flag.
    cli_default: the flag's default when it is not the field's (None: "not given, the field's
        own default applies"); default_help: the default in words, where `%(default)s` would not
        say it ("$KVREPLAY_DEVICE, else cpu").
    """
    metadata = {"help": help, "check": check, "parsed": parsed,
                "choices": tuple(choices) if choices else None, "flag": flag, "type": type,
                "cli": cli, "cli_default": cli_default, "default_help": default_help}
    return field(default=default, default_factory=default_factory, metadata=metadata)


def check_knobs(owner) -> None:
    """Run every knob's check on `owner`, in field order, storing parsed values where asked."""
    for f in fields(owner):
        check = f.metadata.get("check")
        if check is None:
            continue
        result = check(f.name, getattr(owner, f.name), owner)
        if f.metadata.get("parsed"):
            setattr(owner, f.metadata["parsed"], result)


def field_default(f):
    """A field's declared default (the factory's value for a default_factory), or MISSING."""
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def knob_docs(cls):
    """Class decorator: append an "Attributes:" section written from the knobs' help, so
    `help(cls)` describes each field without the docstring repeating it."""
    lines = ["", "Attributes:"]
    for f in fields(cls):
        if "help" not in f.metadata:
            continue
        if f.metadata["default_help"]:
            default = f.metadata["default_help"]
        elif f.default is not MISSING:
            default = repr(f.default)
        else:
            default = None
        text = f"{f.name}: {f.metadata['help']}" + (f" (default: {default})" if default else "")
        lines += textwrap.wrap(text, 96, initial_indent="    ", subsequent_indent="        ")
    cls.__doc__ = inspect.cleandoc(cls.__doc__ or "") + "\n" + "\n".join(lines) + "\n"
    return cls
