#!/usr/bin/env python3
"""Check, before any stage runs, every file the GPU recipe needs from the user.

run.sh calls it for presets that set CHECK_INPUTS_ARGS (presets/gpu8.sh). It prints ONE
message listing everything missing or unusable and exits 1, or prints nothing and exits 0.
Prompt wavs get the backend's own check (ttsrl/reward/wavcheck.py, soundfile) when this Python
has soundfile (run.sh uses the venv's once it exists); before the venv exists, the same limits
from the RIFF/WAVE header read with the standard library (any PCM width, float, mu-law/A-law,
extensible; not the wave module, which opens 8-32-bit PCM only). See README "GPU recipe".
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ttsrl.data.prompt_pool import PoolError, prompt_id_problem, read_pool  # noqa: E402 - stdlib-only import
from ttsrl.families import family, token2wav_families  # noqa: E402 - stdlib-only import
from ttsrl.reward.wavcheck import prompt_wav_header_problem, prompt_wav_problem  # noqa: E402 - stdlib-only import


def _wav_problem(p: Path) -> str | None:
    try:  # the backend's own check when this Python has soundfile (the venv's does)
        import soundfile  # noqa: F401
    except ImportError:
        return prompt_wav_header_problem(p)
    return prompt_wav_problem(p)


def problems(a) -> list[str]:
    out: list[str] = []
    spec = family(a.backend).token2wav
    family_name, var, entries = spec.name, "COSYVOICE2_DIR", spec.model_dir_entries
    if a.model_dir:
        d = Path(a.model_dir)
        miss = [e for e in entries if not ((d / e).is_dir() if e.endswith("/") else (d / e).is_file())]
        if miss:
            out.append(f"{family_name} model folder {d} ({var}): missing {', '.join(miss)}")
    if a.prompt_dir:
        d = Path(a.prompt_dir)
        wavs = sorted(d.glob("*.wav")) if d.is_dir() else []
        if not wavs:
            out.append(f"speaker prompts (PROMPT_DIR): no *.wav in {d}")
        out += [f"speaker prompt {m}" for m in filter(None, map(_wav_problem, wavs))]
        # the server names each wav by its stem (PROMPT_ID): the pool's one id rule
        out += [f"speaker prompt {w}: its stem {w.stem!r} {why} (the reward server would refuse it)"
                for w in wavs if (why := prompt_id_problem(w.stem))]
    if a.prompt_pool:  # zero-shot training: transcripts, tokens and a usable wav for every id
        try:
            pool = read_pool(a.prompt_pool, need_wavs=True)
        except PoolError as e:
            out.append(f"prompt pool (PROMPT_POOL): {e}")
        else:
            out += [f"prompt pool wav {m}" for m in filter(None, map(_wav_problem, map(pool.wav, pool.prompts)))]
    if a.sherpa_model_dir:
        d = Path(a.sherpa_model_dir)
        if not ((d / "model.onnx").is_file() or (d / "model.int8.onnx").is_file()) or not (d / "tokens.txt").is_file():
            out.append(f"sherpa-onnx ASR folder {d} (ASR_MODEL_DIR): needs model.onnx or model.int8.onnx, and tokens.txt")
    for name, f in (("training texts (TRAIN_FILE)", a.train_file), ("held-out texts (TEST_FILE)", a.test_file)):
        if f and not Path(f).is_file():
            out.append(f"{name}: {f} not found")
    if a.seedtts_dir:
        d = Path(a.seedtts_dir)
        meta = d / "meta.lst"
        if not meta.is_file():
            out.append(f"Seed-TTS test set (SEEDTTS_ZH_DIR): {meta} not found")
        else:
            if not (d / "prompt_speech_tokens.jsonl").is_file():
                out.append(f"Seed-TTS prompt tokens: {d / 'prompt_speech_tokens.jsonl'} not found "
                           f"(make it once: .venv/bin/python scripts/prompt_tokens.py {d} --model-dir "
                           f"{a.model_dir or 'CosyVoice2-0.5B'})")
            bad = []
            try:
                lines = meta.read_text(encoding="utf-8").splitlines()
            except UnicodeDecodeError as e:
                line_no = meta.read_bytes()[:e.start].count(b"\n") + 1
                out.append(f"Seed-TTS test set: {meta}:{line_no}: not valid UTF-8; save it as UTF-8")
                lines = []
            for line in lines:
                parts = line.split("|")
                if len(parts) >= 4 and not (d / parts[2].strip()).is_file():
                    bad.append(parts[2].strip())
            if bad:
                out.append(f"Seed-TTS prompt wavs: {len(bad)} listed in {meta} not found, e.g. {bad[:3]}")
    if a.cosyvoice_checkout and not (Path(a.cosyvoice_checkout) / "cosyvoice" / "cli" / "model.py").is_file():
        out.append(f"CosyVoice checkout (COSYVOICE_ROOT): {a.cosyvoice_checkout} has no cosyvoice/cli/model.py")
    elif spec.needs_code:
        if not a.cosyvoice_checkout:
            out.append(f"CosyVoice checkout (COSYVOICE_ROOT): backend {a.backend} needs a CosyVoice source checkout "
                       f"with {spec.name} (--cosyvoice-checkout; the PyPI package lacks it)")
        else:
            root = Path(a.cosyvoice_checkout)
            lacking = [f"{rel}: {cls}" for rel, cls in spec.needs_code
                       if not (root / rel).is_file()
                       or not re.search(rf"^class {cls}\b", (root / rel).read_text(encoding="utf-8", errors="replace"),
                                        flags=re.M)]
            if lacking:
                out.append(f"CosyVoice checkout (COSYVOICE_ROOT): {root} predates {spec.name} (lacks "
                           f"{', '.join(lacking)}); backend {a.backend} needs one at or after {spec.since}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag in ("--model-dir", "--prompt-dir", "--sherpa-model-dir", "--train-file", "--test-file",
                 "--seedtts-dir", "--cosyvoice-checkout"):
        ap.add_argument(flag, default=None)
    ap.add_argument("--prompt-pool", default=None, metavar="DIR",
                    help="zero-shot training's pool (PROMPT_POOL): DIR/prompt_speech_tokens.jsonl valid, with "
                         "transcripts, and DIR/<id>.wav for every id within the prompt-wav limits")
    ap.add_argument("--backend", choices=token2wav_families(), default=token2wav_families()[0],
                    help="the model family whose folder --model-dir is (and whose CosyVoice code "
                         "--cosyvoice-checkout must have)")
    a = ap.parse_args(argv)
    found = problems(a)
    if found:
        print("The GPU recipe needs files that are missing or unusable (README, 'GPU recipe', lists them):\n  - "
              + "\n  - ".join(found) + "\nThose with a public source are fetched by stage -1 (python -m ttsrl.fetch "
              "--preset PRESET; docs/gpu.md lists each source).", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
