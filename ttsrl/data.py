"""Stage 0: a text corpus (JSON or JSONL rows with a ``text`` field) -> verl RL Parquet.

Every valid input row becomes one row of verl's RL schema::

    data_source   str                 --data-source (default "ttsrl")
    prompt        list<struct>        [{"role": "user", "content": text}]; verl renders it
                                      with the tokenizer's chat template, which
                                      ``ttsrl.vocab.CHAT_TEMPLATE`` defines as
                                      <|sos|> + text + <|task_id|>
    ability       str                 "tts"
    reward_model  struct              {"style": "rule", "ground_truth": text}
    extra_info    struct              {"split": "train"|"test", "index": row number in
                                      the output file (0-based), "text": text}
    <other keys>  kept as columns     (see "Extra columns" below)

``text`` is stripped of surrounding whitespace; everything else is taken as given.

Input
    A file whose first non-blank character is ``[`` is one JSON array of objects
    (read incrementally, never whole). Anything else is JSONL: one object per line,
    blank lines ignored. Line numbers in messages are 1-based; for an array element
    they are the line the element starts on.

Validation (pass 1 reads the whole file before anything is written)
    A row is invalid when it is malformed JSON, not an object, has no ``text``, a
    non-string or empty ``text`` or one without any letter or digit, a key that clashes with an output column, or a
    prompt longer than ``max_prompt_length`` tokens. The prompt length is counted on
    the rendered chat prompt with the tokenizer when one is given; without one it is
    estimated as UTF-8 bytes of the text + 2 (<|sos|>, <|task_id|>): a byte-level BPE
    (Qwen's, and ours) never emits more tokens than bytes, so the estimate is an
    upper bound - it never lets through a prompt that verl would drop, but may
    reject one that fits (give the tokenizer for the exact count). Invalid rows are
    an error naming every file and line, unless ``skip_invalid`` is set, in which
    case they are skipped and reported. A malformed JSON *array* cannot be resumed
    after the error, so it is fatal even with ``skip_invalid`` (use JSONL).

Duplicates and leaks
    Two texts are duplicates when their normalised forms are equal: Unicode NFKC,
    case-folded, with whitespace, punctuation and control characters removed (the
    reward ignores punctuation too, so such rows train on the same target). Forms
    are compared by a 64-bit hash kept with its first line number for each distinct
    text: about 200 bytes per distinct text, the only memory that grows with the
    input (about 300 MiB peak RSS for 1M rows).
    Duplicates within a split are reported and kept, or dropped after the first
    occurrence with ``drop_duplicates``. A test text that also occurs in train is
    reported as a leak (kept).

Extra columns
    Every other key of the input objects becomes a column; a row that lacks it gets
    null. Its Arrow type comes from all values in the file (pass 1): only booleans
    -> bool, only integers -> int64, integers and floats -> float64, only strings ->
    string. Any other column (lists, objects, integers beyond int64, or a mix of
    kinds such as a string ``id`` in one row and a number in another) is a string
    column: strings as they are, other values as JSON text (``json.loads`` reads
    them back); a mix of kinds is reported.

Output
    Pass 2 re-reads the input and writes ``chunk_size`` rows at a time with
    ``pyarrow.parquet.ParquetWriter`` (one row group per chunk), so memory does not
    grow with the file. Both files are written to temporary files in the output
    directory and moved into place with ``os.replace`` only after both are complete:
    a crash or error leaves the previous files (or none) and no partial file.
"""

from __future__ import annotations

import codecs
import json
import os
import re
import sys
import tempfile
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import pyarrow as pa
import pyarrow.parquet as pq

from .vocab import SOS_TOKEN, TASK_ID_TOKEN

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DEFAULT_DATA_SOURCE = "ttsrl"
DEFAULT_ABILITY = "tts"
REWARD_STYLE = "rule"
SPLITS = ("train", "test")
OUTPUT_COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info")
_OUTPUT_COLUMN_SET = frozenset(OUTPUT_COLUMNS)
# Tokens the chat template adds around the text (used by the estimate only).
TEMPLATE_TOKENS = len((SOS_TOKEN, TASK_ID_TOKEN))

_READ_BLOCK = 1 << 20  # bytes read at a time from JSON arrays


