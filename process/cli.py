"""Command lines with train.py's manners, for every entry point, and help that comes from the code.

A mistake is one line and exit 2 (``CommandLine``: ``error: unknown flag `--tmp`; did you mean `--temp`?``),
never argparse's usage block, and the usage names the command the user typed (``python -m scripts.eval``).
A dataclass field declared with ``option(default, help)`` carries its help (``field_helps``), so --help and
``help(cls)`` read it from the declaration and cannot drift from it. config/__init__.py builds train.py's
command line from these, data.py python data.py's.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import sys
import typing
from typing import Any, NoReturn

from process.errors import fail


def did_you_mean(word: str, known: list[str], what: str) -> str:
    """The end of an unknown-name error: the closest known name, or where to find them all."""
    close = difflib.get_close_matches(word, known, n=1)
    return f"; did you mean `{close[0]}`?" if close else f"; run with --help to list every {what}"


def option(default: Any, help: str) -> Any:
    """A dataclass field and its help, one line: ``block_size: int = option(128, "context length in tokens")``.
    ``default`` may be ``dataclasses.MISSING`` (a field every caller gives)."""
    return dataclasses.field(default=default, metadata={"help": help})


def field_helps(cls: type) -> dict[str, str]:
    """The help of each field of the dataclass ``cls`` (declared with ``option``; "" for a field without)."""
    return {field.name: field.metadata.get("help", "") for field in dataclasses.fields(cls)}


def add_field_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """A flag for each field of the dataclass ``cls`` (``--data_path`` and ``--data-path``): its type, a Literal's
    values as the choices, its default and its help."""
    helps, kinds = field_helps(cls), typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        flags = [f"--{field.name}"] + ([f"--{field.name.replace('_', '-')}"] if "_" in field.name else [])
        choices = typing.get_args(kinds[field.name]) or None  # a Literal's values; None for str, int, float
        parser.add_argument(*flags, type=str if choices else kinds[field.name], choices=choices,
                            default=field.default, help=helps.get(field.name, ""))


class DefaultsOnce(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to a flag's help, except where the help already says what its default means
    (``(default: newest out/**/best.pt)``) or X would print as nothing: never two defaults, never an empty one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if re.search(r"\(default|default:", text) or action.default in (None, ""):
            return text
        return super()._get_help_string(action)


def typed_command() -> str:
    """The command that started this process, as the user typed it: ``python -m scripts.eval`` for a module
    (argparse would say ``eval.py``, which runs nothing: the scripts import the repo as a package), else the
    script's name as argparse gives it (``train.py``)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        return f"python -m {spec.name.removesuffix('.__main__')}"  # python -m pkg runs pkg.__main__
    return os.path.basename(sys.argv[0])


class CommandLine(argparse.ArgumentParser):
    """argparse with train.py's manners, for every other entry point: a mistake is one line, never
    the usage block. ``error: unknown flag `--tmp`; did you mean `--temp`?`` then exit code 2.
    """

    def __init__(self, **kwargs: Any):
        kwargs.setdefault("formatter_class", DefaultsOnce)
        kwargs.setdefault("prog", typed_command())
        super().__init__(allow_abbrev=False, **kwargs)  # an abbreviation that later grows ambiguous breaks scripts

    def parse_args(self, args=None, namespace=None):  # noqa: D102 - argparse's signature
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self.error(self.unknown_message(unknown))
        return parsed

    def unknown_message(self, unknown: list[str]) -> str:
        flag = next((u.split("=")[0] for u in unknown if u.startswith("-")), None)
        if flag is None:
            return f"unexpected argument `{unknown[0]}`; run with --help to list every flag"
        known = [s for action in self._actions for s in action.option_strings]
        return f"unknown flag `{flag}`" + did_you_mean(flag, known, "flag")

    def error(self, message: str) -> NoReturn:  # argparse calls this for bad values and missing arguments too
        fail(message)  # exit 2, as for any bad input
