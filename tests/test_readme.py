"""The README's promises: the Quick start test command is the one CI runs."""
from __future__ import annotations

import re

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
