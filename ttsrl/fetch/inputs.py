"""Every GPU-recipe input with a public source: where it comes from, where it goes, and fetching it.

:func:`catalogue` names the inputs of one run (the presets' ``FETCH_ARGS``), :func:`survey` finds
each one's state without a network (fetched and as its manifest records; placed by hand; missing;
differing from its manifest), and :func:`fetch` gets what is missing from its hub, lays it out,
writes its manifest, then makes ``prompt_speech_tokens.jsonl`` with ``scripts/prompt_tokens.py``
where the model folder is there. Offline (``HF_HUB_OFFLINE=1``, or the hub does not answer one
probe) it fetches nothing and returns ONE message naming every missing input, its source, the
command that fetches it on a machine with a network and how to place it by hand.

Sources (each the one the reference recipe, CosyVoice's ``examples/grpo/cosyvoice2/run.sh``, uses,
or the model's own release):

=============  ====================================================  ============================
input          source                                                 reader in ttsrl
=============  ====================================================  ============================
model folder   ``Token2WavSpec.hub_repo`` (FunAudioLLM/CosyVoice2-0.5B,  ``scripts/check_inputs.py``,
               FunAudioLLM/Fun-CosyVoice3-0.5B-2512 + ``llm.rl.pt``)   ``ttsrl.model.convert``
ASR            csukuangfj/sherpa-onnx-paraformer-zh-2023-09-14         ``ttsrl.reward.backends.sherpa``
               (sherpa-onnx's ``asr-models`` release, on Hugging Face)
training texts SparkAudio/voxbox ``metadata/aishell-3.jsonl``, first     ``ttsrl.data.prepare``
               80,000 lines (run.sh stage 0)
Seed-TTS zh    yuekai/seed_tts_cosy2 ``test_zh`` (infer_dataset.py)    ``ttsrl.data.testsets``
CV3-Eval zh    yuekai/CV3-Eval ``zero_shot_zh`` (infer_dataset.py)      ``ttsrl.data.testsets``
prompts, pool  yuekai/aishell ``test`` (token2wav_asr_server.py)        ``ttsrl.data.prompt_pool``
=============  ====================================================  ============================
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ttsrl.families import family
from ttsrl.fetch import hub, layouts
from ttsrl.fetch.hub import HubRepo
from ttsrl.fetch.manifest import differences, file_record, manifest_path, read_manifest, write_manifest

ROOT = Path(__file__).resolve().parents[2]
TRAIN_LINES = 80_000  # upstream run.sh stage 0: head -n 80000
PROMPTS_PER_SPEAKER = {"prompts": 1, "pool": 5}
TOKENS_FILE = "prompt_speech_tokens.jsonl"

ASR_REPO = HubRepo("csukuangfj/sherpa-onnx-paraformer-zh-2023-09-14", patterns=("model.int8.onnx", "tokens.txt"))
ASR_TARBALL = ("https://github.com/k2-fsa/sherpa-onnx/releases/download/asr-models/"
               "sherpa-onnx-paraformer-zh-2023-09-14.tar.bz2")
TRAIN_REPO = HubRepo("SparkAudio/voxbox", "dataset", patterns=("metadata/aishell-3.jsonl",))
SEEDTTS_REPO = HubRepo("yuekai/seed_tts_cosy2", "dataset", patterns=("*test_zh-*.parquet", "*test_zh/*.parquet"))
CV3_REPO = HubRepo("yuekai/CV3-Eval", "dataset", patterns=("*zero_shot_zh-*.parquet", "*zero_shot_zh/*.parquet"))
AISHELL_REPO = HubRepo("yuekai/aishell", "dataset", patterns=("test/test-*.parquet", "test/test/*.parquet",
                                                                "data/test-*.parquet"))


class FetchError(RuntimeError):
    """An input that could not be fetched or laid out (message names it and why)."""


@dataclass(frozen=True)
class Input:
    key: str  # the kind (model, asr, train, seedtts, cv3, prompts, pool)
    what: str
    var: str  # the run.sh setting naming its place
    flag: str  # the python -m ttsrl.fetch option naming it
    dest: Path
    is_dir: bool
    repo: HubRepo
    by_hand: str  # how to place it without this tool
    alt: str = ""  # another public source

    @property
    def manifest(self) -> Path:
        return manifest_path(self.dest, self.is_dir)

    def elsewhere(self) -> str:
        """The commands that fetch it on a machine with a network."""
        ours = f"python -m ttsrl.fetch {self.flag} {self.dest}"
        if self.key in ("model", "asr"):
            return f"{self.repo.cli(str(self.dest))}   (or, in a ttsrl checkout: {ours})"
        return f"{ours}   (in a ttsrl checkout; the source files alone: {self.repo.cli()})"

    def present(self) -> bool:
        """Whether something usable is in place (by this tool or by hand): what check_inputs.py needs."""
        d = self.dest
        if self.key == "model":
            return all((d / e).is_dir() if e.endswith("/") else (d / e).is_file() for e in self.repo_files())
        if self.key == "asr":
            return ((d / "model.onnx").is_file() or (d / "model.int8.onnx").is_file()) and (d / "tokens.txt").is_file()
        if self.key == "train":
            return d.is_file()
        if self.key == "seedtts":
            return (d / "meta.lst").is_file()
        if self.key == "cv3":
            return (d / "text").is_file()
        if self.key == "pool":
            return (d / TOKENS_FILE).is_file() or (d / "wavs.scp").is_file()
        return d.is_dir() and any(d.glob("*.wav"))

    def repo_files(self) -> tuple[str, ...]:
        return tuple(p[:-1] if p.endswith("/*") else p for p in self.repo.patterns)


@dataclass
class State:
    input: Input
    status: str  # ok | placed | missing | differs
    detail: list[str]


def catalogue(*, model_dir=None, backend="cosyvoice2", sherpa_model_dir=None, train_file=None, seedtts_dir=None,
              cv3_dir=None, prompt_dir=None, prompt_pool=None) -> list[Input]:
    """The inputs named (each argument a path, or None to leave it out)."""
    out = []
    if model_dir:
        spec = family(backend).token2wav
        entries = spec.model_dir_entries + spec.release_extras
        repo = HubRepo(spec.hub_repo, patterns=tuple(e + "*" if e.endswith("/") else e for e in entries),
                       modelscope_id=spec.modelscope_repo)
        out.append(Input("model", f"{spec.release} model folder", "COSYVOICE2_DIR", "--model-dir", Path(model_dir), True,
                         repo, f"a folder holding {', '.join(entries)} (the released {spec.release})"))
    if sherpa_model_dir:
        out.append(Input("asr", "sherpa-onnx Paraformer ASR", "ASR_MODEL_DIR", "--sherpa-model-dir",
                         Path(sherpa_model_dir), True, ASR_REPO,
                         "a folder holding model.int8.onnx (or model.onnx) and tokens.txt: unpack the release tarball "
                         "and copy those two", alt=ASR_TARBALL))
    if train_file:
        out.append(Input("train", "training texts (aishell-3 transcripts, 80,000 lines)", "TRAIN_FILE",
                         "--train-file", Path(train_file), False, TRAIN_REPO,
                         f"a JSONL file, one {{\"text\": ...}} a line: head -n {TRAIN_LINES} aishell-3.jsonl > FILE",
                         alt="https://huggingface.co/datasets/SparkAudio/voxbox/resolve/main/metadata/aishell-3.jsonl"))
    if seedtts_dir:
        out.append(Input("seedtts", "Seed-TTS test_zh", "SEEDTTS_ZH_DIR", "--seedtts-dir", Path(seedtts_dir), True,
                         SEEDTTS_REPO, "meta.lst ('utt|prompt_text|prompt_wav|text' a line, wav paths relative to "
                         "the folder) and its prompt wavs, e.g. zh/ of Seed-TTS eval's own release",
                         alt="https://github.com/BytedanceSpeech/seed-tts-eval (its test set download)"))
    if cv3_dir:
        out.append(Input("cv3", "CV3-Eval zero_shot zh", "CV3_ZH_DIR", "--cv3-dir", Path(cv3_dir), True, CV3_REPO,
                         "kaldi-style text, prompt_text, prompt_wav.scp and the wavs, e.g. data/zero_shot/zh of "
                         "the CV3-Eval repository", alt="https://github.com/FunAudioLLM/CV3-Eval"))
    if prompt_dir:
        out.append(Input("prompts", "speaker prompts (aishell-1 test, one per speaker)", "PROMPT_DIR",
                         "--prompt-dir", Path(prompt_dir), True, AISHELL_REPO,
                         "*.wav, each >= 16 kHz and 0.5..30 s (any speakers you choose)"))
    if prompt_pool:
        out.append(Input("pool", "zero-shot prompt pool (aishell-1 test, 5 per speaker)", "PROMPT_POOL",
                         "--prompt-pool", Path(prompt_pool), True, AISHELL_REPO,
                         "<ID>.wav and prompt_speech_tokens.jsonl: scripts/prompt_tokens.py wavs.scp --texts "
                         "prompt_text --model-dir MODEL --copy-wavs-to DIR"))
    return out


def survey(inputs: list[Input]) -> list[State]:
    """Each input's state, from the disk alone."""
    out = []
    for inp in inputs:
        m = read_manifest(inp.manifest)
        if m is not None:
            diffs = differences(inp.dest if inp.is_dir else inp.dest.parent, m)
            out.append(State(inp, "differs" if diffs else "ok", diffs))
        elif inp.present():
            out.append(State(inp, "placed", []))
        else:
            out.append(State(inp, "missing", []))
    return out


