"""The speech preset's base model: a tiny kokoro-family LM that reads Mandarin text as Kokoro phonemes.

The same tiny ``Qwen2LM`` as the embedded preset's, pretrained on the corpus with misaki's Mandarin
G2P as its teacher (``ttsrl.families.kokoro.phonemes``) instead of the simulated codec: the codes
it writes are real phonemes that Kokoro-82M speaks and Whisper hears.

Its errors are real syllable errors, as a small TTS LM makes them: in a share of a target's
characters (``syllable_noise``) the teacher reads the character's one confusable character, so the
model learns a second reading beside the right one, and a sampled utterance now and then says it. RL has those to
remove; Whisper's own floor (about 23% CER on perfect phonemes with these Japanese voices,
docs/speech.md) stays.

The zero-shot layout is CosyVoice's, ``[sos] + prompt_text + text + [task_id] + prompt_speech`` ->
target, the prompt a short corpus span read in a random voice: its speech is that voice's token and
the span's phonemes. The target opens with a voice token, the prompt's, except in a share
``speaker_leak`` of examples where it is another voice's: the model follows its prompt's voice
imperfectly, and a policy trained on CER alone can drift to the voice Whisper reads best, which SIM
against the row's voice then sees. Text-only examples have no voice token (the row's voice speaks).

Reading is taught as in the embedded preset: whole sentences, random spans of them and random strings
of corpus characters (drills), each character's text embedding starting from its reading's phonemes.
Deterministic from a seed on one machine, and cached by a fingerprint of its inputs (the corpus, the
config, the phoneme vocabulary and misaki's version), as ``ttsrl.embedded.pretrain`` builds are.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import random
import time
from dataclasses import asdict
from functools import lru_cache
from pathlib import Path

import jiwer
import torch

from ttsrl.embedded.pretrain import (
    PretrainConfig,
    build_threads,
    cached_build,
    is_hanzi,
    new_build,
    prefix_ids,
    read_texts,
    save_build,
    sentence_spans,
    train_steps,
    weights_sha256,
)
from ttsrl.families.kokoro.phonemes import MandarinG2P, PhonemeVocab, load_vocab
from ttsrl.model import vocab as V
from ttsrl.model.cosyvoice_lm import Qwen2LM, SamplingConfig


class Teacher:
    """Text -> the family's speech codes through misaki's G2P (cached), with the build's noise."""

    def __init__(self, chars: list[str], cfg: PretrainConfig, rng: random.Random):
        self.vocab: PhonemeVocab = load_vocab()
        self.g2p = MandarinG2P()
        self.cfg, self.rng = cfg, rng
        # each character's one confusable character, drawn once from its own generator
        pick = random.Random(cfg.seed + 2)
        self.confuser = {ch: pick.choice([c for c in chars if c != ch]) for ch in chars} if len(chars) > 1 else {}
        self.codes = lru_cache(maxsize=65536)(self._codes)

    def _codes(self, text: str) -> tuple[int, ...]:
        return tuple(self.vocab.encode(self.g2p(text)))

    def noisy(self, text: str) -> tuple[int, ...]:
        """The codes of ``text`` with each character read, with probability ``syllable_noise``, as its
        confusable character (then the whole text through the G2P: a wrong syllable in its context).
        One fixed confusion a character, as a TTS LM's misreadings are systematic (a polyphone, a
        look-alike), not uniform: the model learns a second reading with real mass, which sampling
        (top-p 0.8 included) draws and RL can remove."""
        p = self.cfg.syllable_noise
        out = "".join(self.confuser[ch] if ch in self.confuser and self.rng.random() < p else ch for ch in text)
        return self.codes(out)

    def voice(self) -> int:
        return self.vocab.voice_code(self.rng.choice(self.vocab.voices))

    def voice_token(self, prompt_voice: int) -> int:
        """The target's voice token: the prompt's, or (``speaker_leak``) another voice's."""
        if self.rng.random() < self.cfg.speaker_leak:
            return self.rng.choice([c for c in range(len(self.vocab.symbols), self.vocab.size) if c != prompt_voice])
        return prompt_voice


