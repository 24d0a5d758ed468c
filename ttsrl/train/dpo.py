"""Offline preference optimisation of the speech-token LM on TRL 1.16's ``DPOTrainer`` and ``KTOTrainer``.

What TRL does here: everything a user of its trainers gets, the loss included. The pair
collator (``DataCollatorForPreference``: prompt+chosen and prompt+rejected concatenated into
one batch, chosen first, right padding, a ``completion_mask``), the reference log-prob
precompute (one pass of the frozen start model before training), the loss of every
``loss_type`` and their ``loss_weights`` mixtures, ``ld_alpha``, the f-divergences, WPO
weighting, its metrics (rewards, margins, accuracies), accelerate (FSDP on GPUs, one process
on CPU) and ``save_model``.

What ttsrl adds, and why:

* **The speech head in TRL's fused-head call.** TRL 1.16 patches the model so
  ``model(..., labels=L, fused_lm_head=True)`` projects hidden states through
  ``lm_head.weight``/``.bias`` itself (``trl.trainer.utils.add_fused_lm_head``). That keeps
  CosyVoice2's head bias but drops the speech mask of
  :class:`ttsrl.model.modeling_cosyvoice2.SpeechHead`: the log-softmax would run over the ~158k
  text+speech ids instead of the 6564 speech/stop classes the model can emit.
  :func:`add_speech_lm_head` is a drop-in with TRL's calling convention and output type
  (``FusedCausalLMOutput``, every field TRL reads) that projects through the head's speech rows
  only; since masked logits are exp(-1e4) = 0, this is exactly the model's own distribution.
  It is installed for the policy and for the reference while the trainer's ``__init__`` runs,
  so the precomputed reference log-probs come from it too.
* **cDPO on per-token means** (:func:`cdpo_smoothing_term`), the one loss term TRL 1.16 lacks
  for CosyVoice2's own ``DPOLoss`` (:data:`RECIPES`); the rest of that recipe is TRL's
  ``sigmoid_norm`` and ``ipo``.
* **The dataset preparation.** Pairs are already token ids (speech tokens have no text form
  worth tokenising); ``_prepare_dataset`` only checks the columns.

Sequence log-probs cover exactly the completion tokens (speech codes + the end of speech); the
prompt (``[sos] text [task_id]`` and, zero-shot, the prompt speech) and the padding never count.
CosyVoice2's recipe averages over the positions whose target IS the ignore id (text and
padding): ``tests/test_dpo.py`` fails on that inverted mask.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch
import torch.nn.functional as F

from ttsrl.model import vocab as V

IGNORE = -100  # TRL's (and transformers') ignore label


# ---------------------------------------------------------------------------
# the speech head for TRL's fused-head protocol


def speech_head_logprobs(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor,
                         temperature: float = 1.0):
    """Log-probs (and entropy, log sum p², mean logit, top-1 hit) of ``targets`` (HF ids inside the
    head's ``output_range``) from hidden states ``(N, H)``, through the speech rows of
    the biased head only: the softmax over the model's 6564 output classes."""
    start, end = head.output_range
    if targets.numel() and (targets.min() < start or targets.max() >= end):
        bad = targets[(targets < start) | (targets >= end)][0].item()
        raise ValueError(f"completion token id {bad} is not a speech/stop token ({start}..{end - 1})")
    weight, bias = head.weight, head.bias
    try:  # FSDP2 exposes sharded parameters as DTensors
        from torch.distributed.tensor import DTensor

        if isinstance(weight, DTensor):
            weight, bias = weight.full_tensor(), bias.full_tensor()
    except ImportError:  # pragma: no cover
        pass
    logits = F.linear(hidden, weight[start:end], bias[start:end]).float() / temperature
    logp = logits.log_softmax(-1)
    idx = (targets - start).long()
    lp = logp.gather(-1, idx[:, None]).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
        log_sum_sq_probs = torch.logsumexp(2 * logp, -1)  # log sum_v p_v^2: TRL's WPO weights (use_weighting)
        mean_logits = logits.mean(-1)
        is_top1 = logits.argmax(-1) == idx
    return lp, entropy, log_sum_sq_probs, mean_logits, is_top1


def add_speech_lm_head(model, temperature: float = 1.0, cast_lm_head_to_fp32: bool = False,
                       outputs: tuple[str, ...] = ("log_probs",)) -> None:
    """Drop-in for ``trl.trainer.utils.add_fused_lm_head`` (TRL 1.16) that keeps the
    speech mask: ``model(..., labels=L, fused_lm_head=True)`` returns TRL's
    ``FusedCausalLMOutput`` with next-token log-probs of the labels that are not -100
    (zero elsewhere), computed over the speech/stop classes only."""
    from trl.trainer.utils import FusedCausalLMOutput

    head = model.get_output_embeddings()
    if not hasattr(head, "output_range"):
        raise TypeError(f"{type(model).__name__} has no speech head (lm_head.output_range); load the checkpoint "
                        "with ttsrl.model.hf_model.load_speech_lm (CosyVoice2Qwen2ForCausalLM)")
    original_forward = model.forward

    def _forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None,
                 **kwargs):
        if not fused_lm_head:
            for k, v in (("labels", labels), ("shift_labels", shift_labels),
                         ("num_items_in_batch", num_items_in_batch)):
                if v is not None:
                    kwargs[k] = v
            return original_forward(*args, **kwargs)
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state
        if shift_labels is None:
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        lm_head = self.get_output_embeddings()
        labels = labels.to(hidden.device)
        mask = labels != IGNORE
        h = hidden[mask]
        if cast_lm_head_to_fp32:
            h = h.float()
        ctx = torch.autocast(h.device.type, enabled=False) if cast_lm_head_to_fp32 else contextlib.nullcontext()
        with ctx:
            lp, ent, lsq, ml, top1 = speech_head_logprobs(h, lm_head, labels[mask], temperature)

        def full(x):
            return x.new_zeros(mask.shape).masked_scatter(mask, x)

        log_probs = full(lp)
        loss = -log_probs.sum() / (mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch)
        return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=full(ent), log_sum_sq_probs=full(lsq),
                                   mean_logits=full(ml), is_top1=full(top1), label_mask=mask)

    import types

    model.forward = types.MethodType(_forward, model)


