"""Pass 1 of stage 0 (``ttsrl.data.prepare``): read one input file whole before anything
is written, and learn what pass 2 needs and what to report: the rows to write and to
skip, the invalid rows with their reasons, duplicates and train/test leaks (by a hash
of the normalised text, ``rowchecks.normalise_for_dedup``), prompt lengths and the
kinds of value of every extra column. The rules: docs/architecture.md, "Stage 0's rows".
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from ttsrl.data.rowchecks import (
    ExtraColumn,
    PromptLength,
    ZeroShotPrompts,
    extract_text,
    normalise_for_dedup,
    value_kind,
)
from ttsrl.jsonl import Invalid, RecordReader


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
    # zero-shot rows: the pool position of output row i's prompt (4 bytes a row), and how
    # often a row's walk passed a prompt by, by reason (rowchecks.ZeroShotPrompts)
    prompt_positions: array = field(default_factory=lambda: array("i"), repr=False)
    prompt_skips: Counter = field(default_factory=Counter)

    def extra_schema(self) -> list[pa.Field]:
        return [pa.field(c.name, c.arrow_type) for c in self.columns.values()]


def scan_split(split: str, path: Path, length: PromptLength, *, max_prompt_length: int, drop_duplicates: bool,
               chunk_size: int, max_listed: int, train_seen: dict[int, int] | None = None,
               on_progress: Callable[[int], None] | None = None,
               zero_shot: ZeroShotPrompts | None = None) -> SplitScan:
    """Pass 1 over one file: validate every row, count prompt tokens (``chunk_size``
    texts at a time), find duplicates (dropped with ``drop_duplicates``), leaks
    (against ``train_seen``) and the types of the extra columns. Each kind of problem
    lists its first ``max_listed`` lines. With ``zero_shot`` every row is given its pool
    prompt (by its output index) and counted with it; a row no prompt fits is invalid."""
    reader = RecordReader(path)
    scan = SplitScan(split, Path(path), invalid=ProblemList(max_listed),
                     duplicates=ProblemList(max_listed), leaks=ProblemList(max_listed))

    def invalid(line: int, why: Invalid) -> None:
        scan.invalid.add(line, why.message)
        scan.invalid_kinds[why.kind] += 1
        scan.skip_lines.add(line)

    def flush(batch: list[tuple[int, str, dict]]) -> None:
        counts = [0] * len(batch) if zero_shot else length.count([text for _, text, _ in batch])
        for (line, text, obj), n in zip(batch, counts):
            position = None
            if zero_shot is not None:  # the row's output index is the count of rows kept so far
                choice = zero_shot.choose(split, scan.rows, text)
                scan.prompt_skips.update(choice.skipped)
                position, n = choice.position, choice.tokens
                if position is None:
                    why = ", ".join(f"{k} {c}" for k, c in Counter(choice.skipped).items())
                    invalid(line, Invalid("no pool prompt", f"no prompt of the pool fits this row (passed by: "
                                                            f"{why}; {zero_shot.description})"))
                    continue
            if n > max_prompt_length:
                invalid(line, Invalid("too long", f"prompt has {n} tokens, more than "
                                      f"--max_prompt_length {max_prompt_length} "
                                      f"({length.description})"))
                continue
            key = hash(normalise_for_dedup(text))
            first = scan.seen.get(key)
            if first is not None:
                scan.duplicates.add(line, f"same text as line {first}")
                if drop_duplicates:
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
                kind = value_kind(v)
                if kind is not None and kind not in col.kinds:
                    col.kinds[kind] = line
            if position is not None:
                scan.prompt_positions.append(position)
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
        if len(batch) >= chunk_size:
            flush(batch)
            batch = []
    flush(batch)
    return scan
