"""CosyVoice's text-to-speech-token LM (``Qwen2LM``), re-implemented faithfully, for any family.

This is the reference the Hugging Face conversion is checked against, and the way
tiny checkpoints in CosyVoice2's own ``llm.pt`` format are made. Module names match
CosyVoice (cosyvoice/llm/llm.py) so ``state_dict()`` has exactly the keys of a
released ``llm.pt``:

    llm_embedding.weight                 (2, H)     row 0 = sos, row 1 = task_id
    llm.model.model.embed_tokens.weight  (V, H)     inner Qwen2 (text embeddings)
    llm.model.model.layers.{i}.*                    inner Qwen2 blocks
    llm.model.model.norm.weight
    llm.model.lm_head.weight             (V, H)     tied to embed_tokens, unused
    llm_decoder.weight / .bias           (6564, H)  speech-token head (with bias)
    speech_embedding.weight              (6564, H)

Sequence layout (unistream): ``[sos] + text + [task_id] + speech``. Another family's LM is this
class with that family's layout (:func:`lm_class`: its head size and bias, where sos/task_id live,
its stop rows); the sampling rules run here, each family names its own (``Family.rules``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
from torch import nn

from ttsrl.cli import add_fields, given, option
from ttsrl.families import DEFAULT_FAMILY, Family, family, family_of_rule, family_of_state, sampling_rules

IGNORE_ID = -1


class Qwen2Encoder(nn.Module):
    """Holds the inner ``Qwen2ForCausalLM`` under the attribute name CosyVoice uses."""

    def __init__(self, config):
        super().__init__()
        from transformers import Qwen2ForCausalLM

        self.model = Qwen2ForCausalLM(config)

    def forward(self, inputs_embeds, attention_mask=None, past_key_values=None, use_cache=False):
        out = self.model.model(inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                               past_key_values=past_key_values, use_cache=use_cache)
        return out.last_hidden_state, out.past_key_values


# Sampling rules, by name: each family declares its own (its folder's docstring says what each
# does and which upstream commit it follows); a rule is of one kind:
#   "2026": before the minimum length the family's ``min_len_held`` rows are -inf, one draw;
#       repetition-aware sampling blocks the repeated pick in its redraw (-inf in place);
#   "2024": the repeated pick is not blocked in the redraw, and before the minimum length any stop
#       index is rejected and the whole draw repeated, at most max_trials times, then SamplingError.
# A rule belongs to one family (its stop rows); a generator refuses a rule of another family.
SAMPLING_RULES = sampling_rules()  # the command-line choices (families registered at import)


def rule_family(rule: str) -> Family:
    """The family whose stop rows the rule holds back."""
    return family_of_rule(rule)[0]


def default_rule(fam: Family | str) -> str:
    return family(fam).default_rule


def _is_2026(rule: str) -> bool:
    return family_of_rule(rule)[1] == "2026"


def check_rule_family(rule: str, fam: Family) -> None:
    """Refuse sampling a model of family ``fam`` with another family's rule."""
    if rule_family(rule) is not fam:
        raise ValueError(f"sampling rule {rule} is {rule_family(rule).name}'s, but the model is {fam.name}: use "
                         f"--sampling-rule {fam.default_rule} (rules: {', '.join(sampling_rules())})")


@dataclass(frozen=True)
class SamplingConfig:
    """CosyVoice2's inference defaults (cosyvoice2.yaml / Qwen2LM.inference). Each field's
    help is its command-line option in every CLI that samples (:func:`add_sampling_args`)."""

    top_p: float = option(0.8, help="nucleus sampling: keep the most likely tokens until their mass reaches this")
    top_k: int = option(25, help="nucleus sampling: keep at most this many tokens")
    win_size: int = option(10, help="repetition-aware sampling window (last N tokens)")
    tau_r: float = option(0.1, help="repetition threshold (fraction of the window): a pick repeated this often "
                                    "is redrawn")
    min_token_text_ratio: float = option(2.0, help="minimum speech codes per text token (stop tokens refused "
                                                   "before)")
    max_token_text_ratio: float = option(20.0, help="maximum speech codes per text token")
    max_trials: int = option(100, cli=False, help="rule cosyvoice2-2024 only: redraws while stop tokens are not "
                                                  "allowed")
    rule: str = option(DEFAULT_FAMILY.default_rule, flag="--sampling-rule", choices=SAMPLING_RULES,
                       help="CosyVoice's sampling rule, one of the model family's own (each family's folder, "
                            "ttsrl/families/NAME/, says what its rules do): FAMILY-2026 = CosyVoice's current code, "
                            "cosyvoice2-2024 = the earlier rule (for comparison with older numbers)")

    def __post_init__(self):
        family_of_rule(self.rule)  # an unknown rule raises, naming the known ones