# ---------------------------------------------------------------------------
# data


def pairs_to_rows(pairs, vocab: V.SpeechVocab) -> list[dict]:
    """Pair rows -> TRL's pre-tokenised preference rows. Each completion is its speech
    tokens followed by the end of speech (CosyVoice2's training target)."""
    rows = []
    for p in pairs:
        rows.append({"prompt_ids": list(p.prompt_ids),
                     "chosen_ids": vocab.codes_to_ids(p.chosen) + [vocab.eos_id],
                     "rejected_ids": vocab.codes_to_ids(p.rejected) + [vocab.eos_id]})
    return rows


# ---------------------------------------------------------------------------
# trainer


@contextlib.contextmanager
def _speech_head_in_trl(module: str = "trl.trainer.dpo_trainer"):
    """Make ``DPOTrainer.__init__`` (or ``KTOTrainer``'s) install :func:`add_speech_lm_head`
    (policy and reference) instead of TRL's mask-less fused head."""
    import importlib

    mod = importlib.import_module(module)
    saved = mod.add_fused_lm_head
    mod.add_fused_lm_head = add_speech_lm_head
    try:
        yield
    finally:
        mod.add_fused_lm_head = saved


def _require_columns(dataset, need: set[str], name: str):
    """The pre-tokenised dataset itself (TRL's own preparation is skipped), or ValueError
    naming the columns it lacks."""
    missing = need - set(dataset.column_names)
    if missing:
        raise ValueError(f"{name} dataset lacks {sorted(missing)}")
    return dataset




# ---------------------------------------------------------------------------
# TRL's settings, read from its config classes


def trl_field(config_cls, name: str):
    """The dataclass field ``name`` of a TRL config class (``DPOConfig``, ``KTOConfig``)."""
    import dataclasses

    for f in dataclasses.fields(config_cls):
        if f.name == name:
            return f
    raise KeyError(f"{config_cls.__name__} has no field {name!r} (TRL changed?)")


def trl_default(config_cls, name: str):
    """TRL's default of a config field (a list default, e.g. ``loss_type``, as a tuple)."""
    import dataclasses

    f = trl_field(config_cls, name)
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return tuple(value) if isinstance(value, list) else value


