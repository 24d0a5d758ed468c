"""CosyVoice's code and model folder, as our token2wav (``cosyvoice2``) and prompt
tokenizer use them: which files a CosyVoice2 model folder must hold, importing
CosyVoice (installed, or a source checkout), loading its yaml without the LLM, its
frontend on a chosen device, ``frontend_zero_shot`` on a prompt wav, and reading audio
at the 16 kHz its speech tokenizer and campplus expect. Keyword arguments are matched
to the installed version's signatures (:func:`call_matching`)."""

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

from ttsrl.reward.wavcheck import check_prompt_wav

#: what token2wav loads from the model folder (the LLM's llm.pt and CosyVoice-BlankEN/ are not)
TOKEN2WAV_FILES = ("cosyvoice2.yaml", "flow.pt", "hift.pt", "campplus.onnx", "speech_tokenizer_v2.onnx")
#: what a released CosyVoice2-0.5B folder holds that the whole recipe (stage -1 included) needs
MODEL_DIR_ENTRIES = ("llm.pt",) + TOKEN2WAV_FILES + ("CosyVoice-BlankEN/",)
YAML_KEEP = ("flow", "hift", "feat_extractor")
log = logging.getLogger("ttsrl.reward.backends")


def missing_model_entries(model_dir: str | Path, entries: Sequence[str] = TOKEN2WAV_FILES) -> list[str]:
    d = Path(model_dir)
    return [e for e in entries if not ((d / e).is_dir() if e.endswith("/") else (d / e).is_file())]


def check_model_dir(model_dir: str | Path, entries: Sequence[str] = TOKEN2WAV_FILES) -> None:
    """One error naming every missing file of a CosyVoice2 model folder."""
    missing = missing_model_entries(model_dir, entries)
    if missing:
        raise FileNotFoundError(f"CosyVoice2 model folder {model_dir} lacks {', '.join(missing)} "
                                f"(needs {', '.join(entries)}; from the released CosyVoice2-0.5B)")


def load_wav_16k(path: str | Path):
    """Mono float32 tensor (1, T) at 16 kHz, read with soundfile (torchaudio.load needs
    torchcodec in torchaudio >= 2.9) and resampled with torchaudio's pure-Python Resample."""
    import soundfile as sf

    wav, rate = sf.read(str(path), dtype="float32", always_2d=True)
    return to_16k(np.ascontiguousarray(wav.mean(axis=1)), rate)


def to_16k(wav: np.ndarray, rate: int):
    """Mono float32 tensor (1, T) at 16 kHz from a waveform at ``rate`` Hz (torchaudio's
    Resample, as CosyVoice resamples): what its speech tokenizer and campplus read."""
    import torch
    import torchaudio

    t = torch.from_numpy(np.ascontiguousarray(wav, dtype=np.float32).reshape(-1))[None]
    if rate != 16000:
        t = torchaudio.transforms.Resample(orig_freq=rate, new_freq=16000)(t)
    return t


def import_cosyvoice(checkout: str | None):
    if checkout:
        root = Path(checkout)
        if not (root / "cosyvoice" / "cli" / "model.py").is_file():
            raise FileNotFoundError(f"{root} is not a CosyVoice checkout (no cosyvoice/cli/model.py)")
        for p in (root / "third_party" / "Matcha-TTS", root):
            if str(p) not in sys.path:
                sys.path.insert(0, str(p))
    try:
        from cosyvoice.cli.frontend import CosyVoiceFrontEnd  # type: ignore
        from cosyvoice.cli.model import CosyVoice2Model  # type: ignore
    except ImportError as e:
        where = checkout or "the installed packages"
        raise ImportError(f"cannot import CosyVoice from {where}: {e}. `bash scripts/install.sh` installs "
                          "cosyvoice-minicpmo==0.1.0 and what it needs (see requirements*.txt)") from e
    return CosyVoiceFrontEnd, CosyVoice2Model


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


def load_yaml_without_llm(path: Path, keep: Sequence[str] = YAML_KEEP) -> dict:
    """CosyVoice's yaml with every top-level object not in ``keep`` set to None. An older
    CosyVoice2 yaml's decoder is read as the current one (:func:`old_decoder_yaml`); any other
    argument the CosyVoice code in use does not take is named, with its yaml file."""
    from hyperpyyaml import load_hyperpyyaml

    text = old_decoder_yaml(path.read_text(encoding="utf-8"), path)
    keys = re.findall(r"^([A-Za-z_]\w*)\s*:\s*!(?:new|name|apply):", text, flags=re.M)
    overrides = {k: None for k in keys if k not in keep}
    try:
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


def make_frontend(FrontEnd, model_dir: Path, feat_extractor, dev):
    """CosyVoice's own CosyVoiceFrontEnd for prompt wavs (no text tokenizer: token2wav
    and the speech tokenizer never read text), its device set to ``dev``.

    CosyVoice opens its speech tokenizer with a bare CUDA provider whenever CUDA is visible,
    i.e. on GPU 0 whatever the replica (eight replicas: eight sessions on GPU 0, and a CPU
    replica on a GPU too). While it is built, its module's ``onnxruntime`` opens every session
    on ``dev`` instead: one session per replica, on its own device."""
    module = sys.modules.get(getattr(FrontEnd, "__module__", ""))
    kwargs = dict(get_tokenizer=NoText, feat_extractor=feat_extractor, campplus_model=str(model_dir / "campplus.onnx"),
                  speech_tokenizer_model=str(model_dir / "speech_tokenizer_v2.onnx"), spk2info="",
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
    fe.device = dev
    return fe


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
