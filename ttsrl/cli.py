"""Command-line options declared by dataclass fields: each setting is written once, with its help.

A config dataclass declares its settings with :func:`option`; a CLI builds its parser
from the fields and parses straight into the config::

    @dataclass
    class Config:
        data: str = option(help="training file")                  # no default: a required option
        lr: float = option(1e-6, help="learning rate")
        loggers: tuple[str, ...] = option(("console",), help="where logs go", choices=LOGGERS)

    p = argparse.ArgumentParser()
    add_fields(p, Config)                  # --data, --lr, --loggers
    cfg = Config(**given(p.parse_args(), Config))

Field metadata (``option`` fills it): ``help`` (required: a field without it is an error
that names its FILE:LINE), ``flag`` (the option's name when not ``--field-name``),
``choices`` (allowed values; for a tuple field, allowed items), ``metavar``, ``cli=False``
(a field set by code, not an option), ``negated=True`` (a bool field whose flag, e.g.
``--no-length-guard``, sets it false), ``parse`` (a function from the typed text to the
value, for any other type; ValueError is a usage error), ``append=True`` (a repeatable
option: the field is the list of its values, each parsed, not split at commas; with
``positional=True`` the values are the positional arguments, one or more), ``nargs``
(with ``parse``: several values after one flag, argparse's ``nargs``), ``aliases``
(short flags, e.g. ``("-i",)``) and ``group`` (the title of the ``--help`` section it is
listed in). Types:
``str``, ``int``, ``float``, ``bool`` (``--flag`` alone is true; or a value: true/false,
1/0, yes/no, on/off), ``Optional[X]`` and ``tuple[X, ...]`` (comma-separated).

Every option's argparse default is ``None``, so :func:`given` returns only the values
typed on the command line: the caller layers them over the dataclass defaults (or a
preset) and the dataclass's own checks (``__post_init__``) judge the result.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import types
import typing

METAVARS = {int: "INT", float: "FLOAT", str: "STR", bool: "BOOL"}
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def option(default=dataclasses.MISSING, *, help: str, default_factory=dataclasses.MISSING, **meta):
    """A dataclass field carrying its command-line help (and ``flag``/``choices``/``cli``...)."""
    metadata = {"help": help, **meta}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false (1/0, yes/no, on/off), got {text!r}")


def field_location(cls: type, name: str) -> str:
    """``FILE:LINE`` where field ``name`` of ``cls`` is declared (best effort)."""
    try:
        lines, start = inspect.getsourcelines(cls)
        path = inspect.getsourcefile(cls)
    except (OSError, TypeError):
        return f"{cls.__module__}.{cls.__qualname__}"
    for node in ast.parse(textwrap.dedent("".join(lines))).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return f"{path}:{start + node.lineno - 1}"
    return f"{path}:{start}"


def _where(cls: type, f: dataclasses.Field) -> str:
    """``FILE:LINE: Class.field`` for an error message; only then, since finding the line parses the
    class's source (about 20 ms a field: most of a large CLI's start-up, were it done for every field)."""
    return f"{field_location(cls, f.name)}: {cls.__name__}.{f.name}"


def _item_type(hint) -> tuple[type, bool]:
    """(scalar type, is a tuple of them) of a field's annotation, Optional removed."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _item_type(args[0]) if len(args) == 1 else (hint, False)
    if origin is tuple:
        args = typing.get_args(hint)
        return (args[0], True) if len(args) == 2 and args[1] is Ellipsis else (hint, False)
    return hint, False


def _default_text(f: dataclasses.Field) -> str:
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return "none" if value is None else str(value)


def option_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of ``cls`` that are command-line options."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", True)]


def _split(text: str, conv, choices, flag: str) -> tuple:
    items = tuple(conv(x.strip()) for x in text.split(",") if x.strip())
    bad = [x for x in items if choices and x not in choices]
    if bad:
        raise argparse.ArgumentTypeError(f"{flag}: {bad} not in {tuple(choices)}")
    return items


