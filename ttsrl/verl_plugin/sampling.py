"""The ``hf`` rollout's sampling: verl's sampling dict (vLLM's vocabulary) normalised
(:func:`parse_sampling`), turned into a transformers ``GenerationConfig``
(:meth:`Sampling.generation_config`) and the processor that draws each token
(:meth:`Sampling.logits_processors`), and the stop ids of a checkpoint (:func:`eos_ids_of`).
Used by ``hf_rollout``'s server; imports neither verl nor Ray.

**Why the draw is ours.** transformers' sampling step sorts the whole vocabulary for top-p and
draws with ``torch.multinomial`` over the whole vocabulary, which cost more than the tiny model's
forward passes: 128 sequences x 64 tokens over the embedded model's 7,808-entry vocabulary took
4.8-5.2 s with transformers' draw and 1.4-1.6 s with ours (2 threads;
``benchmarks/bench_hf_rollout_batch.py``). :func:`draw_top_k_top_p` draws from the same
distribution (temperature, then top-k, then top-p over what top-k kept, as vLLM's and transformers'
samplers do; not CosyVoice's nucleus, ``ttsrl.model.cosyvoice_lm._nucleus``, whose top-p counts mass
over the whole distribution before the top-k cap) working on the top-k entries only; ``generate`` then runs greedy over scores that
are finite at the drawn token alone. Log-probabilities are still taken from the raw logits
(``hf_rollout``), as the actor computes them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Sampling:
    """The sampling parameters verl's agent loop sends, normalised."""

    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    max_tokens: int
    want_logprobs: bool
    ignore_eos: bool

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def generation_config(self, eos_ids: list[int], pad_id: int):
        """``generate``'s settings: always its greedy step, over :meth:`logits_processors`' scores
        when sampling (the processors run after transformers' own: repetition penalty, minimum
        length); the raw logits of each step are returned when log-probs are wanted."""
        from transformers import GenerationConfig

        return GenerationConfig(
            max_new_tokens=self.max_tokens,
            min_new_tokens=0,
            do_sample=False,
            repetition_penalty=self.repetition_penalty,
            eos_token_id=None if self.ignore_eos else list(eos_ids),
            pad_token_id=pad_id,
            num_beams=1,
            return_dict_in_generate=True,
            output_logits=self.want_logprobs,
        )

    def logits_processors(self) -> list:
        """For ``generate(logits_processor=...)``: none when greedy, else one that draws the token."""
        if self.greedy:
            return []
        from transformers import LogitsProcessor

        sampling = self

        class DrawToken(LogitsProcessor):
            def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
                token = draw_top_k_top_p(scores, sampling.temperature, sampling.top_k, sampling.top_p)
                return torch.full_like(scores, float("-inf")).scatter_(-1, token.unsqueeze(-1), 0.0)

        return [DrawToken()]


def top_k_top_p_candidates(scores: torch.Tensor, temperature: float, top_k: int,
                           top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidates of each row and their logits: ``scores / temperature``, the ``top_k`` largest
    (all when ``top_k`` <= 0), then of those the smallest prefix, largest first, whose probability
    mass reaches ``top_p`` (a candidate is dropped once the mass before it is >= ``top_p``: the
    rule of vLLM's and transformers' top-p, which drop the low tail whose total is <= 1 - top_p;
    the most likely one is always kept). Returns (logits, vocabulary ids), largest first, with
    ``-inf`` logits for the dropped candidates."""
    x = scores.float() / temperature
    k = top_k if 0 < top_k < x.shape[-1] else x.shape[-1]
    logits, ids = torch.topk(x, k, dim=-1)
    if 0.0 < top_p < 1.0:
        probs = logits.softmax(-1)
        before = probs.cumsum(-1) - probs
        logits = logits.masked_fill(before >= top_p, float("-inf"))
    return logits, ids


def draw_top_k_top_p(scores: torch.Tensor, temperature: float, top_k: int, top_p: float,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of ``scores`` (batch x vocabulary), drawn from the softmax of
    :func:`top_k_top_p_candidates` with ``torch.multinomial`` (torch's global generator unless
    ``generator``: the hf rollout seeds it as verl seeds vLLM)."""
    logits, ids = top_k_top_p_candidates(scores, temperature, top_k, top_p)
    pick = torch.multinomial(logits.softmax(-1), 1, generator=generator)
    return ids.gather(-1, pick).squeeze(-1)


def parse_sampling(params: dict[str, Any], default_max_tokens: int, room: int) -> Sampling:
    """verl's sampling dict (vLLM vocabulary) -> Sampling.

    ``room`` is what the context length leaves for this prompt."""
    params = dict(params)
    max_tokens = params.pop("max_tokens", params.pop("max_new_tokens", default_max_tokens))
    max_tokens = max(1, min(int(max_tokens), room))
    top_k = params.get("top_k", -1)
    return Sampling(
        temperature=float(params.get("temperature", 1.0)),
        top_p=float(params.get("top_p", 1.0)),
        top_k=-1 if top_k is None else int(top_k),
        repetition_penalty=float(params.get("repetition_penalty", 1.0) or 1.0),
        max_tokens=max_tokens,
        want_logprobs=bool(params.get("logprobs", False)),
        ignore_eos=bool(params.get("ignore_eos", False)),
    )


def eos_ids_of(model_config) -> list[int]:
    """Stop ids: the checkpoint's generation_config eos ids, else the tokenizer's."""
    ids: list[int] = []
    gen = getattr(model_config, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos is not None:
        ids = [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
    tok = getattr(model_config, "tokenizer", None)
    if not ids and tok is not None and tok.eos_token_id is not None:
        ids = [int(tok.eos_token_id)]
    if not ids:
        raise ValueError(f"no eos id in generation_config or tokenizer of {model_config.local_path}")
    return ids
