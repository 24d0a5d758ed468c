"""Stage 0: a text corpus (JSON or JSONL rows with a ``text`` field) -> verl RL Parquet.

Every valid input row becomes one row of verl's RL schema (``data_source``, a chat ``prompt`` that
the tokenizer's template renders as CosyVoice2's LM input, ``ability``, ``reward_model`` with the
text as ground truth, ``extra_info``), with a speaker prompt from a pool for zero-shot training.
The rows are checked before anything is written, so that a bad row is found here and not by verl
mid-run (which drops a prompt over budget silently): invalid rows, prompts over budget and test
texts that leak into training are errors naming FILE:LINE. Pass 1 (``ttsrl.data.scan``) reads the whole input; pass 2 streams
the accepted rows into both files, which replace the old ones only once both are complete
(``ttsrl.atomic``). The rules as a user sees them: docs/architecture.md, "Stage 0's rows".
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import pyarrow as pa
import pyarrow.parquet as pq

from ttsrl.atomic import atomic_path, remove_stale_temps
from ttsrl.cli import option
from ttsrl.data.devsplit import check_dev_set
from ttsrl.data.prompt_pool import PromptPool, read_pool
from ttsrl.data.rowchecks import (
    OUTPUT_COLUMNS,
    SKIP_BOUNDARY,
    TokenizerPromptLength,
    ZeroShotPrompts,
    extract_text,
    make_prompt_length,
    zero_shot_messages,
)
from ttsrl.data.scan import ProblemList, SplitScan, scan_split
from ttsrl.jsonl import DataError, RecordReader

DEFAULT_DATA_SOURCE = "ttsrl"
DEFAULT_ABILITY = "tts"
REWARD_STYLE = "rule"
SPLITS = ("train", "test")
__all__ = ["OUTPUT_COLUMNS", "DataError", "PrepareConfig", "PrepareReport", "output_schema", "prepare"]


@dataclass(frozen=True)
class PrepareConfig:
    """Stage 0's settings; each field (but ``tokenizer`` given as an object) is also an option of
    ``prepare_data.py`` (the snake_case flags first, as verl's own data scripts spell them)."""
    train_file: Path = option(flag="--train_file", aliases=("--train-file",), parse=Path, metavar="FILE",
                              help="training rows (JSON or JSONL with a \"text\" field)")
    test_file: Path = option(flag="--test_file", aliases=("--test-file",), parse=Path, metavar="FILE",
                             help="held-out rows for validation, never trained on")
    local_dir: Path = option(flag="--local_dir", aliases=("--local-dir",), parse=Path, metavar="DIR",
                             help="output folder (created if missing) for train.parquet and test.parquet")
    # HF tokenizer folder, or a loaded tokenizer (PreTrainedTokenizerBase); None: estimate prompt lengths
    tokenizer: Union[str, Path, Any, None] = option(
        None, parse=Path, metavar="HF_DIR", help="Hugging Face folder whose tokenizer has the chat template (the "
                                                 "converted hf_model/); prompt lengths are then exact, else estimated")
    max_prompt_length: int = option(1024, flag="--max_prompt_length", aliases=("--max-prompt-length",), metavar="N",
                                    help="prompt budget in tokens, as verl's data.max_prompt_length")
    skip_invalid: bool = option(False, flag="--skip-invalid", aliases=("--skip_invalid",),
                                help="skip invalid rows (and list them) instead of failing")
    drop_duplicates: bool = option(False, flag="--drop-duplicates", aliases=("--drop_duplicates",),
                                   help="drop repeated texts within a split (keeps the first); default: keep, warn")
    allow_leak: bool = option(False, help="keep test (and --dev-file) texts that also occur in the train file (by "
                                          "default such a leak is an error listing each one, and nothing is written)")
    dev_file: Union[Path, None] = option(
        None, flag="--dev-file", aliases=("--dev_file",), parse=Path, metavar="FILE",
        help="the run's own dev set (run.sh's DEV_FILE), checked and not converted: rows in the run's mode "
             "(with --prompt-pool each names a pool prompt_id with its transcript and speech tokens; without, "
             "text-only), no text a training text (unless --allow-leak)")
    data_source: str = option(DEFAULT_DATA_SOURCE, flag="--data-source", aliases=("--data_source",), metavar="NAME",
                              help="value of the data_source column; verl passes it to the reward function")
    ability: str = option(DEFAULT_ABILITY, help="value of the ability column")
    chunk_size: int = option(10_000, flag="--chunk-size", aliases=("--chunk_size",), metavar="ROWS",
                             help="rows held in memory and written per Parquet row group")
    max_listed: int = option(20, metavar="N", help="line numbers listed per kind of problem")
    prompt_pool: Union[Path, None] = option(
        None, flag="--prompt-pool", aliases=("--prompt_pool",), parse=Path, metavar="DIR",
        help="zero-shot rows: give every row a speaker prompt from DIR/prompt_speech_tokens.jsonl (ids, "
             "transcripts, speech tokens; scripts/prompt_tokens.py writes it); default: text-only rows")
    prompt_seed: int = option(0, flag="--prompt-seed", aliases=("--prompt_seed",), metavar="N",
                              help="seed of the prompt assignment (the same seed, pool and input give the same "
                                   "prompts)")
    progress: bool = option(True, flag="--quiet", aliases=("-q",), negated=True,  # tqdm bars on stderr (a terminal)
                            help="no progress bar and no summary (warnings and errors still go to stderr)")


# ---------------------------------------------------------------------------
# Pass 2: write
# ---------------------------------------------------------------------------

ZERO_SHOT_INFO = ("prompt_id", "prompt_text")  # extra_info fields a zero-shot row adds


def output_schema(extra: list[pa.Field], zero_shot: bool = False) -> pa.Schema:
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    info = [("split", pa.string()), ("index", pa.int64()), ("text", pa.string())]
    if zero_shot:
        info += [(name, pa.string()) for name in ZERO_SHOT_INFO]
    return pa.schema([
        ("data_source", pa.string()),
        ("prompt", pa.list_(message)),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        ("extra_info", pa.struct(info)),
        *extra,
    ])


def _build_batch(schema: pa.Schema, scan: SplitScan, cfg: PrepareConfig, first_index: int,
                 texts: list[str], extras: dict[str, list[Any]], pool: PromptPool | None = None) -> pa.RecordBatch:
    n = len(texts)
    text_arr = pa.array(texts, type=pa.string())
    if pool is None:
        prompt = pa.ListArray.from_arrays(
            pa.array(range(n + 1), type=pa.int32()),
            pa.StructArray.from_arrays([pa.array(["user"] * n, type=pa.string()), text_arr],
                                       names=["role", "content"]))
    else:
        chosen = [pool.prompts[scan.prompt_positions[first_index + i]] for i in range(n)]
        messages = [m for p, t in zip(chosen, texts) for m in zero_shot_messages(p.prompt_text, t, p.speech)]
        per_row = len(messages) // n if n else 0
        prompt = pa.ListArray.from_arrays(
            pa.array(range(0, n * per_row + 1, per_row), type=pa.int32()),
            pa.StructArray.from_arrays([pa.array([m["role"] for m in messages], type=pa.string()),
                                        pa.array([m["content"] for m in messages], type=pa.string())],
                                       names=["role", "content"]))
    reward = pa.StructArray.from_arrays([pa.array([REWARD_STYLE] * n, type=pa.string()), text_arr],
                                        names=["style", "ground_truth"])
    info_arrays = [pa.array([scan.split] * n, type=pa.string()),
                   pa.array(range(first_index, first_index + n), type=pa.int64()), text_arr]
    if pool is not None:
        info_arrays += [pa.array([p.id for p in chosen], type=pa.string()),
                        pa.array([p.prompt_text for p in chosen], type=pa.string())]
    info = pa.StructArray.from_arrays(info_arrays, names=[f.name for f in schema.field("extra_info").type])
    arrays = [pa.array([cfg.data_source] * n, type=pa.string()), prompt,
              pa.array([cfg.ability] * n, type=pa.string()), reward, info]
    arrays += [col.convert(extras[name]) for name, col in scan.columns.items()]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def write_split(scan: SplitScan, cfg: PrepareConfig, out_path: Path,
                on_chunk: Callable[[int, int], None] | None = None, pool: PromptPool | None = None) -> int:
    """Pass 2: re-read the input and write the rows pass 1 accepted to ``out_path``,
    ``cfg.chunk_size`` rows per row group. ``on_chunk(rows_in_chunk, bytes_read)`` is
    called after each chunk is written. With ``pool``, each row takes the prompt pass 1
    chose for it. Returns the number of rows written."""
    reader = RecordReader(scan.path)
    schema = output_schema(scan.extra_schema(), zero_shot=pool is not None)
    written = 0
    texts: list[str] = []
    extras: dict[str, list[Any]] = {name: [] for name in scan.columns}

    with pq.ParquetWriter(str(out_path), schema) as writer:
        def flush() -> None:
            nonlocal written, texts
            if not texts:
                return
            writer.write_batch(_build_batch(schema, scan, cfg, written, texts, extras, pool))
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


# ---------------------------------------------------------------------------
# The whole stage
# ---------------------------------------------------------------------------

@dataclass
class PrepareReport:
    scans: dict[str, SplitScan]
    outputs: dict[str, Path]
    length_description: str
    drop_duplicates: bool
    pool: PromptPool | None = None
    pool_checked: bool = False  # each row's ids compared with verl's rendering (a tokenizer was given)
    dev_leaks: list[str] | None = None  # --dev-file rows that are training texts (kept: --allow-leak)

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
                           "the train file (kept: --allow-leak):\n" + _list_problems(scan.path, scan.leaks))
            if scan.split == "test" and self.dev_leaks:
                out.append(f"dev/train leak: {len(self.dev_leaks)} of the dev texts also occur in the train file "
                           "(kept: --allow-leak):\n" + _list_lines(self.dev_leaks))
            merged = scan.prompt_skips.get(SKIP_BOUNDARY, 0)
            if merged:
                out.append(f"{scan.path}: {merged} times a row passed a pool prompt by because {SKIP_BOUNDARY} "
                           "(verl tokenises the rendered prompt in one piece, CosyVoice the transcript and the "
                           "text each on its own); those rows took the next prompt along")
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
        if self.pool is not None:
            lines.append(f"zero-shot rows: prompts from {self.pool.path} ({len(self.pool)} prompts, sha1 "
                         f"{self.pool.sha1}), " + ("each row's ids equal to verl's rendering of it"
                                                   if self.pool_checked else
                                                   "NOT compared with verl's rendering (give --tokenizer)"))
            for split, scan in self.scans.items():
                if scan.prompt_skips:
                    why = ", ".join(f"{n} times {k}" for k, n in scan.prompt_skips.most_common())
                    lines.append(f"{split}: rows walked past a prompt: {why}")
        return "\n".join(lines)


