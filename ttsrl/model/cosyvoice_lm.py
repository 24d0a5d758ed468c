"""CosyVoice2's text-to-speech-token LM (``Qwen2LM``), re-implemented faithfully.

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

Sequence layout (unistream): ``[sos] + text + [task_id] + speech``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
from torch import nn

from ttsrl.cli import add_fields, given, option
from ttsrl.model.vocab import COSYVOICE2, COSYVOICE3, SOS_ROW, TASK_ID_ROW, Family

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


# Sampling rules, by name. CosyVoice changed its sampling twice in February 2026; the
# default follows its current code, the older rule stays selectable so numbers made
# with it (our sweeps before this change, CosyVoice releases before 2026-02) can be
# reproduced.
#
#   "cosyvoice2-2026" (default): CosyVoice's current code, read at FunAudioLLM/CosyVoice
#       ace7c47 (2026-03-16):
#       - cosyvoice/utils/common.py ras_sampling, commit f2ddcbe ("fix ras", 2026-02-04):
#         when the nucleus pick already occurs >= win_size * tau_r times in the last
#         win_size tokens, ITS SCORE IS SET TO -inf and a token is drawn from the full
#         distribution of the remaining scores;
#       - cosyvoice/llm/llm.py TransformerLM.sampling_ids, commit 0e62489 ("simply code",
#         2026-02-11): before the minimum length the score of row speech_token_size
#         (6561, the trained eos) is set to -inf and ONE draw is made. Only that row: the
#         other stop rows (6562, 6563) stay drawable and, as in Qwen2LM.inference, end
#         the utterance when drawn.
#       Both writes are in place on the step's scores, so the eos block also holds in the
#       repetition redraw.
#   "cosyvoice2-2024": the rule before those commits: the repeated nucleus pick is NOT
#       blocked in the redraw, and before the minimum length any stop index (6561..6563)
#       is rejected and the whole draw repeated, at most max_trials times, then
#       SamplingError.
#   "cosyvoice3-2026": CosyVoice3LM at ace7c47 samples with the same ras_sampling and the same
#       sampling_ids, whose min-length write hits row 6561, which for CosyVoice3 is sos, not its
#       eos (6562): upstream's HF loop can stop before the minimum length on any of the 199 other
#       stop rows, while its vLLM path (SamplingParams min_tokens, stop_token_ids = all 200)
#       cannot. This rule takes the consistent reading: before the minimum length every stop
#       row (6561..6760) is -inf (Family.min_len_held), one draw.
# A rule belongs to one family (its stop rows); a generator refuses a rule of another family.
RULE_2026 = "cosyvoice2-2026"
RULE_2024 = "cosyvoice2-2024"
RULE_COSYVOICE3 = "cosyvoice3-2026"
_RULES: dict[str, tuple[Family, str]] = {RULE_2026: (COSYVOICE2, "2026"), RULE_2024: (COSYVOICE2, "2024"),
                                         RULE_COSYVOICE3: (COSYVOICE3, "2026")}
SAMPLING_RULES = tuple(_RULES)
DEFAULT_RULE = {f.name: r for r, (f, kind) in reversed(_RULES.items()) if kind == "2026"}


def rule_family(rule: str) -> Family:
    """The family whose stop rows the rule holds back."""
    return _RULES[rule][0]


def _is_2026(rule: str) -> bool:
    return _RULES[rule][1] == "2026"


def check_rule_family(rule: str, fam: Family) -> None:
    """Refuse sampling a model of family ``fam`` with another family's rule."""
    if rule_family(rule) is not fam:
        raise ValueError(f"sampling rule {rule} is {rule_family(rule).name}'s, but the model is {fam.name}: use "
                         f"--sampling-rule {DEFAULT_RULE[fam.name]} (rules: {', '.join(SAMPLING_RULES)})")


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
    rule: str = option(RULE_2026, flag="--sampling-rule", choices=SAMPLING_RULES,
                       help="CosyVoice's sampling rule: cosyvoice2-2026 = its current code (RAS blocks the "
                            "repeated token; before the minimum length only eos 6561 is -inf, one draw), "
                            "cosyvoice2-2024 = the earlier rule (for comparison with older numbers), "
                            "cosyvoice3-2026 = CosyVoice3's (every stop row -inf before the minimum length)")

    def __post_init__(self):
        if self.rule not in SAMPLING_RULES:
            raise ValueError(f"unknown sampling rule {self.rule!r}; choose one of {', '.join(SAMPLING_RULES)}")


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
    """Next output index (0..6563) from one step's log-probs over the 6564 outputs.

    The one place the sampling rule lives (``cfg.rule``, see ``SAMPLING_RULES``): the
    batched generator, the reference ``Qwen2LM.inference`` and the vLLM path call it.
    ``allow_stop`` is False before the minimum length. ``logp`` itself is not changed:
    the rule's -inf writes go to this step's own copy of the scores, which every later
    draw of the step then uses (CosyVoice writes into its step's scores in place).

    cosyvoice2-2026: before the minimum length the eos row (6561) is -inf, then
    repetition-aware sampling once. cosyvoice2-2024: repetition-aware sampling,
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
    eos row (6561) under cosyvoice2-2026, every stop index under cosyvoice2-2024 and
    cosyvoice3-2026 (the family's ``min_len_held`` under a 2026 rule)."""
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
    """(B, 6564) bool: True at the indices a nucleus pick would count as repeated
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
    """P(pick_token returns x) for a batch of steps: ``logp`` (B, 6564) log-probs,
    ``repeated`` (B, 6564) from :func:`repeated_mask`, ``allow_stop`` (B,) bool.
    Returns (B, 6564) float64; a row sums to 1 minus the probability that pick_token
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
    """CosyVoice2's LM (``family`` = COSYVOICE2); :class:`CosyVoice3LM` is CosyVoice3's."""

    family: Family = COSYVOICE2

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
        fam = self.family
        if fam.input_embedding == "llm_embedding":
            w, rows = self.llm_embedding.weight, (SOS_ROW, TASK_ID_ROW)
        else:
            w, rows = self.speech_embedding.weight, (fam.sos_index, fam.task_id_index)
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
        sampling = sampling or SamplingConfig(rule=DEFAULT_RULE[self.family.name])
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


