"""Stage 2 on the head: ``train_grpo.py`` run with its output through stage 2's console filter
(``ttsrl.console``: verl's full output to the log, one line per step on screen), inside the
head's Ray cluster on several nodes (``ttsrl.launch.roles``). When it fails, the lines of its
log that say why come first (an errno, an exception, an OOM kill), then the log's tail.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from ttsrl import console
from ttsrl.launch import roles


def run_logged(command: list[str], log: Path) -> int:
    """``command`` with stdout and stderr through the console filter into ``log`` (appended);
    its exit status. Ctrl-C reaches the command (its process group is ours); this process waits
    for its shutdown output instead of dying first."""
    log.parent.mkdir(parents=True, exist_ok=True)
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with open(log, "ab") as out:
            out.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {console.RUN_MARKER}\n".encode())
            print(f"[console] one line per step here; verl's full metrics and worker logs: {log}", flush=True)
            proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    restore_signals=True, preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                                                           signal.SIG_DFL))
            console.run(proc.stdout, out, sys.stdout)
            return proc.wait()
    finally:
        signal.signal(signal.SIGINT, old)


def explain_failure(log: Path) -> None:
    """Why stage 2 failed, as its log says it, then the log's tail (stderr)."""
    text = log.read_text(encoding="utf-8", errors="replace") if log.is_file() else ""
    why = console.causes(console.last_run(text))
    if why:
        print("stage 2 failed; why, as its log says it:\n" + "\n".join(f"  {line}" for line in why), file=sys.stderr)
    print(f"stage 2 failed; the end of {log}:\n" + "\n".join(text.splitlines()[-40:]), file=sys.stderr, flush=True)


def grpo(command: list[str], log: Path, cluster: roles.Cluster | None = None) -> int:
    """Train (on one node, or as the head of ``cluster``); 0 or the failure's status."""
    ray = None
    try:
        if cluster is not None:
            try:
                address, ray = roles.head_ray(cluster)
            except RuntimeError as e:
                print(str(e), file=sys.stderr, flush=True)
                return 1
            cut = command.index("--") if "--" in command else len(command)  # before the Hydra overrides
            command = [*command[:cut], "--ray-address", address, *command[cut:]]
        rc = run_logged(command, log)
        if rc:
            explain_failure(log)
        if cluster is not None:  # before Ray stops: a worker's Ray then knows the run ended
            if rc:
                roles.mark_failed(cluster, rc, "2")
            else:
                roles.mark_head(cluster, "trained")
        return rc
    finally:
        if ray is not None:
            ray.stop()