def phoneme_init_(model: Qwen2LM, tokenizer, teacher: Teacher, chars: list[str], seed: int,
                  scale: float = 0.05) -> None:
    """Structured initial embeddings (``pinyin_init``): a random vector per speech code, the same for its
    embedding row and its head row; a character's text embedding the sum of its reading's phoneme vectors.
    Drawn from their own generator, so the rest of the model's initial weights do not change."""
    g = torch.Generator().manual_seed(seed + 1)
    h = model.speech_embedding.weight.shape[1]
    units = torch.randn(teacher.vocab.size, h, generator=g) * scale
    with torch.no_grad():
        model.speech_embedding.weight[: teacher.vocab.size] = units
        model.llm_decoder.weight[: teacher.vocab.size] = units
        emb = model.embed_tokens.weight
        for ch in chars:
            ids = tokenizer.encode(ch, add_special_tokens=False)
            codes = teacher.codes(ch)
            if len(ids) == 1 and codes:
                emb[ids[0]] = units[list(codes)].sum(0)


def fingerprint(texts: list[str], cfg: PretrainConfig, vocab: PhonemeVocab) -> str:
    """The build's inputs: the corpus, the config (the thread count included; not the codec's tone and
    initial noise, which this build does not read), the phoneme vocabulary and misaki's version."""
    inputs = {**asdict(cfg), "threads": build_threads(cfg)}
    for k in ("tone_noise", "initial_noise"):
        del inputs[k]
    world = {"symbols": vocab.symbols, "voices": vocab.voices, "misaki": md.version("misaki")}
    h = hashlib.sha256(json.dumps({"texts": texts, "cfg": inputs, "world": world, "v": 1},
                                  ensure_ascii=False).encode())
    return h.hexdigest()[:16]


def heldout_per(model: Qwen2LM, tokenizer, teacher: Teacher, texts: list[str], seed: int = 0) -> dict:
    """Phoneme error rate (pooled edit distance over the teacher's clean phoneme codes, voice tokens
    dropped) of one sampled zero-shot reading of each text, each prompted by a corpus-free phrase in
    a voice taken in turn, by the family's rule; and the share whose first voice token is the prompt's
    voice (``voice_kept``). Sampled by the family's rule with ``tau_r`` :data:`PHONEME_TAU_R`. No audio:
    a fast check of the build, not the Whisper CER stage 4 reports."""
    sampling = SamplingConfig(min_token_text_ratio=0.0, rule=model.family.default_rule, tau_r=PHONEME_TAU_R)
    g = torch.Generator().manual_seed(seed)
    v = teacher.vocab
    ptext = tokenizer.encode(model.family.system_prefix + PROMPT_PHRASE, add_special_tokens=False)
    errs = total = kept = 0
    for i, text in enumerate(texts):
        voice = v.voices[i % len(v.voices)]
        pspeech = [v.voice_code(voice), *teacher.codes(PROMPT_PHRASE)]
        ids = tokenizer.encode(text, add_special_tokens=False)
        with torch.no_grad():
            codes = list(model.inference(ids, ptext, pspeech, sampling=sampling, generator=g))
        said, _ = v.split(codes)
        kept += said in (None, voice)
        ref = [c for c in teacher.codes(text) if c < len(v.symbols)]
        o = jiwer.process_words(" ".join(map(str, ref)), " ".join(str(c) for c in codes if c < len(v.symbols)) or "-")
        errs, total = errs + o.substitutions + o.deletions + o.insertions, total + len(ref)
    return {"heldout_per_sampling": round(errs / max(total, 1), 4), "heldout_voice_kept": round(kept / len(texts), 4)}


#: CosyVoice's repetition-aware sampling redraws a pick met win_size * tau_r times in the last win_size
#: tokens; its 0.1 (once in 10) suits 25 Hz codec tokens, but phonemes repeat within ten symbols all the
#: time (vowels, tone arrows, spaces), so at 0.1 most picks were redrawn from the full distribution
#: (sampled PER 45% where greedy read almost every sentence right). 1.0 redraws only a symbol that
#: filled the whole window: a loop guard
PHONEME_TAU_R = 1.0