class DataError(Exception):
    """Input that cannot be turned into a dataset; the message names file and line."""


@dataclass(frozen=True)
class PrepareConfig:
    train_file: Path
    test_file: Path
    local_dir: Path
    # HF tokenizer folder, or a loaded tokenizer; None: estimate prompt lengths
    tokenizer: Union[str, Path, "PreTrainedTokenizerBase", None] = None
    max_prompt_length: int = 1024
    skip_invalid: bool = False
    drop_duplicates: bool = False
    data_source: str = DEFAULT_DATA_SOURCE
    ability: str = DEFAULT_ABILITY
    chunk_size: int = 10_000  # rows per Parquet row group / in memory at once
    max_listed: int = 20  # line numbers listed per kind of problem
    progress: bool = True  # tqdm bars on stderr (only shown on a terminal)


# ---------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------

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


class RecordReader:
    """Iterate the rows of a JSONL file or a JSON array file, with line numbers.

    ``bytes_read`` tells how far into the file the reader is (for progress bars).
    """

    def __init__(self, path: str | Path, block_size: int = _READ_BLOCK):
        self.path = Path(path)
        self.block_size = block_size
        if not self.path.is_file():
            raise DataError(f"{self.path}: no such file")
        self.bytes_read = 0
        self.format = self._detect_format()

    def _detect_format(self) -> str:
        with open(self.path, "rb") as f:
            head = f.read(4096)
            while head and not head.lstrip():
                head = f.read(4096)
        head = head.removeprefix(codecs.BOM_UTF8).lstrip()
        if not head:
            raise DataError(f"{self.path}: file is empty (expected JSONL rows or a JSON array "
                            "of objects with a \"text\" field)")
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
                    yield RawRecord(lineno, json.loads(text))
                except json.JSONDecodeError as e:
                    yield RawRecord(lineno, error=Invalid("malformed JSON",
                                                           f"malformed JSON: {e.msg} (column {e.colno})"))

    def _iter_array(self) -> Iterator[RawRecord]:
        """Elements of a top-level JSON array, decoded one at a time.

        The buffer holds the current element plus at most one read block. A value
        is accepted only when something follows it in the buffer, so a number cut
        by the block boundary is never taken for a complete one."""
        decoder = json.JSONDecoder()
        utf8 = codecs.getincrementaldecoder("utf-8-sig")()
        buf, pos, line, eof = "", 0, 1, False

        with open(self.path, "rb") as f:
            def more() -> bool:
                nonlocal buf, pos, eof
                if eof:
                    return False
                block = f.read(self.block_size)
                self.bytes_read += len(block)
                eof = not block
                try:
                    text = utf8.decode(block, final=eof)
                except UnicodeDecodeError:
                    raise DataError(f"{self.path}:{line + buf.count(chr(10), pos)}: not valid UTF-8 "
                                    "near this line") from None
                buf, pos = buf[pos:] + text, 0
                return True

            def skip_ws() -> str:
                """Advance past whitespace; the next character, '' at end of file."""
                nonlocal pos, line
                while True:
                    m = _NON_WS.search(buf, pos)
                    if m:
                        line += buf.count("\n", pos, m.start())
                        pos = m.start()
                        return buf[pos]
                    line += buf.count("\n", pos)
                    pos = len(buf)
                    if not more():
                        return ""

            def fail(what: str, at_line: int | None = None) -> DataError:
                return DataError(f"{self.path}:{at_line or line}: {what} in the JSON array "
                                 "(an array cannot be resumed after a syntax error, even with "
                                 "--skip-invalid; fix the file or use JSONL)")

            more()
            if skip_ws() != "[":
                raise fail("expected '['")
            pos += 1
            first = True
            while True:
                c = skip_ws()
                if c == "]":
                    pos += 1
                    break
                if not first:
                    if c != ",":
                        raise fail(f"expected ',' or ']' but found {c!r}" if c else "unexpected end of file")
                    pos += 1
                    c = skip_ws()
                if not c:
                    raise fail("unexpected end of file")
                start_line = line
                last_error = None
                while True:
                    try:
                        value, end = decoder.raw_decode(buf, pos)
                        if end < len(buf) or eof:
                            break
                    except json.JSONDecodeError as e:
                        # An element cut by the block boundary fails further on once
                        # more text is read; a real error stays where it is (except
                        # inside a string still open at the end of the buffer).
                        error = (e.msg, e.pos - pos)
                        if eof or (error == last_error and not e.msg.startswith("Unterminated string")):
                            err_line = start_line + buf.count("\n", pos, e.pos)
                            raise fail(f"malformed JSON: {e.msg}", err_line) from None
                        last_error = error
                    more()
                line += buf.count("\n", pos, end)
                pos = end
                first = False
                yield RawRecord(start_line, value)
            if skip_ws():
                raise fail("unexpected content after the closing ']'")


