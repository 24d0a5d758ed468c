"""Held-out test sets for stage 4, in three layouts (``--test-set NAME=PATH``).

Test-set layouts (``--test-set NAME=PATH``):

* JSONL file: one object per line with ``text`` and optional ``id``, ``prompt_text``,
  ``prompt_speech_tokens`` (list of speech codes 0..6560), ``prompt_id``. Ids default to
  ``NAME_<line>``. ``prompt_id`` names the speaker token2wav voices and SIM is measured against:
  an id of the scoring backend's prompt pool (``--prompt-dir``; the reward server's PROMPT_ID),
  as the embedded zero-shot test set (``data/corpus/test_zeroshot.jsonl``) names the sim
  backend's speakers, whose world has no wavs.
* Seed-TTS (``test_zh``): a directory with ``meta.lst`` (or PATH = the ``.lst`` file),
  lines ``utt|prompt_text|prompt_wav|text``.
* CosyVoice3 CV3-Eval (``zero_shot/zh``): a directory with Kaldi-style ``text``
  (``utt text``), ``prompt_text`` (``utt prompt text``) and ``prompt_wav.scp``.

Prompt speech tokens come from ``DIR/prompt_speech_tokens.jsonl``, lines
``{"id": UTT, "prompt_speech_tokens": [...]}``, which ``scripts/prompt_tokens.py`` writes
from the prompt wavs with CosyVoice's speech tokenizer (``speech_tokenizer_v2.onnx``).
With it (zero-shot), each utterance's own prompt wav (resolved against DIR) is also the
speaker token2wav voices (``Utterance.prompt_wav``), as in Seed-TTS's protocol.
Without that file the directory layouts run without prompt text or speech (plain
TTS) and the log says so: CosyVoice2 must not get a prompt text without its speech.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from ttsrl.jsonl import iter_objects, iter_text_lines
from ttsrl.families import any_speech_token_size

PROMPT_TOKENS_FILE = "prompt_speech_tokens.jsonl"


class TestSetError(ValueError):
    """A test set file that cannot be read (message names the file and line)."""

    __test__ = False  # not a pytest class despite the name


@dataclass(frozen=True)
class Utterance:
    id: str
    text: str
    prompt_text: str = ""
    prompt_speech: tuple[int, ...] | None = None
    prompt_wav: str | None = None  # speaker wav for token2wav (zero-shot directory layouts)
    prompt_id: str | None = None  # the scoring backend's pool prompt token2wav voices (JSONL ``prompt_id``)


@dataclass
class TestSet:
    __test__ = False
    name: str
    path: str
    utterances: list[Utterance]
    layout: str
    notes: list[str] = field(default_factory=list)

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for u in self.utterances:
            h.update(json.dumps([u.id, u.text, u.prompt_text, u.prompt_speech]
                                + ([u.prompt_wav] if u.prompt_wav else [])
                                + ([{"prompt_id": u.prompt_id}] if u.prompt_id else []), ensure_ascii=False).encode())
        return h.hexdigest()[:16]


def parse_test_set_arg(arg: str) -> tuple[str, str]:
    name, sep, path = arg.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--test-set expects NAME=PATH, got {arg!r}")
    if not all(c.isalnum() or c in "-_." for c in name):
        raise ValueError(f"test set name {name!r}: use letters, digits, '-', '_', '.' (it names a folder)")
    return name, path


def _check_codes(codes, where: str) -> tuple[int, ...]:
    if not isinstance(codes, list) or not all(isinstance(c, int) and not isinstance(c, bool) for c in codes):
        raise TestSetError(f"{where}: prompt_speech_tokens must be a list of integers")
    n = any_speech_token_size()  # the run's own: SpeechVocab.codes_to_ids
    bad = [c for c in codes if not 0 <= c < n]
    if bad:
        raise TestSetError(f"{where}: prompt speech token {bad[0]} outside 0..{n - 1}")
    return tuple(codes)


def read_jsonl_test_set(name: str, path: Path) -> TestSet:
    utts = []
    for where, obj in iter_objects(path, TestSetError):
        text = obj.get("text")
        if not isinstance(text, str) or not text.strip():
            raise TestSetError(f"{where}: expected a non-empty string 'text'")
        uid = obj.get("id", f"{name}_{len(utts) + 1:05d}")
        prompt_text = obj.get("prompt_text") or ""
        if not isinstance(prompt_text, str):
            raise TestSetError(f"{where}: 'prompt_text' must be a string")
        speech = obj.get("prompt_speech_tokens")
        speech = None if speech is None else _check_codes(speech, where)
        if prompt_text and not speech:
            raise TestSetError(f"{where}: 'prompt_text' without 'prompt_speech_tokens' "
                               "(CosyVoice2's zero-shot prompt needs both)")
        prompt_id = obj.get("prompt_id")
        if prompt_id is not None and (not isinstance(prompt_id, str) or not prompt_id):
            raise TestSetError(f"{where}: 'prompt_id' must be a non-empty string (an id of the scoring "
                               f"backend's --prompt-dir pool), got {prompt_id!r}")
        utts.append(Utterance(str(uid), text.strip(), prompt_text.strip(), speech, prompt_id=prompt_id))
    return _finish(TestSet(name, str(path), utts, "jsonl"))


def _read_prompt_tokens(d: Path) -> dict[str, tuple[int, ...]] | None:
    p = d / PROMPT_TOKENS_FILE
    if not p.is_file():
        return None
    out = {}
    for where, obj in iter_objects(p, TestSetError):
        if "id" not in obj or "prompt_speech_tokens" not in obj:
            raise TestSetError(f"{where}: expected {{\"id\": ..., \"prompt_speech_tokens\": [...]}}")
        out[str(obj["id"])] = _check_codes(obj["prompt_speech_tokens"], where)
    return out


def _with_prompts(name: str, d: Path, layout: str, rows: list[tuple[str, str, str]],
                  wavs: dict[str, str] | None = None) -> TestSet:
    """rows: (utt, prompt_text, text). Attach prompt speech tokens when the file exists,
    and then each utterance's prompt wav (``wavs``: utt -> path relative to ``d``)."""
    tokens = _read_prompt_tokens(d)
    notes = []
    if tokens is None:
        notes.append(f"{d / PROMPT_TOKENS_FILE} not found: running WITHOUT zero-shot prompts "
                     "(no prompt text, no prompt speech); extract the prompt wavs' tokens with "
                     "CosyVoice's speech tokenizer to evaluate zero-shot")
        utts = [Utterance(u, t) for u, _, t in rows]
    else:
        missing = [u for u, _, _ in rows if u not in tokens]
        if missing:
            raise TestSetError(f"{d / PROMPT_TOKENS_FILE}: no tokens for {len(missing)} utterance(s), "
                               f"e.g. {missing[:3]}")
        wav_of = {u: str((d / w).resolve()) for u, w in (wavs or {}).items() if w}  # read by token2wav
        utts = [Utterance(u, t, p, tokens[u], wav_of.get(u)) for u, p, t in rows]
    return _finish(TestSet(name, str(d), utts, layout, notes))


