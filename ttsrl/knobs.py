"""Every ``TTSRL_*`` environment variable ("knob"), declared once: name, type, default, meaning, reader.

Knobs are for what a run's configs cannot carry: settings read inside processes that
verl or Ray start (the reward function, the ``hf`` rollout, the verl and vLLM plugins),
the installer and test scripts, and per-machine paths. Python code reads them only
through :func:`get` (a name not declared here raises ``KeyError``; a malformed value raises
``ValueError`` naming the variable). Knobs marked ``shell`` are read by the shell scripts
and are listed here so that this table is the whole list. ``train_grpo.py`` records
:func:`in_effect` in the run's ``ttsrl_run.json``.

    python -m ttsrl.knobs          # the table: name, type, default, reader, meaning
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ttsrl.cli import parse_bool


@dataclass(frozen=True)
class Knob:
    name: str
    type: type  # str, int, float, bool or Path
    default: object  # the value when unset or empty; None: the reader's own default (said in ``meaning``)
    meaning: str
    reader: str  # the code that reads it
    shell: bool = False  # read by shell scripts, not through get()


_REWARD = "ttsrl/reward/client.py (reward_tts.py, mine_pairs.py)"
_ROLLOUT = "ttsrl/verl_plugin/hf_rollout.py"
KNOBS: dict[str, Knob] = {k.name: k for k in (
    Knob("TTSRL_REWARD_URL", str, None, "reward server base URL, or a comma-separated list the client spreads "
         "requests over with failover (unset: ttsrl.reward.protocol.DEFAULT_URL); run.sh exports REWARD_URLS",
         _REWARD),
    Knob("TTSRL_REWARD_MODEL", str, None, "model name served by the reward server (unset: "
         "ttsrl.reward.protocol.DEFAULT_MODEL_NAME)", _REWARD),
    Knob("TTSRL_REWARD_MAX_FAIL_FRACTION", float, 0.1, "share of this process's last TTSRL_REWARD_FAIL_WINDOW "
         "reward calls that may fail (scored 0, logged) before a call raises; and of a training step's rollouts that "
         "may be without a reward (scored 0 or lost) before the run stops, ahead of that step's update",
         _REWARD + ", ttsrl/verl_plugin/reward_metrics.py"),
    Knob("TTSRL_REWARD_FAIL_WINDOW", int, 64, "how many of this process's most recent reward calls the failure "
         "fraction is judged over", _REWARD),
    Knob("TTSRL_REWARD_RETRIES", int, 4, "waits for a usable server when every listed one is out of rotation",
         _REWARD),
    Knob("TTSRL_REWARD_BACKOFF_S", float, 0.5, "a failed server's first time out of rotation in seconds (doubles "
         "per failure in a row, capped at 30 s)", _REWARD),
    Knob("TTSRL_REWARD_TIMEOUT_S", float, 300.0, "timeout of one reward request attempt in seconds", _REWARD),
    Knob("TTSRL_REWARD_MAX_CONNECTIONS", int, 256, "concurrent reward requests per event loop", _REWARD),
    Knob("TTSRL_HF_ROLLOUT_BATCH_WINDOW_S", float, 0.05, "hf rollout: requests keep being collected into one batch "
         "until none arrived for this many seconds", _ROLLOUT),
    Knob("TTSRL_HF_ROLLOUT_MAX_BATCH", int, 128, "hf rollout: most sequences generated in one batch (the embedded "
         "run's 16 prompts x n=8 = 128: one batch a step)", _ROLLOUT),
    Knob("TTSRL_HF_ROLLOUT_THREADS", int, 0, "hf rollout: torch CPU threads of the generating actor (0: all "
         "cores)", _ROLLOUT),
    Knob("TTSRL_ALLOW_VERL_MISMATCH", bool, False, "load our verl plugin under a verl other than the pinned one",
         "ttsrl/verl_plugin/__init__.py"),
    Knob("TTSRL_PLUGIN_LOADED_LOG", bool, False, "print one line per process that loads the vLLM model plugin",
         "ttsrl/model/vllm_plugin.py"),
    Knob("TTSRL_CACHE_DIR", Path, Path("~/.cache/ttsrl"), "cache of the compiled reference text normaliser and of "
         "Whisper models", "ttsrl/reward/rewards.py, ttsrl/reward/backends/whisper.py"),
    Knob("TTSRL_TEST_DEVICE", str, "cpu", "device of the vLLM engine test (cpu or cuda; scripts/gpu_check.sh sets "
         "cuda)", "tests/gpu_stack/test_vllm_engine.py"),
    Knob("TTSRL_USE_PYTHON", str, None, "install into this interpreter instead of a new venv (the Dockerfile)",
         "scripts/install.sh", shell=True),
    Knob("TTSRL_TORCH_INDEX", str, None, "pip index URL for the CPU torch wheel", "scripts/install.sh", shell=True),
    Knob("TTSRL_SKIP_FLASH_ATTN", bool, False, "1: a GPU install without flash-attn", "scripts/install.sh, "
         "scripts/cuda_toolkit.sh", shell=True),
    Knob("TTSRL_SKIP_VLLM_TESTS", bool, False, "1: scripts/test.sh leaves out the vLLM tests", "scripts/test.sh",
         shell=True),
    Knob("TTSRL_SKIP_OMNI_TESTS", bool, False, "1: scripts/test.sh leaves out the vllm-omni parity tests (and "
         "building .venv-omni)", "scripts/test.sh", shell=True),
    Knob("TTSRL_COSYVOICE_CHECKOUT", str, None, "a CosyVoice source checkout with CosyVoice3 (FunAudioLLM/CosyVoice "
         "at or after dd2d926) for the cosyvoice3 backend's tests (unset: they are skipped; the PyPI package lacks "
         "CosyVoice3)", "tests/test_cosyvoice3_backend.py"),
)}


def knob(name: str) -> Knob:
    try:
        return KNOBS[name]
    except KeyError:
        raise KeyError(f"unknown knob {name!r}: declare it in ttsrl/knobs.py (python -m ttsrl.knobs lists "
                       "them)") from None


def default(name: str):
    """The declared default of knob ``name`` (``~`` expanded for paths)."""
    k = knob(name)
    return k.default.expanduser() if isinstance(k.default, Path) else k.default


def get(name: str, environ: Mapping[str, str] | None = None):
    """Knob ``name``'s value in ``environ`` (default ``os.environ``), typed; its default when unset or empty."""
    k = knob(name)
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or raw == "":
        return default(name)
    try:
        if k.type is bool:
            return parse_bool(raw)
        return Path(raw).expanduser() if k.type is Path else k.type(raw)
    except (ValueError, argparse.ArgumentTypeError):
        raise ValueError(f"environment variable {name}={raw!r} is not a valid {k.type.__name__} "
                         f"({k.meaning})") from None


def in_effect(environ: Mapping[str, str] | None = None) -> dict:
    """Every Python-read knob's value (JSON types) in ``environ``, as a run records it."""
    values = {name: get(name, environ) for name, k in KNOBS.items() if not k.shell}
    return {name: str(v) if isinstance(v, Path) else v for name, v in values.items()}


def table() -> str:
    rows = [("name", "type", "default", "read by", "meaning")]
    for k in KNOBS.values():
        dflt = "(reader's)" if k.default is None and not k.shell else "unset" if k.default is None else str(k.default)
        rows.append((k.name, k.type.__name__, dflt, k.reader + (" [shell]" if k.shell else ""), k.meaning))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows)


if __name__ == "__main__":
    print(table())