_NON_WS = re.compile(r"[^ \t\r\n]")


# ---------------------------------------------------------------------------
# Row checks
# ---------------------------------------------------------------------------

def extract_text(value: Any) -> tuple[str | None, Invalid | None]:
    """The stripped ``text`` of a parsed row, or (None, why it is invalid)."""
    if not isinstance(value, dict):
        return None, Invalid("not an object", "expected a JSON object with a \"text\" field, "
                                              f"got {_json_kind(value)}")
    if "text" not in value:
        return None, Invalid("missing text", "missing field \"text\" (expected a non-empty string)")
    text = value["text"]
    if not isinstance(text, str):
        return None, Invalid("text not a string",
                             f"field \"text\" must be a string, got {_json_kind(text)}")
    text = text.strip()
    if not text:
        return None, Invalid("empty text", "field \"text\" is empty (expected a non-empty string)")
    if not (text[0].isalnum() or any(ch.isalnum() for ch in text)):
        return None, Invalid("nothing to speak", "field \"text\" has no letter or digit "
                                                 "(nothing to speak)")
    if not _OUTPUT_COLUMN_SET.isdisjoint(value):
        clash = next(k for k in OUTPUT_COLUMNS if k in value)
        return None, Invalid("reserved field", f"field {clash!r} clashes with verl's output "
                                               "column of that name; rename it in the input")
    return text, None


def _json_kind(v: Any) -> str:
    if v is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string",
            list: "an array", dict: "an object"}.get(type(v), type(v).__name__)


@cache
def _dedup_table() -> dict[int, None]:
    """Code points removed before comparing texts: whitespace, punctuation, controls."""
    drop = {}
    for cp in range(sys.maxunicode + 1):
        cat = unicodedata.category(chr(cp))
        if cat[0] in "PZ" or cat in ("Cc", "Cf"):
            drop[cp] = None
    return drop


def normalise_for_dedup(text: str) -> str:
    """The form in which two texts count as duplicates (see the module doc)."""
    return unicodedata.normalize("NFKC", text).casefold().translate(_dedup_table())


# ---------------------------------------------------------------------------
# Prompt length
# ---------------------------------------------------------------------------

class PromptLength:
    """Counts the tokens of the rendered chat prompt for a batch of texts."""

    description = ""

    def count(self, texts: list[str]) -> list[int]:
        raise NotImplementedError


class EstimatedPromptLength(PromptLength):
    """Upper bound without a tokenizer: UTF-8 bytes + the template's special tokens."""

    description = "estimated as UTF-8 bytes + 2, an upper bound; --tokenizer counts exactly"

    def count(self, texts: list[str]) -> list[int]:
        return [len(t.encode("utf-8")) + TEMPLATE_TOKENS for t in texts]