def trl_choices(config_cls, name: str) -> tuple[str, ...]:
    """The values TRL allows for a config field, as TRL declares them: the field's ``choices``
    metadata, else its ``Literal`` type, else the list its help text gives ("Possible values are:
    `a`, `b`. ..."), which is where TRL 1.16 declares ``DPOConfig.loss_type`` and
    ``f_divergence_type``. ValueError when none of the three names any value."""
    import re
    import typing

    f = trl_field(config_cls, name)
    if f.metadata.get("choices"):
        return tuple(f.metadata["choices"])
    hint = typing.get_type_hints(config_cls).get(name)
    for t in (hint, *typing.get_args(hint)):
        if typing.get_origin(t) is typing.Literal:
            return tuple(typing.get_args(t))
    m = re.search(r"Possible values are:(.*?)\.(?:\s|$)", f.metadata.get("help", ""), re.S)
    values = tuple(re.findall(r"`'?([A-Za-z0-9_]+)'?`", m.group(1))) if m else ()
    if not values:
        raise ValueError(f"{config_cls.__name__}.{name}: TRL declares no choices (metadata, Literal or help)")
    return values


# CosyVoice2's own DPO (its DPOLoss, beta 0.01, on per-token mean log-probs) in TRL's terms: sigmoid
# on per-token means is TRL's sigmoid_norm; its IPO is TRL's ipo (TRL averages IPO per token too);
# its cDPO is sigmoid_norm plus CDPO_TERM below (--cdpo-label-smoothing). tests/test_dpo.py holds the
# equality with CosyVoice2's formula on fixed log-probs.
RECIPES: dict[str, dict] = {
    "trl": {},  # TRL's own defaults
    "cosyvoice2": {"loss_type": ("sigmoid_norm",), "beta": 0.01},
}
CDPO_TERM = "sigmoid_norm"  # the TRL loss type whose label smoothing ttsrl adds


def cdpo_smoothing_term(per_token_logps: torch.Tensor, completion_mask: torch.Tensor, ref_chosen_logps: torch.Tensor,
                        ref_rejected_logps: torch.Tensor, beta: float, epsilon: float) -> torch.Tensor:
    """What conservative DPO adds to ``sigmoid_norm``: ``-(1-ε) log σ(βd) - ε log σ(-βd) = -log σ(βd) + ε β d``,
    so cDPO on per-token means (CosyVoice2's ``DPOLoss`` with label smoothing) is TRL's ``sigmoid_norm`` plus
    ``ε β mean(d)``, with ``d`` the per-token-mean log-ratio difference exactly as ``sigmoid_norm`` forms it
    (token sums over TRL's completion-mask counts; reference sums as TRL precomputed them).

    TRL 1.16 reads ``label_smoothing`` only in ``robust``, ``exo_pair`` and ``aot*``, and its only per-token
    normalised losses are ``sigmoid_norm`` and ``ipo``: no combination of its loss types gives this term
    (on summed log-probs one does: ``sigmoid`` and ``robust`` weighted ``2-2ε`` and ``-(1-2ε)``)."""
    n = completion_mask.sum(dim=1).clamp(min=1.0)
    seq = per_token_logps[:, -(completion_mask.shape[1] - 1):].sum(dim=1)
    ref = torch.cat([ref_chosen_logps, ref_rejected_logps]).to(seq.device, seq.dtype)
    chosen, rejected = ((seq - ref) / n).chunk(2, dim=0)
    return epsilon * beta * (chosen - rejected).mean()


