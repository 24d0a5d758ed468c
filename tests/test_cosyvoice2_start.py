"""Starting the CosyVoice2 reward backend on many replicas and on an
old model folder's yaml, on the random-weight test folder (tests/cosyvoice2_tiny.py).

- prompt wavs are extracted once per server process and shared by its replicas (not once per
  replica: eight GPUs used to extract every wav eight times);
- CosyVoice's speech tokenizer (ONNX) opens once per replica, on the replica's own device (it
  used to open on GPU 0 first, then again on the replica's GPU).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

for mod, why in (("cosyvoice.cli.model", "CosyVoice's runtime (cosyvoice-minicpmo)"), ("hyperpyyaml", "hyperpyyaml"),
                 ("onnx", "onnx"), ("whisper", "openai-whisper"), ("matcha.utils.audio", "Matcha-TTS (cosyvoice-minicpmo)")):
    pytest.importorskip(mod, reason=f"{why} is not installed (bash scripts/install.sh installs it)")

sys.path.insert(0, str(Path(__file__).parent))
from cosyvoice2_tiny import as_before_2025, tiny_folder_with_prompts, write_tone_wav  # noqa: E402

from ttsrl.families import family  # noqa: E402
from ttsrl.reward.backends import BackendConfig  # noqa: E402
from ttsrl.reward.backends import cosyvoice as cv2  # noqa: E402
from ttsrl.reward.backends.cosyvoice_code import import_cosyvoice, load_yaml_without_llm, make_frontend  # noqa: E402

COSYVOICE2 = family("cosyvoice2").token2wav

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return tiny_folder_with_prompts(tmp_path_factory.mktemp("cosyvoice2"))


def test_prompt_wavs_are_extracted_once_for_all_replicas(folders, monkeypatch, tmp_path):
    """Three replicas built as the server builds them (in threads, at once): each prompt wav's
    features are extracted once, and every replica holds the same features."""
    import shutil

    import torch

    from ttsrl.reward.server import BackgroundServer, ServerConfig

    model, shared = folders
    prompts = shutil.copytree(shared, tmp_path / "prompts")  # changed below
    extracted = []
    real = cv2.zero_shot_inputs

    def counting(fe, wav, rate):
        extracted.append(Path(wav).name)
        return real(fe, wav, rate)

    monkeypatch.setattr(cv2, "zero_shot_inputs", counting)
    monkeypatch.setattr(cv2, "_SHARED", {}, raising=False)  # this process's earlier tests extracted nothing
    backend = BackendConfig(backend="cosyvoice2", asr="sim", cosyvoice_model_dir=str(model), prompt_dir=str(prompts))
    with BackgroundServer(ServerConfig(backend=backend, port=0, devices=["cpu"] * 3, max_batch=1)) as srv:
        replicas = [p.token2wav for p in srv.server.pipelines]
    assert sorted(extracted) == ["spk_a.wav", "spk_b.wav"], extracted  # 6 before: every wav on every replica
    for r in replicas[1:]:
        for a, b in zip(r.prompts, replicas[0].prompts, strict=True):
            assert a.name == b.name and a.data["wav"] == b.data["wav"]
            assert all(torch.equal(a.data[k], b.data[k]) for k in ("prompt_token", "prompt_feat", "embedding"))
    # a changed wav is a new prompt: extracted again, not taken from the cache
    write_tone_wav(prompts / "spk_b.wav", 1.0, 22050, 260.0)
    cv2.CosyVoiceToken2Wav(cv2.CosyVoiceConfig(model_dir=str(model), family="cosyvoice2", prompt_dir=str(prompts), device="cpu"))
    assert sorted(extracted) == ["spk_a.wav", "spk_b.wav", "spk_b.wav"], extracted


class _Opened:
    """onnxruntime.InferenceSession recording the providers asked for; opens on the CPU (this
    machine has no GPU, and the point is where CosyVoice asks to open it)."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def __call__(self, path, *args, providers=None, **kwargs):
        self.calls.append((Path(path).name, providers))
        return self.real(path, *args, providers=["CPUExecutionProvider"], **kwargs)

    def of(self, name):
        return [p for n, p in self.calls if n == name]


@pytest.mark.parametrize("device,expected", [
    ("cuda:3", [("CUDAExecutionProvider", {"device_id": 3}), "CPUExecutionProvider"]),
    ("cpu", ["CPUExecutionProvider"]),
])
def test_speech_tokenizer_opens_once_on_the_replicas_own_device(folders, monkeypatch, device, expected):
    """With GPUs visible, CosyVoice's frontend opens its speech tokenizer with a bare CUDA
    provider (GPU 0). Each replica's frontend now opens it once, on the replica's device: GPU 3
    for a replica on cuda:3, the CPU for a CPU replica (never GPU 0). Campplus stays on the CPU."""
    import onnxruntime
    import torch

    model, _ = folders
    opened = _Opened(onnxruntime.InferenceSession)
    monkeypatch.setattr(onnxruntime, "InferenceSession", opened)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU node: CosyVoice asks for CUDA
    FrontEnd, _ = import_cosyvoice(None, COSYVOICE2)
    conf = load_yaml_without_llm(model / "cosyvoice2.yaml", keep=("feat_extractor",))
    fe = make_frontend(FrontEnd, model, conf["feat_extractor"], torch.device(device), COSYVOICE2)
    assert opened.of("speech_tokenizer_v2.onnx") == [expected], opened.calls
    assert opened.of("campplus.onnx") == [["CPUExecutionProvider"]], opened.calls
    assert fe.device == torch.device(device)
    import cosyvoice.cli.frontend as frontend_module

    assert frontend_module.onnxruntime is onnxruntime  # the module's own onnxruntime is back


