"""Is a KServe-v2 reward server ready?  ``python -m ttsrl.reward.health URL [--wait SECONDS]``.

Exit status 0 when ``URL/v2/health/ready`` (``ttsrl.reward.protocol.READY_PATH``) answers 200 (within ``--wait`` seconds).
:func:`launch_server` starts the reward-server CLI as a user does and returns its URL once it
says it is ready (tests, benchmarks, ``scripts/gpu_check.py``)."""

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests

from ttsrl.reward.protocol import READY_PATH


def ready(url: str, timeout: float = 2.0) -> bool:
    try:
        return requests.get(url.rstrip("/") + READY_PATH, timeout=timeout).status_code == 200
    except requests.RequestException:
        return False


def wait_ready(url: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while True:
        if ready(url):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)


READY_LINE = "ready on http://"  # what token2wav_asr_server.py prints once it serves


def launch_server(*args: str, timeout: float = 120.0) -> tuple[subprocess.Popen, str]:
    """Start ``token2wav_asr_server.py ARGS`` (pass ``--port 0`` for any free port) and
    return (process, URL) once it prints that it is ready. Its output keeps being drained
    so a full pipe never blocks it; RuntimeError with what it printed if it does not start."""
    script = Path(__file__).resolve().parents[2] / "token2wav_asr_server.py"
    proc = subprocess.Popen([sys.executable, str(script), *args], cwd=script.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen: list[str] = []
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if READY_LINE in line:
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, line.split("ready on ")[1].split()[0]
    proc.kill()
    raise RuntimeError("reward server did not start:\n" + "".join(seen[-40:]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("url")
    p.add_argument("--wait", type=float, default=0.0, help="keep trying this many seconds")
    a = p.parse_args(argv)
    return 0 if wait_ready(a.url, a.wait) else 1


if __name__ == "__main__":
    sys.exit(main())
