"""The README's promises: the Quick start test command is the one CI runs, and CI leaves no test out."""
from __future__ import annotations

import configparser
import itertools
import re
import shlex

from conftest import REPO


def quick_start_commands() -> list[str]:
    section = (REPO / "README.md").read_text().split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_quick_start_is_exactly_two_commands_and_ci_runs_the_second():
    commands = quick_start_commands()
    assert len(commands) == 2
    assert "python train.py --config small" in commands[0]
    ci_script = (REPO / ".ci" / "run").read_text()
    assert commands[1] in ci_script.splitlines()


def selections() -> list[str]:
    """The marker expression of each `python -m pytest` in .ci/run; without -m, pytest.ini's default."""
    ini = configparser.ConfigParser()
    ini.read(REPO / "pytest.ini")
    default = shlex.split(ini["pytest"]["addopts"])
    found = []
    for line in (REPO / ".ci" / "run").read_text().splitlines():
        if "python -m pytest" in line and not line.lstrip().startswith("#"):
            words = default + shlex.split(line.split("python -m pytest", 1)[1])
            found.append(words[len(words) - 1 - words[::-1].index("-m") + 1])  # the last -m wins
    return found


def test_ci_runs_every_test_the_default_run_leaves_out():
    """Slow, interop, both or neither: one of .ci/run's pytest commands selects it."""
    expressions = selections()
    assert len(expressions) >= 2
    for slow, interop in itertools.product([False, True], repeat=2):
        markers = {"slow": slow, "interop": interop, "network": True}
        assert any(eval(expression, {}, markers) for expression in expressions), (markers, expressions)
