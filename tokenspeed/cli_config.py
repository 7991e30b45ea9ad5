"""CLI flags generated from the config dataclasses: one kebab-case flag per field, help from its metadata."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from tokenspeed.errors import ConfigError


def _base_type(annotation: Any) -> tuple[type, bool]:
    """(scalar type, optional) of a field annotation like `int | None`."""
    hint = eval(annotation, vars(typing)) if isinstance(annotation, str) else annotation  # noqa: S307
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        inner = [a for a in args if a is not type(None)]
        return inner[0], True
    return hint, False


def add_config_args(parser: argparse.ArgumentParser, cls: type, title: str, skip: set[str] = frozenset()) -> None:
    """Add an argument group `title` with a flag for each field of dataclass `cls` (defaults: None = unset)."""
    group = parser.add_argument_group(title)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind, _ = _base_type(f.type)
        default = f.default if f.default is not dataclasses.MISSING else None
        text = f.metadata.get("help", "")
        if "default" not in text:
            text = f"{text} (default: {default})"
        # "%(default).0s" prints nothing; its presence stops argparse appending the unset None default again.
        help_text = text.replace("%", "%%") + "%(default).0s"
        if kind is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
        else:
            group.add_argument(flag, dest=f.name, type=kind, default=None, help=help_text)


def config_from_args(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """Instantiate `cls` from the flags the user set (unset flags keep the dataclass defaults)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
              if getattr(args, f.name, None) is not None}
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return cls(**values)
    except TypeError as e:  # a wrong type that argparse could not catch
        raise ConfigError(str(e)) from e
