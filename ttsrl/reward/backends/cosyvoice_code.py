"""CosyVoice's code and model folder, as our token2wav (``cosyvoice``) and prompt tokenizer use
them: which files a model folder of each family must hold (``Family.token2wav``),
importing CosyVoice (installed, or a source checkout) and checking it has the family's classes,
loading its yaml without the LLM, its frontend on a chosen device, ``frontend_zero_shot`` on a
prompt wav, the campplus embedding of a waveform, and reading audio at the 16 kHz its speech
tokenizer and campplus expect. Keyword arguments are matched to the installed version's
signatures (:func:`call_matching`)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import io
import logging
import re
import sys
import threading
from pathlib import Path
from typing import Sequence

import numpy as np

from ttsrl.families import Token2WavSpec
from ttsrl.reward.wavcheck import check_prompt_wav

YAML_KEEP = ("flow", "hift", "feat_extractor")
log = logging.getLogger("ttsrl.reward.backends")


def missing_model_entries(model_dir: str | Path, entries: Sequence[str]) -> list[str]:
    d = Path(model_dir)
    return [e for e in entries if not ((d / e).is_dir() if e.endswith("/") else (d / e).is_file())]


def check_model_dir(model_dir: str | Path, family: Token2WavSpec, entries: Sequence[str] | None = None) -> None:
    """One error naming every missing file of a model folder of ``family`` (its token2wav files
    unless ``entries``)."""
    entries = family.token2wav_files if entries is None else entries
    missing = missing_model_entries(model_dir, entries)
    if missing:
        raise FileNotFoundError(f"{family.name} model folder {model_dir} lacks {', '.join(missing)} "
                                f"(needs {', '.join(entries)}; from the released {family.release})")


def load_wav(path: str | Path, target_sr: int, min_sr: int = 16000):
    """Mono float32 tensor (1, T) at ``target_sr``: CosyVoice's ``load_wav`` (upstream reads with
    ``torchaudio.load(backend='soundfile')``), reading with soundfile itself: torchaudio.load needs
    torchcodec in torchaudio >= 2.9, whose libraries need not load beside this torch. Resampled
    with torchaudio's pure-Python Resample, as CosyVoice does."""
    import soundfile as sf

    wav, rate = sf.read(str(path), dtype="float32", always_2d=True)
    if rate != target_sr and rate < min_sr:
        raise ValueError(f"{path}: wav sample rate {rate} must be at least {min_sr}")
    return resample(np.ascontiguousarray(wav.mean(axis=1)), rate, target_sr)


def load_wav_16k(path: str | Path):
    """Mono float32 tensor (1, T) at 16 kHz (:func:`load_wav`)."""
    return load_wav(path, 16000)


def resample(wav: np.ndarray, rate: int, target_sr: int):
    """Mono float32 tensor (1, T) at ``target_sr`` from a waveform at ``rate`` Hz (torchaudio's
    Resample, as CosyVoice resamples)."""
    import torch
    import torchaudio

    t = torch.from_numpy(np.ascontiguousarray(wav, dtype=np.float32).reshape(-1))[None]
    if rate != target_sr:
        t = torchaudio.transforms.Resample(orig_freq=rate, new_freq=target_sr)(t)
    return t


def to_16k(wav: np.ndarray, rate: int):
    """Mono float32 tensor (1, T) at 16 kHz from a waveform at ``rate`` Hz: what CosyVoice's
    speech tokenizer and campplus read."""
    return resample(wav, rate, 16000)


def checkout_lacks(checkout: str | Path, family: Token2WavSpec) -> list[str]:
    """What of ``family``'s code a CosyVoice checkout lacks ("path: Class"), read from its files
    (nothing imported); [] when it has it all."""
    root = Path(checkout)
    out = []
    for rel, cls in family.needs_code:
        f = root / rel
        if not f.is_file() or not re.search(rf"^class {cls}\b", f.read_text(encoding="utf-8", errors="replace"),
                                            flags=re.M):
            out.append(f"{rel}: {cls}")
    return out


def _lacks_family(family: Token2WavSpec, where: str, lacking: Sequence[str]) -> ImportError:
    return ImportError(f"{family.name} token2wav needs a CosyVoice source checkout at or after {family.since} "
                       f"(--cosyvoice-checkout DIR; the PyPI package cosyvoice-minicpmo lacks {family.name}); "
                       f"{where} lacks {', '.join(lacking)}")


_CHECKOUT_PATHS: list[str] = []  # what _use_code put on sys.path