@pytest.mark.slow  # waits out a health check: ~12 s
def test_start_timeout_is_a_setting(tmp_path):
    """run.sh waited a fixed 300 s for the server; REWARD_START_TIMEOUT_S sets it (300 by
    default, 900 in the gpu8 preset, the environment wins), and the wait ends at once when the
    server it started has exited."""
    import os

    def config(preset, **env):
        r = subprocess.run(["bash", str(ROOT / "run.sh"), "--config"], cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "PRESET": preset, **env}, timeout=60)
        assert r.returncode == 0, r.stderr
        return dict(line.partition("=")[::2] for line in r.stdout.splitlines())["REWARD_START_TIMEOUT_S"]

    assert config("presets/embedded.sh") == "300" and config("presets/gpu8.sh") == "900"
    assert config("presets/gpu8.sh", REWARD_START_TIMEOUT_S="1800") == "1800"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "ttsrl.reward.health", "http://127.0.0.1:9", "--wait", "120",
                        "--pid", str(dead.pid)], cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert r.returncode == 1 and f"pid {dead.pid}) exited before it was ready" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 30


def _old_folder(model: Path, dest: Path, edit) -> Path:
    import shutil

    shutil.copytree(model, dest)
    (dest / "cosyvoice2.yaml").write_text(edit((model / "cosyvoice2.yaml").read_text()))
    return dest


def test_an_old_yaml_with_causal_decoder_is_read_as_the_current_one(folders, tmp_path, caplog):
    """The pinned CosyVoice has no `causal` argument in ConditionalDecoder
    (a TypeError at server start). The old yaml is read as the current one, with a note naming
    the file: the same flow.pt loads (strict) and the same codes give the same waveform."""
    import logging

    import numpy as np

    model, prompts = folders
    old = _old_folder(model, tmp_path / "CosyVoice2-old", as_before_2025)
    assert "causal: True" in (old / "cosyvoice2.yaml").read_text()
    with caplog.at_level(logging.WARNING, logger="ttsrl.reward.backends"):
        t_old = cv2.CosyVoiceToken2Wav(cv2.CosyVoiceConfig(model_dir=str(old), family="cosyvoice2", prompt_dir=str(prompts), device="cpu"))
    assert any(str(old / "cosyvoice2.yaml") in r.getMessage() and "causal" in r.getMessage() for r in caplog.records)
    t_new = cv2.CosyVoiceToken2Wav(cv2.CosyVoiceConfig(model_dir=str(model), family="cosyvoice2", prompt_dir=str(prompts), device="cpu"))
    codes = [(5 + 37 * i) % 6561 for i in range(15)]
    a, b = (t.synthesize([codes], [None])[0].waveform for t in (t_old, t_new))
    assert np.array_equal(a, b)


def test_a_key_the_cosyvoice_code_does_not_take_is_named_with_its_yaml(folders, tmp_path):
    model, _ = folders

    def hift_causal(yaml: str) -> str:
        line = "hift: !new:cosyvoice.hifigan.generator.HiFTGenerator\n"
        return yaml.replace(line, line + "    causal: True\n")

    bad = _old_folder(model, tmp_path / "CosyVoice2-bad", hift_causal)
    with pytest.raises(ValueError) as e:
        load_yaml_without_llm(bad / "cosyvoice2.yaml")
    msg = str(e.value)
    assert str(bad / "cosyvoice2.yaml") in msg and "'causal'" in msg and "HiFTGenerator" in msg, msg
    assert "current cosyvoice2.yaml" in msg, msg


def test_frontends_built_at_once_leave_the_modules_onnxruntime_as_it_was(monkeypatch):
    """Replicas build their frontends in threads. The swap of the frontend module's
    ``onnxruntime`` must read the module's own one under the lock: read before it, a thread
    waiting for the lock took the other replica's wrapper for the original and put it back,
    and every later frontend then opened its sessions on that replica's device (seen when the
    CosyVoice2 test files ran in one process). The interleaving is forced here with a stand-in
    frontend class that waits inside its constructor (CosyVoice's own cannot be paused there)."""
    import threading
    import types

    import onnxruntime
    import torch

    from ttsrl.reward.backends import cosyvoice_code

    module = types.ModuleType("ttsrl_test_frontend")
    module.onnxruntime = onnxruntime
    inside, go = threading.Event(), threading.Event()

    class FrontEnd:
        def __init__(self, **kwargs):
            if not inside.is_set():  # the first builder waits here, holding the swap
                inside.set()
                go.wait(10)
            self.seen = module.onnxruntime

    FrontEnd.__module__ = module.__name__
    monkeypatch.setitem(sys.modules, module.__name__, module)
    built = {}

    def build(name, dev):
        built[name] = cosyvoice_code.make_frontend(FrontEnd, Path("/nonexistent"), None, torch.device(dev), COSYVOICE2)

    first = threading.Thread(target=build, args=("a", "cpu"))
    first.start()
    assert inside.wait(10)
    second = threading.Thread(target=build, args=("b", "cpu"))
    second.start()
    time.sleep(0.5)  # the second builder reaches the swap while the first holds it
    go.set()
    first.join(10)
    second.join(10)
    assert set(built) == {"a", "b"}
    assert module.onnxruntime is onnxruntime
    # each built while its own wrapper, around the module's own onnxruntime, was in place
    assert all(fe.seen._ort is onnxruntime for fe in built.values())
