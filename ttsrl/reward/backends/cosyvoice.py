"""The token2wav of CosyVoice's families (flow matching + HiFT vocoder), run with CosyVoice's code.

One engine for every family whose ``<Family>Model.token2wav`` and ``CosyVoiceFrontEnd`` take
CosyVoice's calls: the family (``CosyVoiceConfig.family``) names its files, model class and the
code it needs (``Family.token2wav``, a :class:`~ttsrl.families.Token2WavSpec` in its folder);
what differs between CosyVoice2 and CosyVoice3 is that data, not a class here.

Code: the installed ``cosyvoice`` package (PyPI ``cosyvoice-minicpmo==0.1.0``, whose
``cosyvoice/flow``, ``cosyvoice/hifigan``, ``cosyvoice/transformer`` and ``cosyvoice/utils`` are
byte-identical to upstream FunAudioLLM/CosyVoice at commit 46dfe043, 2025-06-25; its
``cli/`` drops the LLM and text normaliser) or, with ``checkout``, a CosyVoice source
checkout put first on ``sys.path`` (a family whose spec names ``needs_code`` must have one that
holds it: CosyVoice3). Weights: a model folder of the family (its ``token2wav_files``).

Only what token2wav needs is built: the yaml is loaded with every top-level object
except ``flow``, ``hift`` and ``feat_extractor`` overridden to None, so the 0.5B LLM
(and the training-data processors, which import ``pyworld``) are never constructed.
CosyVoice's own ``<Family>Model.token2wav`` and ``CosyVoiceFrontEnd.frontend_zero_shot``
do the work; keyword arguments are matched to the installed version's signatures.

Devices are explicit and right by construction: every call into a replica (building it,
prompt extraction, synthesis) runs under ``torch.cuda.device(dev)``, so CosyVoice's bare
``torch.device('cuda')`` means this replica's GPU in whatever thread runs it; the model's and
frontend's ``device`` attributes are set to ``dev``; ``cuda`` without index means the current
device. HiFT's source excitation is random: each synthesis seeds the replica's generator from
the codes (sha1), so the same codes and prompt give the same waveform (CosyVoice3's flow noise
and HiFT source phases are drawn once when built, from ``set_all_random_seed(0)``'s stream:
hence one yaml built at a time, ``_BUILD_LOCK``).

Speakers: the reward voices each text with one of the ``*.wav`` of ``prompt_dir`` (chosen by
the pipeline from the text, or named by the request's PROMPT_ID: the wav's stem, ``prompt_pool``);
zero-shot evaluation passes each utterance's own prompt wav
(:meth:`prompt_from_wav`). Prompt wavs must be >= 16 kHz and <= 30 s (CosyVoice's limits).
The features of ``prompt_dir``'s wavs are extracted once per process and shared by every
replica (:func:`shared_prompt_features`, keyed by the model files and the wav's content):
a server with eight replicas extracts each wav once, not eight times, and every replica voices
a speaker with the same features (CosyVoice's frontend computes mels on the CPU and the
speech tokens and campplus embedding with ONNX Runtime), each from its own device copy.
"""

from __future__ import annotations

import hashlib
import threading
import uuid as uuidlib
from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ttsrl.families import Token2WavSpec
from ttsrl.families import family as family_named
from ttsrl.reward.backends.base import Audio, SpeakerPrompt, Token2Wav
from ttsrl.reward.backends.cosyvoice_code import (
    call_matching,
    check_model_dir,
    import_cosyvoice,
    load_yaml_without_llm,
    make_frontend,
    resolve_device,
    spk_embedding,
    to_16k,
    zero_shot_inputs,
)
from ttsrl.reward.wavcheck import PROMPT_MAX_S, PROMPT_MIN_RATE, check_prompt_wav  # noqa: F401 - the one wav check

#: shortest 16 kHz audio campplus is given: one 25 ms kaldi fbank frame
SPK_MIN_SAMPLES = 400
_CPU_LOCK = threading.Lock()  # CPU replicas share torch's one CPU generator
_SHARED: dict[tuple, dict] = {}  # (model files, wav sha1) -> prompt features on the CPU
_SHARED_LOCKS: dict[tuple, threading.Lock] = {}
_SHARED_GUARD = threading.Lock()


