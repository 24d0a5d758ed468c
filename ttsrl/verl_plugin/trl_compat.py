"""verl 0.9.1 with TRL >= 1.13 in the same environment (ttsrl's DPO/KTO stage needs TRL 1.16).

verl decides "TRL is installed" by ``find_spec("trl")`` (``verl.utils.import_utils.
is_trl_available``) and then, in every FSDP worker's model set-up
(``verl.models.transformers.monkey_patch.apply_monkey_patch``), imports
``AutoModelForCausalLMWithValueHead`` from ``trl.experimental.ppo`` or ``trl``. TRL 1.13
removed that class (and ``trl.experimental.ppo``), so with TRL 1.16 installed every GRPO
run died at actor init with ``ImportError: cannot import name
'AutoModelForCausalLMWithValueHead' from 'trl'``.

verl only needs TRL for value-head models (a critic built on TRL's class), which ttsrl
never uses. :func:`install` makes the two modules that ask see TRL as available only
when that class can actually be imported. Applied in every verl process by the plugin,
on both presets.
"""

from __future__ import annotations

import importlib


def trl_value_head_available() -> bool:
    """True when TRL's ``AutoModelForCausalLMWithValueHead`` imports (TRL < 1.13)."""
    for module in ("trl.experimental.ppo", "trl"):
        try:
            if hasattr(importlib.import_module(module), "AutoModelForCausalLMWithValueHead"):
                return True
        except ImportError:
            continue
    return False


def install() -> None:
    """Point verl's ``is_trl_available`` (as imported by the two modules that use it)
    at :func:`trl_value_head_available`. Idempotent."""
    import verl.models.transformers.monkey_patch as monkey_patch
    import verl.utils.model as model_utils

    for mod in (monkey_patch, model_utils):
        mod.is_trl_available = trl_value_head_available
