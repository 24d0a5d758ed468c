"""Whisper (faster-whisper, wheel-shipped Whisper-base) on audio the test makes with espeak-ng."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("faster_whisper", reason="faster-whisper is not installed")
if shutil.which("espeak-ng") is None:
    pytest.skip("espeak-ng is not installed (apt-get install -y espeak-ng): no audio to transcribe",
                allow_module_level=True)

from ttsrl.atomic import sha256_file  # noqa: E402
from ttsrl.embedded import codec  # noqa: E402
from ttsrl.reward.backends import BackendConfig, build_pipeline  # noqa: E402
from ttsrl.reward.backends.whisper import MISSING_MERGE, WHEEL_MODEL_SHA256, prepare_wheel_model  # noqa: E402
from ttsrl.text import cer  # noqa: E402

TEXTS = ["我想喝一杯热茶。", "今天天气很好，我们去公园散步。"]


@pytest.fixture(scope="module")
def pipeline():
    try:
        return build_pipeline(BackendConfig(backend="whisper", want_score=True))
    except FileNotFoundError as e:  # the wheels are missing
        pytest.skip(f"Whisper-base files not available: {e}")


def test_wheel_model_is_assembled_verified_and_patched(pipeline):
    d = prepare_wheel_model()
    assert (d / "READY").read_text().strip() == WHEEL_MODEL_SHA256
    assert sha256_file(d / "model.bin") == WHEEL_MODEL_SHA256
    merges = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))["model"]["merges"]
    assert merges[0] == MISSING_MERGE and merges.count(MISSING_MERGE) == 1
    assert prepare_wheel_model() == d  # idempotent


def test_whisper_transcribes_espeak_speech(pipeline):
    codes = [codec.encode(t) for t in TEXTS]
    out = pipeline.transcribe_tokens(codes, TEXTS)
    rates = [cer(t, o.text) for t, o in zip(TEXTS, out)]
    print("transcripts", [o.text for o in out], "CER", rates)
    assert sum(rates) / len(rates) < 0.8
    assert all(o.duration_s > 0.5 for o in out)
    # an empty sequence is an empty transcript without touching the models
    assert pipeline.transcribe_tokens([[]], [TEXTS[0]])[0].text == ""


def test_forced_score_prefers_the_right_text(pipeline):
    audio = pipeline.token2wav.synthesize([codec.encode(TEXTS[0])], [None])
    right, wrong = pipeline.asr.score(audio * 2, [TEXTS[0], "这本书非常有意思。"])
    assert right > wrong


@pytest.mark.slow  # Whisper through the server: ~5 s
def test_reward_server_with_whisper(pipeline):
    import requests

    from ttsrl.reward.server import BackgroundServer, ServerConfig

    with BackgroundServer(ServerConfig(port=0), pipelines=[pipeline]) as srv:
        codes = codec.encode(TEXTS[0])
        payload = {"inputs": [
            {"name": "TOKENS", "shape": [1, len(codes)], "datatype": "INT32", "data": [codes]},
            {"name": "TOKEN_LENS", "shape": [1, 1], "datatype": "INT32", "data": [[len(codes)]]},
            {"name": "GT_TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [TEXTS[0]]}]}
        r = requests.post(f"{srv.url}/v2/models/token2wav_asr/infer", json=payload, timeout=120)
        assert r.status_code == 200, r.text
        outs = {o["name"]: o["data"][0] for o in r.json()["outputs"]}
        assert 0.3 < outs["REWARDS"] <= 1.0 and outs["TRANSCRIPTS"]


@pytest.mark.slow  # Whisper through the server: ~28 s
def test_corpus_cer_through_the_server(pipeline):
    """espeak-ng speech of held-out corpus sentences -> reward server -> Whisper-base: the CER
    it gives is printed (espeak's robotic Mandarin: about 0.6-0.8 per the offline-speech notes);
    the bound only says Whisper hears speech, not noise."""
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    import requests

    from ttsrl.reward.server import BackgroundServer, ServerConfig
    from ttsrl.text import error_counts

    corpus = Path(__file__).resolve().parents[1] / "data" / "corpus" / "test.jsonl"
    texts = [json.loads(x)["text"] for x in corpus.read_text(encoding="utf-8").splitlines()[:8]]

    def ask(url, text):
        codes = codec.encode(text)
        payload = {"inputs": [
            {"name": "TOKENS", "shape": [1, len(codes)], "datatype": "INT32", "data": [codes]},
            {"name": "TOKEN_LENS", "shape": [1, 1], "datatype": "INT32", "data": [[len(codes)]]},
            {"name": "GT_TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [text]}]}
        r = requests.post(f"{url}/v2/models/token2wav_asr/infer", json=payload, timeout=300)
        assert r.status_code == 200, r.text
        return {o["name"]: o["data"][0] for o in r.json()["outputs"]}

    with BackgroundServer(ServerConfig(port=0), pipelines=[pipeline]) as srv:
        with ThreadPoolExecutor(4) as ex:
            outs = list(ex.map(lambda t: ask(srv.url, t), texts))
    errs = [error_counts(t, o["TRANSCRIPTS"], "char") for t, o in zip(texts, outs)]
    corpus_cer = sum(e for e, _ in errs) / sum(n for _, n in errs)
    print(f"Whisper-base on espeak-ng speech of {len(texts)} corpus sentences: CER {corpus_cer:.3f}",
          [o["TRANSCRIPTS"] for o in outs])
    assert corpus_cer < 0.9
    assert all(0.0 <= o["REWARDS"] <= 1.0 for o in outs)


#: Batched vs one-utterance decoding, per compute type. The two passes run the same math with
#: another batch size, so the kernels sum in another order and nothing else may differ.
#: float32 checks the batching logic itself (padding, masks, frame counts): a reordered float32 sum
#: of these O(1) scores is off by a few hundred eps at most (eps 1.2e-7), so 1e-5 holds on every
#: x86 kernel, while a wrong mask or frame count moves a score by the right/wrong gap (~1).
#: int8 (the CPU default, what the reward server runs) quantises activations per row on the fly: a
#: float difference that crosses a rounding boundary moves one activation by a whole int8 step, and
#: how often that happens depends on the CPU's kernels (AVX2, VNNI, AVX-512 BF16, AMX), so no
#: absolute bound follows from the computation. What the score is for does give one: it ranks the
#: right text above a wrong one (test_forced_score_prefers_the_right_text, cer_nll). The batched
#: score must keep every such ranking with room: its distance to the single score stays under a
#: tenth of the smallest right/wrong margin measured on the same audio, on the same machine.
MARGIN_SHARE = 0.1
FLOAT32_TOLERANCE = 1e-5


@pytest.mark.slow  # Whisper decoding: 32-48 s per dtype on 2 cores
@pytest.mark.parametrize("compute_type", ["float32", "int8"])
def test_a_batch_decodes_as_each_utterance_alone(pipeline, compute_type):
    """The server hands Whisper a whole batch (one encoder pass, one greedy ``generate``, one
    forced-alignment pass); each utterance gets exactly the transcript it gets alone, and a forced
    score that ranks texts as the score it gets alone does."""
    from ttsrl.reward.backends.whisper import WhisperASR, WhisperConfig

    texts = TEXTS + ["这本书非常有意思。", "他在二零二三年去了北京。"]
    heard = [o.audio for o in pipeline.transcribe_tokens([codec.encode(t) for t in texts], texts)]
    assert len({round(a.duration_s, 2) for a in heard}) == len(texts)  # lengths differ: padding is exercised
    asr = pipeline.asr if compute_type == "int8" else WhisperASR(WhisperConfig(compute_type=compute_type))
    assert asr._model.model.compute_type.startswith(compute_type)  # CPU int8 runs as int8_float32
    batch = asr.transcribe(heard)
    alone = [asr.transcribe([a])[0] for a in heard]
    assert batch == alone and any(batch), (batch, alone)
    scores = asr.score(heard, texts)
    single = [asr.score([a], [t])[0] for a, t in zip(heard, texts)]
    diff = max(abs(s - a) for s, a in zip(scores, single))
    # each utterance against another utterance's text: the gap the score exists to show
    wrong = [asr.score([a], [texts[(i + 1) % len(texts)]])[0] for i, a in enumerate(heard)]
    margin = min(r - w for r, w in zip(single, wrong))
    print(f"{compute_type}: max |batched - single| forced score {diff:.3g}, "
          f"smallest right/wrong margin {margin:.3g}")
    assert margin > 0, (single, wrong)  # every utterance prefers its own text
    bound = FLOAT32_TOLERANCE if compute_type == "float32" else MARGIN_SHARE * margin
    assert diff <= bound, (scores, single, bound)
