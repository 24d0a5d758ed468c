"""Our verl 0.9.1 plugin: a CPU platform, the fixes a CPU run needs, and the
``hf`` rollout (transformers generation that receives the actor's weights).

verl imports ``ttsrl.verl_plugin.plugin`` at start-up in every process (driver and
Ray workers) when ``VERL_USE_EXTERNAL_MODULES=ttsrl.verl_plugin.plugin`` is set; that
import calls :func:`install`. ``ttsrl`` must then be importable (``PYTHONPATH`` =
repository root). No verl file is edited. Importing this package itself installs
nothing (reading ``cpu_env`` does not pull in verl or Ray).

* always: the ``cpu`` platform is registered (inert unless chosen), the ``hf``
  rollout (``actor_rollout_ref.rollout.name=hf``), verl is kept from importing a
  value-head class that TRL 1.16 no longer has (``trl_compat``), and each reward term
  becomes a training metric per step (``reward_metrics``: ``reward/cer/mean``, ...).
* with ``VERL_PLATFORM=cpu``: the gloo backend-string fix and no-op pinning
  (``patches``). ``VERL_ENGINE_DEVICE=cuda`` must also be set so verl's FSDP
  engine, registered for cuda/npu only, is found (``cpu_env`` gives all three).

verl is pinned to ``VERL_VERSION``: these hooks use verl internals, and importing
the plugin under another verl version fails loudly unless
``TTSRL_ALLOW_VERL_MISMATCH=1``.
"""

from __future__ import annotations

import os
from typing import Mapping

VERL_VERSION = "0.9.1"
PLUGIN_MODULE = f"{__name__}.plugin"  # what verl imports; importing it installs the plugin


def _physical_cores() -> int:
    try:
        import psutil

        return psutil.cpu_count(logical=False) or os.cpu_count() or 1
    except ImportError:
        return os.cpu_count() or 1


def cpu_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment variables that select this plugin's CPU path (values the caller's
    ``environ``, default ``os.environ``, already sets win where said).

    Besides the plugin's three, two quiet and contain the single-node CPU run:

    * ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: Ray 2.60's switch for multi-node clusters
      (``ray._private.ray_constants.ENABLE_RAY_CLUSTER``, on by default on Linux). Off, the
      node's address is 127.0.0.1 (``services.get_node_ip_address``), so the GCS, raylets,
      workers, dashboard agent, runtime-env agent and TransferQueue's sockets (bound to
      ``ray.util.get_node_ip_address()``) listen on loopback only, not on every interface.
      Attaching to a running cluster needs it on (``ray start --address`` aborts without it):
      ``GRPOConfig.env()`` leaves it out then, unless ``environ`` sets it.
    * ``TQ_NUM_THREADS``: TransferQueue (verl's data plane) sets torch's thread count to
      ``TQ_NUM_THREADS`` (default 8) around every put/get and warns "target_num_threads 8
      should not exceed total physical CPU cores" each time when the machine has fewer:
      hundreds of lines a step on a laptop. Capped at the physical core count, as it would
      cap it itself. A value set in the environment wins.
    """
    environ = os.environ if environ is None else environ
    return {
        "VERL_USE_EXTERNAL_MODULES": PLUGIN_MODULE,
        "VERL_PLATFORM": "cpu",
        "VERL_ENGINE_DEVICE": "cuda",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"),
        "TQ_NUM_THREADS": environ.get("TQ_NUM_THREADS", str(min(8, _physical_cores()))),
    }


def _check_version() -> None:
    from importlib.metadata import version

    from ttsrl import knobs

    found = version("verl")
    if found != VERL_VERSION and not knobs.get("TTSRL_ALLOW_VERL_MISMATCH"):
        raise ImportError(f"ttsrl.verl_plugin is written against verl=={VERL_VERSION}, found verl=={found}; "
                          "re-check the plugin (tests/test_grpo_cpu.py) before changing the pin")


def install() -> None:
    """Register the ``cpu`` platform and the ``hf`` rollout; with ``VERL_PLATFORM=cpu``
    also the CPU patches. Idempotent."""
    _check_version()
    from ttsrl.verl_plugin import hf_rollout, platform, trl_compat  # noqa: F401  (registers the platform)

    trl_compat.install()  # TRL 1.16 (DPO/KTO) beside verl 0.9.1: see trl_compat
    hf_rollout.register()
    from ttsrl.verl_plugin import reward_metrics

    reward_metrics.install()  # the reward's terms per training step (reward/<key>/mean)
    if os.environ.get("VERL_PLATFORM", "").strip().lower() == platform.PLATFORM_NAME:
        from ttsrl.verl_plugin.patches import install_cpu_patches

        install_cpu_patches()
