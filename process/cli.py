"""Command lines with train.py's manners, for every entry point, and help that comes from the code.

A mistake is one line and exit 2 (``CommandLine``: ``error: unknown flag `--tmp`; did you mean `--temp`?``),
never argparse's usage block, and the usage names the command the user typed (``python -m scripts.eval``).
config/__init__.py makes train.py's flags (and python -m prepare's corpus flags) with ``add_flag`` and types
their values with ``parse_typed``.
"""
from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
import typing
from typing import Any, NoReturn

from process.errors import ConfigError, fail


def did_you_mean(word: str, known: list[str], what: str) -> str:
    """The end of an unknown-name error: the closest known name, or where to find them all."""
    close = difflib.get_close_matches(word, known, n=1)
    return f"; did you mean `{close[0]}`?" if close else f"; run with --help to list every {what}"


BOOL_WORDS = dict.fromkeys(("1", "true", "yes", "on"), True) | dict.fromkeys(("0", "false", "no", "off"), False)


def type_name(kind: Any) -> str:
    """What --help and errors call a field's type (int, float, bool or str): a Literal's values are str."""
    return "str" if typing.get_origin(kind) is typing.Literal else kind.__name__


def parse_typed(name: str, kind: Any, raw: Any) -> Any:
    """A TOML or command-line value as the type ``kind`` (int, float, bool, str or a Literal of str), or a
    ConfigError naming the field ``name``. A Literal's values are checked by the caller (config.validate)."""
    expected = type_name(kind)
    try:
        if expected == "bool":
            return raw if isinstance(raw, bool) else BOOL_WORDS[str(raw).lower()]
        if expected in ("int", "float") and isinstance(raw, bool):  # True is 1 to Python, never to a user
            raise ValueError
        if expected == "int":
            if isinstance(raw, float) and not raw.is_integer():
                raise ValueError
            return int(raw.replace("_", "")) if isinstance(raw, str) else int(raw)
        return float(raw) if expected == "float" else str(raw)
    except (KeyError, ValueError):
        raise ConfigError(f"{name} must be {expected}, got {raw!r}") from None


def add_flag(parser: Any, name: str, kind: Any, help: str) -> None:
    """``--name`` (and ``--na-me`` for ``na_me``) on a parser or one of its groups, for a field of type ``kind``:
    its text is kept for parse_typed and it is absent unless given (argparse.SUPPRESS); a bool stands alone
    (``--resume``) or takes a value (``--resume false``); a Literal's values are its metavar."""
    flags = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
    is_bool, choices = type_name(kind) == "bool", typing.get_args(kind)
    parser.add_argument(*flags, dest=name, default=argparse.SUPPRESS, nargs="?" if is_bool else None,
                        const="true" if is_bool else None, help=help,
                        metavar="{" + ",".join(choices) + "}" if choices else type_name(kind).upper())


def peek(argv: list[str] | None, flag: str) -> str | None:
    """The value ``flag`` has in ``argv`` (None if absent), read before the full parse (whose --help may need it)."""
    early = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    early.add_argument(flag, dest="value", default=None)
    return early.parse_known_args(argv)[0].value


def parse_known(parser: argparse.ArgumentParser, argv: list[str] | None) -> tuple[dict[str, Any], str | None]:
    """The values of the flags ``parser`` knows, and the name of the first one it does not (``--max_iter=5``:
    ``max_iter``) or None; a stray word that is no flag is a ConfigError."""
    args, unknown = parser.parse_known_args(argv)
    word = next((word for word in unknown if word.startswith("-")), unknown[0] if unknown else None)
    if word is not None and not word.startswith("-"):
        raise ConfigError(f"unexpected argument `{word}`")
    return vars(args), word and word.lstrip("-").split("=")[0]


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
    """argparse with train.py's manners, for every other entry point: a mistake is one line and exit 2."""

    def __init__(self, **kwargs: Any):
        kwargs.setdefault("formatter_class", DefaultsOnce)
        kwargs.setdefault("prog", typed_command())
        super().__init__(allow_abbrev=False, **kwargs)  # an abbreviation that later grows ambiguous breaks scripts

    def parse_args(self, args=None, namespace=None):  # noqa: D102 - argparse's signature
        # intermixed: positionals may stand between flags (bench's `dtype=float32 --threads 1 compile=on`)
        parsed, unknown = self.parse_known_intermixed_args(args, namespace)
        flag = next((u.split("=")[0] for u in unknown if u.startswith("-")), None)
        if flag is not None:
            known = [s for action in self._actions for s in action.option_strings]
            self.error(f"unknown flag `{flag}`" + did_you_mean(flag, known, "flag"))
        if unknown:
            self.error(f"unexpected argument `{unknown[0]}`; run with --help to list every flag")
        return parsed

    def error(self, message: str) -> NoReturn:  # argparse calls this for bad values and missing arguments too
        fail(message)  # exit 2, as for any bad input
