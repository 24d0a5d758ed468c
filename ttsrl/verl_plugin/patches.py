"""Process-wide fixes verl 0.9.1 needs on a machine without an accelerator.

They are applied only when the CPU platform is selected (see ``install_cpu_patches``)
and are idempotent.

1. ``verl.utils.distributed`` builds the backend string
   ``f"cpu:gloo,{device}:{backend}"``, which on CPU is ``"cpu:gloo,cpu:gloo"``;
   torch rejects a device listed twice. We wrap ``torch.distributed.init_process_group``
   (verl calls it through the module attribute) and drop repeated device entries. The
   same wrapper gives a one-process group an in-process store (``single_process_store``):
   the ``env://`` rendezvous would start a TCPStore listening on every interface.
2. FSDP2's ``CPUOffloadPolicy(pin_memory=True)`` (verl forces it on the reference
   model) pins host memory, which raises when no accelerator exists. We make the
   policy's ``pin_memory`` False when CUDA is unavailable.
3. The v1 trainer's replay buffer waits for rollouts by sleeping a fixed 2 s between
   polls (not configurable), so every step's generation rounds up to a multiple of
   2 s. A CPU step is a few seconds, so we poll every ``CPU_POLL_INTERVAL_S``.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed

_MARK = "_ttsrl_cpu_patched"
CPU_POLL_INTERVAL_S = 0.05


def dedup_backend(backend: str | None) -> str | None:
    """``"cpu:gloo,cpu:gloo"`` -> ``"cpu:gloo"``; other strings unchanged.

    Raises ValueError when one device is given two different backends."""
    if not backend or ":" not in backend:
        return backend
    seen: dict[str, str] = {}
    for part in backend.split(","):
        device, _, name = part.strip().partition(":")
        if device in seen and seen[device] != name:
            raise ValueError(f"backend string {backend!r} gives device {device!r} two backends")
        seen.setdefault(device, name)
    return ",".join(f"{d}:{b}" for d, b in seen.items())


def single_process_store(kwargs: dict) -> dict:
    """A one-process group gets an in-process ``HashStore`` instead of the ``env://``
    rendezvous, whose ``TCPStore`` server listens on every interface (not just
    ``MASTER_ADDR``); the CPU preset's actor and reference run as one process each.
    Other groups are left as they are."""
    if kwargs.get("store") is not None or kwargs.get("init_method") not in (None, "env://"):
        return kwargs
    world = kwargs.get("world_size", -1)
    if world in (None, -1):
        world = int(os.environ.get("WORLD_SIZE", "-1") or -1)
    if world != 1 or kwargs.get("rank", 0) not in (None, -1, 0):
        return kwargs
    out = {k: v for k, v in kwargs.items() if k != "init_method"}
    out.update(store=torch.distributed.HashStore(), rank=0, world_size=1)
    return out


def _patch_init_process_group() -> None:
    original = torch.distributed.init_process_group
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        if "backend" in kwargs:
            kwargs["backend"] = dedup_backend(kwargs["backend"])
        elif args:
            args = (dedup_backend(args[0]), *args[1:])
        return original(*args, **single_process_store(kwargs))

    setattr(init_process_group, _MARK, True)
    torch.distributed.init_process_group = init_process_group


def _fix_after_init(cls, fix) -> None:
    """Run ``fix(instance)`` after every ``cls.__init__``; installing it twice is a no-op."""
    original_init = cls.__init__
    if getattr(original_init, _MARK, False):
        return

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        fix(self)

    setattr(__init__, _MARK, True)
    cls.__init__ = __init__


def _no_pinning(policy) -> None:
    if not torch.cuda.is_available():
        object.__setattr__(policy, "pin_memory", False)  # pinning needs an accelerator; a no-op on CPU


def _fast_poll(buffer) -> None:
    buffer.poll_interval = min(buffer.poll_interval, CPU_POLL_INTERVAL_S)


def install_cpu_patches() -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    _patch_init_process_group()
    _fix_after_init(CPUOffloadPolicy, _no_pinning)
    _fix_after_init(ReplayBuffer, _fast_poll)