def make_trainer_class():
    """``DPOTrainer`` on pre-tokenised speech pairs through the speech head; the loss is TRL's own
    (every ``loss_type``, ``loss_weights``, ``ld_alpha``, ``f_divergence_type``, ...), plus only
    :func:`cdpo_smoothing_term` when ``cdpo_label_smoothing`` is set."""
    from trl import DPOTrainer

    class SpeechDPOTrainer(DPOTrainer):
        def __init__(self, *args, cdpo_label_smoothing: float = 0.0, **kwargs):
            with _speech_head_in_trl():
                super().__init__(*args, **kwargs)
            self.cdpo_label_smoothing = cdpo_label_smoothing
            if cdpo_label_smoothing:
                if not 0.0 < cdpo_label_smoothing < 0.5:
                    raise ValueError(f"cdpo_label_smoothing must lie in (0, 0.5), got {cdpo_label_smoothing}")
                if (CDPO_TERM not in self.loss_types or self.ld_alpha is not None
                        or self.f_divergence_type != "reverse_kl" or not self.precompute_ref_logps):
                    raise ValueError(f"cdpo_label_smoothing smooths loss type {CDPO_TERM!r} with reverse_kl, no "
                                     "ld_alpha and precomputed reference log-probs (CosyVoice2's cDPO); got "
                                     f"loss types {self.loss_types}, f_divergence_type {self.f_divergence_type!r}, "
                                     f"ld_alpha {self.ld_alpha}")

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            return _require_columns(dataset, {"prompt_ids", "chosen_ids", "rejected_ids"}, dataset_name)

        def _compute_loss(self, model, inputs, return_outputs):
            if not self.cdpo_label_smoothing:
                return super()._compute_loss(model, inputs, return_outputs)
            seen = []  # the fused forward's output, as TRL's loss saw it (no second forward)
            hook = self.accelerator.unwrap_model(model).register_forward_hook(lambda m, a, out: seen.append(out))
            try:
                result = super()._compute_loss(model, inputs, return_outputs)
            finally:
                hook.remove()
            weight = self.loss_weights[self.loss_types.index(CDPO_TERM)]
            term = weight * cdpo_smoothing_term(seen[0].log_probs, inputs["completion_mask"],
                                                inputs["ref_chosen_logps"], inputs["ref_rejected_logps"],
                                                self.beta, self.cdpo_label_smoothing)
            return (result[0] + term, result[1]) if return_outputs else result + term

    return SpeechDPOTrainer


def pairs_to_kto_rows(pairs, vocab: V.SpeechVocab) -> list[dict]:
    """Pairs -> KTO's unpaired rows: chosen is desirable (label True), rejected
    undesirable (False), interleaved so every batch holds both kinds."""
    rows = []
    for r in pairs_to_rows(pairs, vocab):
        rows.append({"prompt_ids": r["prompt_ids"], "completion_ids": r["chosen_ids"], "label": True})
        rows.append({"prompt_ids": r["prompt_ids"], "completion_ids": r["rejected_ids"], "label": False})
    return rows


def make_kto_trainer_class():
    """TRL's ``KTOTrainer`` with its own KTO loss (sequence log-prob sums, KL estimate
    from mismatched pairs) on pre-tokenised speech rows, through the speech head."""
    from trl import KTOTrainer

    class SpeechKTOTrainer(KTOTrainer):
        def __init__(self, *args, **kwargs):
            with _speech_head_in_trl("trl.trainer.kto_trainer"):
                super().__init__(*args, **kwargs)

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            _require_columns(dataset, {"prompt_ids", "completion_ids", "label"}, dataset_name)
            if self.calculate_KL:  # TRL's rule: completions rotated by one within each batch
                def add_kl(batch):
                    batch["KL_completion_ids"] = [batch["completion_ids"][-1]] + batch["completion_ids"][:-1]
                    return batch

                dataset = dataset.map(add_kl, batched=True, batch_size=args.per_device_train_batch_size)
            return dataset

    return SpeechKTOTrainer


def sequences_logps(model, vocab: V.SpeechVocab, prompts: Sequence[Sequence[int]],
                    completions: Sequence[Sequence[int]], average: str = "sum") -> torch.Tensor:
    """Reference implementation for checks: log-prob of each completion (HF ids) after
    its prompt, one unpadded forward per sequence through the model's own forward
    (full masked logits)."""
    out = []
    with torch.no_grad():
        for p, c in zip(prompts, completions):
            ids = torch.tensor([list(p) + list(c)])
            logits = model(input_ids=ids).logits[0].float()
            logp = logits.log_softmax(-1)
            n = len(p)
            lp = torch.stack([logp[n - 1 + j, t] for j, t in enumerate(c)])
            out.append(lp.sum() if average == "sum" else lp.mean())
    return torch.stack(out)


__all__ = ["add_speech_lm_head", "cdpo_smoothing_term", "make_kto_trainer_class", "make_trainer_class", "pairs_to_kto_rows",
           "pairs_to_rows", "RECIPES", "sequences_logps", "trl_choices", "trl_default", "trl_field"]
