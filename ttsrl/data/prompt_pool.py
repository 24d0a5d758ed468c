"""A prompt pool: the speakers zero-shot training rows continue, read and checked once.

A pool is a folder ``DIR`` holding ``DIR/prompt_speech_tokens.jsonl`` (what
``scripts/prompt_tokens.py`` writes), one JSON object per line::

    {"id": ID, "prompt_text": TRANSCRIPT, "prompt_speech_tokens": [codes], "speaker": NAME}

``id`` a string usable as a file stem (:func:`prompt_id_problem`, the one rule the reward server
applies to PROMPT_ID too; it finds ``DIR/<ID>.wav`` by it and refuses an id it does not know), unique;
``prompt_text`` the wav's transcript (zero-shot training puts it before the row's text, as
CosyVoice2's LLM input does); ``prompt_speech_tokens`` a non-empty list of speech codes in
speech codes of a registered family (``ttsrl.families``; the run's own vocabulary checks them again where they become token ids); ``speaker`` optional (the embedded
world's pools name the simulated speaker). For the real backends every id also has its wav,
``DIR/<ID>.wav`` (``need_wavs``); the embedded world's pool has none.

Every problem of the file is reported at once, each as FILE:LINE and what was expected, so a
pool is fixed in one pass. The pool's identity is :func:`pool_sha1` over its ids: the same
digest the reward server publishes as ``prompt_pool_sha1`` (a run can tell that its rows and
its server name the same prompts).
"""

from __future__ import annotations

import hashlib
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from ttsrl.jsonl import DataError, RecordReader
from ttsrl.families import any_speech_token_size
from ttsrl.model.vocab import speech_token_name_in

POOL_FILE = "prompt_speech_tokens.jsonl"  # the same name stage 4's test-set folders use
MAX_ID_BYTES = 255  # a file stem (the reward server's PROMPT_ID limit)
MAX_LISTED = 20  # problems listed in one error
POOL_ROWS = 'prompts {"id": ..., "prompt_text": ..., "prompt_speech_tokens": [...]}'  # an empty pool's message


class PoolError(DataError):
    """A pool folder that cannot be used (missing, or lines that break the format)."""


@dataclass(frozen=True)
class PoolPrompt:
    """One prompt of the pool: its id (= wav stem), transcript, speech codes and speaker."""

    id: str
    prompt_text: str
    speech: tuple[int, ...]
    speaker: str | None = None
    line: int = 0  # where it was read (messages)


@dataclass(frozen=True)
class PromptPool:
    """A checked pool, its prompts sorted by id (assignment depends on the ids, not on the
    order of the file's lines)."""

    folder: Path
    prompts: tuple[PoolPrompt, ...]

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def path(self) -> Path:
        return self.folder / POOL_FILE

    @property
    def sha1(self) -> str:
        return pool_sha1(p.id for p in self.prompts)

    def wav(self, prompt: PoolPrompt) -> Path:
        return self.folder / f"{prompt.id}.wav"


def pool_sha1(ids) -> str:
    """sha1 of the sorted ids, one a line: the reward server's ``prompt_pool_sha1``
    (``ttsrl.reward.backends.base.prompt_pool_sha1`` is this function)."""
    return hashlib.sha1("".join(f"{i}\n" for i in sorted(ids)).encode("utf-8")).hexdigest()


def prompt_id_problem(v: str) -> str | None:
    """Why ``v`` cannot be a prompt id (None when it can): the one rule, applied by stage 0 and the
    checker (:func:`read_pool`), the reward server to its pool and to every request's PROMPT_ID
    (``ttsrl.reward.infer_request``). 1..MAX_ID_BYTES bytes of UTF-8, no control or format character
    (Unicode category C: a tab, U+0085, U+200B ...), no '/' or '\\', no leading/trailing
    whitespace, not '.' or '..' (the ids are the stems of a folder's wav files)."""
    if not v:
        return "is empty"
    n = len(v.encode("utf-8", "surrogatepass"))
    if n > MAX_ID_BYTES:
        return f"is {n} bytes long (at most {MAX_ID_BYTES}: the ids are file stems)"
    if v != v.strip():
        return "starts or ends with whitespace"
    if v in (".", ".."):
        return "is not a file stem"
    bad = next((c for c in v if c in "/\\" or unicodedata.category(c).startswith("C")), None)
    if bad is not None:
        return f"holds the character {bad!r} (ids are file stems: no '/', '\\' or control characters)"
    return None


def _id_problem(value) -> str | None:
    if not isinstance(value, str):
        return f"\"id\" must be a non-empty string, got {value!r}"
    why = prompt_id_problem(value)
    return f"\"id\" {value[:80]!r} is not usable as a file stem: it {why}" if why else None