def _use_code(root: Path | None) -> None:
    """Make ``import cosyvoice`` give a checkout's (``root``) or, with None, the installed package:
    the checkout first on ``sys.path`` (an earlier checkout's entries taken off), and a
    ``cosyvoice`` already imported from elsewhere in this process (the installed package for
    another backend, or another checkout) dropped from ``sys.modules``, so that the right one is
    imported; what was built from the other keeps its own modules."""
    import importlib.machinery

    keep = [str(root / "third_party" / "Matcha-TTS"), str(root)] if root is not None else []
    for p in list(_CHECKOUT_PATHS):
        if p not in keep:
            _CHECKOUT_PATHS.remove(p)
            while p in sys.path:
                sys.path.remove(p)
    for p in keep:
        if p in sys.path:
            sys.path.remove(p)
        sys.path.insert(0, p)
        if p not in _CHECKOUT_PATHS:
            _CHECKOUT_PATHS.append(p)
    mod = sys.modules.get("cosyvoice")
    if mod is None:
        return
    spec = importlib.machinery.PathFinder.find_spec("cosyvoice")
    want = {Path(p).resolve() for p in (spec.submodule_search_locations or [])} if spec is not None else set()
    have = {Path(p).resolve() for p in getattr(mod, "__path__", [])}
    if want and want != have:
        log.warning("cosyvoice was imported from %s; importing it from %s instead", ", ".join(map(str, have)) or "?",
                    ", ".join(map(str, want)))
        for name in [n for n in sys.modules if n == "cosyvoice" or n.startswith("cosyvoice.")]:
            del sys.modules[name]


def import_cosyvoice(checkout: str | None, family: Token2WavSpec):
    """CosyVoice's frontend class and ``family``'s model class, from ``checkout`` (a source
    checkout) or the installed ``cosyvoice`` package."""
    if checkout:
        root = Path(checkout)
        if not (root / "cosyvoice" / "cli" / "model.py").is_file():
            raise FileNotFoundError(f"{root} is not a CosyVoice checkout (no cosyvoice/cli/model.py)")
        lacking = checkout_lacks(root, family)
        if lacking:
            raise _lacks_family(family, f"the checkout {root}", lacking)
    _use_code(Path(checkout) if checkout else None)
    try:
        import cosyvoice.cli.model as models  # type: ignore
        from cosyvoice.cli.frontend import CosyVoiceFrontEnd  # type: ignore
    except ImportError as e:
        where = checkout or "the installed packages"
        raise ImportError(f"cannot import CosyVoice from {where}: {e}. `bash scripts/install.sh` installs "
                          "cosyvoice-minicpmo==0.1.0 and what it needs (see requirements*.txt)") from e
    model = getattr(models, family.model_class, None)
    if model is None:
        raise _lacks_family(family, checkout or f"the installed cosyvoice ({where_cosyvoice()})",
                            [f"cosyvoice.cli.model.{family.model_class}"])
    return CosyVoiceFrontEnd, model


def where_cosyvoice() -> str:
    """Where the ``cosyvoice`` package in use comes from."""
    spec = importlib.util.find_spec("cosyvoice")
    return str(Path(spec.origin).parent) if spec is not None and spec.origin else "cosyvoice not found"


