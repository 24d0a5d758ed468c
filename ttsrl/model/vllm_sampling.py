"""CosyVoice's sampling rules inside vLLM 0.24's sampler (a V1 logits processor).

vLLM's sampler has no repetition-aware sampling, but it draws exactly from the
distribution its logits give it. One step of ``ttsrl.model.cosyvoice_lm.pick_token`` is
a distribution in closed form (``rule_distributions``, formulas above it), so this
processor writes its log into the request's logits and vLLM's own draw (temperature
1.0, no top-k/top-p, no penalties) then follows the rule. Per request:

    SamplingParams(temperature=1.0, top_p=1.0, top_k=0, min_tokens=0,
                   extra_args=rule_args(sampling, min_len, greedy=False), ...)

Only requests that carry :data:`EXTRA_ARGS_KEY` are touched. The processor owns the
minimum length: vLLM's ``min_tokens`` runs before custom processors and would set every
stop row to -inf in the scores the rule starts from (rule 2026 blocks only eos 6561, and
rule 2024's nucleus is taken over the stop rows too), so it must stay 0. Greedy requests
(temperature 0) get only the rule's rows held before the minimum length
(``held_before_min_len``).

The window is the request's generated tokens, read through the live reference to its
output token ids that vLLM hands over in ``BatchUpdate.added``. Where ``pick_token`` can
only raise (rule 2024: ``max_trials`` stop draws in a row), vLLM draws from the rule's
distribution conditioned on not raising, i.e. with ``max_trials`` unbounded; a step with
nothing at all to draw from ends the item with eos.

Passed to ``vllm.LLM(logits_processors=[PROCESSOR])`` by :class:`ttsrl.model.generate.VLLMGenerator`.
vLLM-only imports: import this module lazily.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from ttsrl.model import vocab as V
from ttsrl.model.cosyvoice_lm import (
    SamplingConfig,
    check_rule_family,
    held_before_min_len,
    repeated_mask,
    rule_distributions,
)

PROCESSOR = "ttsrl.model.vllm_sampling:CosyVoiceRuleProcessor"
EXTRA_ARGS_KEY = "ttsrl_cosyvoice_rule"


def rule_args(sampling: SamplingConfig, min_len: int, greedy: bool) -> dict[str, Any]:
    """``SamplingParams.extra_args`` that turn the processor on for one request."""
    return {EXTRA_ARGS_KEY: {"sampling": asdict(sampling), "min_len": int(min_len), "greedy": bool(greedy)}}


def rule_sampling_params(sampling: SamplingConfig, min_len: int, max_len: int, greedy: bool,
                         stop_ids: list[int], seed: int) -> SamplingParams:
    """vLLM sampling parameters under which a request follows ``sampling.rule``."""
    return SamplingParams(temperature=0.0 if greedy else 1.0, top_p=1.0, top_k=0, min_tokens=0,
                          max_tokens=max_len, stop_token_ids=list(stop_ids), seed=seed, detokenize=False,
                          extra_args=rule_args(sampling, min_len, greedy))


@dataclass(frozen=True)
class _Rule:
    """What the processor needs of one request (parsed from its ``extra_args``)."""

    sampling: SamplingConfig
    min_len: int
    greedy: bool

    @classmethod
    def of(cls, params: SamplingParams) -> _Rule | None:
        args = (params.extra_args or {}).get(EXTRA_ARGS_KEY)
        if args is None:
            return None
        return cls(SamplingConfig(**args["sampling"]), int(args["min_len"]), bool(args["greedy"]))


def _check_neutral(params: SamplingParams, greedy: bool) -> None:
    """Refuse settings under which vLLM would change the rule's distribution after (or,
    for min_tokens, before) the processor."""
    wrong = []
    if greedy != (params.temperature == 0.0):
        wrong.append(f"temperature={params.temperature} (greedy={greedy})")
    if not greedy and params.temperature != 1.0:
        wrong.append(f"temperature={params.temperature}")
    if params.top_p != 1.0 or params.top_k not in (0, -1) or params.min_p != 0.0:
        wrong.append(f"top_p={params.top_p}, top_k={params.top_k}, min_p={params.min_p}")
    if params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
        wrong.append("penalties")
    if params.min_tokens:
        wrong.append(f"min_tokens={params.min_tokens}")
    if params.logit_bias or params.allowed_token_ids or params.bad_words:
        wrong.append("logit_bias/allowed_token_ids/bad_words")
    if wrong:
        raise ValueError(f"CosyVoice2 rule requests need vLLM's sampler neutral, got {'; '.join(wrong)}")


@dataclass
class _Active:
    rule: _Rule
    output_ids: list[int]  # vLLM's live list of the request's generated token ids


class CosyVoiceRuleProcessor(LogitsProcessor):
    """Writes log P of CosyVoice2's sampling rule into the logits of the requests that ask for it."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        try:
            rule = _Rule.of(sampling_params)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"bad extra_args[{EXTRA_ARGS_KEY!r}]: {e}") from e
        if rule is not None:
            _check_neutral(sampling_params, rule.greedy)

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        hf_config = vllm_config.model_config.hf_config
        output_range = getattr(hf_config, "speech_output_range", None)
        name = getattr(hf_config, "speech_family", None)
        if output_range is None or name is None:  # the converter writes both, and every step keeps its config
            raise ValueError("CosyVoiceRuleProcessor needs a converted CosyVoice checkpoint "
                             f"(config.json without {'speech_output_range' if output_range is None else 'speech_family'})")
        self.vocab = V.SpeechVocab(int(output_range[0]), V.family(name))
        if tuple(int(x) for x in output_range) != self.vocab.output_range:
            raise ValueError(f"speech_output_range {list(output_range)} is not {self.vocab.num_outputs} outputs "
                             f"({self.vocab.family.name})")
        self.device = device
        self.active: dict[int, _Active] = {}  # batch row -> request state

    def is_argmax_invariant(self) -> bool:
        return False  # it changes what argmax picks (held stop rows), so it must run before greedy sampling

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.active, batch_update, self._new_request)

    @staticmethod
    def _new_request(params: SamplingParams, _prompt_ids: list[int] | None, output_ids: list[int]) -> _Active | None:
        rule = _Rule.of(params)
        return None if rule is None else _Active(rule, output_ids)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        groups: dict[tuple[SamplingConfig, bool], list[int]] = {}
        for row, act in self.active.items():
            groups.setdefault((act.rule.sampling, act.rule.greedy), []).append(row)
        for (sampling, greedy), rows in groups.items():
            if greedy:
                self._hold_stops(logits, rows, sampling)
            else:
                self._write_rule(logits, rows, sampling)
        return logits

    def _allow_stop(self, rows: list[int]) -> list[bool]:
        return [len(self.active[r].output_ids) >= self.active[r].rule.min_len for r in rows]

    def _hold_stops(self, logits: torch.Tensor, rows: list[int], sampling: SamplingConfig) -> None:
        """Greedy: before the minimum length the rule's held rows are -inf (argmax skips them)."""
        held = [self.vocab.to_hf(i) for i in held_before_min_len(sampling.rule)]
        for row, allow in zip(rows, self._allow_stop(rows)):
            if not allow:
                logits[row, held] = -float("inf")

    def _write_rule(self, logits: torch.Tensor, rows: list[int], sampling: SamplingConfig) -> None:
        """Sampling: row := log P of the rule over the speech/stop ids, -inf elsewhere."""
        check_rule_family(sampling.rule, self.vocab.family)
        start, end = self.vocab.output_range
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        logp = logits[index, start:end].float().log_softmax(dim=-1)
        windows = [[self.vocab.to_index(t) for t in self.active[r].output_ids[-sampling.win_size:]] for r in rows]
        allow = torch.tensor(self._allow_stop(rows), device=logits.device)
        probs = rule_distributions(logp, repeated_mask(windows, sampling, logits.device), allow, sampling)
        probs = _end_when_empty(probs, self.vocab.eos_index)
        new = torch.full((len(rows), logits.shape[-1]), -float("inf"), dtype=logits.dtype, device=logits.device)
        new[:, start:end] = probs.log().to(logits.dtype)
        logits[index] = new


def _end_when_empty(probs: torch.Tensor, eos_index: int) -> torch.Tensor:
    """Rows with no mass to draw from (pick_token would only raise) put all of it on eos."""
    total = probs.sum(dim=-1, keepdim=True)
    eos = torch.zeros_like(probs)
    eos[:, eos_index] = 1.0
    return torch.where(torch.isfinite(total) & (total > 0), probs, eos)
