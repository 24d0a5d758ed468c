"""Process-wide fixes verl 0.9.1 needs on a machine without an accelerator.

They are applied only when the CPU platform is selected (see ``install_cpu_patches``)
and are idempotent.

1. ``verl.utils.distributed`` builds the backend string
   ``f"cpu:gloo,{device}:{backend}"``, which on CPU is ``"cpu:gloo,cpu:gloo"``;
   torch rejects a device listed twice. We wrap ``torch.distributed.init_process_group``
   (verl calls it through the module attribute) and drop repeated device entries. The
   same wrapper keeps the group's store off the network (``local_store``): the ``env://``
   rendezvous starts a TCPStore on rank 0 listening on every interface; a one-process
   group gets an in-process store instead, a group whose ``MASTER_ADDR`` is a loopback
   address (FSDP world size 2 on one host) a TCPStore bound to that address only, and its
   gloo connections are pinned to the loopback interface (``GLOO_SOCKET_IFNAME``; gloo
   otherwise listens on whatever address the host name resolves to).
2. FSDP2's ``CPUOffloadPolicy(pin_memory=True)`` (verl forces it on the reference
   model) pins host memory, which raises when no accelerator exists. We make the
   policy's ``pin_memory`` False when CUDA is unavailable.
3. The v1 trainer's replay buffer waits for rollouts by sleeping a fixed 2 s between
   polls (not configurable), so every step's generation rounds up to a multiple of
   2 s. A CPU step is a few seconds, so we poll every ``CPU_POLL_INTERVAL_S``.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import socket

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


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: leave it to torch
        return False


def _loopback_tcp_store(host: str, port: int, rank: int, world: int, timeout) -> "torch.distributed.TCPStore":
    """Rank 0 serves the store on ``host:port`` only (a socket bound there, handed to torch);
    the other ranks connect to it as torch's own rendezvous would."""
    from torch.distributed import TCPStore

    if rank != 0:
        return TCPStore(host, port, world_size=world, is_master=False, timeout=timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1" if host == "localhost" else host, port))
        sock.listen(max(world, 16))
    except OSError as e:
        sock.close()
        raise RuntimeError(f"torch.distributed store of a {world}-rank group: cannot listen on "
                           f"MASTER_ADDR:MASTER_PORT = {host}:{port}: {e}") from e
    fd = sock.detach()
    try:
        return TCPStore(host, port, world_size=world, is_master=True, timeout=timeout, multi_tenant=True,
                        master_listen_fd=fd)
    except Exception:
        socket.close(fd)
        raise


def _loopback_interface() -> str:
    """The name of the interface holding 127.0.0.1 (``lo`` on Linux)."""
    try:
        import psutil

        for name, addrs in psutil.net_if_addrs().items():
            if any(a.address == "127.0.0.1" for a in addrs):
                return name
    except ImportError:
        pass
    return "lo"


def local_store(kwargs: dict) -> dict:
    """The ``init_process_group`` arguments with a store that listens on no outside interface,
    where the ``env://`` rendezvous would start a TCPStore on every interface:

    * a one-process group (the CPU preset's actor and reference) gets an in-process ``HashStore``;
    * a group of several ranks whose ``MASTER_ADDR`` is a loopback address (FSDP world size 2
      on one host, where verl's master address is the node's 127.0.0.1) gets a ``TCPStore``
      served on ``MASTER_ADDR:MASTER_PORT`` only.

    Other groups (another ``init_method`` or store, a routable ``MASTER_ADDR``) are left as
    they are."""
    if kwargs.get("store") is not None or kwargs.get("init_method") not in (None, "env://"):
        return kwargs
    world = kwargs.get("world_size", -1)
    if world in (None, -1):
        world = int(os.environ.get("WORLD_SIZE", "-1") or -1)
    rank = kwargs.get("rank", -1)
    if rank in (None, -1):
        rank = int(os.environ.get("RANK", "-1") or -1)
    out = {k: v for k, v in kwargs.items() if k != "init_method"}
    if world == 1 and rank in (-1, 0):
        out.update(store=torch.distributed.HashStore(), rank=0, world_size=1)
        return out
    host, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    if world < 2 or not 0 <= rank < world or not _is_loopback(host) or not port.isdigit():
        return kwargs
    from torch.distributed.constants import default_pg_timeout

    timeout = kwargs.get("timeout") or default_pg_timeout
    # gloo binds its pairs to the host name's address unless told an interface: keep them on loopback
    os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_interface())
    out.update(store=_loopback_tcp_store(host, int(port), rank, world, timeout), rank=rank, world_size=world)
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
        return original(*args, **local_store(kwargs))

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