def add_sampling_args(parser) -> None:
    """The sampling options (one per ``SamplingConfig`` field) on ``parser`` or an argument group."""
    add_fields(parser, SamplingConfig)


def sampling_from_args(args) -> SamplingConfig:
    """The ``SamplingConfig`` of a command line parsed with :func:`add_sampling_args`."""
    return SamplingConfig(**given(args, SamplingConfig))


def _nucleus(probs: torch.Tensor, top_p: float, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CosyVoice's nucleus over the last dimension: (sorted probs, their indices, kept).
    Sorted descending (stable); entry i is kept while the mass before it is < ``top_p``
    and i < ``top_k``; the first entry always."""
    sorted_p, sorted_idx = probs.sort(dim=-1, descending=True, stable=True)
    mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    keep = (mass_before < top_p) & (torch.arange(sorted_p.shape[-1], device=probs.device) < top_k)
    keep[..., 0] = True
    return sorted_p, sorted_idx, keep


def nucleus_sampling(logp: torch.Tensor, top_p: float, top_k: int, generator=None) -> int:
    """Sample from the smallest head of the sorted distribution whose mass reaches
    ``top_p``, at most ``top_k`` entries (same rule as CosyVoice's loop)."""
    sorted_p, sorted_idx, keep = _nucleus(logp.float().softmax(dim=-1), top_p, top_k)
    kept_p = sorted_p[keep]
    choice = torch.multinomial(kept_p, 1, replacement=True, generator=generator)
    return int(sorted_idx[keep][choice])


def random_sampling(logp: torch.Tensor, generator=None) -> int:
    return int(torch.multinomial(logp.float().softmax(dim=-1), 1, replacement=True, generator=generator))


def _repeated(top: int, decoded: Sequence[int], cfg: SamplingConfig) -> bool:
    return list(decoded[-cfg.win_size:]).count(top) >= cfg.win_size * cfg.tau_r


def ras_sampling(logp: torch.Tensor, decoded: Sequence[int], cfg: SamplingConfig, generator=None) -> int:
    """Repetition-aware sampling (VALL-E 2 / CosyVoice2): nucleus sampling, but a
    token already repeated often in the last ``win_size`` steps is redrawn from the
    full distribution. Rule ``cosyvoice2-2026`` blocks the repeated token in that
    redraw by writing -inf into ``logp`` IN PLACE (as CosyVoice's ras_sampling does on
    its ``weighted_scores``); pass a tensor you own. Rule ``cosyvoice2-2024`` does not."""
    top = nucleus_sampling(logp, cfg.top_p, cfg.top_k, generator)
    if _repeated(top, decoded, cfg):
        if _is_2026(cfg.rule):
            logp[top] = -float("inf")
        top = random_sampling(logp, generator)
    return top


class SamplingError(RuntimeError):
    """Rule cosyvoice2-2024 only: nothing but stop tokens was drawn in ``max_trials``
    draws while the minimum length forbids stopping."""


def pick_token(logp: torch.Tensor, decoded: Sequence[int], allow_stop: bool, cfg: SamplingConfig,
               greedy: bool = False, generator: torch.Generator | None = None) -> int:
    """Next output index (0..N-1) from one step's log-probs over the family's N outputs.

    The one place the sampling rule lives (``cfg.rule``, see ``SAMPLING_RULES``): the
    batched generator, the reference ``Qwen2LM.inference`` and the vLLM path call it.
    ``allow_stop`` is False before the minimum length. ``logp`` itself is not changed:
    the rule's -inf writes go to this step's own copy of the scores, which every later
    draw of the step then uses (CosyVoice writes into its step's scores in place).

    A rule of kind "2026": before the minimum length the family's ``min_len_held`` rows are
    -inf, then repetition-aware sampling once. Kind "2024": repetition-aware sampling,
    redrawn while a stop index comes out before the minimum length, at most
    ``max_trials`` times, then :class:`SamplingError`. Greedy (not a CosyVoice mode):
    argmax over the same rows the rule allows."""
    if greedy:
        scores = logp.detach().float().clone()
        if not allow_stop:
            scores[list(held_before_min_len(cfg.rule))] = -float("inf")
        return int(scores.argmax())
    if _is_2026(cfg.rule):
        scores = logp.detach().float().clone()  # this step's scores; written in place below
        if not allow_stop:
            scores[list(rule_family(cfg.rule).min_len_held)] = -float("inf")
        return ras_sampling(scores, decoded, cfg, generator)
    for _ in range(cfg.max_trials):
        top = ras_sampling(logp, decoded, cfg, generator)
        if allow_stop or top < rule_family(cfg.rule).speech_token_size:
            return top
    raise SamplingError(f"sampled only stop tokens in {cfg.max_trials} trials before the minimum length")


def held_before_min_len(rule: str) -> tuple[int, ...]:
    """Output indices that argmax decoding may not pick before the minimum length: the
    family's ``min_len_held`` under a rule of kind "2026", every stop index under "2024"."""
    fam = rule_family(rule)
    return fam.min_len_held if _is_2026(rule) else fam.stop_indices


# ---- one step of the rule as a distribution ------------------------------------------
# pick_token's draw for one step has a closed form, so an engine whose sampler can only
# draw from the logits it is given (vLLM) follows the rule exactly by drawing from it
# (ttsrl/model/vllm_sampling.py). With p = softmax of the step's scores (2026: eos row
# -inf before the minimum length), q = the nucleus distribution of p (the entries
# _nucleus keeps, renormalised) and R = the indices that count as repeated in the window
# (_repeated):
#
#   cosyvoice2-2026: a nucleus pick t outside R is the token; a pick t in R is blocked and
#       the token redrawn from p without t:
#           P(x) = q(x)[x∉R] + Σ_{t∈R} q(t) p(x) [x≠t] / (1 − p(t))
#   cosyvoice2-2024: the redraw does not block t:
#           D(x) = q(x)[x∉R] + (Σ_{t∈R} q(t)) p(x)
#       from the minimum length on P = D. Before it a stop index (S = Σ_{s stop} D(s))
#       rejects the whole draw, at most M = max_trials draws, so for a speech token x
#           P(x) = D(x) (1 + S + ... + S^(M−1)) = D(x) (1 − S^M) / (1 − S)
#       and with probability S^M pick_token raises SamplingError instead.
#
# The P returned sums to 1 − P(pick_token raises): S^M above, or (2026) the nucleus mass
# of repeated picks t with p(t) = 1, whose redraw has nothing left to draw from.


def repeated_mask(decoded: Sequence[Sequence[int]], cfg: SamplingConfig,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """(B, N) bool: True at the indices a nucleus pick would count as repeated
    (:func:`_repeated`) after row b's decoded output indices ``decoded[b]``."""
    rows: list[int] = []
    cols: list[int] = []
    for b, seq in enumerate(decoded):
        window = list(seq[-cfg.win_size:])
        rows += [b] * len(window)
        cols += window
    counts = torch.zeros((len(decoded), rule_family(cfg.rule).num_outputs), dtype=torch.float64, device=device)
    index = (torch.tensor(rows, dtype=torch.long, device=device), torch.tensor(cols, dtype=torch.long, device=device))
    counts.index_put_(index, torch.ones(len(rows), dtype=torch.float64, device=device), accumulate=True)
    return counts >= cfg.win_size * cfg.tau_r


def _nucleus_distribution(probs: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """q: ``probs`` kept by :func:`_nucleus` (the set nucleus_sampling draws from), renormalised (float64)."""
    sorted_p, sorted_idx, keep = _nucleus(probs, top_p, top_k)
    kept = torch.where(keep, sorted_p, 0.0).double()
    kept = kept / kept.sum(dim=-1, keepdim=True)
    return torch.zeros_like(kept).scatter(-1, sorted_idx, kept)


def _sum_except(v: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """Σ_{t≠x} v(t) for every x of the last dimension. At x = ``top``, the entry that may
    hold nearly all of the sum, it is summed from the others: total − v(x) would lose
    its digits there."""
    others = v.sum(dim=-1, keepdim=True) - v
    return others.scatter(-1, top, v.scatter(-1, top, 0.0).sum(dim=-1, keepdim=True))


def _ras_2026(p: torch.Tensor, q: torch.Tensor, repeated: torch.Tensor) -> torch.Tensor:
    top = p.argmax(dim=-1, keepdim=True)  # the only t that can have p(t) > 1/2
    rest = _sum_except(p, top)  # 1 − p(t)
    w = torch.where(repeated & (rest > 0), q / rest, 0.0)  # q(t) / (1 − p(t)) for t in R
    return torch.where(repeated, 0.0, q) + p * _sum_except(w, top)


def _ras_2024(p: torch.Tensor, q: torch.Tensor, repeated: torch.Tensor) -> torch.Tensor:
    return torch.where(repeated, 0.0, q) + torch.where(repeated, q, 0.0).sum(dim=-1, keepdim=True) * p


def _reject_stops(d: torch.Tensor, max_trials: int, n_speech: int) -> torch.Tensor:
    """Rule 2024 before the minimum length: ``d`` redrawn while a stop index comes out,
    at most ``max_trials`` draws: D(x) (1 − S^M) / (1 − S) on the speech tokens."""
    out = torch.zeros_like(d)
    if max_trials <= 0:
        return out
    speech = d[..., :n_speech]
    go = speech.sum(dim=-1, keepdim=True)  # 1 − S, summed from the speech rows
    drawn = -torch.expm1(max_trials * torch.log1p(-go))  # 1 − S^M
    out[..., :n_speech] = speech * torch.where(go > 0, drawn / go, 0.0)
    return out


def rule_distributions(logp: torch.Tensor, repeated: torch.Tensor, allow_stop: torch.Tensor,
                       cfg: SamplingConfig) -> torch.Tensor:
    """P(pick_token returns x) for a batch of steps: ``logp`` (B, N) log-probs,
    ``repeated`` (B, N) from :func:`repeated_mask`, ``allow_stop`` (B,) bool.
    Returns (B, N) float64; a row sums to 1 minus the probability that pick_token
    raises (see the formulas above). Sampling only; greedy is :func:`held_before_min_len`."""
    scores = logp.detach().float().clone()
    fam = rule_family(cfg.rule)
    if _is_2026(cfg.rule):
        held = torch.zeros(scores.shape[-1], dtype=torch.bool, device=scores.device)
        held[list(fam.min_len_held)] = True
        scores.masked_fill_(~allow_stop[:, None] & held, -float("inf"))
    q = _nucleus_distribution(scores.softmax(dim=-1), cfg.top_p, cfg.top_k)  # float32 as nucleus_sampling
    p = scores.double().softmax(dim=-1)
    if _is_2026(cfg.rule):
        return _ras_2026(p, q, repeated)
    d = _ras_2024(p, q, repeated)
    return torch.where(allow_stop[:, None], d, _reject_stops(d, cfg.max_trials, fam.speech_token_size))


def rule_distribution(logp: torch.Tensor, decoded: Sequence[int], allow_stop: bool,
                      cfg: SamplingConfig) -> torch.Tensor:
    """The distribution of ``pick_token(logp, decoded, allow_stop, cfg)`` (sampling) over
    the 6564 outputs, float64; its sum falls short of 1 by the probability that it raises."""
    allow = torch.tensor([allow_stop], device=logp.device)
    return rule_distributions(logp[None], repeated_mask([decoded], cfg, logp.device), allow, cfg)[0]


class Qwen2LM(nn.Module):
    """CosyVoice2's LM, upstream's ``Qwen2LM``; :func:`lm_class` gives another family's."""

    family: Family = family("cosyvoice2")

    def __init__(self, qwen2_config):
        super().__init__()
        fam = self.family
        h = qwen2_config.hidden_size
        self.llm_input_size = h
        self.llm_output_size = h
        self.speech_token_size = fam.speech_token_size
        if fam.input_embedding == "llm_embedding":
            self.llm_embedding = nn.Embedding(2, h)
        self.llm = Qwen2Encoder(qwen2_config)
        self.llm_decoder = nn.Linear(h, fam.num_outputs, bias=fam.head_bias)
        self.speech_embedding = nn.Embedding(fam.num_outputs, h)
        self.stop_token_ids = list(fam.stop_indices)

    # ---- construction ----------------------------------------------------------
    @classmethod
    def from_pretrained(cls, cosyvoice_dir: str | Path, dtype=torch.float32, llm_file: str = "llm.pt") -> "Qwen2LM":
        """Load ``DIR/llm.pt`` (or ``llm_file``) with the inner config from ``DIR/CosyVoice-BlankEN``."""
        from transformers import AutoConfig

        d = Path(cosyvoice_dir)
        config = AutoConfig.from_pretrained(d / "CosyVoice-BlankEN")
        model = cls(config)
        state = load_llm_state_dict(d / llm_file)
        model.load_state_dict(state, strict=True)
        return model.to(dtype).eval()

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.llm.model.model.embed_tokens

    def input_vectors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sos, task_id) embeddings, each (1, H): ``llm_embedding`` rows 0 and 1 (CosyVoice2)
        or the sos and task_id rows of ``speech_embedding`` (CosyVoice3)."""
        key, rows = self.family.input_rows()
        w = self.llm_embedding.weight if key == "llm_embedding.weight" else self.speech_embedding.weight
        return w[rows[0]: rows[0] + 1], w[rows[1]: rows[1] + 1]

    # ---- teacher-forced forward -----------------------------------------------
    def build_inputs(self, text_ids: Sequence[int], speech: Sequence[int]) -> torch.Tensor:
        """Embeddings of ``[sos] + text + [task_id] + speech`` for one utterance: (1, T, H)."""
        dev = self.speech_embedding.weight.device
        text = self.embed_tokens(torch.tensor(list(text_ids), dtype=torch.long, device=dev))
        sp = self.speech_embedding(torch.tensor(list(speech), dtype=torch.long, device=dev))
        sos, task = self.input_vectors()
        return torch.cat([sos, text, task, sp], dim=0).unsqueeze(0)

    def forward_logits(self, text_ids: Sequence[int], speech: Sequence[int]) -> torch.Tensor:
        """Logits over the family's outputs at every position: (T, num_outputs), T = len(text)+2+len(speech)."""
        hidden, _ = self.llm(self.build_inputs(text_ids, speech))
        return self.llm_decoder(hidden[0])

    def loss(self, text_ids: Sequence[int], speech: Sequence[int]) -> torch.Tensor:
        """The family's training loss for one utterance: cross-entropy on the speech
        part, targets ``speech + [eos]``, IGNORE for sos/text."""
        logits = self.forward_logits(text_ids, speech)
        n_text = len(text_ids) + 1  # sos + text; the task_id position predicts speech[0]
        target = torch.tensor([IGNORE_ID] * n_text + list(speech) + [self.family.eos_index], device=logits.device)
        return nn.functional.cross_entropy(logits, target, ignore_index=IGNORE_ID)

    # ---- inference -------------------------------------------------------------
    @torch.inference_mode()
    def inference(self, text_ids: Sequence[int], prompt_text_ids: Sequence[int] = (),
                  prompt_speech: Sequence[int] = (), sampling: SamplingConfig | None = None,
                  generator: torch.Generator | None = None, greedy: bool = False) -> Iterator[int]:
        """Yield speech codes as CosyVoice does: prompt text is prepended to the text,
        prompt speech follows task_id; before ``min_len`` the stop rows are held back
        by ``sampling.rule`` (see :func:`pick_token`; default the family's rule); a drawn
        stop token ends generation; at most ``max_len`` codes. Lengths count the target text only."""
        sampling = sampling or SamplingConfig(rule=self.family.default_rule)
        check_rule_family(sampling.rule, self.family)
        n_text = len(text_ids)
        lm_input = self.build_inputs(list(prompt_text_ids) + list(text_ids), prompt_speech)
        min_len = int(n_text * sampling.min_token_text_ratio)
        max_len = int(n_text * sampling.max_token_text_ratio)
        out: list[int] = []
        cache = None
        for i in range(max_len):
            hidden, cache = self.llm(lm_input, past_key_values=cache, use_cache=True)
            logp = self.llm_decoder(hidden[0, -1]).log_softmax(dim=-1)
            top = pick_token(logp, out, i >= min_len, sampling, greedy, generator)
            if top in self.stop_token_ids:
                break
            yield top
            out.append(top)
            lm_input = self.speech_embedding.weight[top].reshape(1, 1, -1)


_LM_CLASSES: dict[str, type[Qwen2LM]] = {Qwen2LM.family.name: Qwen2LM}


def lm_class(fam: Family | str) -> type[Qwen2LM]:
    """The family's LM class: :class:`Qwen2LM` with its layout, named as upstream names it
    (``CosyVoice3LM``); state-dict keys are upstream's."""
    f = family(fam)
    cls = _LM_CLASSES.get(f.name)
    if cls is None or cls.family is not f:
        cls = _LM_CLASSES[f.name] = type(f.upstream_class, (Qwen2LM,), {"family": f, "__doc__": (
            f"{f.name}'s LM (upstream {f.upstream_class}): {f.num_outputs} outputs, "
            f"sos/task_id in {f.input_rows()[0]}, head bias {f.head_bias}.")})
    return cls


__all__ = ["IGNORE_ID", "Qwen2LM", "SamplingConfig", "SamplingError", "family_of_state", "lm_class",
           "load_llm_state_dict", "pick_token", "rule_distribution", "rule_distributions"]


def load_llm_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Read ``llm.pt`` memory-mapped, with a clear error for a file that is not one."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (expected a CosyVoice2 or CosyVoice3 llm.pt)")
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # corrupt zip, truncated file, pickle with code...
        raise ValueError(f"{path}: cannot be read as a PyTorch state dict ({type(e).__name__}: {e})") from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path}: expected a dict of tensors (a state_dict), got {type(state).__name__}")
    return state