def prompt_key(model_dir: str | Path, checkout: str | None, wav: Path, family: Token2WavSpec) -> tuple:
    """What a prompt wav's features depend on: the model's feature files (path, size, mtime),
    the CosyVoice code, and the wav's bytes (sha1)."""
    d = Path(model_dir).resolve()
    files = tuple((name, (d / name).stat().st_size, (d / name).stat().st_mtime_ns)
                  for name in (family.yaml, "campplus.onnx", family.speech_tokenizer))
    return str(d), checkout, files, hashlib.sha1(wav.read_bytes()).hexdigest()


def shared_prompt_features(key: tuple, extract) -> dict:
    """The features under ``key``, from ``extract()`` the first time in this process (replicas
    built at once in threads wait for the one extracting), kept on the CPU."""
    with _SHARED_GUARD:
        lock = _SHARED_LOCKS.setdefault(key, threading.Lock())
    with lock:
        hit = _SHARED.get(key)
        if hit is None:
            hit = _SHARED[key] = {k: v.detach().cpu() if hasattr(v, "detach") else v for k, v in extract().items()}
    return hit


@dataclass
class CosyVoiceConfig:
    model_dir: str  # a model folder of the family (CosyVoice2-0.5B, Fun-CosyVoice3-0.5B-2512)
    family: str  # the model family whose token2wav this is (ttsrl.families; the backend's name)
    prompt_dir: str | None = None  # *.wav speaker prompts for requests without their own prompt wav
    checkout: str | None = None  # CosyVoice source checkout; None = the installed `cosyvoice` package
    device: str = "cuda:0"
    fp16: bool = False
    prompt_cache: int = 256  # prompt wavs whose features are kept
    batch_flow: bool = False  # flow over the whole batch at once (ttsrl.reward.backends.cosyvoice2_batch; a family
    # whose spec has batch_flow); False: one by one


def _seed(codes: Sequence[int]) -> int:
    """HiFT's noise seed for a code sequence (sha1): the same codes give the same waveform."""
    return int.from_bytes(hashlib.sha1(np.asarray(codes, dtype=np.int64).tobytes()).digest()[:4], "big")


def _check_prompt(prompt: SpeakerPrompt, family: Token2WavSpec) -> None:
    if prompt.data is None:
        raise ValueError(f"{family.name} token2wav needs a speaker prompt: give --prompt-dir (reward) "
                         "or each utterance's prompt wav (zero-shot evaluation)")


def cosine(a, b) -> float | None:
    """Cosine similarity of two embeddings (tensors or arrays of any shape, flattened);
    None when either is all zeros."""
    x = np.asarray(a.detach().cpu() if hasattr(a, "detach") else a, dtype=np.float64).reshape(-1)
    y = np.asarray(b.detach().cpu() if hasattr(b, "detach") else b, dtype=np.float64).reshape(-1)
    nx, ny = np.linalg.norm(x), np.linalg.norm(y)
    if nx == 0 or ny == 0:
        return None
    return float(np.clip(x @ y / (nx * ny), -1.0, 1.0))


class PromptTokenizer:
    """Prompt wav -> the speech tokens ``family``'s zero-shot inference gives its LLM
    (``llm_prompt_speech_token`` of ``frontend_zero_shot``: the family's speech tokenizer,
    trimmed to the prompt's mel length as CosyVoice does)."""

    def __init__(self, model_dir: str | Path, family: Token2WavSpec, checkout: str | None = None,
                 device: str = "cpu"):
        check_model_dir(model_dir, family=family)
        self.model_dir = Path(model_dir)
        self.device = resolve_device(device)
        FrontEnd, _ = import_cosyvoice(checkout, family)
        conf = load_yaml_without_llm(self.model_dir / family.yaml, keep=("feat_extractor",))
        self.sample_rate = int(conf.get("sample_rate", 24000))
        with self._scope():
            self._fe = make_frontend(FrontEnd, self.model_dir, conf["feat_extractor"], self.device, family)

    def _scope(self):
        import torch

        return torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext()

    def __call__(self, wav: str | Path) -> list[int]:
        with self._scope():
            inp = zero_shot_inputs(self._fe, Path(wav), self.sample_rate)
        return [int(t) for t in inp["llm_prompt_speech_token"].reshape(-1).tolist()]


