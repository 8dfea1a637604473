"""One mapping from a typed config (a pydantic model) to command-line flags and back.

Every field becomes `--field-name` with the field's description as its help; a flag left out keeps the
model's default. A bad value fails as `ConfigError`, which names the field (as its flag) and says why. A
config too large for flags (training's) is a YAML file plus `key=value` overrides, every key in the help.
Whichever command meets a bad setting ends with exit code 2 and `error: <field>: <why>` (`bad_settings_exit`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import types
import typing
from collections.abc import Iterator, Sequence
from pathlib import Path

from pydantic import AfterValidator, BaseModel, ValidationError, ValidationInfo

from mars_ray.core.errors import ConfigError


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _json_object(text: str, info: ValidationInfo) -> str:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(info.field_name, f"not JSON ({error})") from None
    if not isinstance(value, dict):
        raise ConfigError(info.field_name, f"must be a JSON object, got {text}")
    return text


# A flag whose value is a JSON object (`--fields '{"tau": 0.5}'`), kept as its text, checked as it parses.
JsonObject = typing.Annotated[str, AfterValidator(_json_object)]


def _scalar(annotation) -> tuple[type | None, tuple | None]:
    """The argparse type and choices of an annotation (Optional and Literal unwrapped)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) is typing.Literal:
        choices = typing.get_args(annotation)
        return type(choices[0]), choices
    return (str if annotation is Path else annotation), None


def add_config_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    config: type[BaseModel],
    exclude: frozenset[str] = frozenset(),
) -> None:
    """A flag per field of `config` (but `exclude`), typed, with its description and default in the help."""
    for name, field in config.model_fields.items():
        if name in exclude:
            continue
        annotation = field.annotation
        many = typing.get_origin(annotation) in (list, tuple)
        kind, choices = _scalar(typing.get_args(annotation)[0] if many else annotation)
        help_text = field.description or ""
        if not field.is_required():
            help_text += f" (default: {field.get_default(call_default_factory=True)})"
        options: dict = {"dest": name, "help": help_text.strip(), "default": argparse.SUPPRESS}
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        else:
            options.update(type=kind, choices=choices, nargs="+" if many else None)
        parser.add_argument(flag(name), required=field.is_required(), **options)


def add_override_arguments(parser: argparse.ArgumentParser, config: type[BaseModel]) -> None:
    """`key=value` arguments replacing values of `config` (parsed as YAML), every key listed in the help."""
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="replace a config value (YAML)")
    parser.epilog = keys_help(config)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter


def keys_help(config: type[BaseModel]) -> str:
    """Every field of `config` as `key=value` help: name, description, default (for `key=value` commands)."""
    lines = []
    for name, field in config.model_fields.items():
        default = "required" if field.is_required() else field.get_default(call_default_factory=True)
        lines.append(f"  {name}: {field.description or ''} (default: {default})")
    return "config keys (YAML values):\n" + "\n".join(lines)


def given(config: type[BaseModel], args: argparse.Namespace) -> dict:
    """The fields of `config` that the parsed flags set (a flag left out is absent, not its default)."""
    return {name: getattr(args, name) for name in config.model_fields if hasattr(args, name)}


def config_from_args(config: type[BaseModel], args: argparse.Namespace, **values):
    """The config the parsed flags describe (`values` added), validated."""
    return validated(config, {**given(config, args), **values}, name=_flag_of)


def _flag_of(field: str) -> str:
    """The flag that gave `field`: a list's item (`taus.0`) came from the list's flag (`--taus`)."""
    return flag(re.sub(r"(\.\d+)+$", "", field))


Config = typing.TypeVar("Config", bound=BaseModel)


def parse_command(config: type[Config], argv: Sequence[str] | None = None, **parser_options) -> Config:
    """The config of a standalone command (`python -m ...`): a flag per field of `config`, parsed from `argv`
    (None: the command line), by a parser made with `parser_options` (prog, description, ...); a bad value
    ends the command as `mars-ray`'s do (`bad_settings_exit`), before it starts any work."""
    parser = argparse.ArgumentParser(**parser_options)
    add_config_arguments(parser, config)
    args = parser.parse_args(argv)
    with bad_settings_exit(parser.prog):
        return config_from_args(config, args)


@contextlib.contextmanager
def bad_settings_exit(prog: str) -> Iterator[None]:
    """Inside it, a bad setting ends the command with exit code 2 (argparse's, for a bad command line) and
    `<prog>: error: <field>: <why>` on stderr. A bad setting: a `ConfigError` (or any `ValueError`), a typed
    config that failed validation (training's YAML), a file not readable."""
    try:
        yield
    except (ValueError, OSError) as error:  # pydantic's ValidationError is a ValueError too
        shown = config_error(error) if isinstance(error, ValidationError) else error
        print(f"{prog}: error: {shown}", file=sys.stderr)
        raise SystemExit(2) from None


def validated(config: type[BaseModel], values: dict, name=lambda field: field):
    """`config(**values)`, or a `ConfigError` naming the first bad field as `name(field)` shows it."""
    try:
        return config(**values)
    except ValidationError as error:
        raise config_error(error, name) from None


def config_error(error: ValidationError, name=lambda field: field) -> ConfigError:
    """The first problem of a failed validation as a `ConfigError` on its field, shown as `name(field)`."""
    first = error.errors()[0]
    field = ".".join(str(part) for part in first["loc"])
    raised = first.get("ctx", {}).get("error")  # a validator's ConfigError: its message, no "Value error, "
    why = raised.message if isinstance(raised, ConfigError) else first["msg"]
    return ConfigError(name(field) if field else error.title, why)
