"""Prose that cannot drift: README.md and docs/*.md link only to files that exist, and every command
they print parses its flags against today's code (a dry parse: nothing is run or written)."""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, TOOLS, entry_point, interop_if

import cli
import config

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),  # the guide
         *sorted((REPO / "docs" / "notebook").glob("*.md"))]  # the lab notebook: its commands still run
ENTRY = re.compile(r"^(train|sample)\.py$")  # the core's entry points, run as files: python train.py
TOOL = re.compile(r"^(scripts|dev)\.[a-z_]\w*$")  # python -m scripts.eval (`scripts.NAME` is a placeholder)
AS_A_FILE = re.compile(r"^(scripts|dev)/\w+\.py$")  # a tool run as a file: it would not find the repo's modules


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
    """(script, argv) of every `python SCRIPT ...`, `python -m TOOL ...` or `torchrun ... SCRIPT ...` on the page."""
    text = page.read_text()
    variables = dict(re.findall(r'\b([A-Z][A-Z0-9_]+)="([^"]*)"', text))  # e.g. ADAMW="--optimizer adamw"
    found = []
    for fragment in code_fragments(text):
        for name, value in variables.items():
            fragment = fragment.replace(f"${name}", value)
        for part in re.split(r"&&|;", fragment):
            if not re.search(r"\b(python|torchrun)\s.*(\.py\b|-m (scripts|dev)\.)", part):
                continue  # prose in backticks, a log line, an error message
            words = shlex.split(part.replace("\\|", "|"), comments=True)  # a broken quote fails here, loudly
            starts = [i for i, w in enumerate(words) if any(kind.match(w) for kind in (ENTRY, TOOL, AS_A_FILE))
                      and i > 0 and (words[i - 1] in ("python", "-m") or words[0] == "torchrun")]
            if starts:
                found.append((words[starts[0]], words[starts[0] + 1:]))
    return found


def dry_parse(script: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Parse argv as the script would, then stop; raises SystemExit(2) on a flag it does not know."""
    if script in ("train.py", "scripts.doctor"):  # both read the training config's command line
        config.parse_args(argv)
        return
    original = cli.CommandLine.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise Parsed

    monkeypatch.setattr(cli.CommandLine, "parse_args", parse_then_stop)
    with pytest.raises(Parsed):
        entry_point(script).main(argv)


ALL_COMMANDS = [(page, script, argv) for page in PAGES for script, argv in commands(page)]


def test_the_pages_print_commands_for_every_entry_point():
    scripts = {script for _, script, _ in ALL_COMMANDS}
    assert {"train.py", "sample.py", "scripts.prepare", "scripts.doctor", "scripts.bench"} <= scripts


@pytest.mark.parametrize("page, script, argv", [interop_if(s, p, s, a) for p, s, a in ALL_COMMANDS],
                         ids=[f"{p.name}:{s}:{' '.join(a)[:60]}" for p, s, a in ALL_COMMANDS])
def test_every_printed_command_parses(page, script, argv, monkeypatch, capsys):
    module = script.removesuffix(".py").replace("/", ".")
    removed = script.replace(".", "/") + ".py"  # dev.bench_sample -> dev/bench_sample.py
    if TOOL.match(script) and not (REPO / removed).exists():  # a one-off measurement, gone
        assert re.search(rf"git show [0-9a-f]{{7,40}}:{removed}", page.read_text()), (
            f"{page.name}: `{script}` is gone: say which commit still has it (`git show COMMIT:{removed}`)")
        return
    assert not AS_A_FILE.match(script), (f"{page.name}: `python {script}` finds neither config/ nor the project "
                                         f"folders (or, installed, another checkout's): write `python -m {module}`")
    try:
        dry_parse(script, argv, monkeypatch)
    except SystemExit as stop:  # --help exits 0; anything else is a flag the code no longer has
        assert stop.code == 0 and "--help" in argv, \
            f"{page.name}: `{script} {' '.join(argv)}`: {capsys.readouterr().err}"
    except cli.ConfigError as err:
        pytest.fail(f"{page.name}: `{script} {' '.join(argv)}`: {err}")


def relative_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:", t) and t.split("#")[0]]


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_relative_link_resolves(page):
    missing = [t for t in relative_links(page) if not (page.parent / t).exists()]
    assert not missing, f"{page.relative_to(REPO)} links to missing files: {missing}"


# ----------------------------------------------------------------------------- --help
HELP_ENTRY_POINTS = ["train.py", "sample.py", *TOOLS]


def help_of(script: str, argv: tuple[str, ...], capsys) -> str:
    """What `python SCRIPT ARGV --help` (or `python -m TOOL ARGV --help`) prints (argparse exits 0 after it)."""
    with pytest.raises(SystemExit) as stopped:
        entry_point(script).main([*argv, "--help"])
    assert stopped.value.code == 0
    return capsys.readouterr().out


def help_entries(text: str) -> dict[str, str]:
    """Argument (its flags, or a positional's name) -> its help, from --help output with the wrapping undone."""
    entries, current = {}, None
    for line in text.splitlines():
        if re.match(r"^  \S", line):  # "  --flag FLAG   help..." or "  --a-long-flag A_LONG_FLAG" alone
            current, _, rest = line.strip().partition("  ")
            entries[current] = rest.strip()
        elif current and re.match(r"^ {6,}\S", line):
            entries[current] = (entries[current] + " " + line.strip()).strip()
        else:
            current = None
    return entries


@pytest.mark.parametrize("script", [interop_if(script, script) for script in HELP_ENTRY_POINTS])
def test_every_argument_says_what_it_does_and_its_default_once(script, capsys):
    entries = help_entries(help_of(script, (), capsys))
    assert len(entries) > 2
    for argument, text in entries.items():
        assert text, f"{script}: {argument} has no help"
        assert text.count("(default") <= 1 and "(default: )" not in text, f"{script}: {argument}: {text}"


def test_help_with_a_preset_shows_the_presets_values_as_the_defaults(capsys):
    small = config.load_preset("small")
    entries = help_entries(help_of("train.py", ("--config", "small"), capsys))
    assert entries["--n_layer INT, --n-layer INT"].endswith(
        f"(default: {small['n_layer']}, from small; else {config.DEFAULTS['n_layer']})")
    assert entries["--seed INT"].endswith(f"(default: {config.DEFAULTS['seed']})")  # small leaves it alone
    entries = help_entries(help_of("train.py", (), capsys))
    assert entries["--n_layer INT, --n-layer INT"].endswith(f"(default: {config.DEFAULTS['n_layer']})")


def test_the_doctors_help_describes_the_doctor(capsys):
    text = help_of("scripts.doctor", ("--config", "tiny"), capsys)
    doctor = entry_point("scripts.doctor").__doc__.split("\n")[0]
    assert doctor in " ".join(text.split()) and "Train a tiny GPT" not in text


def test_what_documented_commands_write_into_the_repo_is_ignored_by_git():
    """README's export writes hf/shakespeare, plot.py's default -o is loss.png: neither may show in git status."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    paths = ["hf/shakespeare/config.json", "loss.png", "out/small/best.pt", "data/x/train.bin"]
    ignored = subprocess.run(["git", "check-ignore", *paths], cwd=REPO, capture_output=True, text=True).stdout
    assert ignored.split() == paths

