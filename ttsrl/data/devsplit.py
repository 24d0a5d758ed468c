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

A dev set the user names (``DEV_FILE``) is checked by stage 0 against the run (``check_dev_set``,
called by ``ttsrl.data.prepare`` with ``--dev-file``): its rows in the run's mode (zero-shot rows
naming a pool prompt with that prompt's transcript and speech tokens; text-only rows without a
pool), and no dev text a training text (``ALLOW_LEAK=1`` aside, as for a test set), because stage 5
chooses the step on it: a row voiced by one speaker but prompted with another's transcript, or a
text the model trained on, would choose on a figure that does not measure the run.
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


def _prompt_mismatch(u, pool: PromptPool | None, by_id: dict) -> str | None:
    """Why dev utterance ``u`` does not fit the run (None when it does): the run's mode, then its
    pool prompt (``by_id``: the pool's prompts by id)."""
    prompted = bool(u.prompt_id or u.prompt_text or u.prompt_speech)
    if pool is None:
        return None if not prompted else (
            f"a prompted dev row (prompt_id {u.prompt_id!r}) in a text-only run (no PROMPT_POOL): the run trains and "
            "is used without a speaker prompt; give text-only dev rows, or set PROMPT_POOL to the pool they name")
    if not prompted:
        return (f"a text-only dev row in a zero-shot run (PROMPT_POOL={pool.folder}): each dev row names a pool "
                "prompt (prompt_id, prompt_text, prompt_speech_tokens); leave DEV_FILE empty and stage 0 holds "
                "such rows out of the training texts")
    if not u.prompt_id:
        return (f"names no prompt_id of the pool {pool.path} (a zero-shot run's dev row is voiced by its pool "
                "prompt's speaker, and SIM is measured against it)")
    prompt = by_id.get(u.prompt_id)
    if prompt is None:
        known = sorted(by_id)
        return (f"prompt_id {u.prompt_id!r} is not in the pool {pool.path} ({len(known)} ids, e.g. "
                + ", ".join(repr(i) for i in known[:3]) + ")")
    wrong = []
    if u.prompt_text != prompt.prompt_text:
        wrong.append(f"prompt_text {u.prompt_text[:40]!r}, the pool's is {prompt.prompt_text[:40]!r}")
    if tuple(u.prompt_speech or ()) != prompt.speech:
        wrong.append(f"prompt_speech_tokens ({len(u.prompt_speech or ())} codes) differ from the pool's "
                     f"({len(prompt.speech)} codes)")
    if wrong:
        return (f"prompt_id {u.prompt_id!r} ({pool.path}:{prompt.line}) but " + "; ".join(wrong)
                + ": the row would be prompted with one prompt and voiced by another")
    return None


def check_dev_set(path: str | Path, pool: PromptPool | None, train_seen: dict[int, int],
                  max_listed: int = 20) -> list[str]:
    """Check a user's dev set (any stage-4 layout; read as stage 4 reads it) against the run:
    raises ``DataError`` listing every row that does not fit the run's mode or its pool prompt as
    FILE:LINE. Returns the dev rows whose text is a training text, as "FILE:LINE: ..." lines
    (``train_seen``: the training file's hashes of ``normalise_for_dedup`` forms, as stage 0's
    train/test leak check keeps them); the caller refuses or reports them."""
    from ttsrl.data.rowchecks import normalise_for_dedup
    from ttsrl.data.testsets import TestSetError, read_test_set

    try:
        ts = read_test_set("dev", path)
        # JSONL: FILE:LINE of each row (the reader keeps one utterance per object, in order)
        wheres = ([w for w, _ in iter_objects(path)] if ts.layout == "jsonl"
                  else [f"{ts.path} (utterance {u.id})" for u in ts.utterances])
    except (TestSetError, ValueError, OSError) as e:
        raise DataError(f"dev set (DEV_FILE) {path}: {e}") from None
    by_id = {p.id: p for p in pool.prompts} if pool is not None else {}
    problems, leaks = [], []
    for where, u in zip(wheres, ts.utterances):
        why = _prompt_mismatch(u, pool, by_id)
        if why:
            problems.append(f"  {where}: {why}")
        key = hash(normalise_for_dedup(u.text))
        if key in train_seen:
            leaks.append(f"{where}: same text as train line {train_seen[key]}")
    if problems:
        listed = problems[:max_listed] + ([f"  ... and {len(problems) - max_listed} more"]
                                          if len(problems) > max_listed else [])
        raise DataError(f"dev set (DEV_FILE) {path}: {len(problems)} of its {len(ts.utterances)} rows do not fit "
                        "this run (stage 5 chooses the step on them):\n" + "\n".join(listed))
    return leaks


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
