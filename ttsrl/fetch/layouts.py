"""Hub datasets -> the layouts ttsrl's readers take. Each writer says which upstream format it reads.

The rows come from a dataset's Parquet files (what ``datasets.load_dataset`` reads for these
repositories), read with pyarrow in batches: an audio column is the ``datasets`` ``Audio``
feature stored as a struct ``{"bytes": ..., "path": ...}``. Wav bytes are written as they are;
any other encoding is decoded with soundfile and written as 16-bit PCM wav.

* Seed-TTS ``test_zh`` (:func:`seedtts_layout`) from ``yuekai/seed_tts_cosy2`` split ``test_zh``,
  the set upstream's ``examples/grpo/cosyvoice2/infer_dataset.py`` evaluates (``load_dataset(
  "yuekai/seed_tts_cosy2", split=...)``; columns ``id``, ``prompt_text``, ``target_text``,
  ``prompt_audio``), written as Seed-TTS's own ``meta.lst`` (``utt|prompt_text|prompt_wav|text``,
  the layout ``ttsrl.data.testsets.read_seedtts_test_set`` reads) with ``prompt-wavs/<utt>.wav``.
* CV3-Eval ``zero_shot/zh`` (:func:`cv3_layout`) from ``yuekai/CV3-Eval`` split ``zero_shot_zh``
  (infer_dataset.py's ``dataset_name = "yuekai/CV3-Eval" if 'zero' in split``; the same columns;
  files ``data/zero_shot_zh-*.parquet``), written as CV3-Eval's kaldi files ``text``,
  ``prompt_text``, ``prompt_wav.scp`` (``ttsrl.data.testsets.read_cv3_test_set``) and ``wavs/``.
* Speaker prompts and the zero-shot prompt pool (:func:`aishell_prompts`) from ``yuekai/aishell``
  config ``test``, split ``test``, the set upstream's ``token2wav_asr_server.py`` draws its prompts
  from (``load_dataset("yuekai/aishell", "test")["test"]``; columns ``audio``, ``text``, whose
  spaces it removes): ``per_speaker`` utterances of 3..10 s of each test speaker (aishell-1 ids
  ``BAC009S0764W0121``: speaker ``S0764``), as ``<utt>.wav``, with ``wavs.scp`` and a kaldi-style
  ``prompt_text`` that ``scripts/prompt_tokens.py`` reads.
* Training texts (:func:`head_lines`): the first 80,000 lines of voxbox's ``aishell-3.jsonl``
  (upstream run.sh stage 0: ``head -n 80000 data/aishell-3.jsonl > data/train.jsonl``); each line
  has the ``text`` field stage 0 reads.
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Iterator

from ttsrl.atomic import atomic_write_bytes, atomic_write_text

MIN_PROMPT_S, MAX_PROMPT_S = 3.0, 10.0
AISHELL_SPEAKER = re.compile(r"S\d{4}")


class LayoutError(ValueError):
    """A dataset's rows are not what the layout expects (message names the file and column)."""


def rows(parquets: list[Path], columns: tuple[str, ...]) -> Iterator[dict]:
    """Rows of the Parquet files, in file order, with ``columns`` (each must exist)."""
    import pyarrow.parquet as pq

    for p in parquets:
        f = pq.ParquetFile(p)
        names = set(f.schema_arrow.names)
        missing = [c for c in columns if c not in names]
        if missing:
            raise LayoutError(f"{p}: no column(s) {missing}; it has {sorted(names)}")
        for batch in f.iter_batches(batch_size=64, columns=list(columns)):
            yield from batch.to_pylist()


