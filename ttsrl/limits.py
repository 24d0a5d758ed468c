"""Length limits on texts and speech codes, the same in every reader.

Stage 0 (``ttsrl.data.rowchecks``), the pair readers (``ttsrl.train.pairs``: mining, user pairs,
DPO/KTO) and the reward server (``ttsrl.reward.infer_request``) check texts and code sequences
here, so a row one of them accepts is never refused (or, worse, run out of memory)
by another. Each message names the limit.

* ``MAX_TEXT_CHARS``: characters of a text. CosyVoice2 speaks at most ~20 speech
  tokens per text token; 1,000 characters is several minutes of speech, beyond
  anything a reward or a DPO pair should hold (a 200,000-character text became a
  200,002-id prompt).
* ``MAX_SPEECH_CODES``: speech codes of one utterance: 4,096 codes at CosyVoice2's
  25 codes/s is 164 s (a DPO pair of 1e5 codes asked for a 10 GB allocation).
"""

from __future__ import annotations

from ttsrl.text import unreadable

MAX_TEXT_CHARS = 1000
MAX_SPEECH_CODES = 4096


def text_length_problem(text: str, max_chars: int = MAX_TEXT_CHARS) -> str | None:
    """Why ``text`` is too long (None when it is not)."""
    if len(text) > max_chars:
        return f"text has {len(text)} characters, more than the limit of {max_chars}"
    return None


def text_problem(text: str, max_chars: int = MAX_TEXT_CHARS) -> str | None:
    """Why ``text`` cannot be a reference text (None when it can): too long, or a
    text the normaliser cannot read (``ttsrl.text.unreadable``)."""
    return text_length_problem(text, max_chars) or unreadable(text)


def codes_problem(n_codes: int, max_codes: int = MAX_SPEECH_CODES) -> str | None:
    """Why ``n_codes`` speech codes are too many (None when they are not)."""
    if n_codes > max_codes:
        return f"{n_codes} speech codes, more than the limit of {max_codes}"
    return None
