"""The GPU recipe's up-front check of user-provided files (scripts/check_inputs.py), run as
run.sh runs it; and the gpu8 preset wiring it."""

from __future__ import annotations

import subprocess
import sys
import wave
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from ttsrl.families import family  # noqa: E402


def _wav(path: Path, rate: int, seconds: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\0\0" * int(rate * seconds))


def _run(*args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "check_inputs.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=60)


def test_one_message_names_everything_missing(tmp_path):
    model = tmp_path / "CosyVoice2-0.5B"
    model.mkdir()
    (model / "flow.pt").write_bytes(b"x")
    _wav(tmp_path / "prompts" / "ok.wav", 16000, 1.0)
    _wav(tmp_path / "prompts" / "low.wav", 8000, 1.0)
    _wav(tmp_path / "prompts" / "long.wav", 16000, 31.0)
    seed = tmp_path / "zh"
    seed.mkdir()
    (seed / "meta.lst").write_text("u1|p|prompt-wavs/u1.wav|t\n", encoding="utf-8")
    r = _run("--model-dir", model, "--prompt-dir", tmp_path / "prompts", "--sherpa-model-dir", tmp_path / "asr",
             "--train-file", tmp_path / "train.jsonl", "--test-file", ROOT / "data" / "corpus" / "test.jsonl",
             "--seedtts-dir", seed)
    assert r.returncode == 1
    msg = r.stderr
    for missing in ("llm.pt", "cosyvoice2.yaml", "hift.pt", "campplus.onnx", "speech_tokenizer_v2.onnx",
                    "CosyVoice-BlankEN/", "low.wav: 8000 Hz", "long.wav: 31.0 s", "tokens.txt", "train.jsonl",
                    "prompt_speech_tokens.jsonl", "prompt-wavs/u1.wav"):
        assert missing in msg, missing
    assert "flow.pt," not in msg and "ok.wav" not in msg and "test.jsonl" not in msg
    assert msg.count("\n  - ") == 7  # one message, one line per problem


def test_complete_inputs_pass(tmp_path):
    model = tmp_path / "m"
    for e in family("cosyvoice2").token2wav.model_dir_entries:
        (model / e).mkdir(parents=True) if e.endswith("/") else (model.mkdir(exist_ok=True), (model / e).write_bytes(b"x"))
    _wav(tmp_path / "p" / "a.wav", 24000, 2.0)
    (tmp_path / "asr").mkdir()
    (tmp_path / "asr" / "model.int8.onnx").write_bytes(b"x")
    (tmp_path / "asr" / "tokens.txt").write_text("a 0\n")
    r = _run("--model-dir", model, "--prompt-dir", tmp_path / "p", "--sherpa-model-dir", tmp_path / "asr")
    assert r.returncode == 0 and r.stderr == ""


def test_gpu8_preset_wires_the_check(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "COSYVOICE2_DIR": str(tmp_path / "nope")}
    r = subprocess.run(["bash", "-c", "source presets/gpu8.sh && echo \"${CHECK_INPUTS_ARGS[*]}\" && echo \"${REWARD_ARGS[*]}\""],
                       cwd=ROOT, capture_output=True, text=True, env=env, timeout=60)
    args, reward = r.stdout.splitlines()[:2]
    assert f"--model-dir {tmp_path / 'nope'}" in args and "--seedtts-dir" in args and "--prompt-dir" in args
    assert "--cosyvoice-checkout" not in reward  # CosyVoice's code comes from the pinned package
    r = subprocess.run(["bash", "run.sh", "1", "1"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**env, "PRESET": "presets/gpu8.sh"})
    assert r.returncode == 1 and "llm.pt" in r.stderr and "stage 1" not in r.stdout


def test_device_specs():
    import pytest
    import torch

    from ttsrl.reward.backends.cosyvoice_code import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():  # this machine: a clear error, not a silent CPU run
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            resolve_device("cuda")
    else:  # "cuda" without index is the current device, explicitly indexed
        assert resolve_device("cuda").index == torch.cuda.current_device()
    with pytest.raises(ValueError, match="unsupported device"):
        resolve_device("mps")