def offline_message(needed: list[State], why: str) -> str:
    """ONE message: every input to fetch, its source, the command elsewhere, and placing it by hand."""
    lines = [f"ttsrl.fetch: {len(needed)} input(s) to fetch, and the hub cannot be reached ({why}):"]
    for s in needed:
        inp = s.input
        lines.append(f"  - {inp.what} ({inp.var}) -> {inp.dest}" + (" [differs from its manifest]"
                                                                       if s.status == "differs" else ""))
        lines += [f"      {d}" for d in s.detail[:5]]
        lines.append(f"      source:    {inp.repo.describe()}" + (f"; also {inp.alt}" if inp.alt else ""))
        lines.append(f"      elsewhere: {inp.elsewhere()}")
        lines.append(f"      by hand:   {inp.by_hand}")
    ms = "" if hub.modelscope_installed() else " (ModelScope for the model folders: pip install modelscope)"
    lines.append("Fetch them on a machine with a network and copy each folder here (with its fetch_manifest.json), "
                 "or place them by hand; a mirror: HF_ENDPOINT=https://hf-mirror.com" + ms + ". "
                 "scripts/check_inputs.py then checks what was placed.")
    return "\n".join(lines)


def _verify(path: Path, meta: dict, where: str) -> dict:
    rec = file_record(path)
    if meta.get("size") is not None and rec["size"] != meta["size"]:
        path.unlink()
        raise FetchError(f"{where}: {rec['size']} bytes, the hub lists {meta['size']}; removed, fetch again")
    if meta.get("sha256") and rec["sha256"] != meta["sha256"]:
        path.unlink()
        raise FetchError(f"{where}: sha256 differs from the hub's; removed, fetch again")
    return rec


