"""Stage 4: synthesise held-out test sets with every model and score them.

For each model (the start model = step 0, and every ``MERGED_DIR/step_N``) and each
test set: generate speech codes (``ttsrl.generate``), turn them into transcripts
through the backend pipeline (``ttsrl.backends``), score them with ``ttsrl.text``
(BOTH reference and hypothesis normalised the same way) and write

    OUT/step_N/<test_set>/results.jsonl   one row per utterance
    OUT/step_N/<test_set>/summary.json    micro-averaged CER, pinyin error, reward, ...
    OUT/step_N/<test_set>/wavs/<id>.wav   when the backend makes audio

then the sweep: ``OUT/report.md`` (markdown table), ``OUT/summary.json`` (a list of
rows: step, model, test_set, cer, pinyin_error, reward, n, failures) and ``OUT/cer.png``.

Distributed: under ``torchrun`` every rank takes utterances ``rank::world`` of each
test set (no padding: each utterance is decoded exactly once), scores its share, and
rank 0 gathers the rows (``gather_object`` over a gloo group) and writes the files.

Test-set layouts (``--test-set NAME=PATH``):

* JSONL file: one object per line with ``text`` and optional ``id``, ``prompt_text``,
  ``prompt_speech_tokens`` (list of speech codes 0..6560). Ids default to ``NAME_<line>``.
* Seed-TTS (``test_zh``): a directory with ``meta.lst`` (or PATH = the ``.lst`` file),
  lines ``utt|prompt_text|prompt_wav|text``.
* CosyVoice3 CV3-Eval (``zero_shot/zh``): a directory with Kaldi-style ``text``
  (``utt text``), ``prompt_text`` (``utt prompt text``) and ``prompt_wav.scp``.

Prompt speech tokens cannot be made from the prompt wavs here (that needs CosyVoice's
speech tokenizer, ``speech_tokenizer_v2.onnx``); give them in
``DIR/prompt_speech_tokens.jsonl``, lines ``{"id": UTT, "prompt_speech_tokens": [...]}``.
Without that file the directory layouts run without prompt text or speech (plain
TTS) and the log says so: CosyVoice2 must not get a prompt text without its speech.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Sequence

from .atomic import atomic_path, atomic_write_text
from .generate import GenerationConfig, Generated, Request
from .jsonl import iter_objects
from .vocab import SPEECH_TOKEN_SIZE

PROMPT_TOKENS_FILE = "prompt_speech_tokens.jsonl"
RESULTS_FILE = "results.jsonl"
SUMMARY_FILE = "summary.json"
REPORT_FILE = "report.md"
PLOT_FILE = "cer.png"
SCHEMA_VERSION = 1


class TestSetError(ValueError):
    """A test set file that cannot be read (message names the file and line)."""

    __test__ = False  # not a pytest class despite the name


# ---------------------------------------------------------------------------
# test sets


@dataclass(frozen=True)
class Utterance:
    id: str
    text: str
    prompt_text: str = ""
    prompt_speech: tuple[int, ...] | None = None


@dataclass
class TestSet:
    __test__ = False
    name: str
    path: str
    utterances: list[Utterance]
    layout: str
    notes: list[str] = field(default_factory=list)

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for u in self.utterances:
            h.update(json.dumps([u.id, u.text, u.prompt_text, u.prompt_speech], ensure_ascii=False).encode())
        return h.hexdigest()[:16]


def parse_test_set_arg(arg: str) -> tuple[str, str]:
    name, sep, path = arg.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--test-set expects NAME=PATH, got {arg!r}")
    if not all(c.isalnum() or c in "-_." for c in name):
        raise ValueError(f"test set name {name!r}: use letters, digits, '-', '_', '.' (it names a folder)")
    return name, path


def _check_codes(codes, where: str) -> tuple[int, ...]:
    if not isinstance(codes, list) or not all(isinstance(c, int) and not isinstance(c, bool) for c in codes):
        raise TestSetError(f"{where}: prompt_speech_tokens must be a list of integers")
    bad = [c for c in codes if not 0 <= c < SPEECH_TOKEN_SIZE]
    if bad:
        raise TestSetError(f"{where}: prompt speech token {bad[0]} outside 0..{SPEECH_TOKEN_SIZE - 1}")
    return tuple(codes)


def read_jsonl_test_set(name: str, path: Path) -> TestSet:
    utts = []
    for where, obj in iter_objects(path, TestSetError):
        text = obj.get("text")
        if not isinstance(text, str) or not text.strip():
            raise TestSetError(f"{where}: expected a non-empty string 'text'")
        uid = obj.get("id", f"{name}_{len(utts) + 1:05d}")
        prompt_text = obj.get("prompt_text") or ""
        if not isinstance(prompt_text, str):
            raise TestSetError(f"{where}: 'prompt_text' must be a string")
        speech = obj.get("prompt_speech_tokens")
        speech = None if speech is None else _check_codes(speech, where)
        if prompt_text and not speech:
            raise TestSetError(f"{where}: 'prompt_text' without 'prompt_speech_tokens' "
                               "(CosyVoice2's zero-shot prompt needs both)")
        utts.append(Utterance(str(uid), text.strip(), prompt_text.strip(), speech))
    return _finish(TestSet(name, str(path), utts, "jsonl"))


def _read_prompt_tokens(d: Path) -> dict[str, tuple[int, ...]] | None:
    p = d / PROMPT_TOKENS_FILE
    if not p.is_file():
        return None
    out = {}
    for where, obj in iter_objects(p, TestSetError):
        if "id" not in obj or "prompt_speech_tokens" not in obj:
            raise TestSetError(f"{where}: expected {{\"id\": ..., \"prompt_speech_tokens\": [...]}}")
        out[str(obj["id"])] = _check_codes(obj["prompt_speech_tokens"], where)
    return out


def _with_prompts(name: str, d: Path, layout: str, rows: list[tuple[str, str, str]]) -> TestSet:
    """rows: (utt, prompt_text, text). Attach prompt speech tokens when the file exists."""
    tokens = _read_prompt_tokens(d)
    notes = []
    if tokens is None:
        notes.append(f"{d / PROMPT_TOKENS_FILE} not found: running WITHOUT zero-shot prompts "
                     "(no prompt text, no prompt speech); extract the prompt wavs' tokens with "
                     "CosyVoice's speech tokenizer to evaluate zero-shot")
        utts = [Utterance(u, t) for u, _, t in rows]
    else:
        missing = [u for u, _, _ in rows if u not in tokens]
        if missing:
            raise TestSetError(f"{d / PROMPT_TOKENS_FILE}: no tokens for {len(missing)} utterance(s), "
                               f"e.g. {missing[:3]}")
        utts = [Utterance(u, t, p, tokens[u]) for u, p, t in rows]
    return _finish(TestSet(name, str(d), utts, layout, notes))


def read_seedtts_test_set(name: str, meta: Path) -> TestSet:
    rows = []
    with open(meta, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            parts = line.split("|")
            if len(parts) < 4 or not parts[0] or not parts[3].strip():
                raise TestSetError(f"{meta}:{lineno}: expected 'utt|prompt_text|prompt_wav|text' "
                                   f"(Seed-TTS meta.lst), got {len(parts)} field(s)")
            rows.append((parts[0], parts[1].strip(), parts[3].strip()))
    return _with_prompts(name, meta.parent, "seedtts", rows)


def _read_kaldi(path: Path) -> list[tuple[str, str]]:
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            utt, _, value = line.partition(" ")
            if not value.strip():
                raise TestSetError(f"{path}:{lineno}: expected 'utt value' (Kaldi style)")
            out.append((utt, value.strip()))
    return out


def read_cv3_test_set(name: str, d: Path) -> TestSet:
    texts = _read_kaldi(d / "text")
    prompts = dict(_read_kaldi(d / "prompt_text")) if (d / "prompt_text").is_file() else {}
    return _with_prompts(name, d, "cv3", [(u, prompts.get(u, ""), t) for u, t in texts])


def read_test_set(name: str, path: str | Path) -> TestSet:
    """Read a test set in any supported layout (see the module docstring)."""
    p = Path(path)
    if p.is_dir():
        if (p / "meta.lst").is_file():
            return read_seedtts_test_set(name, p / "meta.lst")
        if (p / "text").is_file():
            return read_cv3_test_set(name, p)
        raise TestSetError(f"{p}: a test-set directory needs meta.lst (Seed-TTS) or text + prompt_text "
                           "(CosyVoice3 CV3-Eval)")
    if not p.is_file():
        raise TestSetError(f"{p}: no such test-set file or directory")
    if p.suffix == ".lst":
        return read_seedtts_test_set(name, p)
    return read_jsonl_test_set(name, p)


def _finish(ts: TestSet) -> TestSet:
    if not ts.utterances:
        raise TestSetError(f"{ts.path}: no utterances")
    seen: dict[str, int] = {}
    for i, u in enumerate(ts.utterances):
        if u.id in seen:
            raise TestSetError(f"{ts.path}: utterance id {u.id!r} appears twice (entries {seen[u.id] + 1} "
                               f"and {i + 1}); ids must be unique")
        seen[u.id] = i
    return ts


def shard(items: Sequence, rank: int, world: int) -> list:
    """Items ``rank::world``: every item on exactly one rank, none repeated."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside 0..{world - 1}")
    return list(items[rank::world])