class CosyVoice3LM(Qwen2LM):
    """CosyVoice3's LM (upstream ``CosyVoice3LM``, ace7c47): no ``llm_embedding`` (sos and
    task_id are rows 6561 and 6563 of ``speech_embedding``), a 6761-row head without bias,
    every index >= 6561 a stop. State-dict keys are upstream's:

        llm.model.model.*                    inner Qwen2 (text embeddings, blocks, norm)
        llm.model.lm_head.weight  (V, H)     tied to embed_tokens, unused
        llm_decoder.weight        (6761, H)  speech-token head (no bias)
        speech_embedding.weight   (6761, H)
    """

    family = COSYVOICE3


LM_CLASSES = {cls.family.name: cls for cls in (Qwen2LM, CosyVoice3LM)}


def family_of_state(state: dict) -> Family:
    """The family an ``llm.pt`` state dict belongs to, from its keys and head size."""
    if "llm_embedding.weight" in state:
        return COSYVOICE2
    rows = state.get("speech_embedding.weight")
    for cls in LM_CLASSES.values():
        if cls.family.input_embedding == "speech_embedding" and rows is not None and rows.shape[0] == cls.family.num_outputs:
            return cls.family
    shape = None if rows is None else tuple(rows.shape)
    raise ValueError(f"llm.pt is neither CosyVoice2's (has llm_embedding) nor CosyVoice3's (no llm_embedding, "
                     f"speech_embedding with {COSYVOICE3.num_outputs} rows); speech_embedding is {shape}")


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
