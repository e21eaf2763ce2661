"""The config machinery (services/config/flags.py): a field's annotation and metadata make its flag, its
argparse choices, its environment parsing and its checks, once for every field of every service."""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing

import pytest

from ddtree.config import (
    AutoOnOff,
    ConfigBase,
    DrafterConfig,
    GatewayConfig,
    SecurityConfig,
    VerifierConfig,
    add_config_flags,
    config_from_flags,
)
from ddtree.config.flags import field_types, literal_choices, one_of, option

SERVICE_CONFIGS = (DrafterConfig, VerifierConfig, GatewayConfig, SecurityConfig)


@dataclasses.dataclass(frozen=True)
class Toy(ConfigBase):
    flag_group = "toy"

    mode: AutoOnOff = option("auto", "a switch")
    shape: typing.Literal["round", "square"] = option("round", "a shape")
    size: int = option(4, "a size", at_least=1, at_most=8)
    floor: int = option(0, "a floor", at_least=-1)
    rate: float = option(1.0, "a rate", above=0)
    loud: bool = option(False, "a flag")


def _action(parser: argparse.ArgumentParser, dest: str) -> argparse.Action:
    return next(a for a in parser._actions if a.dest == dest)


def test_a_literal_annotation_is_the_flags_choices_and_the_check():
    parser = argparse.ArgumentParser()
    add_config_flags(parser, Toy)
    assert _action(parser, "mode").choices == ("auto", "on", "off")
    assert _action(parser, "shape").choices == ("round", "square")
    assert _action(parser, "size").choices is None
    args = parser.parse_args(["--mode", "on", "--size", "8", "--loud", "yes"])
    assert config_from_flags(Toy, args, environ={}) == Toy(mode="on", size=8, loud=True)
    with pytest.raises(SystemExit):
        parser.parse_args(["--mode", "sideways"])
    # The environment is not argparse: the same choices are checked by validate, with the field's name.
    with pytest.raises(ValueError, match=r"^mode must be auto, on or off, got 'sideways'$"):
        config_from_flags(Toy, None, environ={"DDTREE_MODE": "sideways"})
    with pytest.raises(ValueError, match=r"^shape must be round or square, got 'oval'$"):
        Toy(shape="oval").validate()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"size": 0}, r"^size must be in \[1, 8\], got 0$"),
        ({"size": 9}, r"^size must be in \[1, 8\], got 9$"),
        ({"floor": -2}, r"^floor must be >= -1, got -2$"),
        ({"rate": 0.0}, r"^rate must be > 0, got 0.0$"),
        ({"rate": float("nan")}, r"^rate must be > 0, got nan$"),
    ],
)
def test_bounds_from_metadata(change, message):
    Toy().validate()
    with pytest.raises(ValueError, match=message):
        Toy(**change).validate()


def test_environment_values_are_parsed_by_annotation():
    cfg = config_from_flags(Toy, None, environ={"DDTREE_SIZE": "3", "DDTREE_RATE": "0.5", "DDTREE_LOUD": "on"})
    assert (cfg.size, cfg.rate, cfg.loud) == (3, 0.5, True)
    with pytest.raises(ValueError, match=r"^DDTREE_SIZE='x' is not a valid int$"):
        config_from_flags(Toy, None, environ={"DDTREE_SIZE": "x"})
    with pytest.raises(ValueError, match=r"^DDTREE_LOUD='maybe' is not a valid bool$"):
        config_from_flags(Toy, None, environ={"DDTREE_LOUD": "maybe"})


def test_one_of():
    assert one_of(("on", "off")) == "on or off"
    assert one_of(("auto", "on", "off")) == "auto, on or off"
    assert one_of(("only",)) == "only"


@pytest.mark.parametrize("cls", SERVICE_CONFIGS, ids=lambda c: c.__name__)
def test_every_choice_field_of_every_service_is_a_flag_choice_and_checked(cls):
    """Every Literal field: its flag offers exactly its values, its default is one of them, and any other
    value is refused by validate with a message naming the field, the value and the values allowed."""
    parser = argparse.ArgumentParser()
    add_config_flags(parser, cls)
    hints = field_types(cls)
    literal_fields = [f for f in dataclasses.fields(cls) if literal_choices(hints[f.name]) is not None]
    assert literal_fields or cls is SecurityConfig
    for f in literal_fields:
        choices = literal_choices(hints[f.name])
        assert _action(parser, f.name).choices == choices and f.default in choices
        with pytest.raises(ValueError, match=re.escape(f"{f.name} must be {one_of(choices)}, got 'bogus'")):
            dataclasses.replace(cls(), **{f.name: "bogus"}).validate()
    cls().validate()  # the defaults are valid


def test_the_choices_each_service_declares():
    hints = {cls: field_types(cls) for cls in SERVICE_CONFIGS}
    assert literal_choices(hints[VerifierConfig]["cuda_graphs"]) == ("auto", "on", "off")
    assert literal_choices(hints[DrafterConfig]["cuda_graphs"]) == ("auto", "on", "off")
    assert literal_choices(hints[VerifierConfig]["dtype"]) == ("float32", "bfloat16", "float16")
    assert literal_choices(hints[DrafterConfig]["dtype"]) == ("auto", "float32", "bfloat16", "float16")
    assert literal_choices(hints[VerifierConfig]["tree_cut"]) == ("cost", "fixed")
    assert literal_choices(hints[GatewayConfig]["http_metrics"]) == ("auto", "open", "key", "off")
    with pytest.raises(ValueError, match=r"^cuda_graphs must be auto, on or off, got 'yes'$"):
        VerifierConfig(cuda_graphs="yes").validate()


@pytest.mark.parametrize("cls", SERVICE_CONFIGS, ids=lambda c: c.__name__)
def test_help_is_grouped_and_carries_no_measurements(cls):
    """One --help section per group of fields, each flag in one; a help says what a flag does, not what
    it measured (figures go to docs/performance.md)."""
    parser = argparse.ArgumentParser()
    add_config_flags(parser, cls)
    titles = [g.title for g in parser._action_groups if g._group_actions][1:]  # after argparse's "options"
    assert len(titles) == len(set(titles))
    flags = [a.dest for g in parser._action_groups[2:] for a in g._group_actions]
    assert sorted(flags) == sorted(f.name for f in dataclasses.fields(cls))
    measured = re.compile(r"\d\s*(tok/s|ms\b|µs|us\b|MiB|GiB/s|GB/s|s each)")
    for f in dataclasses.fields(cls):
        assert f.metadata["help"] and not measured.search(f.metadata["help"]), (f.name, f.metadata["help"])