def read_seedtts_test_set(name: str, meta: Path) -> TestSet:
    rows, wavs = [], {}
    for lineno, line in iter_text_lines(meta, TestSetError):
        if not line.strip():
            continue
        parts = line.split("|")
        if len(parts) < 4 or not parts[0] or not parts[3].strip():
            raise TestSetError(f"{meta}:{lineno}: expected 'utt|prompt_text|prompt_wav|text' "
                               f"(Seed-TTS meta.lst), got {len(parts)} field(s)")
        rows.append((parts[0], parts[1].strip(), parts[3].strip()))
        wavs[parts[0]] = parts[2].strip()
    return _with_prompts(name, meta.parent, "seedtts", rows, wavs)


def _read_kaldi(path: Path) -> list[tuple[str, str]]:
    out = []
    for lineno, line in iter_text_lines(path, TestSetError):
        line = line.strip()
        if not line:
            continue
        utt, _, value = line.partition(" ")
        if not value.strip():
            raise TestSetError(f"{path}:{lineno}: expected 'utt value' (Kaldi style)")
        out.append((utt, value.strip()))
    return out


def read_cv3_test_set(name: str, d: Path) -> TestSet:
    texts = _read_kaldi(d / "text")
    prompts = dict(_read_kaldi(d / "prompt_text")) if (d / "prompt_text").is_file() else {}
    wavs = dict(_read_kaldi(d / "prompt_wav.scp")) if (d / "prompt_wav.scp").is_file() else None
    return _with_prompts(name, d, "cv3", [(u, prompts.get(u, ""), t) for u, t in texts], wavs)


def read_test_set(name: str, path: str | Path) -> TestSet:
    """Read a test set in any supported layout (see the module docstring)."""
    p = Path(path)
    if p.is_dir():
        if (p / "meta.lst").is_file():
            return read_seedtts_test_set(name, p / "meta.lst")
        if (p / "text").is_file():
            return read_cv3_test_set(name, p)
        raise TestSetError(f"{p}: a test-set directory needs meta.lst (Seed-TTS) or text + prompt_text "
                           "(CosyVoice3 CV3-Eval)")
    if not p.is_file():
        raise TestSetError(f"{p}: no such test-set file or directory")
    if p.suffix == ".lst":
        return read_seedtts_test_set(name, p)
    return read_jsonl_test_set(name, p)


def _finish(ts: TestSet) -> TestSet:
    if not ts.utterances:
        raise TestSetError(f"{ts.path}: no utterances")
    seen: dict[str, int] = {}
    for i, u in enumerate(ts.utterances):
        if u.id in seen:
            raise TestSetError(f"{ts.path}: utterance id {u.id!r} appears twice (entries {seen[u.id] + 1} "
                               f"and {i + 1}); ids must be unique")
        seen[u.id] = i
    return ts