# ---------------------------------------------------------------------------
# requests and scoring


def make_requests(tokenizer, utts: Sequence[Utterance]) -> list[Request]:
    def enc(t: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(t, add_special_tokens=False)) if t else ()

    return [Request(u.id, enc(u.text), enc(u.prompt_text) if u.prompt_speech else (), u.prompt_speech or ())
            for u in utts]


def _failure_unit(pipeline) -> str:
    # The sim ASR writes toned pinyin, which error_counts compares by syllable; a
    # failure's reference length must use the same unit as the successes around it.
    return "pinyin" if getattr(pipeline.asr, "name", "") == "sim" else "char"


def score(pipeline, utts: Sequence[Utterance], gens: Sequence[Generated], *, reward: str = "tanh",
          length_guard: bool = True, wav_dir: Path | None = None, chunk: int = 32) -> list[dict]:
    """One result row per utterance. No output (zero codes or a generation error)
    is a failure: 100% error (errors = reference length), reward 0."""
    from .text import compute_reward, error_counts

    live = [i for i, g in enumerate(gens) if g.codes and g.error is None]
    hyps: dict[int, str] = {}
    for start in range(0, len(live), chunk):  # bounded audio in memory at a time
        part = live[start:start + chunk]
        codes = [gens[i].codes for i in part]
        texts = [utts[i].text for i in part]
        for i, tr in zip(part, pipeline.transcribe_tokens(codes, texts)):
            hyps[i] = tr.text
            if wav_dir is not None and tr.audio is not None and tr.audio.waveform is not None:
                wav_dir.mkdir(parents=True, exist_ok=True)
                tr.audio.write_wav(wav_dir / f"{_safe_name(utts[i].id)}.wav")
    unit = _failure_unit(pipeline)
    rows = []
    for i, (u, g) in enumerate(zip(utts, gens)):
        row = {"id": u.id, "text": u.text, "n_codes": len(g.codes), "stopped": g.stopped}
        if i in hyps:
            hyp = hyps[i]
            ce, cn = error_counts(u.text, hyp, "char")
            pe, pn = error_counts(u.text, hyp, "pinyin")
            r = compute_reward(reward, u.text, hyp, n_tokens=len(g.codes) if length_guard else None,
                               token_rate=pipeline.token_rate)
            row.update(transcript=hyp, cer_errors=ce, ref_len=cn, pinyin_errors=pe, pinyin_ref_len=pn,
                       reward=float(r.reward), failure=False, error=None)
        else:
            _, cn = error_counts(u.text, "", unit)
            _, pn = error_counts(u.text, "", "pinyin")
            row.update(transcript="", cer_errors=cn, ref_len=cn, pinyin_errors=pn, pinyin_ref_len=pn,
                       reward=0.0, failure=True, error=g.error or "no speech codes generated")
        rows.append(row)
    return rows


