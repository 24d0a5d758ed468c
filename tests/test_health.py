"""The reward server says which model folder it serves: its model metadata's
``model_dir`` is the cosyvoice2 backend's folder as an absolute path ("" for a backend without
one), and ``python -m ttsrl.reward.health URL --expect model_dir=PATH`` compares it, so a
launcher can refuse a server that serves another model folder. Real servers on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from helpers import stop_process

from ttsrl.reward.health import launch_server

ROOT = Path(__file__).resolve().parents[1]
MODEL = "token2wav_asr"


def health(url: str, *expect: str) -> subprocess.CompletedProcess:
    args = [a for e in expect for a in ("--expect", e)]
    return subprocess.run([sys.executable, "-m", "ttsrl.reward.health", url, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def served(*args: str):
    proc, url = launch_server("--port", "0", "--log-level", "WARNING", *args, timeout=300)
    return proc, url, requests.get(f"{url}/v2/models/{MODEL}", timeout=10).json()


def test_a_backend_without_a_model_folder_publishes_an_empty_one():
    proc, url, meta = served("--backend", "sim", "--reward", "toneless")
    try:
        assert (meta["model_dir"], meta["reward"], meta["backend_name"]) == ("", "toneless", "sim")
        assert health(url, "model_dir=", "reward=toneless", "backend=sim").returncode == 0
        wrong = health(url, "model_dir=/models/CosyVoice2-0.5B")
        assert wrong.returncode == 3
        assert "model_dir ''" in wrong.stderr and "/models/CosyVoice2-0.5B" in wrong.stderr
    finally:
        stop_process(proc)


@pytest.mark.slow  # a CosyVoice2 server start: ~12 s
def test_cosyvoice2_publishes_its_absolute_model_folder(tmp_path):
    for mod in ("cosyvoice.cli.model", "hyperpyyaml", "onnx", "whisper", "matcha.utils.audio"):
        pytest.importorskip(mod, reason="CosyVoice's runtime is not installed (bash scripts/install.sh installs it)")
    sys.path.insert(0, str(Path(__file__).parent))
    from cosyvoice2_tiny import tiny_folder_with_prompts

    model, prompts = tiny_folder_with_prompts(tmp_path)
    relative = os.path.relpath(model, ROOT)  # as a user may type it; the server runs in ROOT
    proc, url, meta = served("--backend", "cosyvoice2", "--asr", "sim", "--cosyvoice-model-dir", relative,
                             "--prompt-dir", str(prompts), "--devices", "cpu")
    try:
        assert os.path.isabs(meta["model_dir"]) and os.path.realpath(meta["model_dir"]) == os.path.realpath(model)
        assert health(url, f"model_dir={model}", "backend=cosyvoice2").returncode == 0
        assert health(url, f"model_dir={relative}").returncode == 0  # compared as an absolute path
        other = tmp_path / "CosyVoice2-other"
        wrong = health(url, f"model_dir={other}")
        assert wrong.returncode == 3 and str(other) in wrong.stderr and meta["model_dir"] in wrong.stderr
        config = requests.get(f"{url}/v2/models/{MODEL}/config", timeout=10).json()
        assert config["parameters"]["model_dir"]["string_value"] == meta["model_dir"]
    finally:
        stop_process(proc)