class TokenizerPromptLength(PromptLength):
    """Exact count: the tokenizer's chat template as verl applies it.

    verl counts ``apply_chat_template([user turn], add_generation_prompt=True)``.
    When the template puts the text verbatim between a fixed prefix and suffix
    (ours does), the same ids come from tokenising prefix + text + suffix, which
    the fast (Rust) tokenizer does in one batched call; this is checked on a probe
    sentence, and any other template is rendered row by row."""

    _SENTINEL = "\x00TTSRL-TEXT\x00"
    _PROBE = "今天是2024年3月5日, hello world! 重庆的银行行长\n第二行"

    def __init__(self, tokenizer: Any):
        if isinstance(tokenizer, (str, os.PathLike)):
            from transformers import AutoTokenizer
            path = Path(tokenizer)
            if not path.is_dir():
                raise DataError(f"--tokenizer {path}: not a directory (expected a Hugging Face "
                                "tokenizer folder, e.g. the converted hf_model/)")
            try:
                tokenizer = AutoTokenizer.from_pretrained(str(path))
            except Exception as e:  # transformers raises many kinds here
                raise DataError(f"--tokenizer {path}: cannot load a tokenizer: {e}") from e
            self.description = f"counted with the tokenizer in {path}"
        else:
            self.description = "counted with the given tokenizer"
        if not getattr(tokenizer, "chat_template", None):
            raise DataError("the tokenizer has no chat template; give the converted model's "
                            "folder (hf_model/), whose tokenizer renders <|sos|> text <|task_id|>")
        self.tokenizer = tokenizer
        rendered = self._render(self._SENTINEL)
        self._affixes = None
        if rendered.count(self._SENTINEL) == 1:
            self._affixes = tuple(rendered.split(self._SENTINEL))
            if self.count([self._PROBE]) != [len(self._exact_ids(self._PROBE))]:
                self._affixes = None

    @property
    def batched(self) -> bool:
        """True when counts come from one batched tokenizer call (the template puts
        the text verbatim between a fixed prefix and suffix)."""
        return self._affixes is not None

    def _messages(self, text: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": text}]

    def _render(self, text: str) -> str:
        return self.tokenizer.apply_chat_template(self._messages(text), add_generation_prompt=True,
                                                  tokenize=False)

    def _exact_ids(self, text: str) -> list[int]:
        out = self.tokenizer.apply_chat_template(self._messages(text), add_generation_prompt=True,
                                                 tokenize=True)
        if isinstance(out, Mapping) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)

    def count(self, texts: list[str]) -> list[int]:
        if not texts:
            return []
        if self._affixes is None:
            return [len(self._exact_ids(t)) for t in texts]
        prefix, suffix = self._affixes
        rendered = [prefix + t + suffix for t in texts]
        backend = getattr(self.tokenizer, "backend_tokenizer", None)  # the Rust tokenizer
        if backend is not None:  # same ids (checked on the probe), without Python overhead
            encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
            return [len(e.ids) for e in encode(rendered, add_special_tokens=False)]
        ids = self.tokenizer(rendered, add_special_tokens=False)["input_ids"]
        return [len(x) for x in ids]


def make_prompt_length(tokenizer: Any) -> PromptLength:
    return EstimatedPromptLength() if tokenizer is None else TokenizerPromptLength(tokenizer)


# ---------------------------------------------------------------------------
# Extra columns
# ---------------------------------------------------------------------------

_INT64 = (-(1 << 63), (1 << 63) - 1)


