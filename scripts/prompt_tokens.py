#!/usr/bin/env python
"""Prompt wavs -> prompt_speech_tokens.jsonl, the file zero-shot evaluation (stage 4) reads.

    python scripts/prompt_tokens.py --model-dir pretrained_models/CosyVoice2-0.5B \\
        data/seedtts_testset/zh                 # writes data/seedtts_testset/zh/prompt_speech_tokens.jsonl

INPUT is a Seed-TTS folder (meta.lst: utt|prompt_text|prompt_wav|text), a meta.lst file, a
CV3-Eval folder (prompt_wav.scp: utt path), or any wav list: a text file with one
"ID PATH" or one PATH per line (id = the file's stem); relative paths are read against the
list's folder. Each line written is {"id": ID, "prompt_text": TRANSCRIPT, "prompt_speech_tokens":
[...]}: the speech tokens CosyVoice2's own zero-shot frontend (``frontend_zero_shot``,
speech_tokenizer_v2.onnx at 25 Hz) gives its LLM for that wav, and its transcript where known: a
Seed-TTS meta.lst gives it, a CV3-Eval folder's kaldi-style ``prompt_text`` file, or for a wav
list ``--texts FILE`` (kaldi style, "ID transcript" a line). Prompt wavs must be >= 16 kHz and
<= 30 s. The output is written atomically; a wav that cannot be used stops the run with its name.

A prompt pool for zero-shot training (PROMPT_POOL, docs/gpu.md) needs every transcript (the run
says how many lack one) and DIR/<ID>.wav beside the jsonl: ``--copy-wavs-to DIR`` copies each
wav there and writes DIR/prompt_speech_tokens.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# this checkout's ttsrl, even where another checkout's is installed
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ttsrl.data.testsets import PROMPT_TOKENS_FILE  # noqa: E402
from ttsrl.families import family, token2wav_families  # noqa: E402
from ttsrl.jsonl import iter_text_lines  # noqa: E402


def read_texts(path: Path) -> dict[str, str]:
    """A kaldi-style transcript file: "ID transcript" a line (CV3-Eval's prompt_text, --texts)."""
    out: dict[str, str] = {}
    for lineno, line in iter_text_lines(path, SystemExit):
        fields = line.strip().split(maxsplit=1)
        if not fields:
            continue
        if len(fields) < 2 or fields[0] in out:
            why = "expected 'ID transcript'" if len(fields) < 2 else f"id {fields[0]!r} listed twice"
            raise SystemExit(f"{path}:{lineno}: {why}")
        out[fields[0]] = fields[1].strip()
    return out


def read_wav_list(path: Path) -> tuple[list[tuple[str, Path]], Path, dict[str, str]]:
    """(id, wav) pairs, the default output folder and the transcripts the input gives."""
    if path.is_dir():
        if (path / "meta.lst").is_file():
            return read_wav_list(path / "meta.lst")
        if (path / "prompt_wav.scp").is_file():
            items, base, _ = read_wav_list(path / "prompt_wav.scp")
            texts = read_texts(path / "prompt_text") if (path / "prompt_text").is_file() else {}
            return items, base, texts
        raise SystemExit(f"{path}: no meta.lst (Seed-TTS) or prompt_wav.scp (CV3-Eval) in this folder")
    if not path.is_file():
        raise SystemExit(f"{path}: no such file or folder")
    base, out, texts = path.parent, [], {}
    for lineno, line in iter_text_lines(path, SystemExit):
        line = line.strip()
        if not line:
            continue
        if "|" in line:  # Seed-TTS meta.lst
            parts = line.split("|")
            if len(parts) < 4:
                raise SystemExit(f"{path}:{lineno}: expected 'utt|prompt_text|prompt_wav|text'")
            uid, wav = parts[0], parts[2].strip()
            texts[uid] = parts[1].strip()
        else:
            fields = line.split(maxsplit=1)
            uid, wav = (fields if len(fields) == 2 else (Path(fields[0]).stem, fields[0]))
        p = Path(wav) if Path(wav).is_absolute() else base / wav
        out.append((uid, p))
    if not out:
        raise SystemExit(f"{path}: no wavs listed")
    return out, base, texts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("input", help="Seed-TTS folder, meta.lst, CV3-Eval folder or a wav list")
    ap.add_argument("--model-dir", required=True, help="CosyVoice2 model folder (speech_tokenizer_v2.onnx, ...)")
    ap.add_argument("--output", default=None, help=f"JSONL to write (default: INPUT's folder/{PROMPT_TOKENS_FILE})")
    ap.add_argument("--cosyvoice-checkout", default=None,
                    help="CosyVoice source checkout (default: the installed cosyvoice package)")
    ap.add_argument("--backend", choices=token2wav_families(), default=token2wav_families()[0],
                    help="the model family whose speech tokenizer --model-dir holds (cosyvoice3: speech_tokenizer_v3.onnx)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N] (the ONNX tokenizer runs there)")
    ap.add_argument("--texts", default=None, metavar="FILE",
                    help="transcripts of a wav list, kaldi style ('ID transcript' a line); a Seed-TTS meta.lst "
                         "and a CV3-Eval folder bring their own")
    ap.add_argument("--copy-wavs-to", default=None, metavar="DIR",
                    help=f"make a prompt pool: copy every wav to DIR/<ID>.wav and write DIR/{PROMPT_TOKENS_FILE}")
    a = ap.parse_args(argv)

    from tqdm import tqdm

    from ttsrl.atomic import atomic_write_text
    from ttsrl.reward.backends.cosyvoice import PromptTokenizer

    items, base, texts = read_wav_list(Path(a.input))
    if a.texts:
        texts.update(read_texts(Path(a.texts)))
    pool_dir = Path(a.copy_wavs_to) if a.copy_wavs_to else None
    out = Path(a.output) if a.output else (pool_dir or base) / PROMPT_TOKENS_FILE
    if out.is_dir():  # before the work, not after it
        raise SystemExit(f"--output {out} is a folder; give the JSONL file to write (e.g. {out / PROMPT_TOKENS_FILE})")
    missing = [str(p) for _, p in items if not p.is_file()]
    if missing:
        raise SystemExit(f"{len(missing)} prompt wav(s) not found, e.g. {missing[:3]}")
    seen: set[str] = set()
    for uid, _ in items:
        if uid in seen:
            raise SystemExit(f"{a.input}: id {uid!r} listed twice")
        seen.add(uid)
    from ttsrl.reward.wavcheck import prompt_wav_problem

    bad = [f"{uid}: {why}" for uid, wav in items if (why := prompt_wav_problem(wav))]
    if bad:  # all of them, before loading the model
        raise SystemExit(f"{len(bad)} prompt wav(s) cannot be used:\n  " + "\n  ".join(bad))
    tok = PromptTokenizer(a.model_dir, checkout=a.cosyvoice_checkout, device=a.device,
                          family=family(a.backend).token2wav)
    lines = []
    for uid, wav in tqdm(items, desc="prompt tokens", unit="wav"):
        try:
            codes = tok(wav)
        except ValueError as e:
            raise SystemExit(f"{uid}: {e}") from None
        line = {"id": uid, "prompt_text": texts[uid]} if texts.get(uid) else {"id": uid}
        lines.append(json.dumps({**line, "prompt_speech_tokens": codes}, ensure_ascii=False))
    if pool_dir is not None:
        import shutil

        pool_dir.mkdir(parents=True, exist_ok=True)
        for uid, wav in items:
            if (pool_dir / f"{uid}.wav").resolve() != wav.resolve():
                shutil.copyfile(wav, pool_dir / f"{uid}.wav")
    atomic_write_text(out, "\n".join(lines) + "\n")
    print(f"wrote {len(lines)} prompts to {out}")
    lacking = [uid for uid, _ in items if not texts.get(uid)]
    if lacking:
        print(f"{len(lacking)} of them without a transcript (e.g. {lacking[:3]}): stage 4 can use them, zero-shot "
              "training (PROMPT_POOL) cannot; give --texts (kaldi style 'ID transcript')", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
