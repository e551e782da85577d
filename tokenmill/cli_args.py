"""argparse flags generated from the config dataclasses, so the CLI and the Python API agree."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from tokenmill.config import SECTIONS, EngineConfig
from tokenmill.sampling_params import SamplingParams

_TYPES = {"str": str, "int": int, "float": float}
_SAMPLING_FLAGS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos")


def _add_field(group, field: dataclasses.Field, help_text: str | None = None,
               default: Any = dataclasses.MISSING) -> None:
    flag = "--" + field.name.replace("_", "-")
    type_name = str(field.type).replace(" | None", "").replace("Optional[", "").rstrip("]")
    value = field.default if default is dataclasses.MISSING else default
    # argparse %-formats help text (%(default)s); the config's prose may say "27%".
    help_text = (help_text or field.metadata.get("help", "")).replace("%", "%%")
    if type_name == "bool":
        group.add_argument(flag, action=argparse.BooleanOptionalAction, default=value,
                           help=help_text)
        return
    group.add_argument(flag, type=_TYPES[type_name], default=value, help=help_text,
                       choices=field.metadata.get("choices"))


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One flag per config field; `skip` leaves out fields the command sets its own way."""
    names = []
    for section, klass in SECTIONS.items():
        group = parser.add_argument_group(f"{section} options")
        for field in dataclasses.fields(klass):
            if field.name not in skip:
                _add_field(group, field)
                names.append(field.name)
    parser.set_defaults(engine_fields=names)


def engine_config(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    values = {name: getattr(args, name) for name in args.engine_fields}
    return EngineConfig.from_kwargs(**values, **overrides)


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int | None = 256) -> None:
    group = parser.add_argument_group("sampling options")
    fields = {f.name: f for f in dataclasses.fields(SamplingParams)}
    for name in _SAMPLING_FLAGS:
        default = max_tokens if name == "max_tokens" else dataclasses.MISSING
        _add_field(group, fields[name], help_text=f"SamplingParams.{name}", default=default)
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    values = {name: getattr(args, name) for name in _SAMPLING_FLAGS}
    return SamplingParams(stop=tuple(args.stop), **values)