def _safe_name(s: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in s) or "utt"


def summarize(rows: Sequence[dict]) -> dict:
    """Micro-averaged rates (sum of errors / sum of reference lengths)."""
    ce, cn = sum(r["cer_errors"] for r in rows), sum(r["ref_len"] for r in rows)
    pe, pn = sum(r["pinyin_errors"] for r in rows), sum(r["pinyin_ref_len"] for r in rows)
    failed = [r["id"] for r in rows if r["failure"]]
    n = len(rows)
    return {"n": n, "failures": len(failed), "failed_ids": failed,
            "cer": ce / cn if cn else (0.0 if ce == 0 else 1.0), "cer_errors": ce, "cer_ref_len": cn,
            "pinyin_error": pe / pn if pn else (0.0 if pe == 0 else 1.0), "pinyin_errors": pe,
            "pinyin_ref_len": pn, "reward": sum(r["reward"] for r in rows) / n if n else 0.0,
            "mean_codes": sum(r["n_codes"] for r in rows) / n if n else 0.0,
            "stopped": sum(1 for r in rows if r["stopped"])}


# ---------------------------------------------------------------------------
# files


def write_json(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, ensure_ascii=False, indent=2) + "\n")


def write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def model_fingerprint(model_dir: Path) -> str:
    """Changes when the checkpoint is rewritten (names, sizes and mtimes of its files)."""
    h = hashlib.sha256()
    for p in sorted(model_dir.iterdir()):
        if p.is_file() and p.suffix in (".json", ".safetensors", ".bin"):
            st = p.stat()
            h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------
