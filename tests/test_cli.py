"""ttsrl.cli: options built from dataclass fields, their help declared once on the field."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

import pytest

from ttsrl.cli import add_fields, given, option


@dataclass
class Demo:
    path: str = option(help="an input file")
    steps: int = option(3, help="how many steps")
    rate: Optional[float] = option(None, help="a rate, unset by default")
    fast: bool = option(False, help="go fast")
    mode: str = option("a", choices=("a", "b"), help="the mode")
    tags: tuple[str, ...] = option(("x",), choices=("x", "y", "z"), help="some tags")
    rule: str = option("r1", flag="--sampling-rule", help="renamed option")
    hidden: list[str] = option([], cli=False, help="set by code")


def parse(argv):
    p = argparse.ArgumentParser()
    add_fields(p, Demo)
    return given(p.parse_args(argv), Demo)


def test_only_typed_values_are_given_and_parsed_to_the_field_types():
    assert parse(["--path", "f"]) == {"path": "f"}
    got = parse(["--path", "f", "--steps", "5", "--rate", "0.5", "--fast", "yes", "--mode", "b",
                 "--tags", "y,z", "--sampling-rule", "r2"])
    assert got == {"path": "f", "steps": 5, "rate": 0.5, "fast": True, "mode": "b", "tags": ("y", "z"),
                   "rule": "r2"}
    assert Demo(**got).hidden == []
    assert parse(["--fast", "--path", "f"]) == {"fast": True, "path": "f"}  # a bool option alone is true
    assert parse(["--path", "f", "--fast", "off"]) == {"fast": False, "path": "f"}


@pytest.mark.parametrize("argv", [[], ["--path", "f", "--steps", "x"], ["--path", "f", "--fast", "maybe"],
                                  ["--path", "f", "--mode", "c"], ["--path", "f", "--tags", "x,w"],
                                  ["--path", "f", "--hidden", "h"]])
def test_bad_command_lines_are_refused(argv):
    with pytest.raises(SystemExit):
        parse(argv)


def test_help_is_the_field_help_with_its_default():
    p = argparse.ArgumentParser()
    add_fields(p, Demo)
    helps = {a.dest: a.help for a in p._actions}
    assert helps["steps"] == "how many steps (default: 3)" and helps["path"] == "an input file (required)"
    assert helps["tags"] == "some tags (default: x)" and helps["rate"].endswith("(default: none)")
    assert "hidden" not in helps


def test_a_field_without_help_is_an_error_naming_its_line():
    @dataclass
    class NoHelp:
        fine: int = option(1, help="documented")
        bare: int = 2

    with pytest.raises(TypeError, match=r"test_cli\.py:\d+: NoHelp\.bare has no help") as e:
        add_fields(argparse.ArgumentParser(), NoHelp)
    line = int(str(e.value).split(":")[1])
    assert open(__file__).read().splitlines()[line - 1].strip() == "bare: int = 2"


def test_an_unsupported_type_is_an_error():
    @dataclass
    class Odd:
        table: dict = option(None, help="a mapping")

    with pytest.raises(TypeError, match="Odd.table: type .* is not a command-line type"):
        add_fields(argparse.ArgumentParser(), Odd)