def _hub_files(inp: Input) -> tuple[str, dict[str, dict]]:
    commit, files = hub.hf_files(inp.repo)
    if not files:
        raise FetchError(f"{inp.what}: {inp.repo.describe()} has no file matching {list(inp.repo.patterns)}")
    return commit, files


def _fetch_files(inp: Input, old: dict | None, log) -> dict:
    """A model/ASR folder: the wanted files of the repository into ``inp.dest``."""
    commit, files = _hub_files(inp)
    if inp.key == "model":
        lacking = [e for e in inp.repo_files() if not any(f == e or f.startswith(e) for f in files)]
        if lacking:
            raise FetchError(f"{inp.what}: {inp.repo.describe()} lacks {lacking}")
    records = {}
    for path, meta in sorted(files.items()):
        local = inp.dest / path
        prev = (old or {}).get("files", {}).get(path)
        if prev and local.is_file() and meta.get("sha256") in (None, prev.get("sha256")) \
                and not differences(inp.dest, {"files": {path: prev}}):
            records[path] = prev  # unchanged and intact: not fetched again
            continue
        local.unlink(missing_ok=True)
        log(f"     {path} ({_size(meta.get('size'))})")
        hub.hf_download(inp.repo, commit, path, inp.dest)
        records[path] = {**_verify(local, meta, f"{inp.dest}/{path}"), "from": path}
    return {"source": _source(inp.repo, commit), "files": records}


