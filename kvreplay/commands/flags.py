"""Command-line flags generated from settings dataclasses (EngineConfig, ServerConfig), so a
knob's name, default, choices and help are written once, on its field (kvreplay.validate.knob).

A field `kv_cache_memory` becomes `--kv-cache-memory` (dest kv_cache_memory); int and float
defaults give the flag's type; a bool field is a switch (`--approx-prefill` turns a False
default on; a True default needs its own flag name, `--no-prefix-caching`, that turns it off).
"""
from __future__ import annotations

import argparse
from dataclasses import MISSING, fields

from kvreplay.validate import field_default


def _flag_kwargs(f) -> tuple[str, dict]:
    meta = f.metadata
    flag = meta["flag"] or "--" + f.name.replace("_", "-")
    default = meta["cli_default"] if meta["cli_default"] is not MISSING else field_default(f)
    help_text = meta["help"].replace("%", "%%")
    if isinstance(default, bool):
        if default and not meta["flag"]:  # "--enable-x" would read as turning it on
            raise ValueError(f"{f.name} defaults to True: its knob needs a flag that turns it off")
        state = "off" if default is False else "on; this flag turns it off"
        return flag, dict(dest=f.name, action="store_false" if default else "store_true",
                          help=f"{help_text} (default: {state})")
    kwargs = dict(dest=f.name, default=default,
                  help=f"{help_text} (default: {meta['default_help'] or '%(default)s'})")
    value_type = meta["type"] or (type(default) if type(default) in (int, float) else None)
    if value_type is not None:
        kwargs["type"] = value_type
    if meta["choices"]:
        kwargs["choices"] = list(meta["choices"])
    else:  # the metavar of the flag, as argparse names it, even where dest differs
        kwargs["metavar"] = flag.lstrip("-").replace("-", "_").upper()
    return flag, kwargs


def add_flags(parser, config_cls) -> None:
    """One flag per knob of `config_cls` (fields declared with cli=False have none)."""
    for f in fields(config_cls):
        if "help" in f.metadata and f.metadata["cli"]:
            flag, kwargs = _flag_kwargs(f)
            parser.add_argument(flag, **kwargs)


def config_from_args(config_cls, args: argparse.Namespace, **overrides):
    """`config_cls` from the parsed flags (add_flags); `overrides` win over them. A flag whose
    default is None and was not given leaves the field's own default (e.g. EngineConfig.device:
    $KVREPLAY_DEVICE, else cpu)."""
    kwargs = {}
    for f in fields(config_cls):
        if f.name in overrides:
            kwargs[f.name] = overrides[f.name]
        elif "help" in f.metadata and f.metadata["cli"] and hasattr(args, f.name):
            value = getattr(args, f.name)
            if value is None and f.metadata["cli_default"] is None:
                continue
            kwargs[f.name] = value
    return config_cls(**kwargs)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine flags every engine-backed command shares, one per EngineConfig knob."""
    from kvreplay.config import EngineConfig
    add_flags(parser.add_argument_group("engine"), EngineConfig)


def engine_config_from_args(args: argparse.Namespace):
    """The EngineConfig the engine flags (add_engine_args) describe."""
    from kvreplay.config import EngineConfig
    return config_from_args(EngineConfig, args)
