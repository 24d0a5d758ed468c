"""The embedded preset's base model: a tiny CosyVoice2 ``Qwen2LM`` (or ``CosyVoice3LM``, ``--family``) pretrained on the
shipped corpus with the simulated codec (``ttsrl.embedded.codec``) as its speech tokenizer.

It is deliberately imperfect, as a real TTS LM is: its training targets carry
label noise (a share of syllables get a wrong tone; optionally a wrong initial), so the
model learns to hedge, and sampling from it makes mistakes that a reward can see.
Held-out error then starts well above zero and GRPO has room to lower it. Tone
errors are what real Mandarin TTS models get wrong most, which is also why the
reference reward counts tones.

It learns CosyVoice's zero-shot task too: a share of its examples (``prompt_prob``)
are in the zero-shot layout ``[sos] + prompt_text + text + [task_id] + prompt_speech`` ->
target speech, the prompt a short corpus span spoken in a random simulated speaker's voice
(``codec.SPEAKERS``) and the target in the same voice; the rest are text-only, in the default
voice. A share of a prompted target's codes (``speaker_leak``) is the default voice's instead,
so the model follows its prompt's speaker imperfectly: RL can then raise SIM, or (rewarded on
CER only) drift further to the default voice the simulated ASR reads best.

Deterministic from a seed on one machine; cached: the output folder records a
fingerprint of the corpus and config (the inputs) and ``weights_sha256``, a hash of the
built weights (the output), and a second call with the same inputs returns at once.
Two machines with the same fingerprint but different weight hashes built different
models (float kernels differ between CPUs and torch builds): every later number differs too.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ttsrl.atomic import atomic_torch_save, atomic_write_text
from ttsrl.cli import option
from ttsrl.console import ProgressLines
from ttsrl.cpus import usable_cores
from ttsrl.embedded import codec
from ttsrl.embedded.tiny_model import TinyConfig, qwen2_config
from ttsrl.embedded.tiny_tokenizer import save_blank_en, train_tokenizer
from ttsrl.jsonl import iter_objects
from ttsrl.model import vocab as V
from ttsrl.model.convert import BLANK_EN
from ttsrl.model.cosyvoice_lm import IGNORE_ID, Qwen2LM, SamplingConfig, lm_class

INFO_FILE = "build_info.json"


@dataclass(frozen=True)
class PretrainConfig:
    """The base model's build; the fields with options are also ``build_base_model.py``'s."""
    model: TinyConfig = option(default_factory=lambda: TinyConfig(hidden_size=128, intermediate_size=256,
                                                                  num_hidden_layers=4, num_attention_heads=4,
                                                                  num_key_value_heads=2, tokenizer_vocab=4096),
                               cli=False, help="the tiny model's shape")
    steps: int = option(4000, help="optimiser steps")
    batch_size: int = option(16, cli=False, help="examples per step (twice the steps of 16 read far better than "
                                                 "the same examples in steps of 32; steps of 8 worse)")
    span_prob: float = option(0.3, cli=False, help="share of examples that are a random span of a sentence")
    random_prob: float = option(0.5, cli=False, help="share that are random strings of corpus characters "
                                                     "(reading drills)")
    min_span: int = option(2, cli=False, help="shortest span")
    max_random: int = option(12, cli=False, help="longest random string")
    lr: float = option(3e-3, cli=False, help="learning rate")
    weight_decay: float = option(0.01, cli=False, help="weight decay")
    tone_noise: float = option(0.15, help="share of training syllables given a wrong tone (the start model then "
                                           "hedges between tones, and sampling from it makes errors RL can remove)")
    initial_noise: float = option(0.0, help="share of training syllables whose onset is replaced by a random "
                                            "one (a wrong initial)")
    syllable_noise: float = option(0.2, help="kokoro family: share of a target's characters that misaki's G2P "
                                             "teacher reads as the character's one confusable character (a whole "
                                             "wrong syllable, as a TTS LM misreads; the simulated codec's builds "
                                             "use the tone and initial noise instead)")
    prompt_prob: float = option(0.0, help="share of examples in CosyVoice's zero-shot layout: a prompt (a 2-3 "
                                          "character corpus span in a random simulated speaker's voice) before "
                                          "the text, the target in that voice (0: text-only; the embedded preset's "
                                          "zero-shot mode sets 0.5)")
    speaker_leak: float = option(0.05, help="share of a prompted target's codes spoken in the default voice "
                                            "instead of the prompt's (the model follows its prompt imperfectly; at "
                                            "0.15 CER-only RL found the habit and lost 0.18-0.30 of SIM in 20 steps, at "
                                            "0.05 it lost 0.05-0.08, nearer real models' drift; the kokoro family, whose "
                                            "leak is a whole utterance's voice token, uses 0.15: presets/speech_cpu.sh)")
    prompt_from: float = option(0.0, help="share of the steps that are text-only before zero-shot examples begin (a "
                                          "curriculum: reading in the default voice first, then prompts)")
    prompt_chars: tuple[int, int] = option((2, 3), cli=False, help="shortest and longest prompt, in characters")
    pinyin_init: bool = option(True, help="start the embeddings from the pronunciation dictionary: each speech "
                                          "code's embedding and head row from a vector of its unit (onset, "
                                          "final+tone) and one of its voice, each character's text embedding "
                                          "from the units of its reading (pypinyin), so the model starts "
                                          "knowing what a character sounds like and learns to read in order "
                                          "(as a real TTS LM starts from a pretrained text LM)")
    seed: int = option(1234, help="seed of the data and the initial weights")
    family: str = option("cosyvoice2", choices=tuple(V.FAMILIES),
                         help="model family whose layout the base model has (cosyvoice3: specials in the speech "
                              "embedding, no head bias, every input opens with its <|endofprompt|> instruction)")
    threads: int = option(0, help="torch CPU threads (0: two, or the usable cores where fewer). Part of the build's "
                                  "inputs: 1 and 2 threads build different weights (torch's kernels split the "
                                  "sums by thread), so the count is fixed, never the cores free at the start")

    def __post_init__(self):
        V.family(self.family)
        for name in ("prompt_prob", "speaker_leak", "prompt_from", "syllable_noise"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(self, name)}")
        if self.threads < 0:
            raise ValueError(f"--threads must be >= 0 (0: two, or the usable cores where fewer), got {self.threads}")


BUILD_THREADS = 2


def build_threads(cfg: "PretrainConfig") -> int:
    """The build's thread count: ``cfg.threads``, else two (or the usable cores where fewer). Not the cores
    free at the start: the count changes the weights, and a start model must not depend on the load."""
    return cfg.threads or max(1, min(BUILD_THREADS, usable_cores()))


def warmup_share(steps: int) -> float:
    """OneCycleLR's warm-up share: 5%, and at least 2 steps from 3 steps on. At exactly 20
    steps 5% is one step, where OneCycleLR divides by zero (its warm-up ends at step 0);
    from 40 steps on (the preset's 2,000) it is 5% as before, so those weights are unchanged."""
    return max(0.05, 2 / steps) if steps >= 3 else 0.05


def read_texts(path: str | Path) -> list[str]:
    texts = []
    for where, row in iter_objects(path):
        if not isinstance(row.get("text"), str) or not row["text"].strip():
            raise ValueError(f"{where}: expected an object with a non-empty string 'text'")
        texts.append(row["text"])
    return texts


def is_hanzi(ch: str) -> bool:
    """A character of the CJK Unified Ideographs block: the characters a build teaches to read."""
    return "\u4e00" <= ch <= "\u9fff"


def sentence_spans(text: str, min_len: int) -> list[str]:
    """Every contiguous span of at least ``min_len`` characters that starts and ends on
    a character with a reading (not punctuation or space)."""
    ok = [i for i, ch in enumerate(text) if ch.isalnum()]
    return [text[i:j + 1] for a, i in enumerate(ok) for j in ok[a:] if j + 1 - i >= min_len]


def noisy_codes(codes: list[int], cfg: PretrainConfig, rng: random.Random) -> list[int]:
    """Corrupt the simulated codes the way a sloppy speaker would: wrong tones, a few
    wrong initials (an onset of another initial, in the code's own speaker's book). Silence and letters are left alone."""
    out = list(codes)
    for i, c in enumerate(out):
        kind, value = codec._KIND.get(c, (None, None))
        if kind == "final" and rng.random() < cfg.tone_noise:
            fin, tone = value
            other = rng.choice([t for t in codec.TONES if t != tone])
            out[i] = codec.BOOKS[codec.speaker_of_code(c)].finals[(fin, other)]
        elif kind == "onset" and rng.random() < cfg.initial_noise:
            _, fin = value  # a random initial before the same final, as the option's help says
            out[i] = codec.BOOKS[codec.speaker_of_code(c)].onsets[(rng.choice(codec.INITIALS), fin)]
    return out


def leaky_voice(codes: list[int], cfg: PretrainConfig, rng: random.Random) -> list[int]:
    """A prompted target as the imperfect speaker-follower says it: each code, with probability
    ``speaker_leak``, the default voice's code for the same unit."""
    default = codec.to_speaker(codes, codec.DEFAULT_SPEAKER)
    return [d if rng.random() < cfg.speaker_leak else c for c, d in zip(codes, default)]


def pronunciation_init_(model: Qwen2LM, tokenizer, chars: list[str], seed: int,
                        scale: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """Structured initial embeddings (``pinyin_init``): a random vector per codec unit and per voice; a
    speech code's embedding row and head row are its unit's vector plus half its voice's; a character's
    text embedding is the sum of the unit vectors of its default-voice codes (``codec.encode``). Drawn
    from their own generator, so the rest of the model's initial weights do not change. Returns the unit
    and voice vectors."""
    g = torch.Generator().manual_seed(seed + 1)
    h = model.speech_embedding.weight.shape[1]
    units = torch.randn(codec.NUM_CODES, h, generator=g) * scale
    voices = torch.randn(len(codec.SPEAKERS), h, generator=g) * scale
    # a final's second code starts as its first plus one shared "second take" vector, so the model
    # begins knowing the two say the same sound
    take = torch.randn(h, generator=g) * scale
    for k in range(codec.NUM_CODES):
        if codec.first_code_unit(k) != k:
            units[k] = units[codec.first_code_unit(k)] + take
    with torch.no_grad():
        for code in sorted(codec.ALL_CODES):
            row = units[codec.unit_of(code)] + 0.5 * voices[codec.SPEAKERS.index(codec.speaker_of_code(code))]
            model.speech_embedding.weight[code] = row
            model.llm_decoder.weight[code] = row
        emb = model.embed_tokens.weight
        for ch in chars:
            ids = tokenizer.encode(ch, add_special_tokens=False)
            codes = codec.encode(ch)
            if len(ids) == 1 and codes:
                emb[ids[0]] = sum(units[codec.unit_of(c)] for c in codes)
    return units, voices


def batch_loss(model: Qwen2LM, batch: list[tuple]) -> torch.Tensor:
    """Teacher-forced loss of a right-padded batch: targets speech + eos, IGNORE elsewhere
    (the same layout as ``Qwen2LM.loss``, batched). The 6,564-way decoder runs on the target
    positions only: text and padding positions (about 40% of a batch) have no target, and the
    decoder with its softmax was the larger part of a step (on 2 threads, 200 steps of the preset:
    0.315 s a step before, 0.185 s after).

    An example is ``(text_ids, speech)`` or ``(text_ids, speech, n_prompt)``: the first ``n_prompt``
    codes of ``speech`` are the zero-shot prompt's (input only, no target), as CosyVoice's
    ``[sos] + prompt_text + text + [task_id] + prompt_speech`` continues into the target."""
    embeds, targets = [], []
    for text_ids, speech, *rest in batch:
        n_prompt = rest[0] if rest else 0
        embeds.append(model.build_inputs(text_ids, speech)[0])
        targets.append([IGNORE_ID] * (len(text_ids) + 1 + n_prompt) + list(speech[n_prompt:])
                       + [model.family.eos_index])
    T = max(e.shape[0] for e in embeds)
    H = embeds[0].shape[1]
    x = torch.zeros(len(batch), T, H)
    mask = torch.zeros(len(batch), T, dtype=torch.long)
    y = torch.full((len(batch), T), IGNORE_ID, dtype=torch.long)
    for i, (e, t) in enumerate(zip(embeds, targets)):
        x[i, : len(e)] = e
        mask[i, : len(e)] = 1
        y[i, : len(t)] = torch.tensor(t)
    hidden, _ = model.llm(x, attention_mask=mask)
    keep = y != IGNORE_ID
    return torch.nn.functional.cross_entropy(model.llm_decoder(hidden[keep]), y[keep])


def train_steps(model: Qwen2LM, cfg: PretrainConfig, draw, progress_every_s: float = 30.0) -> float:
    """``cfg.steps`` AdamW steps (one-cycle schedule, gradients clipped at 1) on the batches
    ``draw(step)`` returns; the model is left in eval mode. Returns the last step's loss. On a terminal
    a progress bar; otherwise a progress line at least every ``progress_every_s`` seconds, so a log file shows
    the build is alive."""
    from tqdm import tqdm

    # fused: one kernel over all tensors, 5x faster than the per-tensor loop on CPU (4.8 ms against 24 ms a
    # step for this model's size on one thread); the update is the same AdamW
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=cfg.steps,
                                                pct_start=warmup_share(cfg.steps))
    model.train()
    on_terminal = sys.stderr.isatty()  # tqdm draws on stderr; off a terminal: a line every 30 s
    bar = tqdm(range(cfg.steps), desc="pretrain base model", unit="step", disable=not on_terminal, mininterval=2)
    lines = None if on_terminal else ProgressLines(cfg.steps, "pretrain base model", every_s=progress_every_s,
                                                   out=sys.stdout)
    for step in bar:
        loss = batch_loss(model, draw(step))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
        if lines is not None:
            lines.update(step + 1, loss=loss.item())
    model.eval()
    return loss.item()


def prefix_ids(tokenizer, fam: V.Family) -> list[int]:
    """The family's system prefix as text ids (CosyVoice3's instruction; none for CosyVoice2)."""
    return tokenizer.encode(fam.system_prefix, add_special_tokens=False) if fam.system_prefix else []


def heldout_cer(model: Qwen2LM, tokenizer, texts: list[str], greedy: bool, seed: int = 0,
                sampling: SamplingConfig | None = None) -> float:
    """Micro-averaged error rate of ``codec.decode(generated)`` vs the text (the family's
    sampling rule, no minimum length, unless ``sampling``)."""
    from ttsrl.text import error_counts

    sampling = sampling or SamplingConfig(min_token_text_ratio=0.0, rule=model.family.default_rule)
    g = torch.Generator().manual_seed(seed)
    errs = total = 0
    prefix = prefix_ids(tokenizer, model.family)
    for t in texts:
        ids = tokenizer.encode(t, add_special_tokens=False)
        codes = list(model.inference(ids, prefix, sampling=sampling, generator=g, greedy=greedy))
        e, n = error_counts(t, codec.decode(codes), unit="char")
        errs, total = errs + e, total + n
    return errs / max(total, 1)


def zero_shot_counts(model: Qwen2LM, tokenizer, rows: list[dict], pool: dict, seed: int = 0,
                     sampling: SamplingConfig | None = None) -> list[tuple[int, int, float]]:
    """Per row, (errors, reference length, SIM) of one sampled zero-shot continuation: each row
    ({"text", "prompt_id"}) prompted by ``pool[prompt_id]`` (``ttsrl.embedded.speakers.PoolPrompt``)
    as ``make_requests`` builds it, sampled by the family's rule (or ``sampling``) from one generator
    seeded ``seed``, decoded exactly by the codec; SIM the share of the output's codes in the prompt's book."""
    from ttsrl.embedded.speakers import similarity
    from ttsrl.text import error_counts

    sampling = sampling or SamplingConfig(min_token_text_ratio=0.0, rule=model.family.default_rule)
    g = torch.Generator().manual_seed(seed)
    out = []
    for row in rows:
        p = pool[row["prompt_id"]]
        ids = tokenizer.encode(row["text"], add_special_tokens=False)
        ptext = tokenizer.encode(model.family.system_prefix + p.prompt_text, add_special_tokens=False)
        with torch.no_grad():
            codes = list(model.inference(ids, ptext, p.prompt_speech_tokens, sampling=sampling, generator=g))
        e, n = error_counts(row["text"], codec.decode(codes), unit="char")
        out.append((e, n, similarity(codes, p.speaker)))
    return out


def heldout_zero_shot(model: Qwen2LM, tokenizer, rows: list[dict], pool: dict, seed: int = 0,
                      sampling: SamplingConfig | None = None) -> tuple[float, float]:
    """(micro-averaged error rate, mean SIM) of ``zero_shot_counts``."""
    counts = zero_shot_counts(model, tokenizer, rows, pool, seed, sampling)
    errs, total = sum(c[0] for c in counts), sum(c[1] for c in counts)
    return errs / max(total, 1), sum(c[2] for c in counts) / max(len(counts), 1)


def fingerprint(texts: list[str], cfg: PretrainConfig) -> str:
    """The build's inputs, the thread count included: 1 and 2 threads build different weights (the 40-step
    build of the preset on the shipped corpus: other weights_sha256), so a cache of one is not the other.
    ``v`` is the build code's version: raised when the code changes the weights it trains from
    the same inputs (3: fused AdamW), so a cache is rebuilt."""
    inputs = {**asdict(cfg), "threads": build_threads(cfg)}
    del inputs["syllable_noise"]  # the phoneme teacher's (ttsrl.embedded.phoneme_lm); the codec's build ignores it
    if inputs["prompt_prob"] == 0:  # a text-only build draws no prompt: the zero-shot fields change nothing
        for k in ("prompt_prob", "speaker_leak", "prompt_chars", "prompt_from"):
            del inputs[k]
    h = hashlib.sha256(json.dumps({"texts": texts, "cfg": inputs, "v": 3}, ensure_ascii=False).encode())
    return h.hexdigest()[:16]


def weights_sha256(state_dict: dict) -> str:
    """Content hash of a state dict: names, dtypes, shapes and bytes of every tensor, in
    name order. Equal for bit-identical weights, whatever the file's serialisation."""
    h = hashlib.sha256()
    for k in sorted(state_dict):
        t = state_dict[k].detach().cpu().contiguous().reshape(-1)
        h.update(f"{k}:{t.dtype}:{tuple(state_dict[k].shape)}\n".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def cached_build(out: Path, fp: str, log=print) -> dict | None:
    """The build info of the model at ``out`` if it was built from the inputs ``fp``, else None."""
    info_path = out / INFO_FILE
    if not (info_path.is_file() and (out / "llm.pt").is_file()):
        return None
    info = json.loads(info_path.read_text())
    if info.get("fingerprint") != fp:
        return None
    if "weights_sha256" not in info:  # built before the hash was recorded
        info["weights_sha256"] = weights_sha256(torch.load(out / "llm.pt", map_location="cpu", weights_only=True))
        atomic_write_text(info_path, json.dumps(info, indent=2))
    log(f"base model up to date at {out} (fingerprint {fp}, weights sha256 {info['weights_sha256'][:16]}); "
        "skipping the build")
    return info


def save_build(out: Path, tok, inner, model: Qwen2LM, info: dict) -> None:
    """Write the build as a CosyVoice release folder has it (llm.pt, CosyVoice-BlankEN/), then its info
    last: an interrupted save leaves no info file, so the next call builds again."""
    out.mkdir(parents=True, exist_ok=True)
    save_blank_en(tok, out / BLANK_EN)
    inner.save_pretrained(out / BLANK_EN)
    atomic_torch_save(model.state_dict(), out / "llm.pt")
    atomic_write_text(out / INFO_FILE, json.dumps(info, indent=2))


def new_build(texts: list[str], cfg: PretrainConfig, what: str, log=print) -> tuple:
    """A build's start, the same for every teacher: the seeds, the thread count, the per-character
    tokenizer with the family's run-time specials and the untrained LM of the family's layout.
    Returns (start time, threads, the data's random.Random, tokenizer, inner Qwen2 config, model)."""
    t0 = time.time()
    torch.manual_seed(cfg.seed)
    threads = build_threads(cfg)
    torch.set_num_threads(threads)
    log(f"building {what}: {cfg.steps} steps on {threads} torch thread(s)")
    rng = random.Random(cfg.seed)
    tok = train_tokenizer(texts, cfg.model.tokenizer_vocab, per_character=True)
    fam = V.family(cfg.family)
    n_text = V.add_cosyvoice_specials(tok, fam)
    inner = qwen2_config(cfg.model, n_text + cfg.model.extra_inner_rows)
    return t0, threads, rng, tok, inner, lm_class(fam)(inner)


def build_base_model(corpus: str | Path, out_dir: str | Path, cfg: PretrainConfig = PretrainConfig(),
                     heldout: str | Path | None = None, log=print, progress_every_s: float = 30.0) -> dict:
    """Train (or reuse) the base model at ``out_dir`` (llm.pt + CosyVoice-BlankEN/). On a
    terminal a progress bar; otherwise a progress line (step, loss, elapsed, ETA) at least
    every ``progress_every_s`` seconds, so a log file shows the build is alive."""
    out = Path(out_dir)
    texts = read_texts(corpus)
    fp = fingerprint(texts, cfg)
    info = cached_build(out, fp, log)
    if info is not None:
        return info

    t0, threads, rng, tok, inner, model = new_build(texts, cfg, "the base model", log)
    fam = model.family
    prefix = prefix_ids(tok, fam)

    def example(t: str) -> tuple[list[int], list[int]]:
        return prefix + tok.encode(t, add_special_tokens=False), codec.encode(t)

    sentences = [example(t) for t in texts]
    # Spans and random character strings teach reading character by character (a
    # monotonic text -> speech alignment) instead of memorising whole sentences.
    span_texts = [s for t in texts for s in sentence_spans(t, cfg.min_span)]
    spans = [example(s) for s in span_texts]
    chars = sorted(set(ch for t in texts for ch in t if is_hanzi(ch)))
    if cfg.pinyin_init:
        pronunciation_init_(model, tok, chars, cfg.seed)
    lo, hi = cfg.prompt_chars
    # the prompts: short spans, tokenised and encoded once (CosyVoice3: the prefix opens the prompt
    # text, as ``ttsrl.model.generate.make_requests`` tokenises it)
    prompts = [(tok.encode(fam.system_prefix + s, add_special_tokens=False), codec.encode(s))
               for s in sorted({s for s in span_texts if lo <= len(s) <= hi})]

    def drill() -> tuple[list[int], list[int]]:
        return example("".join(rng.choice(chars) for _ in range(rng.randint(cfg.min_span, cfg.max_random))))

    def prompted(text_ids: list[int], codes: list[int]) -> tuple[list[int], list[int], int]:
        """The example in the zero-shot layout: a clean prompt in a random voice, the noisy target
        in the same voice with some default-voice codes."""
        speaker = rng.choice(codec.SPEAKERS)
        ptext_ids, pcodes = rng.choice(prompts)
        pspeech = codec.to_speaker(pcodes, speaker)
        target = leaky_voice(noisy_codes(codec.to_speaker(codes, speaker), cfg, rng), cfg, rng)
        return ptext_ids + text_ids[len(prefix):], pspeech + target, len(pspeech)
    def draw(step: int) -> list[tuple]:
        batch = []
        for _ in range(cfg.batch_size):
            u = rng.random()
            if u < cfg.random_prob:
                text_ids, codes = drill()
            else:
                text_ids, codes = rng.choice(spans if u < cfg.random_prob + cfg.span_prob else sentences)
            if cfg.prompt_prob > 0 and step >= first_prompted and rng.random() < cfg.prompt_prob:  # no draw at 0: the text-only build
                batch.append(prompted(text_ids, codes))
            else:
                batch.append((text_ids, noisy_codes(codes, cfg, rng)))
        return batch

    first_prompted = int(cfg.prompt_from * cfg.steps)
    loss = train_steps(model, cfg, draw, progress_every_s)
    train_seconds = time.time() - t0
    info = {"fingerprint": fp, "weights_sha256": weights_sha256(model.state_dict()), "config": asdict(cfg),
            "n_train": len(texts), "train_seconds": round(train_seconds, 1), "threads": threads, "final_loss": round(loss, 4)}
    if heldout is not None:
        test = read_texts(heldout)
        info["heldout_cer_greedy"] = round(heldout_cer(model, tok, test, greedy=True), 4)
        info["heldout_cer_sampling"] = round(heldout_cer(model, tok, test, greedy=False, seed=cfg.seed), 4)
    save_build(out, tok, inner, model, info)
    log(f"built base model in {train_seconds:.0f}s: " + ", ".join(f"{k}={v}" for k, v in info.items()
                                                                   if k.startswith(("heldout", "final")))
        + f"; weights sha256 {info['weights_sha256'][:16]} (compare across machines: build_info.json)")
    return info