def _value_kind(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int" if _INT64[0] <= v <= _INT64[1] else "json"
    if isinstance(v, float):
        return "float"
    if isinstance(v, str):
        return "str"
    return "json"


# Columns whose values are all of one of these kinds keep a native Arrow type.
_NATIVE_TYPES = {
    frozenset(): pa.string(),  # only nulls
    frozenset({"bool"}): pa.bool_(),
    frozenset({"int"}): pa.int64(),
    frozenset({"float"}): pa.float64(),
    frozenset({"int", "float"}): pa.float64(),
    frozenset({"str"}): pa.string(),
}


@dataclass
class ExtraColumn:
    """Kinds of value seen in one extra input column, with a line for each.

    A column that is not native (lists, objects, huge integers, mixed kinds) is a
    string column: strings are stored as they are, every other value as JSON text."""

    name: str
    kinds: dict[str, int] = field(default_factory=dict)  # kind -> first line

    @property
    def native(self) -> bool:
        return frozenset(self.kinds) in _NATIVE_TYPES

    @property
    def arrow_type(self) -> pa.DataType:
        return _NATIVE_TYPES.get(frozenset(self.kinds), pa.string())

    @property
    def mixed(self) -> bool:
        """Values of different kinds (int and float together do not count)."""
        return not self.native and len(self.kinds) > 1

    def convert(self, values: list[Any]) -> pa.Array:
        if not self.native:
            values = [v if v is None or isinstance(v, str) else json.dumps(v, ensure_ascii=False)
                      for v in values]
        return pa.array(values, type=self.arrow_type)


# ---------------------------------------------------------------------------
# Pass 1: scan
# ---------------------------------------------------------------------------

@dataclass
class Problem:
    line: int
    reason: str


@dataclass
class ProblemList:
    """A count of problems of one sort, and the first few of them."""

    limit: int
    count: int = 0
    first: list[Problem] = field(default_factory=list)

    def add(self, line: int, reason: str) -> None:
        self.count += 1
        if len(self.first) < self.limit:
            self.first.append(Problem(line, reason))


@dataclass
class SplitScan:
    """What pass 1 learnt about one input file."""

    split: str
    path: Path
    records: int = 0
    rows: int = 0  # rows that will be written
    skip_lines: set[int] = field(default_factory=set)  # lines not written
    invalid: ProblemList = field(default_factory=lambda: ProblemList(20))
    invalid_kinds: Counter = field(default_factory=Counter)
    duplicates: ProblemList = field(default_factory=lambda: ProblemList(20))
    leaks: ProblemList = field(default_factory=lambda: ProblemList(20))
    columns: dict[str, ExtraColumn] = field(default_factory=dict)
    max_prompt_tokens: int = 0
    sum_prompt_tokens: int = 0
    seen: dict[int, int] = field(default_factory=dict, repr=False)  # text hash -> first line

    def extra_schema(self) -> list[pa.Field]:
        return [pa.field(c.name, c.arrow_type) for c in self.columns.values()]


def scan_split(split: str, path: Path, cfg: PrepareConfig, length: PromptLength,
               train_seen: dict[int, int] | None = None,
               on_progress: Callable[[int], None] | None = None) -> SplitScan:
    """Pass 1 over one file: validate every row, count prompt tokens, find duplicates,
    leaks (against ``train_seen``) and the types of the extra columns."""
    reader = RecordReader(path)
    scan = SplitScan(split, Path(path), invalid=ProblemList(cfg.max_listed),
                     duplicates=ProblemList(cfg.max_listed), leaks=ProblemList(cfg.max_listed))

    def invalid(line: int, why: Invalid) -> None:
        scan.invalid.add(line, why.message)
        scan.invalid_kinds[why.kind] += 1
        scan.skip_lines.add(line)

    def flush(batch: list[tuple[int, str, dict]]) -> None:
        counts = length.count([text for _, text, _ in batch])
        for (line, text, obj), n in zip(batch, counts):
            if n > cfg.max_prompt_length:
                invalid(line, Invalid("too long", f"prompt has {n} tokens, more than "
                                      f"--max_prompt_length {cfg.max_prompt_length} "
                                      f"({length.description})"))
                continue
            key = hash(normalise_for_dedup(text))
            first = scan.seen.get(key)
            if first is not None:
                scan.duplicates.add(line, f"same text as line {first}")
                if cfg.drop_duplicates:
                    scan.skip_lines.add(line)
                    continue
            else:
                scan.seen[key] = line
            if train_seen is not None and key in train_seen:
                scan.leaks.add(line, f"same text as train line {train_seen[key]}")
            for k, v in obj.items():
                if k == "text":
                    continue
                col = scan.columns.get(k) or scan.columns.setdefault(k, ExtraColumn(k))
                kind = _value_kind(v)
                if kind is not None and kind not in col.kinds:
                    col.kinds[kind] = line
            scan.rows += 1
            scan.max_prompt_tokens = max(scan.max_prompt_tokens, n)
            scan.sum_prompt_tokens += n
        if on_progress:
            on_progress(reader.bytes_read)

    batch: list[tuple[int, str, dict]] = []
    for rec in reader:
        scan.records += 1
        if rec.error is not None:
            invalid(rec.line, rec.error)
            continue
        text, why = extract_text(rec.value)
        if why is not None:
            invalid(rec.line, why)
            continue
        batch.append((rec.line, text, rec.value))
        if len(batch) >= cfg.chunk_size:
            flush(batch)
            batch = []
    flush(batch)
    return scan


# ---------------------------------------------------------------------------
# Pass 2: write
# ---------------------------------------------------------------------------

def output_schema(extra: list[pa.Field]) -> pa.Schema:
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    return pa.schema([
        ("data_source", pa.string()),
        ("prompt", pa.list_(message)),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64()), ("text", pa.string())])),
        *extra,
    ])


