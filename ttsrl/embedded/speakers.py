"""The embedded world's speakers: its prompt pool, its zero-shot test set and the simulated
speaker model.

The simulated codec gives every speaker a code book of its own (``ttsrl.embedded.codec``:
``SPEAKERS``, ``encode(text, speaker)``), so a prompt's speech tokens reveal its speaker and
a generated stream shows whether it kept that voice. This module holds what is built on it:

* **The prompt pool** ``data/corpus/prompt_pool/prompt_speech_tokens.jsonl``: four short
  prompts per speaker, one JSON object a line in the pool format every part of ttsrl reads
  (``{"id", "prompt_text", "prompt_speech_tokens", "speaker"}``, as ``scripts/prompt_tokens.py``
  writes a real pool, plus the speaker). The prompt texts are 2-3 characters (a prompt's length
  adds to every rollout's input, and sequence length is the embedded run's wall time), made of
  training-corpus characters (the tiny tokenizer knows no others) and are neither training nor
  test sentences nor part of one. The file is committed, not built at run time: it is data, like
  the corpus, small enough to read, and ``PROMPT_POOL=data/corpus/prompt_pool`` works without
  stage -1; ``python -m ttsrl.embedded.speakers`` rewrites it (a test checks it is current).
* **The zero-shot test set** ``data/corpus/test_zeroshot.jsonl``: the held-out sentences, row i
  prompted by pool prompt i mod 16 (each speaker ~70 times): ``prompt_id`` (the speaker the
  scoring backend voices and judges with) and the prompt's text and speech tokens (the LLM's
  input), as stage 4 reads a JSONL test set (``ttsrl.data.testsets``).
* **The speaker model**: :func:`similarity` (SIM), the share of a stream's codes in the prompt
  speaker's book, and :func:`read_pool`, the pool as the ``sim`` backend knows it (each prompt's
  speaker is the book holding most of its tokens, checked against its ``speaker`` key).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ttsrl.atomic import atomic_write_text
from ttsrl.cli import add_fields, given, option
from ttsrl.data import prompt_pool
from ttsrl.data.prompt_pool import POOL_FILE, PoolError
from ttsrl.embedded import codec
from ttsrl.jsonl import iter_objects

ROOT = Path(__file__).resolve().parent.parent.parent
POOL_DIR = ROOT / "data" / "corpus" / "prompt_pool"
TEST_FILE = ROOT / "data" / "corpus" / "test.jsonl"
ZERO_SHOT_TEST_FILE = ROOT / "data" / "corpus" / "test_zeroshot.jsonl"

#: the pool's prompt texts, four per speaker in ``codec.SPEAKERS`` order
PROMPT_TEXTS = ("早上好", "晚安", "再见了", "没问题",
                "对不起", "请坐", "欢迎你", "辛苦了",
                "慢走", "别急", "当然", "请进",
                "明白了", "我来了", "听我说", "一起走")
PER_SPEAKER = len(PROMPT_TEXTS) // len(codec.SPEAKERS)


@dataclass(frozen=True)
class PoolPrompt:
    """One prompt of a pool: its id, transcript, speech tokens and the speaker they reveal."""

    id: str
    prompt_text: str
    prompt_speech_tokens: tuple[int, ...]
    speaker: str


def pool_rows() -> list[dict]:
    """The embedded prompt pool, in file order: ids ``spk<S>_<NN>`` (NN from 01), the prompt
    text spoken cleanly in speaker S's voice."""
    rows = []
    for i, text in enumerate(PROMPT_TEXTS):
        speaker = codec.SPEAKERS[i // PER_SPEAKER]
        rows.append({"id": f"{speaker}_{i % PER_SPEAKER + 1:02d}", "prompt_text": text,
                     "prompt_speech_tokens": codec.encode(text, speaker), "speaker": speaker})
    return rows


def zero_shot_rows(test_rows: Sequence[dict], pool: Sequence[dict]) -> list[dict]:
    """``test_rows`` ({"id", "text"}) each with a pool prompt: row i gets ``pool[i % len(pool)]``
    (round robin: every prompt, hence every speaker, equally often)."""
    out = []
    for i, row in enumerate(test_rows):
        p = pool[i % len(pool)]
        out.append({"id": row["id"], "text": row["text"], "prompt_id": p["id"], "prompt_text": p["prompt_text"],
                    "prompt_speech_tokens": p["prompt_speech_tokens"]})
    return out


def jsonl(rows: Sequence[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def read_pool(folder: str | Path) -> dict[str, PoolPrompt]:
    """``FOLDER/prompt_speech_tokens.jsonl`` by id, read and checked as every pool is
    (``ttsrl.data.prompt_pool.read_pool``: :class:`PoolError` naming file and line), and each
    prompt's tokens must lie mostly in one simulated speaker's book: that speaker is the prompt's;
    an optional ``speaker`` must name it."""
    pool = prompt_pool.read_pool(folder, need_text=False)
    out: dict[str, PoolPrompt] = {}
    for p in pool.prompts:
        where = f"{pool.path}:{p.line}"
        speaker = codec.dominant_speaker(p.speech)
        if speaker is None:
            raise PoolError(f"{where}: prompt {p.id!r}: no token lies in a simulated speaker's book "
                            f"({', '.join(codec.SPEAKERS)}): not a prompt of the embedded world")
        if p.speaker is not None and p.speaker != speaker:
            raise PoolError(f"{where}: prompt {p.id!r} says speaker {p.speaker!r} but its tokens are "
                            f"{speaker!r}'s (most of them lie in that book)")
        out[p.id] = PoolPrompt(p.id, p.prompt_text, p.speech, speaker)
    return out


def similarity(codes: Sequence[int], speaker: str) -> float:
    """SIM of a generated stream to a prompt of ``speaker``: ``codec.speaker_share``, the share of
    its codes in that speaker's book (in [0, 1])."""
    return codec.speaker_share(codes, speaker)


def write_files(pool_dir: Path = POOL_DIR, test_in: Path = TEST_FILE, test_out: Path = ZERO_SHOT_TEST_FILE) -> None:
    """(Re)write the pool and the zero-shot test set (atomically)."""
    pool = pool_rows()
    pool_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(pool_dir / POOL_FILE, jsonl(pool))
    test = [obj for _, obj in iter_objects(test_in)]
    atomic_write_text(test_out, jsonl(zero_shot_rows(test, pool)))


@dataclass
class WriteFiles:
    """Where the committed pool and zero-shot test set are written from."""
    pool_dir: str = option(str(POOL_DIR), help="pool folder (writes prompt_speech_tokens.jsonl)")
    test_in: str = option(str(TEST_FILE), help="held-out sentences, JSONL {id, text}")
    test_out: str = option(str(ZERO_SHOT_TEST_FILE), help="the zero-shot test set to write")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description="Rewrite the embedded world's prompt pool and its zero-shot test set (committed files; "
                    "deterministic: the codec's speaker books, the prompt texts of this module).")
    add_fields(p, WriteFiles)
    a = WriteFiles(**given(p.parse_args(argv), WriteFiles))
    try:
        write_files(Path(a.pool_dir), Path(a.test_in), Path(a.test_out))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {Path(a.pool_dir) / POOL_FILE} ({len(PROMPT_TEXTS)} prompts) and {a.test_out}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
