"""Read a JSONL file of objects with errors that name the file and line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator


def iter_objects(path: str | Path, error: type[Exception] = ValueError) -> Iterator[tuple[str, dict]]:
    """Yield ``("FILE:LINE", object)`` for every non-blank line; a line that is not a
    JSON object raises ``error`` naming its place."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{where}: not JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise error(f"{where}: expected a JSON object")
            yield where, obj