def _build_batch(schema: pa.Schema, scan: SplitScan, cfg: PrepareConfig, first_index: int,
                 texts: list[str], extras: dict[str, list[Any]]) -> pa.RecordBatch:
    n = len(texts)
    text_arr = pa.array(texts, type=pa.string())
    prompt = pa.ListArray.from_arrays(
        pa.array(range(n + 1), type=pa.int32()),
        pa.StructArray.from_arrays([pa.array(["user"] * n, type=pa.string()), text_arr],
                                   names=["role", "content"]))
    reward = pa.StructArray.from_arrays([pa.array([REWARD_STYLE] * n, type=pa.string()), text_arr],
                                        names=["style", "ground_truth"])
    info = pa.StructArray.from_arrays(
        [pa.array([scan.split] * n, type=pa.string()),
         pa.array(range(first_index, first_index + n), type=pa.int64()), text_arr],
        names=["split", "index", "text"])
    arrays = [pa.array([cfg.data_source] * n, type=pa.string()), prompt,
              pa.array([cfg.ability] * n, type=pa.string()), reward, info]
    arrays += [col.convert(extras[name]) for name, col in scan.columns.items()]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def write_split(scan: SplitScan, cfg: PrepareConfig, out_path: Path,
                on_chunk: Callable[[int, int], None] | None = None) -> int:
    """Pass 2: re-read the input and write the rows pass 1 accepted to ``out_path``,
    ``cfg.chunk_size`` rows per row group. ``on_chunk(rows_in_chunk, bytes_read)`` is
    called after each chunk is written. Returns the number of rows written."""
    reader = RecordReader(scan.path)
    schema = output_schema(scan.extra_schema())
    written = 0
    texts: list[str] = []
    extras: dict[str, list[Any]] = {name: [] for name in scan.columns}

    with pq.ParquetWriter(str(out_path), schema) as writer:
        def flush() -> None:
            nonlocal written, texts
            if not texts:
                return
            writer.write_batch(_build_batch(schema, scan, cfg, written, texts, extras))
            written += len(texts)
            if on_chunk:
                on_chunk(len(texts), reader.bytes_read)
            texts = []
            for values in extras.values():
                values.clear()

        for rec in reader:
            if rec.line in scan.skip_lines:
                continue
            text, why = (None, rec.error) if rec.error else extract_text(rec.value)
            if why is not None:
                raise DataError(f"{scan.path}:{rec.line}: {why.message} - the file changed while it was "
                                "being converted; run again")
            texts.append(text)
            for name, values in extras.items():
                values.append(rec.value.get(name))
            if len(texts) >= cfg.chunk_size:
                flush()
        flush()
    if written != scan.rows:
        raise DataError(f"{scan.path}: {written} rows on the second read, {scan.rows} on the first "
                        "- the file changed while it was being converted; run again")
    return written


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems cannot sync directories
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------
# The whole stage
# ---------------------------------------------------------------------------

@dataclass
class PrepareReport:
    scans: dict[str, SplitScan]
    outputs: dict[str, Path]
    length_description: str
    drop_duplicates: bool

    def warnings(self) -> list[str]:
        out = []
        for scan in self.scans.values():
            if scan.invalid.count:
                kinds = ", ".join(f"{n} {k}" for k, n in scan.invalid_kinds.most_common())
                out.append(f"skipped {scan.invalid.count} invalid rows of {scan.path} ({kinds}):\n"
                           + _list_problems(scan.path, scan.invalid))
            if scan.duplicates.count:
                what = "dropped" if self.drop_duplicates else "kept; --drop-duplicates drops them"
                out.append(f"duplicates: {scan.duplicates.count} rows of {scan.path} repeat an "
                           f"earlier text (equal after normalisation; {what}):\n"
                           + _list_problems(scan.path, scan.duplicates))
            if scan.leaks.count:
                out.append(f"train/test leak: {scan.leaks.count} of the test texts also occur in "
                           "the train file (kept):\n" + _list_problems(scan.path, scan.leaks))
            mixed = [c for c in scan.columns.values() if c.mixed]
            for c in mixed:
                kinds = ", ".join(f"{k} at line {line}" for k, line in c.kinds.items())
                out.append(f"column {c.name!r} of {scan.path} mixes kinds of value ({kinds}); "
                           "stored as a string column (strings as they are, other values as "
                           "JSON text)")
        return out

    def summary(self) -> str:
        lines = []
        for split, scan in self.scans.items():
            mean = scan.sum_prompt_tokens / scan.rows if scan.rows else 0.0
            lines.append(f"{split}: {scan.rows} rows from {scan.records} records of {scan.path} -> "
                         f"{self.outputs[split]} (prompt tokens max {scan.max_prompt_tokens}, "
                         f"mean {mean:.1f})")
        lines.append(f"prompt lengths {self.length_description}")
        return "\n".join(lines)