def _fetch_dataset(inp: Input, log) -> dict:
    """A dataset input: its files into the Hugging Face cache, then laid out into ``inp.dest``."""
    commit, files = _hub_files(inp)
    got = []
    for path, meta in sorted(files.items()):
        log(f"     {inp.repo.repo_id}/{path} ({_size(meta.get('size'))}, into the Hugging Face cache)")
        p = hub.hf_download(inp.repo, commit, path, None)
        _verify_cached(p, meta, f"{inp.repo.repo_id}/{path}")
        got.append(p)
    if inp.key == "train":
        inp.dest.parent.mkdir(parents=True, exist_ok=True)
        layouts.head_lines(got[0], inp.dest, TRAIN_LINES)
        written, root = [inp.dest.name], inp.dest.parent
    else:
        inp.dest.mkdir(parents=True, exist_ok=True)
        if inp.key == "seedtts":
            written = layouts.seedtts_layout(got, inp.dest)
        elif inp.key == "cv3":
            written = layouts.cv3_layout(got, inp.dest)
        else:
            written = layouts.aishell_prompts(got, inp.dest, PROMPTS_PER_SPEAKER[inp.key])
        root = inp.dest
    origin = ", ".join(sorted(files))
    return {"source": {**_source(inp.repo, commit), "files": {p: files[p] for p in sorted(files)}},
            "files": {w: file_record(root / w, **{"from": origin}) for w in written}}


def _verify_cached(path: Path, meta: dict, where: str) -> None:
    from ttsrl.atomic import sha256_file

    if meta.get("size") is not None and path.stat().st_size != meta["size"] or \
            meta.get("sha256") and sha256_file(path) != meta["sha256"]:
        raise FetchError(f"{where}: the cached copy {path} differs from the hub's record; delete it and rerun")


def _source(repo: HubRepo, commit: str) -> dict:
    return {"hub": "huggingface", "endpoint": hub.hf_endpoint(), "repo": repo.repo_id, "repo_type": repo.repo_type,
            "revision": repo.revision, "commit": commit}


def _size(n) -> str:
    if n is None:
        return "size unknown"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def fetch_one(inp: Input, log, via_modelscope: bool = False) -> None:
    """Fetch one input and write its manifest (last)."""
    old = read_manifest(inp.manifest)
    if via_modelscope:
        inp.dest.mkdir(parents=True, exist_ok=True)
        rev = hub.modelscope_download(inp.repo, inp.dest)
        files = {str(p.relative_to(inp.dest)): file_record(p, **{"from": str(p.relative_to(inp.dest))})
                 for p in sorted(inp.dest.rglob("*")) if p.is_file() and ".cache" not in p.parts
                 and p != inp.manifest}
        got = {"source": {"hub": "modelscope", "repo": inp.repo.modelscope_id, "revision": rev}, "files": files}
    elif inp.key in ("model", "asr"):
        got = _fetch_files(inp, old, log)
    else:
        got = _fetch_dataset(inp, log)
    write_manifest(inp.manifest, inp.key, got["source"], got["files"])


def tokens_command(inp: Input, model_dir: Path, backend: str, checkout: str | None) -> list[str]:
    """scripts/prompt_tokens.py for a laid-out test set or pool."""
    cmd = [sys.executable, str(ROOT / "scripts" / "prompt_tokens.py")]
    if inp.key == "pool":
        cmd += [str(inp.dest / "wavs.scp"), "--texts", str(inp.dest / "prompt_text"), "--copy-wavs-to", str(inp.dest)]
    else:
        cmd.append(str(inp.dest))
    cmd += ["--model-dir", str(model_dir), "--backend", backend]
    return cmd + (["--cosyvoice-checkout", checkout] if checkout else [])


def run_tokens(cmd: list[str]) -> str | None:
    """Run scripts/prompt_tokens.py; None when it succeeded, else the end of what it said."""
    r = subprocess.run(cmd, capture_output=True, text=True)
    return None if r.returncode == 0 else (r.stderr or r.stdout).strip()[-600:]