class CosyVoiceToken2Wav(Token2Wav):
    """The token2wav of ``cfg.family`` (a family with a ``token2wav`` spec): its files, model
    class and needed code come from that spec; the backend is named after the family."""

    has_speaker_model = True  # campplus.onnx of the model folder

    def __init__(self, cfg: CosyVoiceConfig):
        spec = family_named(cfg.family).token2wav
        if spec is None:
            raise ValueError(f"model family {cfg.family} has no token2wav")
        if cfg.batch_flow and not spec.batch_flow:
            raise ValueError(f"--cosyvoice-batch-flow: {spec.name}'s flow is not one the batched path knows "
                             f"(its Token2WavSpec.batch_flow); backend {cfg.family} voices one utterance at a time "
                             "(start without it)")
        self.name, self.family = cfg.family, spec
        check_model_dir(cfg.model_dir, family=self.family)
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, SpeakerPrompt] = OrderedDict()
        self.n_synthesized = 0  # code sequences voiced by this replica
        with self.device_scope():
            self._build()
            self._prompts = self._load_prompt_dir(cfg.prompt_dir)
        self._pool = {p.name: p for p in self._prompts}

    def device_scope(self):
        import torch

        return torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext()

    def _build(self) -> None:
        import torch

        FrontEnd, Model = import_cosyvoice(self.cfg.checkout, self.family)
        d, dev = Path(self.cfg.model_dir), self.device
        conf = load_yaml_without_llm(d / self.family.yaml)
        flow, hift = conf["flow"], conf["hift"]
        flow.load_state_dict(torch.load(d / "flow.pt", map_location=dev, weights_only=True), strict=True)
        hstate = torch.load(d / "hift.pt", map_location=dev, weights_only=True)
        hift.load_state_dict({k.replace("generator.", ""): v for k, v in hstate.items()}, strict=True)
        flow.to(dev).eval()
        hift.to(dev).eval()
        model = Model(None, flow, hift, False)  # llm None: never built nor loaded
        model.device = dev
        if self.cfg.fp16:
            flow.half()
            model.fp16 = True
        self._model = model
        self._fe = make_frontend(FrontEnd, d, conf["feat_extractor"], dev, self.family)
        self.sample_rate = int(conf.get("sample_rate", 24000))
        self.token_rate = float(conf.get("token_frame_rate", family_named(self.name).token_rate_hz))

    # ---- speaker prompts ----------------------------------------------------
    def _features(self, wav: Path) -> dict:
        inp = zero_shot_inputs(self._fe, wav, self.sample_rate)
        return {"prompt_token": inp["flow_prompt_speech_token"], "prompt_feat": inp["prompt_speech_feat"],
                "embedding": inp["flow_embedding"]}

    def _extract(self, wav: Path, name: str) -> SpeakerPrompt:
        return SpeakerPrompt(name, {**self._features(wav), "wav": str(wav)})

    def _load_prompt_dir(self, prompt_dir: str | None) -> tuple[SpeakerPrompt, ...]:
        if not prompt_dir:
            return ()
        wavs = sorted(Path(prompt_dir).glob("*.wav"))
        if not wavs:
            raise FileNotFoundError(f"no speaker prompt *.wav in {prompt_dir}")
        out = []
        for w in wavs:  # extracted once per process, shared by the replicas; each its own device copy
            feats = shared_prompt_features(prompt_key(self.cfg.model_dir, self.cfg.checkout, w, self.family),
                                           lambda w=w: self._features(w))
            out.append(SpeakerPrompt(w.stem, {**{k: v.to(self.device) for k, v in feats.items()}, "wav": str(w)}))
        return tuple(out)

    @property
    def prompts(self):
        if not self._prompts:
            return (SpeakerPrompt("none"),)
        return self._prompts

    @property
    def prompt_pool(self):
        """``prompt_dir``'s speakers by wav stem (the wire's PROMPT_ID names one): the same
        features as the text-chosen speakers, so a request naming spk_a is voiced exactly as a
        text the pipeline assigns to spk_a."""
        return self._pool

    def prompt_from_wav(self, path: str | Path) -> SpeakerPrompt:
        """This wav as the speaker (zero-shot evaluation); features cached per path."""
        key = str(Path(path).resolve())
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        with self.device_scope():
            p = self._extract(Path(path), Path(path).stem)
        with self._lock:
            self._cache[key] = p
            while len(self._cache) > self.cfg.prompt_cache:
                self._cache.popitem(last=False)
        return p

    # ---- speaker similarity --------------------------------------------------
    def speaker_similarity(self, audios, prompts):
        """Cosine of campplus embeddings (CosyVoice's own ``_extract_spk_embedding``, the
        prompt speaker's path: :func:`spk_embedding`) of each audio at 16 kHz and of its prompt (the prompt's
        embedding as extracted). None for an audio without a waveform or under 25 ms, or
        a prompt without features. Not the Seed-TTS eval SIM (WavLM-large)."""
        import torch

        out: list[float | None] = []
        with self.device_scope(), torch.inference_mode():
            for audio, prompt in zip(audios, prompts, strict=True):
                prompt = prompt if prompt is not None and prompt.data is not None else self.prompts[0]
                if prompt.data is None or audio.waveform is None:
                    out.append(None)
                    continue
                speech = to_16k(audio.waveform, audio.sample_rate)
                if speech.shape[1] < SPK_MIN_SAMPLES:
                    out.append(None)
                    continue
                out.append(cosine(spk_embedding(self._fe, speech), prompt.data["embedding"]))
        return out

    # ---- synthesis -----------------------------------------------------------
    def _one(self, codes: Sequence[int], prompt: SpeakerPrompt) -> Audio:
        import torch

        _check_prompt(prompt, self.family)
        model, dev = self._model, self.device
        uid = str(uuidlib.uuid4())
        token = torch.tensor([list(codes)], dtype=torch.int32, device=dev)
        seed = _seed(codes)
        with self._lock, (_CPU_LOCK if dev.type == "cpu" else nullcontext()):
            model.hift_cache_dict[uid] = None  # token2wav keeps per-uuid caches in the model
            try:
                with torch.inference_mode():
                    if dev.type == "cuda":
                        torch.cuda.manual_seed(seed)  # this device's generator only
                    else:
                        torch.manual_seed(seed)
                    wav = call_matching(model.token2wav, token=token, prompt_token=prompt.data["prompt_token"],
                                prompt_feat=prompt.data["prompt_feat"], embedding=prompt.data["embedding"],
                                token_offset=0, uuid=uid, stream=False, streaming=False, finalize=True,
                                speed=1.0)
            finally:
                model.hift_cache_dict.pop(uid, None)
            self.n_synthesized += 1
        return Audio(waveform=wav.float().cpu().numpy().reshape(-1).astype(np.float32),
                     sample_rate=self.sample_rate, codes=tuple(int(c) for c in codes),
                     token_rate=self.token_rate)

    def _batched(self, batch: Sequence[Sequence[int]], prompts: Sequence[SpeakerPrompt]) -> list[Audio]:
        """The flow over the batch in length groups (each padded, masked: ``length_groups``), then
        HiFT per utterance with the same per-utterance seed as :meth:`_one`: the same audio up to
        float error."""
        import torch

        from ttsrl.reward.backends.cosyvoice2_batch import flow_mels, length_groups

        model, dev = self._model, self.device
        for p in prompts:
            _check_prompt(p, self.family)
        out = []
        with self._lock, (_CPU_LOCK if dev.type == "cpu" else nullcontext()), torch.inference_mode():
            with torch.autocast(dev.type, enabled=bool(self.cfg.fp16 and dev.type == "cuda")):
                mels: list = [None] * len(batch)
                sizes = [len(c) + p.data["prompt_token"].shape[-1] for c, p in zip(batch, prompts)]
                for group in length_groups(sizes):  # padding bounded per group
                    for i, mel in zip(group, flow_mels(model.flow, [batch[i] for i in group],
                                                       [prompts[i].data for i in group], dev)):
                        mels[i] = mel
            for codes, mel in zip(batch, mels):
                seed = _seed(codes)
                if dev.type == "cuda":
                    torch.cuda.manual_seed(seed)
                else:
                    torch.manual_seed(seed)
                wav, _ = model.hift.inference(speech_feat=mel, cache_source=torch.zeros(1, 1, 0, device=dev))
                self.n_synthesized += 1
                out.append(Audio(waveform=wav.float().cpu().numpy().reshape(-1).astype(np.float32),
                                 sample_rate=self.sample_rate, codes=tuple(int(c) for c in codes),
                                 token_rate=self.token_rate))
        return out

    def synthesize(self, batch, prompts):
        prompts = [p if p is not None and p.data is not None else self.prompts[0] for p in prompts]
        with self.device_scope():
            if self.cfg.batch_flow and len(batch) > 1:
                return self._batched(batch, prompts)
            return [self._one(c, p) for c, p in zip(batch, prompts)]
