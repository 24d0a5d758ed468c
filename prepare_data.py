#!/usr/bin/env python3
"""Stage 0: turn JSON/JSONL text rows into verl's train.parquet and test.parquet.

The logic lives in ttsrl/data/prepare.py; this is its command line."""

from __future__ import annotations

import argparse
import sys

from ttsrl.cli import add_fields, parse_into
from ttsrl.data.prepare import DataError, PrepareConfig, prepare

DESCRIPTION = """\
Convert two text corpora (train and held-out test) into the Parquet files verl's
RL trainer reads: LOCAL_DIR/train.parquet and LOCAL_DIR/test.parquet.

Input: a JSONL file (one JSON object per line; blank lines ignored) or a JSON file
holding one array of objects (detected by a leading '['). Each object needs a
non-empty string "text" (surrounding whitespace is stripped).

Output columns (verl's RL schema):
  data_source   --data-source
  prompt        [{"role": "user", "content": text}], rendered by the tokenizer's chat
                template as <|sos|> text <|task_id|>
  ability       --ability
  reward_model  {"style": "rule", "ground_truth": text}
  extra_info    {"split": "train"/"test", "index": 0-based row number in the file,
                 "text": text}
With --prompt-pool DIR (zero-shot rows) every row also gets one speaker prompt of
DIR/prompt_speech_tokens.jsonl: prompt = [{"role": "user", "content": prompt_text + text},
{"role": "assistant", "content": the prompt's <|s_N|> tokens}], rendered as CosyVoice2's
zero-shot input <|sos|> prompt_text text <|task_id|> prompt_speech (the rollout continues
it), extra_info adds "prompt_id" and "prompt_text". Rule: row INDEX of SPLIT starts at
sha256("SEED:SPLIT:INDEX") mod the pool size (pool sorted by id; SEED = --prompt-seed) and
walks on past a prompt whose transcript is the row's text, that would exceed
--max_prompt_length, or (with --tokenizer) that verl's one-piece tokenisation would merge
with the text; the same seed, pool and input give the same prompts.
Every other input key is kept as a column (null where a row lacks it): all-bool
-> bool, all-integer -> int64, integers/floats -> float64, all-string -> string;
any other column (lists, objects, mixed kinds) is a string column: strings as they
are, other values as JSON text (a mix of kinds is reported).
"""

EPILOG = """\
Checks (all rows of both files are read before anything is written):
  invalid rows     malformed JSON, not an object, "text" missing/empty/not a string
                   or without any letter or digit (only punctuation), a key named
                   like an output column, or a prompt longer than
                   --max_prompt_length tokens. Without --skip-invalid they are an
                   error listing FILE:LINE and the reason (exit status 2); with it they
                   are skipped and listed. Also invalid: a string with a lone UTF-16
                   surrogate escape ("\\ud800"), an integer of more than 4,300 digits,
                   nesting deeper than Python's parser allows. Inside a JSON array
                   these and syntax errors cannot be skipped (the array cannot be
                   resumed); use JSONL for that.
  prompt length    with --tokenizer: the exact token count of the chat-rendered prompt,
                   as verl counts it (data.max_prompt_length; verl silently drops longer
                   prompts, this script reports them). Without it: UTF-8 bytes of the
                   text + 2, an upper bound for byte-level BPE tokenizers (Qwen's), which
                   may reject a prompt that would fit but never passes one that would not.
  duplicates       texts equal after normalisation (NFKC, case-folded, whitespace and
                   punctuation removed) within a split: reported and kept, or dropped
                   after the first occurrence with --drop-duplicates.
  leaks            test texts that also occur in the train file: an error naming each
                   (nothing written); kept, and reported, with --allow-leak.
  dev set          --dev-file FILE (run.sh's DEV_FILE), read as stage 4 reads it: each
                   row in the run's mode (with --prompt-pool it names a pool prompt_id
                   and carries that prompt's transcript and speech tokens; without, no
                   prompt), else an error naming FILE:LINE; a dev text that is a
                   training text is a leak, as a test text's is.

Output is written in chunks of --chunk-size rows (one Parquet row group each), to
temporary files in LOCAL_DIR that replace train.parquet/test.parquet only when both
are complete: an error or crash leaves the previous files untouched, and the next
run removes the temporary file of a killed run. Bad input or an unwritable LOCAL_DIR
exits with status 2 and a message naming the file (and line). A progress bar
is shown on stderr when it is a terminal (not with --quiet).

Example:
  python prepare_data.py --train_file data/corpus/train.jsonl \\
      --test_file data/corpus/test.jsonl --local_dir data --tokenizer hf_model
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prepare_data.py", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_fields(p, PrepareConfig)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    cfg = parse_into(p, PrepareConfig, p.parse_args(argv))
    try:
        report = prepare(cfg)
    except DataError as e:
        print(f"prepare_data.py: error: {e}", file=sys.stderr)
        return 2
    for warning in report.warnings():
        print(f"prepare_data.py: warning: {warning}", file=sys.stderr)
    if cfg.progress:  # not --quiet
        print(report.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