# the sweep


@dataclass
class EvalConfig:
    start_model: str
    out_dir: str
    test_sets: list[tuple[str, str]]
    merged_dir: str | None = None
    steps: list[int] | None = None  # None = every merged step (plus 0)
    backend: object = None  # ttsrl.backends.BackendConfig
    generation: GenerationConfig = GenerationConfig()
    engine: str = "auto"  # auto | hf | vllm
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "float32"  # HF engine
    reward: str = "tanh"
    length_guard: bool = True
    save_wavs: bool = True
    force: bool = False
    limit: int | None = None  # first N utterances of each test set (smoke runs)
    gpu_memory_utilization: float = 0.8
    threads: int = 0  # CPU threads per rank (0 = cores / local ranks)


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def gather(self, obj) -> list | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere)."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world if self.is_main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def broadcast(self, obj):
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def init_distributed() -> Dist:
    """Join torchrun's process group (gloo: only small Python objects travel between
    ranks, and gloo keeps that traffic off the GPU the generation engine owns)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    d = Dist(rank=int(os.environ.get("RANK", "0")), world=world,
             local_rank=int(os.environ.get("LOCAL_RANK", "0")),
             local_world=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))))
    if world > 1:
        import datetime

        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=datetime.timedelta(hours=6))
    return d


def pin_local_gpu(d: Dist) -> None:
    """Give each local rank its own GPU as cuda:0 (before CUDA is initialised), so
    both engines and vLLM's engine process use one GPU per rank."""
    if d.local_world <= 1:
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [x for x in visible.split(",") if x.strip()] if visible else None
    if ids is not None and d.local_rank >= len(ids):
        return  # fewer GPUs than ranks: leave as is (CPU ranks)
    os.environ["CUDA_VISIBLE_DEVICES"] = ids[d.local_rank] if ids else str(d.local_rank)


