"""The fetch manifest: what an input's folder holds, where each file came from, its size and sha256.

One manifest per fetched input, inside its folder (``DIR/fetch_manifest.json``), or beside a
one-file input (``FILE.fetch.json``). It is written last, after every file of the input is in
place and hashed, so an input without one was never completely fetched. A rerun trusts an input
only when every file the manifest lists has its recorded size and sha256 (:func:`differences`);
anything else is named and fetched again. Standard library only.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ttsrl.atomic import atomic_write_text, sha256_file

MANIFEST = "fetch_manifest.json"
VERSION = 1


def manifest_path(dest: Path, is_dir: bool) -> Path:
    """Where the manifest of the input at ``dest`` lives."""
    return dest / MANIFEST if is_dir else dest.with_name(dest.name + ".fetch.json")


def file_record(path: Path, **origin) -> dict:
    """A manifest entry: size, sha256 and where the file came from (``origin``)."""
    return {"size": path.stat().st_size, "sha256": sha256_file(path), **origin}


def read_manifest(path: Path) -> dict | None:
    """The manifest, or None when absent or unreadable (then the input counts as not fetched)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict) or data.get("version") != VERSION:
        return None
    return data


def differences(root: Path, manifest: dict) -> list[str]:
    """Every listed file (relative to ``root``) that is missing or differs, one phrase each."""
    out = []
    for rel, rec in sorted(manifest["files"].items()):
        p = root / rel
        if not p.is_file():
            out.append(f"{p}: missing")
        elif p.stat().st_size != rec.get("size"):
            out.append(f"{p}: {p.stat().st_size} bytes, the manifest records {rec.get('size')}")
        elif sha256_file(p) != rec.get("sha256"):
            out.append(f"{p}: sha256 differs from the manifest's {str(rec.get('sha256'))[:12]}...")
    return out


def write_manifest(path: Path, name: str, source: dict, files: dict[str, dict]) -> None:
    """Write the manifest atomically (the input's last file)."""
    data = {"version": VERSION, "input": name, "source": source,
            "fetched_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": dict(sorted(files.items()))}
    atomic_write_text(path, json.dumps(data, indent=1, ensure_ascii=False) + "\n")