def call_matching(fn, **kwargs):
    """Call ``fn`` with the subset of ``kwargs`` its signature accepts."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return fn(**kwargs)
    return fn(**{k: v for k, v in kwargs.items() if k in params})


class NoText:
    """Text tokenizer stand-in: token2wav never reads text tokens (the LLM does)."""

    def encode(self, text, **_):
        return []


def resolve_device(spec: str):
    import torch

    dev = torch.device(spec)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {spec!r} asked for but CUDA is not available")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"unsupported device {spec!r} (cpu, cuda or cuda:N)")
    return dev


_OLD_DECODER = re.compile(r"^(?P<indent>[ \t]*)(?P<key>\w+):[ \t]*!new:cosyvoice\.flow\.decoder\.ConditionalDecoder[ \t]*$",
                          flags=re.M)


def old_decoder_yaml(text: str, path: Path) -> str:
    """A CosyVoice2 yaml from before CosyVoice's commit 1c062ab (April 2025; CosyVoice2-0.5B
    downloads of that time) builds the flow's estimator as ``ConditionalDecoder`` with
    ``causal: True``. The CosyVoice code in use split that class: ``ConditionalDecoder`` no
    longer takes ``causal`` (TypeError), its causal form is ``CausalConditionalDecoder``, with the
    same modules (the same ``flow.pt`` loads) and the same full attention when not streaming
    (our token2wav never streams). Such a yaml is read as the current one: the class renamed
    and ``causal`` dropped (``causal: False``: only dropped), with a logged note. Unchanged when
    the installed ``ConditionalDecoder`` still takes ``causal``."""
    m = _OLD_DECODER.search(text)
    if m is None:
        return text
    decoder = importlib.import_module("cosyvoice.flow.decoder")
    if "causal" in inspect.signature(decoder.ConditionalDecoder.__init__).parameters:
        return text
    # the block: the lines after the class line indented deeper than it
    lines = text[m.end():].split("\n")[1:]
    block = []
    for line in lines:
        if line.strip() and len(line) - len(line.lstrip()) <= len(m["indent"]):
            break
        block.append(line)
    causal = [i for i, line in enumerate(block) if re.match(r"[ \t]+causal[ \t]*:", line)]
    if not causal:
        return text
    value = block[causal[0]].split(":", 1)[1].split("#")[0].strip().lower()
    del block[causal[0]]
    cls = "ConditionalDecoder"
    if value in ("true", "yes", "on", "1"):
        if not hasattr(decoder, "CausalConditionalDecoder"):
            raise ValueError(f"{path}: its flow decoder is `ConditionalDecoder` with `causal: True`, which the "
                             "CosyVoice code in use takes neither that way nor as `CausalConditionalDecoder`; "
                             "download the model folder's current cosyvoice2.yaml (CosyVoice2-0.5B)")
        cls = "CausalConditionalDecoder"
    log.warning("%s is an older CosyVoice2 yaml (flow decoder `ConditionalDecoder` with `causal: %s`, before "
                "CosyVoice commit 1c062ab): read as `%s` without `causal`, as the CosyVoice code in use has it "
                "(the same modules and weights); the model folder's current cosyvoice2.yaml avoids this note",
                path, value, cls)
    head = f"{m['indent']}{m['key']}: !new:cosyvoice.flow.decoder.{cls}"
    rest = lines[len(block) + 1:]
    return text[:m.start()] + "\n".join([head, *block, *rest])


#: one yaml is built at a time in this process: CosyVoice's modules draw fixed noise from torch's
#: global generator while they are built (the flow's ``rand_noise`` after seeding it with 0;
#: CosyVoice3's HiFT source right after), so replicas built at once in threads would interleave
#: their draws and voice differently
_BUILD_LOCK = threading.Lock()


def load_yaml_without_llm(path: Path, keep: Sequence[str] = YAML_KEEP) -> dict:
    """CosyVoice's yaml with every top-level object not in ``keep`` set to None (built under
    ``_BUILD_LOCK``). An older CosyVoice2 yaml's decoder is read as the current one
    (:func:`old_decoder_yaml`); any other argument the CosyVoice code in use does not take is
    named, with its yaml file."""
    from hyperpyyaml import load_hyperpyyaml

    text = old_decoder_yaml(path.read_text(encoding="utf-8"), path)
    keys = re.findall(r"^([A-Za-z_]\w*)\s*:\s*!(?:new|name|apply):", text, flags=re.M)
    overrides = {k: None for k in keys if k not in keep}
    try:
        with _BUILD_LOCK:
            cfg = load_hyperpyyaml(io.StringIO(text), overrides=overrides)
    except TypeError as e:
        bad = re.search(r"unexpected keyword argument '(\w+)'", str(e))
        if bad is None:
            raise
        classes = re.findall(r"Invalid argument to class ([\w.]+)", str(e))
        where = f" of {classes[-1]}" if classes else ""
        raise ValueError(
            f"{path}: the key '{bad[1]}'{where} is not an argument of the CosyVoice code in use "
            f"({where_cosyvoice()}): the yaml and the code come from different CosyVoice releases. Use the "
            "model folder's current cosyvoice2.yaml (download CosyVoice2-0.5B again), or remove that key "
            "from the yaml, or set COSYVOICE_ROOT to a CosyVoice checkout of the yaml's age") from e
    for k in keep:
        if cfg.get(k) is None:
            raise ValueError(f"{path}: no '{k}' entry in the yaml")
    return cfg


def ort_providers(providers, dev) -> list:
    """ONNX Runtime providers for a session of a replica on ``dev``: CUDA on ``dev``'s GPU
    (``device_id``; a bare "CUDAExecutionProvider" means GPU 0), none on a CPU replica; the
    CPU provider last as the fallback."""
    out = []
    for p in providers or ["CPUExecutionProvider"]:
        name, options = (p[0], dict(p[1])) if isinstance(p, (tuple, list)) else (p, {})
        if name == "CUDAExecutionProvider":
            if dev.type != "cuda":
                continue
            options["device_id"] = dev.index
            out.append((name, options))
        else:
            out.append((name, options) if options else name)
    if "CPUExecutionProvider" not in [p[0] if isinstance(p, tuple) else p for p in out]:
        out.append("CPUExecutionProvider")
    return out


class _OrtOn:
    """``onnxruntime`` as CosyVoice's frontend module sees it while one frontend is built:
    every session it opens gets :func:`ort_providers` for ``dev``."""

    def __init__(self, ort, dev):
        self._ort, self._dev = ort, dev

    def __getattr__(self, name):
        return getattr(self._ort, name)

    def InferenceSession(self, path, *args, providers=None, **kwargs):  # noqa: N802 - onnxruntime's name
        return self._ort.InferenceSession(path, *args, providers=ort_providers(providers, self._dev), **kwargs)


_FRONTEND_LOCK = threading.Lock()  # replicas are built in threads; one swaps the module's onnxruntime at a time


def make_frontend(FrontEnd, model_dir: Path, feat_extractor, dev, family: Token2WavSpec):
    """CosyVoice's own CosyVoiceFrontEnd for prompt wavs (no text tokenizer: token2wav
    and the speech tokenizer never read text), its device set to ``dev``.

    CosyVoice opens its speech tokenizer with a bare CUDA provider whenever CUDA is visible,
    i.e. on GPU 0 whatever the replica (eight replicas: eight sessions on GPU 0, and a CPU
    replica on a GPU too). While it is built, its module's ``onnxruntime`` opens every session
    on ``dev`` instead: one session per replica, on its own device.

    A frontend that reads prompt wavs itself (CosyVoice from December 2025 on) does so with its
    module's ``load_wav``, which is set to :func:`load_wav` (the same samples, read with soundfile)."""
    module = sys.modules.get(getattr(FrontEnd, "__module__", ""))
    kwargs = dict(get_tokenizer=NoText, feat_extractor=feat_extractor, campplus_model=str(model_dir / "campplus.onnx"),
                  speech_tokenizer_model=str(model_dir / family.speech_tokenizer), spk2info="",
                  allowed_special="all")
    with _FRONTEND_LOCK:
        # read under the lock: a replica built in another thread holds its wrapper in the module
        # meanwhile, and a wrapper read then would be put back as "the module's own" afterwards
        ort = getattr(module, "onnxruntime", None)
        if ort is None or not hasattr(ort, "InferenceSession"):
            raise RuntimeError(f"{FrontEnd.__module__} does not open its sessions through `onnxruntime`: this "
                               "CosyVoice frontend is not one ttsrl knows (cosyvoice-minicpmo 0.1.0 or a checkout "
                               "of that age)")
        module.onnxruntime = _OrtOn(ort, dev)
        try:
            fe = call_matching(FrontEnd, **kwargs)
        finally:
            module.onnxruntime = ort
        if callable(getattr(module, "load_wav", None)):
            module.load_wav = load_wav
    fe.device = dev
    return fe


