"""Read a JSONL file of objects with errors that name the file and line.

The rows come from stage 0's reader (``ttsrl.records.RecordReader``), so every JSONL
input of the project fails the same way on the same bad file: missing, a folder,
empty, not UTF-8 (binary, Latin-1), malformed, nested too deeply, a lone surrogate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from .records import DataError, RecordReader


def iter_objects(path: str | Path, error: type[Exception] = ValueError) -> Iterator[tuple[str, dict]]:
    """Yield ``("FILE:LINE", object)`` for every non-blank line; a line that is not a
    JSON object, or a file that cannot be read as JSONL, raises ``error`` naming its place."""
    try:
        reader = RecordReader(path)
        for rec in reader:
            where = f"{path}:{rec.line}"
            if rec.error is not None:
                raise error(f"{where}: {rec.error.message}")
            if not isinstance(rec.value, dict):
                raise error(f"{where}: expected a JSON object")
            yield where, rec.value
    except DataError as e:
        raise error(str(e)) from None