#: the prompt phrase of the build's held-out check (in no corpus split)
PROMPT_PHRASE = "你好"


def build_phoneme_lm(corpus: str | Path, out_dir: str | Path, cfg: PretrainConfig, heldout: str | Path | None = None,
                     log=print, progress_every_s: float = 30.0) -> dict:
    """Train (or reuse) the kokoro-family base model at ``out_dir`` (llm.pt + CosyVoice-BlankEN/).
    Sentences the G2P cannot read (Latin letters) are left out, and counted in the log."""
    fam = V.family(cfg.family)
    if fam.name != "kokoro":
        raise ValueError(f"the phoneme LM is the kokoro family's; --family {cfg.family} builds on the simulated codec")
    out = Path(out_dir)
    all_texts = read_texts(corpus)
    texts = [t for t in all_texts if MandarinG2P.reads(t)]
    if len(texts) < len(all_texts):
        log(f"{len(all_texts) - len(texts)} of {len(all_texts)} training sentences have Latin letters, which the "
            "Mandarin G2P cannot read: left out")
    if not texts:
        raise ValueError(f"{corpus}: no sentence the Mandarin G2P can read")
    fp = fingerprint(texts, cfg, load_vocab())
    info = cached_build(out, fp, log)
    if info is not None:
        return info

    t0, threads, rng, tok, inner, model = new_build(texts, cfg, "the kokoro-family base model", log)
    prefix = prefix_ids(tok, fam)
    chars = sorted(set(ch for t in texts for ch in t if is_hanzi(ch)))
    teacher = Teacher(chars, cfg, rng)
    if cfg.pinyin_init:
        phoneme_init_(model, tok, teacher, chars, cfg.seed)
    span_texts = sorted({s for t in texts for s in sentence_spans(t, cfg.min_span)})
    lo, hi = cfg.prompt_chars
    prompts = [s for s in span_texts if lo <= len(s) <= hi]

    def draw_text() -> str:
        u = rng.random()
        if u < cfg.random_prob:
            return "".join(rng.choice(chars) for _ in range(rng.randint(cfg.min_span, cfg.max_random)))
        return rng.choice(span_texts if u < cfg.random_prob + cfg.span_prob else texts)

    first_prompted = int(cfg.prompt_from * cfg.steps)

    def draw(step: int) -> list[tuple]:
        batch = []
        for _ in range(cfg.batch_size):
            text = draw_text()
            text_ids = prefix + tok.encode(text, add_special_tokens=False)
            target = list(teacher.noisy(text))
            if step >= first_prompted and rng.random() < cfg.prompt_prob:
                ptext = rng.choice(prompts)
                voice = teacher.voice()
                pspeech = [voice, *teacher.codes(ptext)]
                ptext_ids = tok.encode(fam.system_prefix + ptext, add_special_tokens=False)
                batch.append((ptext_ids + text_ids[len(prefix):], pspeech + [teacher.voice_token(voice)] + target,
                              len(pspeech)))
            else:
                batch.append((text_ids, target))
        return batch

    loss = train_steps(model, cfg, draw, progress_every_s)
    train_seconds = time.time() - t0
    info = {"fingerprint": fp, "weights_sha256": weights_sha256(model.state_dict()), "config": asdict(cfg),
            "n_train": len(texts), "train_seconds": round(train_seconds, 1), "threads": threads,
            "final_loss": round(loss, 4), "teacher": f"misaki {md.version('misaki')} zh G2P"}
    if heldout is not None:
        test = [t for t in read_texts(heldout) if MandarinG2P.reads(t)]
        info.update(heldout_per(model, tok, teacher, test, seed=cfg.seed))
    save_build(out, tok, inner, model, info)
    log(f"built base model in {train_seconds:.0f}s: " + ", ".join(f"{k}={v}" for k, v in info.items()
                                                                   if k.startswith(("heldout", "final")))
        + f"; weights sha256 {info['weights_sha256'][:16]} (compare across machines: build_info.json)")
    return info
