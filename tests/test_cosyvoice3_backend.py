"""The cosyvoice3 token2wav backend, run with CosyVoice3's own code from a CosyVoice checkout.

CosyVoice3's flow (``CausalMaskedDiffWithDiT``: a DiT in ``CausalConditionalCFM``) and vocoder
(``CausalHiFTGenerator``) are not in the PyPI package (cosyvoice-minicpmo predates them), and CI
has no network to fetch upstream: the tests that voice codes need a CosyVoice source checkout
with CosyVoice3 (FunAudioLLM/CosyVoice at or after dd2d926; tested at ace7c47), named by the
environment variable ``TTSRL_COSYVOICE_CHECKOUT``, and are skipped, with that reason, without it:

    git clone https://github.com/FunAudioLLM/CosyVoice /path/CosyVoice
    TTSRL_COSYVOICE_CHECKOUT=/path/CosyVoice .venv/bin/python -m pytest tests/test_cosyvoice3_backend.py

(its third_party/Matcha-TTS submodule may stay empty: the venv's ``matcha`` is used). The model
folder is built by the test (tests/cosyvoice3_token2wav_tiny.py): upstream's cosyvoice3.yaml shrunk,
random weights, ONNX stand-ins for campplus and speech_tokenizer_v3. These check shapes, rate,
length per code, determinism, SIM's arithmetic and the wiring, not quality. The checks of the
model folder, of the checkout and of the options run everywhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

for mod, why in (("hyperpyyaml", "hyperpyyaml"), ("onnx", "onnx"), ("matcha.utils.audio", "Matcha-TTS")):
    pytest.importorskip(mod, reason=f"{why} is not installed (bash scripts/install.sh installs it)")

sys.path.insert(0, str(Path(__file__).parent))
from cosyvoice2_tiny import write_tone_wav  # noqa: E402

from ttsrl import knobs  # noqa: E402
from ttsrl.families import family  # noqa: E402
from ttsrl.reward.backends.cosyvoice import CosyVoiceConfig, CosyVoiceToken2Wav  # noqa: E402
from ttsrl.reward.backends.cosyvoice_code import check_model_dir, checkout_lacks  # noqa: E402

COSYVOICE3 = family("cosyvoice3").token2wav

ROOT = Path(__file__).resolve().parents[1]
RATE = 24000
SAMPLES_PER_TOKEN = 960  # 25 codes per second, 2 mel frames per code, hop 480 at 24 kHz
CHECKOUT = knobs.get("TTSRL_COSYVOICE_CHECKOUT") or ""


def _checkout_problem() -> str | None:
    if not CHECKOUT:
        return "no CosyVoice checkout with CosyVoice3: set TTSRL_COSYVOICE_CHECKOUT (the PyPI package lacks it)"
    if not (Path(CHECKOUT) / "cosyvoice" / "cli" / "model.py").is_file():
        return f"TTSRL_COSYVOICE_CHECKOUT={CHECKOUT} is not a CosyVoice checkout"
    lacking = checkout_lacks(CHECKOUT, COSYVOICE3)
    if lacking:
        return f"the CosyVoice checkout {CHECKOUT} predates CosyVoice3 (lacks {', '.join(lacking)})"
    try:
        import x_transformers  # noqa: F401 - CosyVoice3's DiT imports it
    except ImportError:
        return "x-transformers is not installed (requirements-cpu.txt pins it)"
    return None


needs_checkout = pytest.mark.skipif(_checkout_problem() is not None, reason=str(_checkout_problem()))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from cosyvoice3_token2wav_tiny import cosyvoice3_token2wav_with_prompts

    return cosyvoice3_token2wav_with_prompts(tmp_path_factory.mktemp("cosyvoice3"), CHECKOUT)


@pytest.fixture(scope="module")
def t2w(folders):
    model, prompts = folders
    return CosyVoiceToken2Wav(CosyVoiceConfig(model_dir=str(model), family="cosyvoice3", prompt_dir=str(prompts), checkout=CHECKOUT,
                                                device="cpu"))


def codes(n, start=0):
    return [(start + 37 * i) % 6561 for i in range(n)]


def _complete_folder(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for f in COSYVOICE3.token2wav_files:
        (d / f).write_bytes(b"x")
    return d


# ---- everywhere: the model folder, the checkout, the options ------------------------------------

def test_a_missing_file_is_one_error_naming_all_missing(tmp_path):
    d = tmp_path / "Fun-CosyVoice3-0.5B-2512"
    d.mkdir()
    (d / "flow.pt").write_bytes(b"x")
    with pytest.raises(FileNotFoundError) as e:
        CosyVoiceToken2Wav(CosyVoiceConfig(model_dir=str(d), family="cosyvoice3", checkout=CHECKOUT or None, device="cpu"))
    msg = str(e.value)
    for f in ("cosyvoice3.yaml", "hift.pt", "campplus.onnx", "speech_tokenizer_v3.onnx"):
        assert f in msg, f
    assert "flow.pt," not in msg.split("(needs")[0] and "CosyVoice3 model folder" in msg
    assert "speech_tokenizer_v2" not in msg  # CosyVoice3's own file list, not CosyVoice2's
    check_model_dir(_complete_folder(tmp_path / "ok"), family=COSYVOICE3)


def test_a_checkout_without_cosyvoice3_is_named(tmp_path):
    old = tmp_path / "CosyVoice-2025-06"
    (old / "cosyvoice" / "cli").mkdir(parents=True)
    (old / "cosyvoice" / "cli" / "model.py").write_text("class CosyVoice2Model:\n    pass\n")
    with pytest.raises(ImportError) as e:
        CosyVoiceToken2Wav(CosyVoiceConfig(model_dir=str(_complete_folder(tmp_path / "m")), family="cosyvoice3", checkout=str(old),
                                             device="cpu"))
    msg = str(e.value)
    assert "needs a CosyVoice source checkout at or after dd2d926" in msg and "PyPI" in msg
    assert "CosyVoice3Model" in msg and "CausalHiFTGenerator" in msg and str(old) in msg
    with pytest.raises(FileNotFoundError, match="not a CosyVoice checkout"):
        CosyVoiceToken2Wav(CosyVoiceConfig(model_dir=str(tmp_path / "m"), family="cosyvoice3", checkout=str(tmp_path / "nope"),
                                             device="cpu"))


@pytest.mark.slow  # a fresh Python importing CosyVoice: ~6 s
def test_no_checkout_is_the_clear_error(tmp_path):
    """Without --cosyvoice-checkout the installed package is used, and the PyPI one lacks CosyVoice3
    (a fresh process: this one may have imported a checkout's)."""
    pytest.importorskip("cosyvoice.cli.model", reason="CosyVoice's runtime (cosyvoice-minicpmo) is not installed")
    model = _complete_folder(tmp_path / "m")
    code = ("from ttsrl.reward.backends.cosyvoice import CosyVoiceConfig, CosyVoiceToken2Wav\n"
            f"CosyVoiceToken2Wav(CosyVoiceConfig(model_dir={str(model)!r}, family='cosyvoice3', device='cpu'))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    if r.returncode == 0:
        pytest.skip("the installed cosyvoice has CosyVoice3 (not the PyPI package)")
    assert "ImportError" in r.stderr and "needs a CosyVoice source checkout at or after dd2d926" in r.stderr
    assert "the PyPI package cosyvoice-minicpmo lacks CosyVoice3" in r.stderr
    assert "cosyvoice.cli.model.CosyVoice3Model" in r.stderr


def test_server_and_pipeline_options_take_cosyvoice3(tmp_path):
    import token2wav_asr_server as server
    from ttsrl.reward.backends import BACKENDS, BackendConfig

    assert "cosyvoice3" in BACKENDS
    cfg = server.parse_args(["--backend", "cosyvoice3", "--cosyvoice-model-dir", "m", "--cosyvoice-checkout", "c",
                             "--prompt-dir", "p", "--asr", "sim"])
    assert cfg.backend.backend == "cosyvoice3" and cfg.backend.model_dir == os.path.abspath("m")
    with pytest.raises(ValueError, match="needs --cosyvoice-model-dir"):
        BackendConfig(backend="cosyvoice3").validate()
    with pytest.raises(ValueError, match="one utterance at a time"):
        BackendConfig(backend="cosyvoice3", cosyvoice_model_dir="m", cosyvoice_batch_flow=True).validate()


def test_check_inputs_knows_a_cosyvoice3_folder_and_checkout(tmp_path):
    """scripts/check_inputs.py (stdlib only: it runs before the venv exists) reads the family's folder
    entries and the code cosyvoice3 needs from the registry; one message names what is missing."""
    sys.path.insert(0, str(ROOT / "scripts"))
    model = tmp_path / "Fun-CosyVoice3-0.5B-2512"
    model.mkdir()
    (model / "flow.pt").write_bytes(b"x")
    old = tmp_path / "old"
    (old / "cosyvoice" / "cli").mkdir(parents=True)
    (old / "cosyvoice" / "cli" / "model.py").write_text("class CosyVoice2Model:\n    pass\n")

    def run(*args):
        return subprocess.run([sys.executable, str(ROOT / "scripts" / "check_inputs.py"), *map(str, args)],
                              capture_output=True, text=True, timeout=60)

    r = run("--backend", "cosyvoice3", "--model-dir", model, "--cosyvoice-checkout", old)
    assert r.returncode == 1 and r.stderr.count("\n  - ") == 2
    for missing in ("CosyVoice3 model folder", "llm.pt", "cosyvoice3.yaml", "speech_tokenizer_v3.onnx",
                    "CosyVoice-BlankEN/", "predates CosyVoice3", "cosyvoice/flow/DiT/dit.py: DiT"):
        assert missing in r.stderr, missing
    assert "speech_tokenizer_v2" not in r.stderr and "flow.pt," not in r.stderr
    assert "needs a CosyVoice source checkout" in run("--backend", "cosyvoice3", "--model-dir", model).stderr
    for e in COSYVOICE3.model_dir_entries:
        (model / e).mkdir(exist_ok=True) if e.endswith("/") else (model / e).write_bytes(b"x")
    assert run("--backend", "cosyvoice3", "--model-dir", model, "--cosyvoice-checkout", old).stderr.count("\n  - ") == 1
    if CHECKOUT and _checkout_problem() is None:
        r = run("--backend", "cosyvoice3", "--model-dir", model, "--cosyvoice-checkout", CHECKOUT)
        assert r.returncode == 0 and r.stderr == ""


# ---- with a CosyVoice3 checkout: voicing ---------------------------------------------------------

@needs_checkout
@pytest.mark.slow  # tiny folder build ~20 s, backend load ~10 s, the first synthesis ~5 s
def test_voices_codes_into_24khz_audio(t2w):
    a, b = t2w.synthesize([codes(12), codes(25, 5)], [None, t2w.prompts[1]])
    assert t2w.sample_rate == RATE and t2w.token_rate == 25.0
    assert t2w._model.flow.token_mel_ratio == 2 and type(t2w._model).__name__ == "CosyVoice3Model"
    for audio, n in ((a, 12), (b, 25)):
        assert audio.sample_rate == RATE and audio.waveform.dtype == np.float32
        assert audio.waveform.shape == (n * SAMPLES_PER_TOKEN,)  # 40 ms per code
        assert audio.duration_s == pytest.approx(n / 25.0)
        assert np.isfinite(audio.waveform).all() and 0 < np.abs(audio.waveform).max() <= 1.0
    assert getattr(t2w._model, "llm", None) is None  # the yaml's llm: entry is never built
    for p, sec in zip(t2w.prompts, (1.2, 1.0)):  # CosyVoice's frontend: 25 Hz tokens, 2 mel frames each
        tok, feat, emb = p.data["prompt_token"], p.data["prompt_feat"], p.data["embedding"]
        assert abs(tok.shape[1] - 25 * sec) <= 2 and feat.shape[1:] == (2 * tok.shape[1], 80) and emb.shape == (1, 192)


@needs_checkout
@pytest.mark.slow  # the frontend of the tiny folder: ~3 s (+ the folder build)
def test_prompt_tokenizer_reads_speech_tokenizer_v3(folders, t2w):
    """scripts/prompt_tokens.py's PromptTokenizer with CosyVoice3's family: speech_tokenizer_v3 at
    25 Hz, trimmed to the prompt's mel as the backend's own prompt features are."""
    from ttsrl.reward.backends.cosyvoice import PromptTokenizer

    _, prompts = folders
    tok = PromptTokenizer(folders[0], CHECKOUT, family=COSYVOICE3)
    got = tok(prompts / "spk_a.wav")
    assert got == t2w.prompts[0].data["prompt_token"].reshape(-1).tolist() and all(0 <= t < 6561 for t in got)


@needs_checkout
@pytest.mark.slow  # two more replicas load (~15 s)
def test_same_codes_and_prompt_give_the_same_waveform(t2w, folders):
    """Upstream's fixed noise (the flow's drawn from seed 0 when built, HiFT's source right after):
    the same codes and prompt give the same waveform, again and in other replicas, also when those
    are built at once in threads (the yaml is built under a lock: their draws never interleave)."""
    a = t2w.synthesize([codes(20)], [t2w.prompts[0]])[0]
    assert np.array_equal(t2w.synthesize([codes(20)], [t2w.prompts[0]])[0].waveform, a.waveform)
    model, prompts = folders
    cfg = CosyVoiceConfig(model_dir=str(model), family="cosyvoice3", prompt_dir=str(prompts), checkout=CHECKOUT, device="cpu")
    with ThreadPoolExecutor(2) as ex:  # as the server builds its replicas: at once, in threads
        others = list(ex.map(lambda _: CosyVoiceToken2Wav(cfg), range(2)))

    def fixed_noise(x):
        src = x._model.hift.m_source
        return [x._model.flow.decoder.rand_noise, src.uv, src.l_sin_gen.rand_ini, src.l_sin_gen.sine_waves]

    for other in others:
        assert all(np.array_equal(u, v) for u, v in zip(fixed_noise(other), fixed_noise(t2w)))
    assert np.array_equal(others[1].synthesize([codes(20)], [others[1].prompts[0]])[0].waveform, a.waveform)
    assert not np.allclose(t2w.synthesize([codes(20, 3)], [t2w.prompts[0]])[0].waveform, a.waveform)


@needs_checkout
@pytest.mark.slow  # CosyVoice3 decoding and campplus: ~3 s
def test_different_prompts_give_different_sim(t2w, tmp_path):
    """SIM = cosine of campplus embeddings (the stand-in of the real signature: the code path and
    arithmetic, not a speaker measure) of the audio at 16 kHz and of the prompt."""
    import torch
    import torchaudio

    from ttsrl.reward.backends import Audio
    from ttsrl.reward.backends.cosyvoice_code import spk_embedding

    p0, p1 = t2w.prompts
    a = t2w.synthesize([codes(30)], [p0])[0]
    b = t2w.synthesize([codes(30)], [p1])[0]
    assert not np.allclose(a.waveform, b.waveform)  # the speaker prompt matters
    s00, s01 = t2w.speaker_similarity([a, a], [p0, p1])
    assert s00 != pytest.approx(s01, abs=1e-4) and -1.0 <= s01 <= 1.0 and -1.0 <= s00 <= 1.0
    speech = torchaudio.transforms.Resample(orig_freq=RATE, new_freq=16000)(torch.from_numpy(a.waveform)[None])
    emb = spk_embedding(t2w._fe, speech).reshape(-1).double()
    ref = p0.data["embedding"].reshape(-1).double()
    assert s00 == pytest.approx(float(emb @ ref / (emb.norm() * ref.norm())), abs=1e-6)
    # a zero-shot prompt wav against its own audio: 1.0
    wav = write_tone_wav(tmp_path / "self.wav", 0.9, 24000, 210.0)
    own = t2w.prompt_from_wav(str(wav))
    import soundfile as sf

    data, sr = sf.read(str(wav), dtype="float32")
    assert t2w.speaker_similarity([Audio(data, sr)], [own]) == [pytest.approx(1.0, abs=1e-6)]
    assert own.data["prompt_feat"].shape[1] == 2 * own.data["prompt_token"].shape[1]


@needs_checkout
@pytest.mark.slow  # the reward server on the cosyvoice3 backend: ~15 s
def test_reward_server_on_cosyvoice3(folders):
    import requests

    from ttsrl.reward.backends import BackendConfig
    from ttsrl.reward.server import BackgroundServer, ServerConfig

    model, prompts = folders
    backend = BackendConfig(backend="cosyvoice3", asr="sim", cosyvoice_model_dir=str(model), prompt_dir=str(prompts),
                            cosyvoice_checkout=CHECKOUT)
    with BackgroundServer(ServerConfig(backend=backend, port=0, devices=["cpu"], max_batch=1, want_sim=True)) as srv:
        c = codes(15)
        payload = {"inputs": [
            {"name": "TOKENS", "shape": [1, len(c)], "datatype": "INT32", "data": [c]},
            {"name": "TOKEN_LENS", "shape": [1, 1], "datatype": "INT32", "data": [[len(c)]]},
            {"name": "GT_TEXT", "shape": [1, 1], "datatype": "BYTES", "data": ["你好"]}]}
        r = requests.post(f"{srv.url}/v2/models/token2wav_asr/infer", json=payload, timeout=600)
        assert r.status_code == 200, r.text
        out = {o["name"]: o["data"][0] for o in r.json()["outputs"]}
        assert 0.0 <= out["REWARDS"] <= 1.0 and -1.0 <= out["SIMS"] <= 1.0
        assert srv.server.pipelines[0].token2wav.name == "cosyvoice3"


# ---- with a CosyVoice3 checkout and vllm-omni's reference venv: the mel against its code2wav -------

OMNI_PY = ROOT / ".venv-omni" / "bin" / "python"
OMNI_DRIVER = ROOT / "tests" / "omni" / "driver.py"


@needs_checkout
@pytest.mark.skipif(not (OMNI_PY.exists() and OMNI_DRIVER.exists()),
                    reason=".venv-omni or tests/omni/driver.py absent: vllm-omni's reference (bash scripts/install.sh "
                           "--vllm-omni)")
@pytest.mark.slow  # ~45 s: the driver's cold import of vllm-omni (~30 s on 2 cores) and its flow
def test_backend_mel_equals_vllm_omni_code2wav(t2w, tmp_path):
    """The mel our backend hands HiFT (CosyVoice3Model.token2wav on the prompt features its
    frontend extracted from a prompt wav) equals vllm-omni's code2wav flow for the same flow.pt,
    codes, prompt features and initial noise (the backend's fixed ``rand_noise``, injected into
    vllm-omni, which draws torch.randn per call). tests/test_omni_parity.py compares upstream's
    flow module on random prompt tensors; this is the backend's whole path up to HiFT."""
    import json

    import torch
    from cosyvoice3_token2wav_tiny import COSYVOICE3_T2W_SIZES

    hift, mels = t2w._model.hift, []
    real = hift.inference

    def spy(speech_feat, **kw):
        mels.append(speech_feat.detach().clone())
        return real(speech_feat=speech_feat, **kw)

    c = codes(40, 11)
    prompt = t2w.prompts[1]
    hift.inference = spy
    try:
        t2w.synthesize([c], [prompt])
    finally:
        del hift.inference  # the bound method again
    (ours,) = mels
    s = COSYVOICE3_T2W_SIZES["tiny"]
    (tmp_path / "flow.json").write_text(json.dumps({
        "pre_lookahead_layer": {"channels": s["lookahead_channels"]},
        "decoder": {"estimator": {"dim": s["dit_dim"], "depth": s["dit_depth"], "heads": s["dit_heads"],
                                  "dim_head": s["dit_head_dim"]}}}))
    np.savez(tmp_path / "prompt.npz", **{k: prompt.data[k].cpu().numpy()
                                         for k in ("prompt_token", "prompt_feat", "embedding")})
    np.save(tmp_path / "noise.npy", t2w._model.flow.decoder.rand_noise.numpy())
    (tmp_path / "codes.json").write_text(json.dumps(c))
    r = subprocess.run([str(OMNI_PY), str(OMNI_DRIVER), "code2wav-mel", "--model-dir", t2w.cfg.model_dir,
                        "--codes", str(tmp_path / "codes.json"), "--prompt", str(tmp_path / "prompt.npz"),
                        "--noise", str(tmp_path / "noise.npy"), "--flow-config", str(tmp_path / "flow.json"),
                        "--out", str(tmp_path / "mel.npy")], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-4000:]
    got = np.load(tmp_path / "mel.npy")
    assert got.shape == tuple(ours.shape) == (1, 80, 2 * len(c))
    diff = float(np.abs(got - ours.float().numpy()).max())
    print(f"max |mel diff| backend vs vllm-omni code2wav: {diff:.3g} (mel std {float(ours.std()):.3g})")
    assert diff < 1e-4 and torch.isfinite(ours).all()


@needs_checkout
def test_export_loads_strict_in_upstreams_cosyvoice3lm(tmp_path):
    """Stage 5's llm.pt of a CosyVoice3 checkpoint in upstream's own ``CosyVoice3LM`` (the
    checkout's ``cosyvoice.llm.llm``; the PyPI package has none): strict load and equal logits
    (``verify_export(reference="cosyvoice")``, what scripts/rehearsal.sh --family cosyvoice3
    checks at full size); swapped sos/task_id rows are seen."""
    import torch
    from cosyvoice3_tiny import write_random_llm3

    from ttsrl.model import convert
    from ttsrl.reward.backends.cosyvoice_code import import_cosyvoice

    write_random_llm3(tmp_path / "cv3")
    convert.cosyvoice_to_hf(tmp_path / "cv3", tmp_path / "hf", log=lambda _: None)
    convert.hf_to_cosyvoice(tmp_path / "hf", tmp_path / "llm.pt", log=lambda _: None)
    import_cosyvoice(CHECKOUT, COSYVOICE3)
    assert convert.verify_export(tmp_path / "hf", tmp_path / "llm.pt", reference="cosyvoice") <= 1e-5
    state = torch.load(tmp_path / "llm.pt")
    rows = state["speech_embedding.weight"]
    rows[[6561, 6563]] = rows[[6563, 6561]].clone()  # sos and task_id swapped
    torch.save(state, tmp_path / "swapped.pt")
    assert convert.verify_export(tmp_path / "hf", tmp_path / "swapped.pt", reference="cosyvoice") > 1e-2
