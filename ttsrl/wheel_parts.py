"""Model files that registry packages ship in parts: find each part, join them once, check the hash.

PyPI caps a wheel's size, so a model of 90 MB or more reaches these machines split over several
packages (Whisper-base over two, Kokoro-82M over four). The joined file is only trusted when its
SHA-256 is the audited one pinned in ttsrl's code: a part from another upload, a truncated
download or a changed release then stops the backend with both hashes named, and nothing is
left at the model's path.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
from pathlib import Path
from typing import Sequence

from ttsrl.atomic import atomic_path


def installed_file(dist: str, rel: str, install_hint: str) -> Path:
    """The file ``rel`` (relative to site-packages) of the installed distribution ``dist``."""
    try:
        p = Path(md.distribution(dist).locate_file(rel))
    except md.PackageNotFoundError:
        raise FileNotFoundError(f"PyPI package {dist} is not installed; {install_hint}") from None
    if not p.is_file():
        raise FileNotFoundError(f"{dist} is installed but {p} is missing; {install_hint}")
    return p


def join_verified(parts: Sequence[Path], out: Path, sha256: str, what: str) -> Path:
    """Write the concatenation of ``parts`` to ``out`` (atomically) if its SHA-256 is ``sha256``;
    otherwise raise naming both hashes and write nothing. Returns ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp, open(tmp, "wb") as f:
        h = hashlib.sha256()
        for part in parts:
            with open(part, "rb") as src:
                for block in iter(lambda: src.read(1 << 20), b""):
                    h.update(block)
                    f.write(block)
        if h.hexdigest() != sha256:
            raise RuntimeError(f"joined {what} has SHA-256 {h.hexdigest()}, expected {sha256}: the installed "
                               f"parts ({', '.join(str(p) for p in parts)}) are not the audited model; "
                               "reinstall them (bash scripts/install.sh)")
    return out
