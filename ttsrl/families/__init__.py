"""The model families ttsrl trains (layer 1): one folder each, and this registry.

A family's folder (``ttsrl/families/<name>/``) defines its :class:`~ttsrl.families.base.Family`:
speech vocabulary, stop set, where sos/task_id live, head bias, prompt prefix, sampling rules and
token2wav. Every other module asks this registry for a family (by name, from an ``llm.pt``'s keys
or from a tokenizer) and holds no family's numbers. A new family is a new folder, one line below
and a preset (docs/families.md).

May import: the standard library and ``ttsrl.families.*``. Nothing else (check_inputs.py reads it
without the venv).
"""

from __future__ import annotations

from typing import Any, Mapping

from ttsrl.families import cosyvoice2, cosyvoice3, kokoro
from ttsrl.families.base import PAD_MULTIPLE, QWEN_SPECIALS, Family, Token2WavSpec, speech_name

__all__ = ["DEFAULT_FAMILY", "FAMILIES", "Family", "any_speech_token_size", "PAD_MULTIPLE", "QWEN_SPECIALS", "Token2WavSpec", "family",
           "family_of_rule", "family_of_state", "register", "sampling_rules", "speech_name", "token2wav_families"]

FAMILIES: dict[str, Family] = {}


def register(fam: Family) -> Family:
    """Add a family (its folder's ``FAMILY``); a name and its rule names are taken once."""
    if fam.name in FAMILIES and FAMILIES[fam.name] is not fam:
        raise ValueError(f"model family {fam.name!r} is registered already")
    taken = {r for f in FAMILIES.values() if f is not fam for r, _ in f.rules}
    clash = [r for r, _ in fam.rules if r in taken]
    if clash:
        raise ValueError(f"family {fam.name}: sampling rule names {clash} belong to another family")
    FAMILIES[fam.name] = fam
    return fam


# the registry: one line a family
register(cosyvoice2.FAMILY)
register(cosyvoice3.FAMILY)
register(kokoro.FAMILY)

DEFAULT_FAMILY = FAMILIES["cosyvoice2"]


def family(name: str | Family) -> Family:
    """The family of this name (a Family passes through)."""
    if isinstance(name, Family):
        return name
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; choose one of {', '.join(FAMILIES)}") from None


def family_of_state(state: Mapping[str, Any]) -> Family:
    """The family an ``llm.pt`` state dict belongs to: the one whose key signature it has."""
    found = [f for f in FAMILIES.values() if f.owns_state(state)]
    if not found:  # no family's row count: the first registered keeping sos/task_id where this file does
        # (a released model's layout before the laptop's kokoro; its shape check then names the rows it expected)
        has_llm_embedding = "llm_embedding.weight" in state
        found = [f for f in FAMILIES.values() if "speech_embedding.weight" in state
                 and has_llm_embedding == (f.input_embedding == "llm_embedding")][:1]
    if len(found) == 1:
        return found[0]
    rows = state.get("speech_embedding.weight")
    shape = None if rows is None else tuple(rows.shape)
    signatures = "; ".join(f"{f.name}: {f.input_rows()[0]} and {f.num_outputs} speech_embedding rows"
                           for f in FAMILIES.values())
    raise ValueError(f"llm.pt matches {'no' if not found else 'more than one'} known family ({signatures}); it has "
                     f"llm_embedding {'yes' if 'llm_embedding.weight' in state else 'no'}, speech_embedding {shape}")


def sampling_rules() -> tuple[str, ...]:
    """Every family's sampling rule names."""
    return tuple(r for f in FAMILIES.values() for r, _ in f.rules)


def family_of_rule(rule: str) -> tuple[Family, str]:
    """(the family whose stop rows the rule holds back, the rule's kind)."""
    for f in FAMILIES.values():
        for r, kind in f.rules:
            if r == rule:
                return f, kind
    raise ValueError(f"unknown sampling rule {rule!r}; choose one of {', '.join(sampling_rules())}")


def any_speech_token_size() -> int:
    """The largest speech vocabulary of any family: a code at or beyond it is no family's speech (readers
    that do not know the run's family check this; the run's own vocabulary checks the rest)."""
    return max(f.speech_token_size for f in FAMILIES.values())


def token2wav_families() -> tuple[str, ...]:
    """The families that have a token2wav backend (each is a ``--backend`` of its own name)."""
    return tuple(n for n, f in FAMILIES.items() if f.token2wav is not None)
