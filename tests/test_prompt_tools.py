"""Prompt wav checks agree with the backend, and the prompt tools give messages, not
tracebacks: scripts/check_inputs.py, scripts/prompt_tokens.py
and the CosyVoice2 backend share ttsrl/reward/wavcheck.py. Real wav files written by soundfile."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from ttsrl.data.testsets import TestSetError, read_test_set
from ttsrl.reward.backends.cosyvoice import check_prompt_wav

ROOT = Path(__file__).resolve().parents[1]


def tone(seconds: float, rate: int = 16000, channels: int = 1) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    x = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    return np.stack([x] * channels, axis=1) if channels > 1 else x


def good_wavs(d: Path) -> list[Path]:
    d.mkdir(parents=True, exist_ok=True)
    out = [d / "float32.wav", d / "extensible.wav", d / "mulaw.wav", d / "pcm24.wav"]
    sf.write(out[0], tone(1.0), 16000, subtype="FLOAT")
    sf.write(out[1], tone(1.0, 24000, channels=2), 24000, subtype="PCM_16", format="WAVEX")
    sf.write(out[2], tone(1.0), 16000, subtype="ULAW")
    sf.write(out[3], tone(1.0, 22050), 22050, subtype="PCM_24")
    return out


def bad_wavs(d: Path) -> dict[str, Path]:
    d.mkdir(parents=True, exist_ok=True)
    full = d / "full.wav"
    sf.write(full, tone(2.0), 16000, subtype="PCM_16")
    raw = full.read_bytes()
    full.unlink()
    out = {"empty": d / "zero.wav", "ten samples": d / "ten.wav", "truncated": d / "cut.wav"}
    sf.write(out["empty"], np.zeros(0, np.float32), 16000, subtype="PCM_16")
    sf.write(out["ten samples"], tone(1.0)[:10], 16000, subtype="PCM_16")
    out["truncated"].write_bytes(raw[: len(raw) // 3])
    return out


def run_script(name, *args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / name), *map(str, args)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


def test_the_backend_reads_what_check_inputs_accepts(tmp_path):
    for wav in good_wavs(tmp_path / "p"):
        check_prompt_wav(wav)
    r = run_script("check_inputs.py", "--prompt-dir", tmp_path / "p")
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_check_inputs_and_the_backend_refuse_the_same_bad_wavs(tmp_path):
    bad = bad_wavs(tmp_path / "p")
    r = run_script("check_inputs.py", "--prompt-dir", tmp_path / "p")
    assert r.returncode == 1
    for kind, wav in bad.items():
        assert wav.name in r.stderr, kind
        with pytest.raises(ValueError, match=wav.name):
            check_prompt_wav(wav)
    assert "truncated" in r.stderr and "10 samples" in r.stderr and "0 samples" in r.stderr


def run_check_inputs_without_soundfile(*args):
    """check_inputs.py as run.sh runs it before stage -2 made the venv: a Python without soundfile."""
    code = ("import runpy, sys; sys.modules['soundfile'] = None; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    return subprocess.run([sys.executable, "-c", code, str(ROOT / "scripts" / "check_inputs.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_check_inputs_without_soundfile_judges_every_wav_encoding(tmp_path):
    """Before the venv exists, check_inputs.py read prompt wavs with the stdlib wave
    module, which cannot open float, mu-law or extensible wavs and so let any of them through
    unchecked (an 8 kHz float32 prompt passed); empty and 10-sample wavs passed too. The
    standard-library RIFF reader applies the backend's limits to every encoding soundfile
    writes, and a corrupt file is a message naming it."""
    good_wavs(tmp_path / "good")
    r = run_check_inputs_without_soundfile("--prompt-dir", tmp_path / "good")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    bad = bad_wavs(tmp_path / "p")
    bad["8 kHz float"] = tmp_path / "p" / "float8k.wav"
    sf.write(bad["8 kHz float"], tone(1.0, 8000), 8000, subtype="FLOAT")
    bad["long 24-bit"] = tmp_path / "p" / "long24.wav"
    sf.write(bad["long 24-bit"], tone(31.0, 16000, channels=2), 16000, subtype="PCM_24", format="WAVEX")
    bad["corrupt"] = tmp_path / "p" / "corrupt.wav"
    bad["corrupt"].write_bytes(b"\x00garbage, not audio" * 50)
    bad["damaged fmt"] = tmp_path / "p" / "damaged.wav"
    bad["damaged fmt"].write_bytes(b"RIFF\x24\x00\x00\x00WAVEfmt \x10\x00\x00\x00" + b"\x00" * 16)
    r = run_check_inputs_without_soundfile("--prompt-dir", tmp_path / "p")
    assert r.returncode == 1, r.stderr
    for kind, wav in bad.items():
        assert wav.name in r.stderr, (kind, r.stderr)
    assert "truncated" in r.stderr and "10 samples" in r.stderr and "0 samples" in r.stderr, r.stderr
    assert "8000 Hz" in r.stderr and "31.0 s" in r.stderr, r.stderr
    # the same files through soundfile (the venv's Python): the same verdicts
    r2 = run_script("check_inputs.py", "--prompt-dir", tmp_path / "p")
    assert r2.returncode == 1 and all(w.name in r2.stderr for w in bad.values()), r2.stderr


def test_prompt_tokens_checks_every_wav_before_loading_the_model(tmp_path):
    bad = bad_wavs(tmp_path / "wavs")
    lst = tmp_path / "wav.scp"
    lst.write_text("".join(f"{k.replace(' ', '_')} {p}\n" for k, p in bad.items()))
    r = run_script("prompt_tokens.py", lst, "--model-dir", tmp_path / "no-model")
    assert r.returncode == 1 and "3 prompt wav(s) cannot be used" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "no-model" not in r.stderr


def test_prompt_tokens_output_folder_is_refused_before_the_work(tmp_path):
    (wav,) = good_wavs(tmp_path / "wavs")[:1]
    lst = tmp_path / "wav.scp"
    lst.write_text(f"a {wav}\n")
    r = run_script("prompt_tokens.py", lst, "--model-dir", tmp_path / "no-model", "--output", tmp_path)
    assert r.returncode == 1 and f"--output {tmp_path} is a folder" in r.stderr, r.stderr[-2000:]


def latin1_seedtts(d: Path) -> Path:
    d.mkdir()
    sf.write(d / "p1.wav", tone(1.0), 16000, subtype="PCM_16")
    (d / "meta.lst").write_bytes("u1|提示|p1.wav|你好\n".encode() + "u2|caf\xe9|p1.wav|t\n".encode("latin-1"))
    return d


def test_a_latin1_meta_lst_is_a_message_in_both_tools(tmp_path):
    d = latin1_seedtts(tmp_path / "zh")
    with pytest.raises(TestSetError, match=rf"{d / 'meta.lst'}:2: not valid UTF-8"):
        read_test_set("seedtts", d)
    r = run_script("prompt_tokens.py", d, "--model-dir", tmp_path / "no-model")
    assert r.returncode == 1 and f"{d / 'meta.lst'}:2: not valid UTF-8" in r.stderr, r.stderr[-2000:]
    r = run_script("check_inputs.py", "--seedtts-dir", d)
    assert r.returncode == 1 and f"{d / 'meta.lst'}:2: not valid UTF-8" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
