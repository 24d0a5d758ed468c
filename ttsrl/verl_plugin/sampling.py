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

    def logits_processors(self, rule: RuleDraw | None = None) -> list:
        """For ``generate(logits_processor=...)``: none when greedy, else one that draws the token:
        by top-k/top-p, or by ``rule`` (CosyVoice's rule: ``GRPOConfig.rollout_rule``)."""
        if self.greedy:
            return []
        if rule is not None:
            if self.temperature != 1.0:
                raise ValueError(f"the rollout rule {rule.cfg.rule} draws at temperature 1.0 (CosyVoice's rules "
                                 f"have none), the rollout asked {self.temperature}")
            return [rule.processor(self.top_p, self.top_k)]
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


@dataclass(frozen=True)
class RuleDraw:
    """Rollouts drawn by one of CosyVoice's sampling rules (``ttsrl.model.cosyvoice_lm``), the rule stage 4
    scores with, instead of plain top-k/top-p: repetition-aware sampling redraws a nucleus pick already made
    in the last ``win_size`` codes from the rest of the distribution, which a policy trained without it
    never meets. Each step draws as ``ttsrl.model.cosyvoice_lm.pick_token`` does, over the family's
    outputs, with the request's top-p and top-k (:meth:`draw`); the window is the codes the request has
    generated (its prompt's speech codes are not in it, as they are not in CosyVoice's
    ``decoded_tokens``). No minimum length: stopping is allowed from
    the first code (the embedded presets' ratio is 0). The log-probs returned stay the policy's, as the
    actor computes them."""

    cfg: Any  # ttsrl.model.cosyvoice_lm.SamplingConfig: its rule, win_size and tau_r are used
    speech_offset: int  # the HF id of output index 0
    num_outputs: int
    eos_index: int

    @classmethod
    def of(cls, rule: str, hf_config) -> RuleDraw:
        """The rule ``rule`` for a converted checkpoint (``config.json``'s ``speech_output_range`` and
        ``speech_family``, which the converter writes)."""
        from ttsrl.model import vocab as V
        from ttsrl.model.cosyvoice_lm import SamplingConfig, check_rule_family, family_of_rule

        output_range = getattr(hf_config, "speech_output_range", None)
        name = getattr(hf_config, "speech_family", None)
        if output_range is None or name is None:
            raise ValueError(f"the rollout rule {rule} needs a converted CosyVoice checkpoint: its config.json has "
                             "no speech_output_range/speech_family")
        fam = V.family(name)
        check_rule_family(rule, fam)
        if family_of_rule(rule)[1] != "2026":
            raise ValueError(f"rollouts are drawn by a family's current rule (kind 2026), not {rule}")
        if int(output_range[1]) - int(output_range[0]) != fam.num_outputs:
            raise ValueError(f"speech_output_range {list(output_range)} is not {fam.num_outputs} outputs ({name})")
        return cls(SamplingConfig(rule=rule, min_token_text_ratio=0.0), int(output_range[0]), fam.num_outputs,
                   fam.eos_index)

    def draw(self, scores: torch.Tensor, generated: torch.Tensor, top_p: float, top_k: int,
             generator: torch.Generator | None = None) -> torch.Tensor:
        """One output index per row, drawn as ``pick_token`` draws (rule of kind "2026", stops allowed):
        a nucleus pick among the top-k (CosyVoice's nucleus: mass counted over the whole distribution),
        and where that pick is in the row's window, a redraw from the full distribution without it.
        Vectorised over the batch and working on the top-k entries but for the redraw rows: building the
        rule's distribution (``rule_distributions``, which the vLLM path must) sorts every row's 6,564
        outputs a step, which doubled a step's time. A redraw row with no mass left (its one possible
        pick blocked) ends with eos, as in vLLM."""
        k = top_k if 0 < top_k < self.num_outputs else self.num_outputs
        p = scores[:, self.speech_offset:self.speech_offset + self.num_outputs].float().softmax(-1)
        top, ids = torch.topk(p, k, dim=-1)
        keep = (top.cumsum(-1) - top) < top_p
        keep[:, 0] = True
        pick = ids.gather(-1, torch.multinomial(torch.where(keep, top, 0.0), 1, generator=generator)).squeeze(-1)
        from ttsrl.model.cosyvoice_lm import repeated_mask

        # each row's window as output indices (ids that are none, such as the padding after a finished row's
        # stop, count for nothing)
        windows = [[t - self.speech_offset for t in row if 0 <= t - self.speech_offset < self.num_outputs]
                   for row in generated[:, -self.cfg.win_size:].tolist()]
        rows = torch.nonzero(repeated_mask(windows, self.cfg).gather(-1, pick[:, None]).squeeze(-1)).flatten()
        if len(rows):
            rest = p[rows].scatter(-1, pick[rows, None], 0.0)
            empty = ~(rest.sum(-1) > 0)
            rest[empty, self.eos_index] = 1.0
            pick[rows] = torch.multinomial(rest, 1, generator=generator).squeeze(-1)
        return pick

    def processor(self, top_p: float, top_k: int):
        """A ``LogitsProcessor`` that draws each token by the rule (one per ``generate`` call: it takes the
        input's width at the first step as the prompt's)."""
        from transformers import LogitsProcessor

        draw = self

        class DrawByRule(LogitsProcessor):
            prompt_width: int | None = None

            def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
                if self.prompt_width is None:
                    self.prompt_width = input_ids.shape[1]
                token = draw.speech_offset + draw.draw(scores, input_ids[:, self.prompt_width:], top_p, top_k)
                return torch.full_like(scores, float("-inf")).scatter_(-1, token.unsqueeze(-1), 0.0)

        return DrawByRule()


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
