"""Prose that cannot drift: README.md and docs/*.md link only to files that exist, and every command
they print parses its flags against today's code (a dry parse: nothing is run or written)."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

import config
from conftest import REPO, load_entry_point

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
ENTRY = re.compile(r"^(train|sample|data)\.py$|^scripts/\w+\.py$")


class Parsed(Exception):
    """Raised by the patched parser once the flags parsed: the script stops before doing anything."""


def code_fragments(text: str) -> list[str]:
    """Lines of fenced code blocks (continuations joined) and inline code spans."""
    blocks = re.findall(r"```[^\n]*\n(.*?)```", text, re.S)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    spans = [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", prose)]
    return lines + spans


def commands(page: Path) -> list[tuple[str, list[str]]]:
    """(script, argv) of every `python SCRIPT ...` or `torchrun ... SCRIPT ...` written on the page."""
    text = page.read_text()
    variables = dict(re.findall(r'\b([A-Z][A-Z0-9_]+)="([^"]*)"', text))  # e.g. ADAMW="--optimizer adamw"
    found = []
    for fragment in code_fragments(text):
        for name, value in variables.items():
            fragment = fragment.replace(f"${name}", value)
        for part in re.split(r"&&|;", fragment):
            if not re.search(r"\b(python|torchrun)\s.*(\.py)\b", part):
                continue  # prose in backticks, a log line, an error message
            words = shlex.split(part.replace("\\|", "|"), comments=True)  # a broken quote fails here, loudly
            starts = [i for i, w in enumerate(words) if ENTRY.match(w) and i > 0
                      and (words[i - 1] == "python" or words[0] == "torchrun")]
            if starts:
                found.append((words[starts[0]], words[starts[0] + 1:]))
    return found


def dry_parse(script: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Parse argv as the script would, then stop; raises SystemExit(2) on a flag it does not know."""
    if script in ("train.py", "scripts/doctor.py"):  # both read the training config's command line
        config.parse_args(argv)
        return
    original = config.CommandLine.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise Parsed

    monkeypatch.setattr(config.CommandLine, "parse_args", parse_then_stop)
    with pytest.raises(Parsed):
        load_entry_point(script).main(argv)


ALL_COMMANDS = [(page, script, argv) for page in PAGES for script, argv in commands(page)]


def test_the_pages_print_commands_for_every_entry_point():
    scripts = {script for _, script, _ in ALL_COMMANDS}
    assert {"train.py", "sample.py", "data.py", "scripts/doctor.py", "scripts/bench.py"} <= scripts


@pytest.mark.parametrize("page, script, argv", ALL_COMMANDS,
                         ids=[f"{p.name}:{s}:{' '.join(a)[:60]}" for p, s, a in ALL_COMMANDS])
def test_every_printed_command_parses(page, script, argv, monkeypatch, capsys):
    try:
        dry_parse(script, argv, monkeypatch)
    except SystemExit as stop:  # --help exits 0; anything else is a flag the code no longer has
        assert stop.code == 0 and "--help" in argv, f"{page.name}: `{script} {' '.join(argv)}`: {capsys.readouterr().err}"
    except config.ConfigError as err:
        pytest.fail(f"{page.name}: `{script} {' '.join(argv)}`: {err}")


def relative_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:", t) and t.split("#")[0]]


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_relative_link_resolves(page):
    missing = [t for t in relative_links(page) if not (page.parent / t).exists()]
    assert not missing, f"{page.relative_to(REPO)} links to missing files: {missing}"


def test_the_readme_fits_in_one_sitting():
    assert len((REPO / "README.md").read_text().splitlines()) <= 250