def _parser_of(parse):
    """``parse`` as an argparse type: its ValueError becomes a usage error naming the problem."""
    def conv(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return conv


def group(parser: argparse.ArgumentParser, title: str):
    """The argument group of ``parser`` titled ``title`` (made when missing)."""
    for g in parser._action_groups:
        if g.title == title:
            return g
    return parser.add_argument_group(title)


def add_fields(parser, cls: type, *, skip: tuple[str, ...] = ()) -> None:
    """Add one option per field of the dataclass ``cls`` to ``parser`` (or an argument group),
    except the fields named in ``skip`` (a CLI that sets them its own way).

    Raises ``TypeError`` naming the field's FILE:LINE for a field without help or of a
    type this module does not parse."""
    hints = typing.get_type_hints(cls)
    for f in option_fields(cls):
        if f.name in skip:
            continue
        target = parser
        if f.metadata.get("group") and isinstance(parser, argparse.ArgumentParser):
            target = group(parser, f.metadata["group"])
        text = f.metadata.get("help")
        if not text:
            raise TypeError(f"{_where(cls, f)} has no help: declare it with option(..., help=...)")
        flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
        names = (flag, *f.metadata.get("aliases", ()))
        choices = f.metadata.get("choices")
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        default = "" if f.metadata.get("append") or f.metadata.get("negated") else f" (default: {_default_text(f)})"
        kw: dict = {"dest": f.name, "default": None, "required": required,
                    "help": (text + (" (required)" if required else default)).replace("%", "%%")}
        if f.metadata.get("negated"):  # --no-x alone: the field is false
            target.add_argument(*names, action="store_const", const=False, **kw)
            continue
        if "metavar" in f.metadata:
            kw["metavar"] = f.metadata["metavar"]
        if "parse" in f.metadata or f.metadata.get("append"):
            kw["type"] = _parser_of(f.metadata.get("parse", str))
            kw.setdefault("metavar", "VALUE")
            if "nargs" in f.metadata:  # e.g. "*": --steps 1 2 3 (a list of parsed values)
                kw["nargs"] = f.metadata["nargs"]
            if choices:
                kw["choices"] = tuple(choices)
            if f.metadata.get("positional"):  # NAME [NAME ...]: argparse names it by its dest
                del kw["dest"], kw["required"]
                target.add_argument(f.name, nargs="+" if f.metadata.get("append") else None, **kw)
            else:
                target.add_argument(*names, action="append" if f.metadata.get("append") else "store", **kw)
            continue
        item, many = _item_type(hints[f.name])
        if item not in METAVARS:
            raise TypeError(f"{_where(cls, f)}: type {hints[f.name]} is not a command-line type (str, int, float, bool, "
                            "Optional[X], tuple[X, ...]); declare parse=FUNCTION for another")
        conv = parse_bool if item is bool else item
        if many:
            kw["type"] = lambda s, conv=conv, choices=choices, flag=flag: _split(s, conv, choices, flag)
            kw.setdefault("metavar", "[,".join(choices) + "]" * (len(choices) - 1) if choices
                          else f"{METAVARS[item]}[,{METAVARS[item]}...]")
        else:
            kw["type"] = conv
            if item is bool:  # --flag alone means true; --flag false also parses
                kw.update(nargs="?", const=True)
            if choices:
                kw["choices"] = tuple(choices)
            else:
                kw.setdefault("metavar", METAVARS[item])
        target.add_argument(*names, **kw)


def given(args: argparse.Namespace, cls: type) -> dict:
    """The fields of ``cls`` set on the command line (parsed by a parser built with :func:`add_fields`)."""
    return {f.name: getattr(args, f.name) for f in option_fields(cls) if getattr(args, f.name, None) is not None}


def parse_into(parser: argparse.ArgumentParser, cls: type, args: argparse.Namespace, **values):
    """``cls(**values, **given(args, cls))``: a config from the command line (``values``: fields
    set by code, e.g. nested configs); its ValueError (``__post_init__``) is a usage error."""
    try:
        return cls(**values, **given(args, cls))
    except ValueError as e:
        parser.error(str(e))
