"""The engine options as command-line flags: one flag per `EngineConfig` field (the `LLM(...)`
keyword with dashes for underscores), and the keyword arguments a parsed command line gives.

Shared by the `sparseserve` command and the benchmarks it runs."""
from __future__ import annotations

import argparse
import dataclasses
import json
import typing

from . import envs
from .config import EngineConfig
from .errors import ConfigError


def parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _field_default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field, named as in LLM(...)."""
    hints = typing.get_type_hints(EngineConfig)
    group = parser.add_argument_group("engine options (LLM(...) arguments)")
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        hint = str(hints[f.name])
        default = _field_default(f)
        doc = f"LLM({f.name}=...), default {default!r}"
        if f.type in (bool, "bool") or "bool" in hint:
            group.add_argument(flag, type=parse_bool, nargs="?", const=True, default=default, help=doc)
        elif "dict" in hint:
            group.add_argument(flag, type=json.loads, default=default, help=doc + " (JSON object)")
        elif hint.startswith("list[") or hint.startswith("typing.List") or "list[" in hint:
            item = int if "int" in hint else float if "float" in hint else str
            group.add_argument(flag, type=item, nargs="+", default=default, help=doc + " (space-separated)")
        elif "int" in hint and "str" not in hint:
            group.add_argument(flag, type=int, default=default, help=doc)
        elif "float" in hint and "str" not in hint:
            group.add_argument(flag, type=float, default=default, help=doc)
        else:
            group.add_argument(flag, type=str, default=default, help=doc)


NODE_OPTIONS = ("nnodes", "node_rank", "master_addr", "master_port")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The LLM(...) keyword arguments the flags set: only values that differ from the defaults, so a
    flag whose option is left at its default never reaches LLM(...). Under torchrun (one process
    per node) its node layout fills the node options that no flag gives."""
    out = {}
    for f in dataclasses.fields(EngineConfig):
        if hasattr(args, f.name):
            value = getattr(args, f.name)
            if value != _field_default(f) or f.name == "model":
                out[f.name] = value
    layout = envs.torchrun_layout()
    if layout is not None and hasattr(args, "nnodes"):
        if layout["local_world_size"] != 1:
            raise ConfigError(f"torchrun started {layout['local_world_size']} processes per node; start one "
                              "(--nproc-per-node 1): sparseserve starts a worker per local rank itself")
        for name in NODE_OPTIONS:
            out.setdefault(name, layout[name])
    return out
