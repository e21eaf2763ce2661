"""The machinery every service config shares: a field's flag, environment variable, parsing and checks.

A config field `foo_bar` is set, in order of precedence, by the flag `--foo-bar`, the environment variable
`DDTREE_FOO_BAR`, or its default. Its annotation says how a flag or variable is parsed: `bool`, `int`,
`float`, `str`, or a `Literal` of strings, whose values are the allowed ones (argparse offers them as
choices, `ConfigBase.validate` checks them; the value stays a plain string). Its metadata, written by
`option`, holds its help and its bounds. `add_config_flags` and `config_from_flags` are the only code that
reads flags and environment for configuration, so the docker files and the CLI can be checked against
`env_var_names()`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import typing
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal

ENV_PREFIX = "DDTREE_"

# The choice of a feature that decides for itself by default: auto = the service decides (and logs why),
# on = required (the service refuses to start where it cannot), off = never.
AutoOnOff = Literal["auto", "on", "off"]

_BOUNDS = ("at_least", "at_most", "above")


def option(default: Any, help: str, *, at_least: Any = None, at_most: Any = None, above: Any = None) -> Any:
    """A config field: its default, its help (what it does; --help adds the default and the variable), and
    the bounds `ConfigBase.validate` checks (at_least <= value <= at_most, value > above; None = none)."""
    given = {"at_least": at_least, "at_most": at_most, "above": above}
    bounds = {name: bound for name, bound in given.items() if bound is not None}
    return dataclasses.field(default=default, metadata={"help": help, **bounds})


def one_of(choices: tuple[str, ...]) -> str:
    """('auto', 'on', 'off') -> 'auto, on or off'."""
    return choices[0] if len(choices) == 1 else f"{', '.join(choices[:-1])} or {choices[-1]}"


def literal_choices(hint: Any) -> tuple[str, ...] | None:
    """The values of a `Literal[...]` annotation, or None for any other annotation."""
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else None


def check_field(name: str, value: Any, hint: Any, metadata: Mapping[str, Any]) -> None:
    """ValueError naming the field, the value and what is allowed, when the value is not one of the
    annotation's choices or is outside the field's bounds (`not value >= bound`: NaN is outside too)."""
    choices = literal_choices(hint)
    if choices is not None and value not in choices:
        raise ValueError(f"{name} must be {one_of(choices)}, got {value!r}")
    low, high, above = (metadata.get(bound) for bound in _BOUNDS)
    if low is not None and high is not None:
        if not low <= value <= high:
            raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    elif low is not None and not value >= low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    elif high is not None and not value <= high:
        raise ValueError(f"{name} must be <= {high}, got {value}")
    if above is not None and not value > above:
        raise ValueError(f"{name} must be > {above}, got {value}")


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """Field name -> its annotation, resolved (the modules use `from __future__ import annotations`)."""
    return typing.get_type_hints(cls)


@dataclasses.dataclass(frozen=True)
class ConfigBase:
    """The root of every config and of every group of fields. `validate` checks each field against its
    annotation's choices and its bounds; a group with rules across fields overrides it, calling super()
    first, and a service config composes groups by inheritance, so `config.page_size` stays flat."""

    flag_group: ClassVar[str] = ""  # the --help section of the fields a class declares

    def validate(self) -> None:
        hints = field_types(type(self))
        for f in dataclasses.fields(self):
            check_field(f.name, getattr(self, f.name), hints[f.name], f.metadata)


def env_var_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def env_var_names(cls: type[ConfigBase]) -> list[str]:
    return [env_var_name(f.name) for f in dataclasses.fields(cls)]


def parse_bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{raw!r} is not a boolean (true/false)")


def _parser_for(hint: Any) -> Callable[[str], Any]:
    if hint is bool:
        return parse_bool
    return str if literal_choices(hint) is not None else hint


def _type_name(hint: Any) -> str:
    return "string" if literal_choices(hint) is not None else hint.__name__


def _groups(cls: type[ConfigBase]) -> list[tuple[str, list[dataclasses.Field]]]:
    """The fields of `cls` by the class that declares them, the service's own first: (title, fields)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    groups: dict[str, list[dataclasses.Field]] = {}
    seen: set[str] = set()
    for klass in cls.__mro__:
        own = [fields[n] for n in vars(klass).get("__annotations__", {}) if n in fields and n not in seen]
        if own:
            groups.setdefault(klass.flag_group or klass.__name__, []).extend(own)
            seen.update(f.name for f in own)
    return list(groups.items())


def add_config_flags(parser: argparse.ArgumentParser, cls: type[ConfigBase]) -> None:
    """One flag per field, in one --help section per group; a flag's default is left unset so that
    config_from_flags can tell flag from environment."""
    hints = field_types(cls)
    for title, fields in _groups(cls):
        group = parser.add_argument_group(title)
        for f in fields:
            group.add_argument(
                "--" + f.name.replace("_", "-"),
                dest=f.name,
                type=_parser_for(hints[f.name]),
                choices=literal_choices(hints[f.name]),
                default=None,
                help=f"{f.metadata.get('help', '')} [env {env_var_name(f.name)}, default {f.default!r}]",
            )


def config_from_flags(
    cls: type[ConfigBase], args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None
) -> Any:
    """Flag > DDTREE_* environment > default, validated: the one place a service's config is made."""
    environ = os.environ if environ is None else environ
    hints = field_types(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        flag = getattr(args, f.name, None) if args is not None else None
        if flag is not None:
            values[f.name] = flag
        elif env_var_name(f.name) in environ:
            raw = environ[env_var_name(f.name)]
            try:
                values[f.name] = _parser_for(hints[f.name])(raw)
            except ValueError:
                raise ValueError(f"{env_var_name(f.name)}={raw!r} is not a valid {_type_name(hints[f.name])}") from None
    config = cls(**values)
    config.validate()
    return config
