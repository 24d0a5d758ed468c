"""The one JSONL reader: every JSONL (or JSON array) input of the project is read here.

:class:`RecordReader` streams rows with the 1-based line each starts on (stage 0 keeps
invalid rows as :class:`RawRecord` with ``error`` set and counts them);
:func:`iter_objects` is the strict form every other reader uses (pairs, test sets, the dev
split, pretraining): the first bad line raises, naming ``FILE:LINE``. Both fail the same way
on the same bad file: missing, a folder, empty, not UTF-8 (binary, Latin-1), malformed,
nested too deeply, a lone surrogate.

Every row comes with the 1-based line it starts on. A row that cannot be parsed is a
:class:`RawRecord` with ``error`` set (the caller may skip it); a problem that stops
the whole file (missing, a directory, empty, a JSON array that is not well formed)
raises :class:`DataError` naming the file and line.

A row is also refused when Python's JSON reader accepts it but nothing downstream
could use it: a string with a lone UTF-16 surrogate escape (``"\\ud800"``: not valid
Unicode, Arrow cannot store it), an integer of more digits than Python converts
(``sys.get_int_max_str_digits()``, 4,300) or nesting deeper than the interpreter's
recursion limit.
"""

from __future__ import annotations

import codecs
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator


class DataError(Exception):
    """Input that cannot be turned into a dataset; the message names file and line."""


@dataclass(frozen=True, slots=True)
class Invalid:
    """Why a row is invalid: a short ``kind`` (counted) and a message for the user."""

    kind: str
    message: str


@dataclass(slots=True)
class RawRecord:
    """One input row: ``value`` is the parsed JSON, or ``error`` says why not."""

    line: int
    value: Any = None
    error: Invalid | None = None


_WS = re.compile(r"[ \t\r\n]*")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_DECODER = json.JSONDecoder()


def _decode_error(e: Exception) -> Invalid:
    """A parse failure of one value as an :class:`Invalid`."""
    if isinstance(e, json.JSONDecodeError):
        return Invalid("malformed JSON", f"malformed JSON: {e.msg} (column {e.colno})")
    if isinstance(e, RecursionError):
        return Invalid("nested too deeply", "JSON nested too deeply for Python's parser")
    # int("...") of too many digits: ValueError("Exceeds the limit (4300 digits) ...")
    return Invalid("number too long", f"a number Python cannot read ({str(e).split(':')[0]})")


def _surrogate_error(source: str, value: Any) -> Invalid | None:
    """A lone surrogate escape leaves a str that is not valid Unicode."""
    if not _SURROGATE_ESCAPE.search(source):
        return None  # the cheap test: no escape that could make one
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        return Invalid("lone surrogate", f"a string holds a lone UTF-16 surrogate "
                                         f"({e.object[e.start]!a}): not valid Unicode text")
    return None


def iter_text_lines(path: str | Path, error: type[Exception] = DataError) -> Iterator[tuple[int, str]]:
    """``(line number, line without its newline)`` of a UTF-8 text file (a BOM on the
    first line is dropped); a line that is not UTF-8 (a Latin-1 or GBK ``meta.lst``)
    raises ``error`` naming ``FILE:LINE`` and the byte, a folder or a missing file too."""
    path = Path(path)
    if path.is_dir():
        raise error(f"{path}: is a directory (expected a text file)")
    try:
        f = open(path, "rb")
    except OSError as e:
        raise error(f"{path}: cannot read: {e.strerror}") from None
    with f:
        for lineno, raw in enumerate(f, start=1):
            if lineno == 1:
                raw = raw.removeprefix(codecs.BOM_UTF8)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise error(f"{path}:{lineno}: not valid UTF-8 (byte {e.start + 1} of the line, "
                            f"{raw[e.start:e.start + 1]!r}); save the file as UTF-8") from None
            yield lineno, text.rstrip("\r\n")