def wav_bytes(audio, where: str) -> bytes:
    """The wav file of a ``datasets`` Audio value (struct of bytes/path, or array/sampling_rate)."""
    import numpy as np
    import soundfile as sf

    if isinstance(audio, dict) and audio.get("bytes"):
        data = bytes(audio["bytes"])
        if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
            return data
        wav, sr = sf.read(io.BytesIO(data), dtype="float32")
    elif isinstance(audio, dict) and audio.get("array") is not None:
        wav, sr = np.asarray(audio["array"], dtype="float32"), int(audio["sampling_rate"])
    else:
        raise LayoutError(f"{where}: audio holds neither bytes nor an array")
    buf = io.BytesIO()
    sf.write(buf, wav, sr, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def duration_s(wav: bytes) -> float:
    import soundfile as sf

    info = sf.info(io.BytesIO(wav))
    return info.frames / info.samplerate


def _one_line(value, where: str) -> str:
    text = str(value or "").replace("\n", " ").replace("|", " ").strip()
    if not text:
        raise LayoutError(f"{where}: empty text")
    return text


def seedtts_layout(parquets: list[Path], out: Path) -> list[str]:
    """Seed-TTS test_zh: ``out/meta.lst`` and ``out/prompt-wavs/<utt>.wav``; returns the files written
    (relative to ``out``), meta.lst last."""
    written, lines = [], []
    for row in rows(parquets, ("id", "prompt_text", "target_text", "prompt_audio")):
        utt = str(row["id"])
        rel = f"prompt-wavs/{utt}.wav"
        atomic_write_bytes(out / rel, wav_bytes(row["prompt_audio"], f"{parquets[0].name} id {utt}"))
        lines.append("|".join((utt, _one_line(row["prompt_text"], utt), rel, _one_line(row["target_text"], utt))))
        written.append(rel)
    if not lines:
        raise LayoutError(f"{[p.name for p in parquets]}: no rows")
    atomic_write_text(out / "meta.lst", "\n".join(lines) + "\n")
    return written + ["meta.lst"]


def cv3_layout(parquets: list[Path], out: Path) -> list[str]:
    """CV3-Eval zero_shot/zh: kaldi ``text``, ``prompt_text``, ``prompt_wav.scp`` and ``wavs/<utt>.wav``."""
    written, text, prompt_text, scp = [], [], [], []
    for row in rows(parquets, ("id", "prompt_text", "target_text", "prompt_audio")):
        utt = str(row["id"]).replace(" ", "_")
        rel = f"wavs/{utt}.wav"
        atomic_write_bytes(out / rel, wav_bytes(row["prompt_audio"], f"{parquets[0].name} id {utt}"))
        text.append(f"{utt} {_one_line(row['target_text'], utt)}")
        prompt_text.append(f"{utt} {_one_line(row['prompt_text'], utt)}")
        scp.append(f"{utt} {rel}")
        written.append(rel)
    if not text:
        raise LayoutError(f"{[p.name for p in parquets]}: no rows")
    for name, lines in (("prompt_text", prompt_text), ("prompt_wav.scp", scp), ("text", text)):
        atomic_write_text(out / name, "\n".join(lines) + "\n")
    return written + ["prompt_text", "prompt_wav.scp", "text"]


def _utt_id(row: dict, index: int) -> str:
    for key in ("id", "key", "utt", "segment_id"):
        if row.get(key):
            return str(row[key])
    path = (row.get("audio") or {}).get("path") if isinstance(row.get("audio"), dict) else None
    return Path(path).stem if path else f"aishell_test_{index:05d}"


def aishell_prompts(parquets: list[Path], out: Path, per_speaker: int) -> list[str]:
    """``per_speaker`` prompts of 3..10 s of each aishell test speaker into ``out``: ``<utt>.wav``,
    ``wavs.scp`` ("utt utt.wav") and ``prompt_text`` ("utt transcript", spaces removed as upstream's
    server does). Returns the files written, the two lists last."""
    import pyarrow.parquet as pq

    cols = [c for c in ("id", "key", "utt", "segment_id", "audio", "text") if c in pq.ParquetFile(parquets[0]).schema_arrow.names]
    if "audio" not in cols or "text" not in cols:
        raise LayoutError(f"{parquets[0]}: expected columns audio and text (yuekai/aishell), got {cols}")
    taken: dict[str, int] = {}
    written, scp, texts = [], [], []
    for i, row in enumerate(rows(parquets, tuple(cols))):
        utt = _utt_id(row, i)
        m = AISHELL_SPEAKER.search(utt)
        speaker = m.group(0) if m else utt
        if taken.get(speaker, 0) >= per_speaker:
            continue
        text = str(row["text"] or "").replace(" ", "").strip()
        wav = wav_bytes(row["audio"], f"{parquets[0].name} {utt}")
        if not text or not MIN_PROMPT_S <= duration_s(wav) <= MAX_PROMPT_S:
            continue
        atomic_write_bytes(out / f"{utt}.wav", wav)
        taken[speaker] = taken.get(speaker, 0) + 1
        written.append(f"{utt}.wav")
        scp.append(f"{utt} {utt}.wav")
        texts.append(f"{utt} {text}")
    if not written:
        raise LayoutError(f"{[p.name for p in parquets]}: no utterance of {MIN_PROMPT_S:.0f}..{MAX_PROMPT_S:.0f} s "
                          "with a transcript")
    atomic_write_text(out / "prompt_text", "\n".join(texts) + "\n")
    atomic_write_text(out / "wavs.scp", "\n".join(scp) + "\n")
    return written + ["prompt_text", "wavs.scp"]


def head_lines(src: Path, out: Path, n: int) -> None:
    """The first ``n`` lines of ``src`` into ``out`` (atomically)."""
    lines = []
    with open(src, encoding="utf-8") as f:
        for line in f:
            if len(lines) >= n:
                break
            lines.append(line if line.endswith("\n") else line + "\n")
    atomic_write_text(out, "".join(lines))