def _list_problems(path: Path, problems: ProblemList) -> str:
    lines = [f"  {path}:{p.line}: {p.reason}" for p in sorted(problems.first, key=lambda p: p.line)]
    if problems.count > len(problems.first):
        lines.append(f"  ... and {problems.count - len(problems.first)} more")
    return "\n".join(lines)


def _list_lines(lines: list[str], limit: int = 20) -> str:
    more = [f"  ... and {len(lines) - limit} more"] if len(lines) > limit else []
    return "\n".join([f"  {line}" for line in lines[:limit]] + more)


def _bar(enabled: bool, total: int, desc: str):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, leave=False, file=sys.stderr,
                disable=not (enabled and sys.stderr.isatty()))


def check_output_dir(out_dir: Path) -> Path:
    """Raise :class:`DataError` when ``out_dir`` cannot be created or written (a file in
    its place or above it, no permission, read-only filesystem). Creates nothing."""
    existing = out_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "exists and is not a directory" if existing == out_dir else f"{existing} is not a directory"
        raise DataError(f"--local_dir {out_dir}: {what}")
    try:  # a probe file tells what os.access cannot (root, read-only mounts, /proc)
        fd, probe = tempfile.mkstemp(prefix=".ttsrl-probe-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        where = "" if existing == out_dir else f" in {existing}"
        raise DataError(f"--local_dir {out_dir}: cannot write{where} ({e.strerror or e})") from None
    return out_dir


def prepare(cfg: PrepareConfig,
            on_chunk: Callable[[str, int], None] | None = None) -> PrepareReport:
    """Run stage 0. Raises ``DataError`` on bad input (nothing is written then).

    ``on_chunk(split, rows)`` is called after each chunk written (progress)."""
    if cfg.max_prompt_length <= 0:
        raise DataError(f"--max_prompt_length must be positive, got {cfg.max_prompt_length}")
    if cfg.chunk_size <= 0:
        raise DataError(f"--chunk-size must be positive, got {cfg.chunk_size}")
    files = {"train": Path(cfg.train_file), "test": Path(cfg.test_file)}
    for path in files.values():
        RecordReader(path)  # fails early on a missing or empty file
    out_dir = check_output_dir(Path(cfg.local_dir))  # fails early, before the long pass 1
    length = make_prompt_length(cfg.tokenizer)
    pool = zero_shot = None
    if cfg.prompt_pool is not None:
        pool = read_pool(cfg.prompt_pool)  # transcripts needed; wavs are the reward server's business
        tok = length.tokenizer if isinstance(length, TokenizerPromptLength) else None
        zero_shot = ZeroShotPrompts(pool, cfg.prompt_seed, tok, cfg.max_prompt_length)

    scans: dict[str, SplitScan] = {}
    for split, path in files.items():
        with _bar(cfg.progress, path.stat().st_size, f"check {path.name}") as bar:
            scans[split] = scan_split(split, path, length, max_prompt_length=cfg.max_prompt_length,
                                      drop_duplicates=cfg.drop_duplicates, chunk_size=cfg.chunk_size,
                                      max_listed=cfg.max_listed,
                                      train_seen=scans["train"].seen if split == "test" else None,
                                      on_progress=lambda b: bar.update(b - bar.n), zero_shot=zero_shot)
    dev_leaks = None
    if cfg.dev_file is not None:  # stage 5 chooses on it: rows of the run's mode, none a training text
        dev_leaks = check_dev_set(cfg.dev_file, pool, scans["train"].seen, cfg.max_listed)
        if dev_leaks and not cfg.allow_leak:
            raise DataError(f"dev/train leak: {len(dev_leaks)} of the dev texts of {cfg.dev_file} also occur in "
                            f"{scans['train'].path} (stage 5 would choose the step on texts it trained on):\n"
                            + _list_lines(dev_leaks, cfg.max_listed)
                            + "\nRemove them from one of the files, or pass --allow-leak to keep them.")
    scans["train"].seen.clear()  # the hashes are not needed any more
    scans["test"].seen.clear()

    bad = [s for s in scans.values() if s.invalid.count]
    if bad and not cfg.skip_invalid:
        parts = [f"{s.invalid.count} invalid rows in {s.path}:\n" + _list_problems(s.path, s.invalid)
                 for s in bad]
        raise DataError("\n".join(parts) + "\nEach row must be a JSON object with a non-empty "
                        "string \"text\" whose prompt fits --max_prompt_length"
                        + (" with one of the pool's prompts" if pool is not None else "")
                        + "; fix the rows or pass --skip-invalid to skip them.")
    for s in scans.values():
        if s.rows == 0:
            raise DataError(f"{s.path}: no valid rows ({s.records} records read)")
    leaks = scans["test"].leaks
    if leaks.count and not cfg.allow_leak:  # a held-out figure over trained texts would mean nothing
        raise DataError(f"train/test leak: {leaks.count} of the test texts of {scans['test'].path} also occur in "
                        f"{scans['train'].path}:\n" + _list_problems(scans["test"].path, leaks)
                        + "\nRemove them from one of the files, or pass --allow-leak to keep them.")

    outputs = {split: out_dir / f"{split}.parquet" for split in SPLITS}
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(out_dir)  # left by a run that was killed
        # both files are complete before either replaces its old version
        with atomic_path(outputs["train"]) as train_tmp, atomic_path(outputs["test"]) as test_tmp:
            for split, tmp in (("train", train_tmp), ("test", test_tmp)):
                with _bar(cfg.progress, scans[split].path.stat().st_size,
                          f"write {outputs[split].name}") as bar:
                    def chunk_done(rows: int, bytes_read: int, split=split, bar=bar) -> None:
                        bar.update(bytes_read - bar.n)
                        if on_chunk:
                            on_chunk(split, rows)
                    write_split(scans[split], cfg, tmp, on_chunk=chunk_done, pool=pool)
    except OSError as e:
        raise DataError(f"{e.filename or out_dir}: cannot write the output: {e.strerror or e}") from None

    return PrepareReport(scans, outputs, zero_shot.description if zero_shot else length.description,
                         cfg.drop_duplicates, pool,
                         pool_checked=zero_shot is not None and zero_shot.tokenizer is not None, dev_leaks=dev_leaks)