class RecordReader:
    """Iterate the rows of a JSONL file or a JSON array file, with line numbers.

    ``bytes_read`` tells how far into the file the reader is (for progress bars). ``rows``: what a
    row holds, as an empty file's message says it (a text corpus's by default; a pool's its own).
    """

    def __init__(self, path: str | Path, rows: str = "objects with a \"text\" field"):
        self.path = Path(path)
        self.rows = rows
        if self.path.is_dir():
            raise DataError(f"{self.path}: is a directory (expected a JSONL file or a JSON array file)")
        if not self.path.is_file():
            raise DataError(f"{self.path}: no such file")
        self.bytes_read = 0
        self.format = self._detect_format()

    def _detect_format(self) -> str:
        try:
            with open(self.path, "rb") as f:
                head = f.read(4096)
                while head and not head.lstrip():
                    head = f.read(4096)
        except OSError as e:
            raise DataError(f"{self.path}: cannot read: {e.strerror}") from None
        head = head.removeprefix(codecs.BOM_UTF8).lstrip()
        if not head:
            raise DataError(f"{self.path}: file is empty (expected JSONL rows or a JSON array of {self.rows})")
        return "json-array" if head.startswith(b"[") else "jsonl"

    def __iter__(self) -> Iterator[RawRecord]:
        self.bytes_read = 0
        return self._iter_jsonl() if self.format == "jsonl" else self._iter_array()

    def _iter_jsonl(self) -> Iterator[RawRecord]:
        with open(self.path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                self.bytes_read += len(raw)
                if lineno == 1:
                    raw = raw.removeprefix(codecs.BOM_UTF8)
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield RawRecord(lineno, error=Invalid("not UTF-8",
                                                           f"not valid UTF-8 (byte {e.start + 1})"))
                    continue
                text = text.rstrip("\r\n")
                if not text.strip():
                    continue
                try:
                    value = json.loads(text)
                except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
                    yield RawRecord(lineno, error=_decode_error(e))
                    continue
                yield RawRecord(lineno, value, _surrogate_error(text, value))

    def _iter_array(self) -> Iterator[RawRecord]:
        """Elements of the top-level JSON array of a file read whole.

        Elements are decoded one at a time (``raw_decode``) only to know the line each
        starts on; a syntax error anywhere is fatal, even with --skip-invalid (the
        array cannot be resumed after it)."""
        raw = self.path.read_bytes()
        self.bytes_read = len(raw)
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            bad_line = raw.count(b"\n", 0, e.start) + 1
            raise DataError(f"{self.path}:{bad_line}: not valid UTF-8 near this line") from None
        n = len(text)
        line, counted = 1, 0

        def line_at(pos: int) -> int:
            nonlocal line, counted
            line += text.count("\n", counted, pos)
            counted = pos
            return line

        def fail(what: str, pos: int) -> DataError:
            return DataError(f"{self.path}:{line_at(pos)}: {what} in the JSON array "
                             "(an array cannot be resumed after a syntax error, even with "
                             "--skip-invalid; fix the file or use JSONL)")

        pos = _WS.match(text, 0).end()
        if pos >= n or text[pos] != "[":
            raise fail("expected '['", pos)
        pos += 1
        first = True
        while True:
            pos = _WS.match(text, pos).end()
            if pos < n and text[pos] == "]":
                pos += 1
                break
            if not first:
                if pos >= n:
                    raise fail("unexpected end of file", pos)
                if text[pos] != ",":
                    raise fail(f"expected ',' or ']' but found {text[pos]!r}", pos)
                pos = _WS.match(text, pos + 1).end()
            if pos >= n:
                raise fail("unexpected end of file", pos)
            start = pos
            try:
                value, pos = _DECODER.raw_decode(text, start)
            except json.JSONDecodeError as e:
                raise fail(f"malformed JSON: {e.msg}", e.pos) from None
            except (ValueError, RecursionError) as e:
                raise fail(_decode_error(e).message, start) from None
            yield RawRecord(line_at(start), value, _surrogate_error(text[start:pos], value))
            first = False
        if _WS.match(text, pos).end() < n:
            raise fail("unexpected content after the closing ']'", _WS.match(text, pos).end())

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
