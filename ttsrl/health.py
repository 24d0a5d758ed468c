"""Is a KServe-v2 reward server ready?  ``python -m ttsrl.health URL [--wait SECONDS]``.

Exit status 0 when ``URL/v2/health/ready`` (``ttsrl.protocol.READY_PATH``) answers 200 (within ``--wait`` seconds)."""

import argparse
import sys
import time

import requests

from .protocol import READY_PATH


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("url")
    p.add_argument("--wait", type=float, default=0.0, help="keep trying this many seconds")
    a = p.parse_args(argv)
    return 0 if wait_ready(a.url, a.wait) else 1


if __name__ == "__main__":
    sys.exit(main())
