"""The ``hf`` rollout's sampling: verl's sampling dict (vLLM's vocabulary) normalised
(:func:`parse_sampling`), turned into a transformers ``GenerationConfig``
(:meth:`Sampling.generation_config`), and the stop ids of a checkpoint
(:func:`eos_ids_of`). Used by ``hf_rollout``'s server; imports neither verl nor Ray."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
        from transformers import GenerationConfig

        kwargs: dict[str, Any] = dict(
            max_new_tokens=self.max_tokens,
            min_new_tokens=0,
            do_sample=not self.greedy,
            repetition_penalty=self.repetition_penalty,
            eos_token_id=None if self.ignore_eos else list(eos_ids),
            pad_token_id=pad_id,
            num_beams=1,
        )
        if not self.greedy:
            kwargs.update(temperature=self.temperature,
                          top_p=self.top_p if 0.0 < self.top_p < 1.0 else 1.0,
                          top_k=self.top_k if self.top_k > 0 else 0)
        else:
            kwargs.update(temperature=1.0, top_p=1.0, top_k=0)
        return GenerationConfig(**kwargs)


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