def fetch(inputs: list[Input], *, source: str = "auto", model_dir=None, backend="cosyvoice2", checkout=None,
          make_tokens: Callable[[list[str]], str | None] | None = run_tokens, log=print) -> tuple[int, str]:
    """Survey, fetch what is missing or differs, make prompt tokens; (exit code, final message)."""
    t0 = time.monotonic()
    states = survey(inputs)
    for s in states:
        if s.status == "ok":
            log(f"     [ok]      {s.input.what}: {s.input.dest} as its manifest records")
        elif s.status == "placed":
            log(f"     [placed]  {s.input.what}: {s.input.dest} (no manifest: placed by hand, not fetched)")
        elif s.status == "differs":
            log(f"     [differs] {s.input.what}: {s.input.dest} differs from its manifest, fetching it again:\n       "
                + "\n       ".join(s.detail))
    needed = [s for s in states if s.status in ("missing", "differs")]
    failed: list[str] = []
    if needed:
        why, use_ms = None, False
        if source != "modelscope":
            why = "HF_HUB_OFFLINE=1" if hub.hf_offline() else hub.reachable(hub.hf_endpoint())
            why = why if why in (None, "HF_HUB_OFFLINE=1") else f"{hub.hf_endpoint()}: {why}"
        if source == "modelscope" or (why and source == "auto" and hub.modelscope_installed()):
            if not hub.modelscope_installed():
                return 1, offline_message(needed, "--source modelscope, but the modelscope package is not installed")
            ms_url = _ms_domain() or hub.MODELSCOPE_DEFAULT
            ms_why = hub.reachable(ms_url)
            use_ms = ms_why is None
            why = "; ".join(filter(None, (why, None if use_ms else f"{ms_url}: {ms_why}")))
        if why and not use_ms:
            return 1, offline_message(needed, why)
        try:
            import huggingface_hub  # noqa: F401
        except ImportError:
            return 1, offline_message(needed, "huggingface_hub is not installed: run stage -2 (bash run.sh -2 -2)")
        for s in needed:
            inp = s.input
            ms = use_ms and inp.key == "model" and bool(inp.repo.modelscope_id)
            if use_ms and not ms:
                failed.append(f"{inp.what} ({inp.var}) -> {inp.dest}: only on Hugging Face ({inp.repo.describe()}), "
                              f"which cannot be reached ({why})")
                continue
            log(f"     [fetch]   {inp.what} -> {inp.dest} from "
                + (f"ModelScope {inp.repo.modelscope_id}" if ms else inp.repo.describe()))
            t = time.monotonic()
            try:
                fetch_one(inp, log, via_modelscope=ms)
            except Exception as e:  # noqa: BLE001 - every input is tried; each failure is named at the end
                failed.append(f"{inp.what} ({inp.var}) -> {inp.dest}: {type(e).__name__}: {e}\n"
                              f"      elsewhere: {inp.elsewhere()}\n      by hand:   {inp.by_hand}")
                continue
            log(f"     [fetched] {inp.what} in {time.monotonic() - t:.0f} s")
    notes = _prompt_tokens(inputs, model_dir, backend, checkout, make_tokens, log)
    if failed:
        return 1, "ttsrl.fetch: could not fetch:\n  - " + "\n  - ".join(failed) + "\n" + notes
    return 0, f"     inputs in place ({time.monotonic() - t0:.0f} s)" + (f"\n{notes}" if notes else "")


def _ms_domain() -> str:
    d = os.environ.get("MODELSCOPE_DOMAIN", "").strip()
    return d if not d or "://" in d else f"https://{d}"


def _prompt_tokens(inputs, model_dir, backend, checkout, make_tokens, log) -> str:
    """prompt_speech_tokens.jsonl of every laid-out test set and pool that lacks one, made by the
    model's own speech tokenizer where the model folder is complete; else say what to run."""
    wanting = [i for i in inputs if i.key in ("seedtts", "cv3", "pool") and i.present()
               and not (i.dest / TOKENS_FILE).is_file()]
    if not wanting:
        return ""
    model = next((i for i in inputs if i.key == "model"), None)
    mdir = Path(model_dir) if model_dir else (model.dest if model else None)
    spec = family(backend).token2wav
    ready = mdir is not None and all((mdir / e).exists() for e in spec.model_dir_entries)
    notes = []
    for inp in wanting:
        cmd = tokens_command(inp, mdir or Path("MODEL_DIR"), backend, checkout)
        shown = " ".join(["python"] + cmd[1:])
        if not ready or make_tokens is None:
            notes.append(f"     {inp.dest / TOKENS_FILE} not made: the model folder {mdir} is not complete; once it "
                         f"is: {shown}")
            continue
        log(f"     [tokens]  {inp.dest / TOKENS_FILE} with {spec.speech_tokenizer} ({shown})")
        err = make_tokens(cmd)
        if err:
            notes.append(f"     {inp.dest / TOKENS_FILE} not made: scripts/prompt_tokens.py failed: {err}")
    return "\n".join(notes)