def _list_problems(path: Path, problems: ProblemList) -> str:
    lines = [f"  {path}:{p.line}: {p.reason}" for p in sorted(problems.first, key=lambda p: p.line)]
    if problems.count > len(problems.first):
        lines.append(f"  ... and {problems.count - len(problems.first)} more")
    return "\n".join(lines)


def _bar(enabled: bool, total: int, desc: str):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, leave=False, file=sys.stderr,
                disable=not (enabled and sys.stderr.isatty()))


def prepare(cfg: PrepareConfig,
            on_chunk: Callable[[str, int], None] | None = None) -> PrepareReport:
    """Run stage 0. Raises ``DataError`` on bad input (nothing is written then).

    ``on_chunk(split, rows)`` is called after each chunk written (progress)."""
    if cfg.max_prompt_length <= 0:
        raise DataError(f"--max_prompt_length must be positive, got {cfg.max_prompt_length}")
    if cfg.chunk_size <= 0:
        raise DataError(f"--chunk-size must be positive, got {cfg.chunk_size}")
    files = {"train": Path(cfg.train_file), "test": Path(cfg.test_file)}
    for split, path in files.items():
        RecordReader(path)  # fails early on a missing or empty file
    length = make_prompt_length(cfg.tokenizer)

    scans: dict[str, SplitScan] = {}
    for split, path in files.items():
        with _bar(cfg.progress, path.stat().st_size, f"check {path.name}") as bar:
            scans[split] = scan_split(split, path, cfg, length,
                                      train_seen=scans["train"].seen if split == "test" else None,
                                      on_progress=lambda b: bar.update(b - bar.n))
    scans["train"].seen.clear()  # the hashes are not needed any more
    scans["test"].seen.clear()

    bad = [s for s in scans.values() if s.invalid.count]
    if bad and not cfg.skip_invalid:
        parts = [f"{s.invalid.count} invalid rows in {s.path}:\n" + _list_problems(s.path, s.invalid)
                 for s in bad]
        raise DataError("\n".join(parts) + "\nEach row must be a JSON object with a non-empty "
                        "string \"text\" whose prompt fits --max_prompt_length; fix the rows or pass "
                        "--skip-invalid to skip them.")
    for s in scans.values():
        if s.rows == 0:
            raise DataError(f"{s.path}: no valid rows ({s.records} records read)")

    out_dir = Path(cfg.local_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    outputs = {split: out_dir / f"{split}.parquet" for split in SPLITS}
    temps: dict[str, Path] = {}
    try:
        for split in SPLITS:
            fd, tmp = tempfile.mkstemp(prefix=f".{split}.", suffix=".parquet.tmp", dir=out_dir)
            os.close(fd)
            temps[split] = Path(tmp)
            os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it private; give it normal modes
            with _bar(cfg.progress, scans[split].path.stat().st_size,
                      f"write {outputs[split].name}") as bar:
                def chunk_done(rows: int, bytes_read: int, split=split, bar=bar) -> None:
                    bar.update(bytes_read - bar.n)
                    if on_chunk:
                        on_chunk(split, rows)
                write_split(scans[split], cfg, temps[split], on_chunk=chunk_done)
            _fsync(temps[split])
        for split in SPLITS:
            os.replace(temps[split], outputs[split])
        _fsync(out_dir)
    finally:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)

    return PrepareReport(scans, outputs, length.description, cfg.drop_duplicates)
