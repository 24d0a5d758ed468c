"""The default dev set: a fixed slice of the training texts, held out of training.

Stage 5 chooses the step to export on a dev set, never on a test set. Unless the user
names one (``DEV_FILE``), stage 0 takes ``size`` texts out of the training JSONL
before anything trains on it: the texts whose SHA-256 is smallest (the same slice for
the same file on any machine, whatever the line order; copies of one text stay on one
side), and writes

    OUT_DIR/train.jsonl   the training rows left (what stage 0 turns into Parquet)
    OUT_DIR/dev.jsonl     the dev rows (what stage 4 scores as the dev set)

With a prompt pool (``--prompt-pool DIR``, run.sh's PROMPT_POOL) the dev set is zero-shot like
the training rows: each dev row gets ``prompt_id``, ``prompt_text`` and ``prompt_speech_tokens``
of one pool prompt (row INDEX starts at ``prompt_pool.first_choice(SEED, "dev", INDEX)`` in the
pool sorted by id and walks past a prompt whose transcript is the row's text), so stage 5 chooses
a zero-shot run's step on zero-shot decoding with the prompt's speaker, as the run is used.

    python -m ttsrl.data.devsplit --train data/corpus/train.jsonl --size 64 --out-dir exp/embedded/data/split
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ttsrl.atomic import atomic_write_text
from ttsrl.cli import add_fields, given, option
from ttsrl.jsonl import DataError, iter_objects

if TYPE_CHECKING:
    from ttsrl.data.prompt_pool import PromptPool

TRAIN_FILE = "train.jsonl"
DEV_FILE = "dev.jsonl"


def _key(text: str) -> str:
    return hashlib.sha256(text.strip().encode("utf-8")).hexdigest()


def assign_prompts(rows: list[dict], pool: PromptPool, seed: int, where: str = "dev set", split: str = "dev") -> None:
    """Give each row (in place) its pool prompt: ``prompt_id``, ``prompt_text``, ``prompt_speech_tokens``
    (the module doc's rule, ``split`` naming the walk's start: ``first_choice(seed, split, index)``).
    A row whose text every prompt's transcript equals: ValueError."""
    from ttsrl.data.prompt_pool import first_choice
    from ttsrl.data.rowchecks import normalise_for_dedup

    forms = [normalise_for_dedup(p.prompt_text) for p in pool.prompts]
    n = len(pool)
    for index, row in enumerate(rows):
        form = normalise_for_dedup(row["text"])
        start = first_choice(seed, split, index, n)
        pos = next(((start + k) % n for k in range(n) if forms[(start + k) % n] != form), None)
        if pos is None:
            raise ValueError(f"{where}, row {index + 1} ({row['text']!r}): every prompt of {pool.path} has this text "
                             "as its transcript; a zero-shot row needs another prompt")
        prompt = pool.prompts[pos]
        row.update(prompt_id=prompt.id, prompt_text=prompt.prompt_text, prompt_speech_tokens=list(prompt.speech))


def split_dev(train: str | Path, size: int, out_dir: str | Path, prompt_pool: str | Path | None = None,
              prompt_seed: int = 0) -> tuple[int, int]:
    """Write OUT_DIR/train.jsonl and OUT_DIR/dev.jsonl; returns (train rows, dev rows). With
    ``prompt_pool``, the dev rows are zero-shot (``assign_prompts``)."""
    if size < 1:
        raise ValueError(f"dev size must be >= 1, got {size}")
    pool = None
    if prompt_pool is not None:
        from ttsrl.data.prompt_pool import read_pool

        pool = read_pool(prompt_pool)  # before the split: a bad pool fails before anything is written
    rows = []
    for where, obj in iter_objects(train):
        text = obj.get("text")
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{where}: expected a non-empty string 'text'")
        rows.append(obj)
    by_text: dict[str, int] = {}
    for r in rows:
        k = _key(r["text"])
        by_text[k] = by_text.get(k, 0) + 1
    if len(by_text) <= size:
        raise ValueError(f"{train}: {len(by_text)} distinct texts, cannot hold out {size} for a dev set "
                         "and still train (lower the dev size or give a dev file)")
    dev_keys, taken = set(), 0
    for k in sorted(by_text):
        if taken >= size:
            break
        dev_keys.add(k)
        taken += by_text[k]
    out = Path(out_dir)
    dev = [r for r in rows if _key(r["text"]) in dev_keys]
    rest = [r for r in rows if _key(r["text"]) not in dev_keys]
    for i, r in enumerate(dev):  # stage 4 needs unique ids; rows without one get the dev set's own
        r.setdefault("id", f"dev_{i:05d}")
    if pool is not None:
        assign_prompts(dev, pool, prompt_seed, where=f"{train} dev set")

    def dump(rs):
        return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rs)

    atomic_write_text(out / TRAIN_FILE, dump(rest))
    atomic_write_text(out / DEV_FILE, dump(dev))
    return len(rest), len(dev)


@dataclass
class DevSplit:
    """``python -m ttsrl.data.devsplit``'s settings; each field is also its option."""
    train: str = option(help="training texts (JSONL with 'text')")
    size: int = option(help="rows to hold out as the dev set")
    out_dir: str = option(help="where train.jsonl and dev.jsonl go")
    prompt_pool: str | None = option(None, metavar="DIR", help="a prompt pool (DIR/prompt_speech_tokens.jsonl): "
                                     "every dev row gets one of its prompts (zero-shot; run.sh's PROMPT_POOL)")
    prompt_seed: int = option(0, help="seed of the dev rows' prompt choice (run.sh's PROMPT_SEED)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_fields(p, DevSplit)
    a = DevSplit(**given(p.parse_args(argv), DevSplit))
    try:
        n_train, n_dev = split_dev(a.train, a.size, a.out_dir, a.prompt_pool, a.prompt_seed)
    except (OSError, ValueError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"dev set: {n_dev} of {n_train + n_dev} training rows held out of training -> "
          f"{Path(a.out_dir) / DEV_FILE}" + (f" (zero-shot: prompts of {a.prompt_pool}, seed {a.prompt_seed})"
                                             if a.prompt_pool else "")
          + f"; training on {Path(a.out_dir) / TRAIN_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