def spk_embedding(fe, speech):
    """The campplus embedding (1, 192) of a 16 kHz waveform (1, T): CosyVoice's own
    ``_extract_spk_embedding`` where it takes the waveform; where it takes a wav path (CosyVoice
    from December 2025 on), the same steps on the waveform (80-bin kaldi fbank without dither,
    mean-normalised over time, its campplus session)."""
    import torch
    import torchaudio.compliance.kaldi as kaldi

    if "prompt_wav" not in inspect.signature(fe._extract_spk_embedding).parameters:
        return fe._extract_spk_embedding(speech)
    feat = kaldi.fbank(speech, num_mel_bins=80, dither=0, sample_frequency=16000)
    feat = feat - feat.mean(dim=0, keepdim=True)
    session = fe.campplus_session
    out = session.run(None, {session.get_inputs()[0].name: feat.unsqueeze(dim=0).cpu().numpy()})[0]
    return torch.tensor([out.flatten().tolist()]).to(fe.device)


def zero_shot_inputs(fe, wav: Path, sample_rate: int) -> dict:
    """CosyVoice's ``frontend_zero_shot`` on a prompt wav (checked: >= 16 kHz, <= 30 s)."""
    import torch

    check_prompt_wav(wav)
    fz = fe.frontend_zero_shot
    kwargs = dict(tts_text="", prompt_text="", resample_rate=sample_rate, zero_shot_spk_id="")
    if "prompt_wav" in inspect.signature(fz).parameters:  # newer CosyVoice loads the file itself
        kwargs["prompt_wav"] = str(wav)
    else:
        kwargs["prompt_speech_16k"] = load_wav_16k(wav)
    with torch.inference_mode():
        return call_matching(fz, **kwargs)
