"""Processes that die with the process that started them (Linux ``PR_SET_PDEATHSIG``).

torchrun starts its ranks in sessions of their own (``start_new_session``), so when ``run.sh``
is killed (``kill -9``, a lost terminal) stage 4's torchrun and both ranks used to go on, on a
GPU node holding their GPU memory. ``run.sh`` starts torchrun as
``python -m ttsrl.lifeline CMD...`` (the signal is set, then CMD is exec'ed in the same process),
and every rank of ``infer_dataset.py`` calls :func:`die_with_parent` first: a dead ``run.sh``
takes torchrun with it, a dead torchrun its ranks. Elsewhere than Linux both do nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel for ``sig`` when this process's parent exits; True where it was set. A
    parent that is already gone (the race before the call) gets the signal sent at once."""
    parent = os.getppid()
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:  # it exited before the call took effect
        os.kill(os.getpid(), sig)
    return True


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m ttsrl.lifeline CMD [ARG...]\n  run CMD in this process, to be sent SIGTERM "
              "when the process that started it exits", file=sys.stderr)
        raise SystemExit(2 if not argv else 0)
    die_with_parent()
    os.execvp(argv[0], argv)  # the death signal survives exec


if __name__ == "__main__":
    main()
