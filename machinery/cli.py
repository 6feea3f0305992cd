"""Command lines with train.py's manners, for every entry point, and help that comes from the code.

A mistake is one line and exit 2 (``CommandLine``: ``error: unknown flag `--tmp`; did you mean `--temp`?``),
never argparse's usage block; a flag's help is the comment beside its dataclass field (``field_comments``),
so --help cannot drift from the declaration. config/__init__.py builds train.py's command line from these,
machinery/corpora.py python data.py's.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import re
import typing
from typing import Any, NoReturn

from machinery.errors import fail


def did_you_mean(word: str, known: list[str], what: str) -> str:
    """The end of an unknown-name error: the closest known name, or where to find them all."""
    close = difflib.get_close_matches(word, known, n=1)
    return f"; did you mean `{close[0]}`?" if close else f"; run with --help to list every {what}"


def field_comments(cls: type) -> dict[str, str]:
    """The comment beside each field of the dataclass ``cls`` (``name: type = default  # comment``): its help."""
    names = {f.name for f in dataclasses.fields(cls)}
    comments = {}
    for line in inspect.getsource(cls).splitlines():
        name, sep, rest = line.strip().partition(":")
        if sep and name in names and "#" in rest:
            comments[name] = rest.split("#", 1)[1].strip()
    return comments


def add_field_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """A flag for each field of the dataclass ``cls`` (``--data_path`` and ``--data-path``): its type, a Literal's
    values as the choices, its default, and its comment as the help."""
    helps, kinds = field_comments(cls), typing.get_type_hints(cls)
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


class CommandLine(argparse.ArgumentParser):
    """argparse with train.py's manners, for every other entry point: a mistake is one line, never
    the usage block. ``error: unknown flag `--tmp`; did you mean `--temp`?`` then exit code 2.
    """

    def __init__(self, **kwargs: Any):
        kwargs.setdefault("formatter_class", DefaultsOnce)
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