def _codes_problem(value) -> str | None:
    if not isinstance(value, list) or not value:
        return "\"prompt_speech_tokens\" must be a non-empty list of speech codes"
    for c in value:
        if not isinstance(c, int) or isinstance(c, bool):
            return f"\"prompt_speech_tokens\" holds {c!r}, not an integer"
        n = any_speech_token_size()
        if not 0 <= c < n:
            return f"\"prompt_speech_tokens\" holds {c}, outside 0..{n - 1}"
    return None


def _text_problem(value) -> str | None:
    if not isinstance(value, str) or not value.strip():
        return f"\"prompt_text\" must be a non-empty string (the wav's transcript), got {value!r}"
    name = speech_token_name_in(value)
    if name:
        return f"\"prompt_text\" holds {name!r}, a token of the speech vocabulary"
    return None


def read_pool(folder: str | Path, *, need_text: bool = True, need_wavs: bool = False) -> PromptPool:
    """Read and check ``folder/prompt_speech_tokens.jsonl``; raises :class:`PoolError`
    listing every bad line. ``need_text``: every prompt must have its transcript (zero-shot
    training does); ``need_wavs``: ``folder/<id>.wav`` must exist for every id (the real
    reward backends voice from it)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise PoolError(f"prompt pool {folder}: not a folder (expected a folder holding {POOL_FILE})")
    path = folder / POOL_FILE
    if not path.is_file():
        raise PoolError(f"prompt pool {folder}: no {POOL_FILE} (scripts/prompt_tokens.py writes it)")
    problems: list[str] = []
    first_line: dict[str, int] = {}
    prompts: list[PoolPrompt] = []
    untranscribed = 0
    try:
        reader = RecordReader(path, rows=POOL_ROWS)
    except DataError as e:  # unreadable or empty: its own words name the file and what a pool's rows hold
        raise PoolError(f"prompt pool {folder}: no prompts: {e}; scripts/prompt_tokens.py writes it") from None
    for rec in reader:
        where = f"{path}:{rec.line}"
        if rec.error is not None:
            problems.append(f"{where}: {rec.error.message}")
            continue
        obj = rec.value
        if not isinstance(obj, dict):
            problems.append(f"{where}: expected a JSON object "
                            "{\"id\": ..., \"prompt_text\": ..., \"prompt_speech_tokens\": [...]}")
            continue
        why = [w for w in (_id_problem(obj.get("id")), _codes_problem(obj.get("prompt_speech_tokens"))) if w]
        text = obj.get("prompt_text")
        if text is None:
            untranscribed += 1
            if need_text:
                why.append("no \"prompt_text\" (the wav's transcript)")
        elif (w := _text_problem(text)) is not None:
            why.append(w)
        speaker = obj.get("speaker")
        if speaker is not None and (not isinstance(speaker, str) or not speaker.strip()):
            why.append(f"\"speaker\" must be a non-empty string when given, got {speaker!r}")
        if why:
            problems.append(f"{where}: " + "; ".join(why))
            continue
        pid = obj["id"]
        if pid in first_line:
            problems.append(f"{where}: id {pid!r} already on line {first_line[pid]}")
            continue
        first_line[pid] = rec.line
        prompts.append(PoolPrompt(pid, (text or "").strip(), tuple(obj["prompt_speech_tokens"]), speaker, rec.line))
    if not problems and not prompts:
        problems.append(f"{path}: no prompts (an empty file)")
    if need_wavs and not problems:
        missing = [p for p in prompts if not (folder / f"{p.id}.wav").is_file()]
        problems += [f"{path}:{p.line}: id {p.id!r} has no wav {folder / (p.id + '.wav')}" for p in missing]
    if problems:
        head = f"prompt pool {folder}: {len(problems)} problem(s)"
        if need_text and untranscribed:
            head += (f"; {untranscribed} prompt(s) lack \"prompt_text\": zero-shot training needs each wav's "
                     "transcript (scripts/prompt_tokens.py writes it from a Seed-TTS meta.lst, a kaldi-style "
                     "prompt_text file or --texts)")
        listed = problems[:MAX_LISTED]
        if len(problems) > MAX_LISTED:
            listed.append(f"... and {len(problems) - MAX_LISTED} more")
        raise PoolError(head + ":\n  " + "\n  ".join(listed))
    return PromptPool(folder, tuple(sorted(prompts, key=lambda p: p.id)))


def first_choice(seed: int, split: str, index: int, n: int) -> int:
    """Where a row's walk over the pool (sorted by id) starts: sha256 of
    ``"SEED:SPLIT:INDEX"`` mod ``n``. Stable across processes, machines and Python versions."""
    if n <= 0:
        raise ValueError("an empty pool")
    digest = hashlib.sha256(f"{seed}:{split}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % n