def settings_of(cfg: EvalConfig, engine: str) -> dict:
    g = cfg.generation
    return {"greedy": g.greedy, "seed": g.seed, "sampling": asdict(g.sampling), "engine": engine,
            "backend": getattr(cfg.backend, "backend", None), "asr": getattr(cfg.backend, "asr", None),
            "reward": cfg.reward, "length_guard": cfg.length_guard, "limit": cfg.limit}


def models_to_score(cfg: EvalConfig) -> dict[int, Path]:
    from .steps import merged_steps

    models = {0: Path(cfg.start_model)}
    if cfg.merged_dir:
        models.update({s: p for s, p in merged_steps(cfg.merged_dir).items() if s != 0})
    if cfg.steps is not None:
        missing = [s for s in cfg.steps if s not in models]
        if missing:
            raise ValueError(f"steps {missing} not found (have {sorted(models)})")
        models = {s: models[s] for s in cfg.steps}
    for s, p in models.items():
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"model for step {s}: {p} has no config.json (not a HF checkpoint)")
    return dict(sorted(models.items()))


def pair_dir(out_dir: Path, step: int, test_set: str) -> Path:
    return out_dir / f"step_{step}" / test_set


def is_scored(path: Path, expect: dict) -> bool:
    try:
        s = json.loads((path / SUMMARY_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return all(s.get(k) == v for k, v in expect.items())


def _choose_engine(cfg: EvalConfig, device: str) -> str:
    import importlib.util

    if cfg.engine != "auto":
        return cfg.engine
    return "vllm" if device.startswith("cuda") and importlib.util.find_spec("vllm") else "hf"


def _device(cfg: EvalConfig) -> str:
    import torch

    if cfg.device == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if cfg.device == "cuda":
        return "cuda:0"
    return cfg.device


def run_sweep(cfg: EvalConfig, log: Callable[[str], None] = print) -> list[dict] | None:
    """Score every (model, test set) not scored yet; write the sweep report on rank 0.
    Returns the sweep rows on rank 0, None on the other ranks."""
    import torch

    from .backends import BackendConfig, build_pipeline

    d = init_distributed()
    try:
        return _run(cfg, d, log, torch, BackendConfig, build_pipeline)
    finally:
        if d.world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def _run(cfg, d: Dist, log, torch, BackendConfig, build_pipeline):
    say = log if d.is_main else (lambda _: None)
    if cfg.device in ("auto", "cuda"):
        pin_local_gpu(d)
    device = _device(cfg)
    engine = _choose_engine(cfg, device)
    if device == "cpu":
        threads = cfg.threads or max(1, (os.cpu_count() or 1) // max(1, d.local_world))
        torch.set_num_threads(threads)
    out_dir = Path(cfg.out_dir)
    test_sets = [read_test_set(n, p) for n, p in cfg.test_sets]
    names = [t.name for t in test_sets]
    if len(set(names)) != len(names):
        raise ValueError(f"test set names must be unique, got {names}")
    for ts in test_sets:
        if cfg.limit:
            ts.utterances = ts.utterances[:cfg.limit]
        for note in ts.notes:
            say(f"[{ts.name}] {note}")
    models = models_to_score(cfg)
    settings = settings_of(cfg, engine)

    # The plan is rank 0's view of what is already scored, shared so that all ranks agree.
    plan = None
    if d.is_main:
        plan = []
        for step, mdir in models.items():
            todo = [ts.name for ts in test_sets
                    if cfg.force or not is_scored(pair_dir(out_dir, step, ts.name), {
                        "settings": settings, "model_fingerprint": model_fingerprint(mdir),
                        "test_set_fingerprint": ts.fingerprint(), "schema": SCHEMA_VERSION})]
            for name in sorted(set(names) - set(todo)):
                say(f"step {step} / {name}: already scored (use --force to redo)")
            if todo:
                plan.append((step, todo))
    plan = d.broadcast(plan)
    say(f"stage 4: {len(models)} model(s), {len(test_sets)} test set(s), {len(plan)} model(s) to score; "
        f"engine {engine} on {device}, {d.world} rank(s), {'greedy' if cfg.generation.greedy else 'sampling'}")

    if plan:
        backend = cfg.backend or BackendConfig()
        pipeline = build_pipeline(backend, device)
        by_name = {ts.name: ts for ts in test_sets}
        total = sum(len(by_name[n].utterances) for _, todo in plan for n in todo)
        bar = _progress(total, d)
        note = bar.write if bar is not None else say  # keep log lines off the progress bar
        for step, todo in plan:
            _score_model(cfg, d, step, models[step], [by_name[n] for n in todo], engine, device, pipeline,
                         settings, out_dir, bar, note)
        if bar is not None:
            bar.close()
    rows = None
    if d.is_main:
        # the report covers every model with a summary on disk, not only --steps
        rows = write_sweep(out_dir, models_to_score(replace(cfg, steps=None)), names)
        say(format_table(rows))
        say(f"report: {out_dir / REPORT_FILE}, {out_dir / SUMMARY_FILE}, {out_dir / PLOT_FILE}")
    d.barrier()
    return rows


def _progress(total: int, d: Dist):
    if not d.is_main:
        return None
    from tqdm import tqdm

    # rank 0 sees its own share; the bar shows the whole job assuming even shards
    return tqdm(total=total, desc="stage 4 synthesise+score", unit="utt", mininterval=2)


def _score_model(cfg, d: Dist, step: int, mdir: Path, test_sets, engine, device, pipeline, settings,
                 out_dir: Path, bar, say) -> None:
    import torch

    from . import generate as G
    from .hf_model import load_speech_lm

    t0 = time.time()
    if engine == "vllm":
        from transformers import AutoTokenizer

        from .vocab import vocab_of

        tokenizer = AutoTokenizer.from_pretrained(mdir)
        gen = G.VLLMGenerator(str(mdir), vocab_of(tokenizer), seed=cfg.generation.seed,
                              gpu_memory_utilization=cfg.gpu_memory_utilization)
    elif engine == "hf":
        lm = load_speech_lm(mdir, dtype=getattr(torch, cfg.dtype), device=device)
        tokenizer = lm.tokenizer
        gen = G.HFGenerator(lm.model, lm.vocab, pad_id=lm.tokenizer.pad_token_id)
    else:
        raise ValueError(f"unknown engine {engine!r} (auto, hf or vllm)")
    say(f"step {step}: {mdir} loaded in {time.time() - t0:.1f}s")
    try:
        for ts in test_sets:
            t1 = time.time()
            mine = shard(ts.utterances, d.rank, d.world)
            reqs = make_requests(tokenizer, mine)
            world = d.world
            gens = gen.generate(reqs, cfg.generation,
                                progress=(lambda n: bar.update(n * world)) if bar is not None else None)
            where = pair_dir(out_dir, step, ts.name)
            wav_dir = where / "wavs" if cfg.save_wavs else None
            rows = score(pipeline, mine, gens, reward=cfg.reward, length_guard=cfg.length_guard, wav_dir=wav_dir)
            parts = d.gather(rows)
            if d.is_main:
                _write_pair(where, step, mdir, ts, parts, settings, time.time() - t1, d.world)
                s = json.loads((where / SUMMARY_FILE).read_text())
                say(f"step {step} / {ts.name}: CER {s['cer']:.4f}  pinyin {s['pinyin_error']:.4f}  "
                    f"reward {s['reward']:.3f}  n {s['n']}  failures {s['failures']}  ({s['seconds']:.0f}s)")
            d.barrier()
    finally:
        if hasattr(gen, "close"):
            gen.close()


def _write_pair(where: Path, step: int, mdir: Path, ts: TestSet, parts: list[list[dict]], settings: dict,
                seconds: float, world: int) -> None:
    got: dict[str, dict] = {}
    for part in parts:
        for r in part:
            if r["id"] in got:
                raise RuntimeError(f"utterance {r['id']} was decoded twice (sharding bug)")
            got[r["id"]] = r
    missing = [u.id for u in ts.utterances if u.id not in got]
    if missing:
        raise RuntimeError(f"{len(missing)} utterance(s) missing from the gathered results, e.g. {missing[:3]}")
    rows = [got[u.id] for u in ts.utterances]
    write_jsonl(where / RESULTS_FILE, rows)
    summary = summarize(rows)
    summary.update(step=step, model=str(mdir), test_set=ts.name, test_set_path=ts.path, layout=ts.layout,
                   notes=ts.notes, seconds=round(seconds, 2), ranks=world, settings=settings,
                   model_fingerprint=model_fingerprint(mdir), test_set_fingerprint=ts.fingerprint(),
                   schema=SCHEMA_VERSION)
    write_json(where / SUMMARY_FILE, summary)


# ---------------------------------------------------------------------------
# report


SWEEP_KEYS = ("step", "model", "test_set", "cer", "pinyin_error", "reward", "n", "failures")


def write_sweep(out_dir: Path, models: dict[int, Path], names: Sequence[str]) -> list[dict]:
    """report.md, summary.json and cer.png from the per-model summaries on disk."""
    rows = []
    for step in sorted(models):
        for name in names:
            p = pair_dir(out_dir, step, name) / SUMMARY_FILE
            if p.is_file():
                s = json.loads(p.read_text())
                rows.append({**{k: s[k] for k in SWEEP_KEYS}, **sampling_of(s)})
    write_json(out_dir / SUMMARY_FILE, rows)
    atomic_write_text(out_dir / REPORT_FILE, "# CER sweep (stage 4)\n\n" + format_table(rows) + "\n")
    plot_cer(rows, out_dir / PLOT_FILE)
    return rows


def sampling_of(summary: dict) -> dict:
    """How a pair was decoded: sampling rule (or greedy) and min/max token-text ratios.
    Summaries written before the rule was recorded used the cosyvoice2-2024 rule."""
    st = summary.get("settings") or {}
    sp = st.get("sampling") or {}
    return {"rule": "greedy" if st.get("greedy") else sp.get("rule", "cosyvoice2-2024"),
            "min_ratio": sp.get("min_token_text_ratio"), "max_ratio": sp.get("max_token_text_ratio")}


def format_table(rows: Sequence[dict]) -> str:
    head = ("| step | test set | CER | pinyin error | mean reward | n | failures | sampling | min/max ratio |\n"
            "|---:|---|---:|---:|---:|---:|---:|---|---|")
    lines = [head]
    best = {}
    for r in rows:
        if r["test_set"] not in best or r["cer"] < best[r["test_set"]]:
            best[r["test_set"]] = r["cer"]
    for r in rows:
        label = "0 (start)" if r["step"] == 0 else str(r["step"])
        mark = " *" if len(rows) > 1 and math.isclose(r["cer"], best[r["test_set"]]) else ""
        lines.append(f"| {label} | {r['test_set']} | {100 * r['cer']:.2f}%{mark} | {100 * r['pinyin_error']:.2f}% "
                     f"| {r['reward']:.3f} | {r['n']} | {r['failures']} | {r.get('rule', '?')} "
                     f"| {r.get('min_ratio', '?')}/{r.get('max_ratio', '?')} |")
    return "\n".join(lines) + ("\n\n`*` lowest CER of its test set." if len(rows) > 1 else "")


def plot_cer(rows: Sequence[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r["test_set"] for r in rows):
        pts = sorted((r["step"], 100 * r["cer"]) for r in rows if r["test_set"] == name)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xlabel("training step (0 = start model)")
    ax.set_ylabel("CER (%)")
    ax.set_title("held-out CER by step")
    ax.grid(alpha=0.3)
    if rows:
        ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
