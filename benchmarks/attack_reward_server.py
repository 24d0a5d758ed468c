"""Attacks on the reward server, counted: hostile bodies, 500s in
/stats, 1,100 idle partial connections under ``ulimit -n 1024`` held for 40 s while
valid requests are sent, then 1,024 connections that each send 4 bytes of a
declared 100 kB body, held while 64 clients send valid requests, and the size of the server's log.

    python benchmarks/attack_reward_server.py [--root CHECKOUT] [--hold-s 40] [--slow-bodies 1024]

``--root`` runs the server of another checkout (e.g. an older commit, to compare).
Prints one line per attack; numbers, no pass/fail.
"""

from __future__ import annotations

import argparse
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from ttsrl.embedded import codec  # noqa: E402
from ttsrl.reward.protocol import DEFAULT_MODEL_NAME, build_payload, infer_path  # noqa: E402

TEXT = "我想喝一杯热茶。"


def bodies() -> dict[str, bytes]:
    """The hostile request bodies of the regression test (tests/test_server_hostile.py)."""
    from test_server_hostile import hostile_bodies

    return hostile_bodies()


def answered(url: str, payload: dict, timeout: float) -> bool:
    """One valid request: answered 200 (False: another status, a refused or reset connection, a timeout)."""
    try:
        return requests.post(url + infer_path(), json=payload, timeout=timeout).status_code == 200
    except requests.RequestException:
        return False


def slow_bodies(url: str, host: str, port: int, a) -> None:
    """``a.slow_bodies`` connections trickling a declared body, held ``a.hold_s`` s while
    ``a.clients`` clients send valid requests back to back; prints what was answered."""
    from concurrent.futures import ThreadPoolExecutor

    socks, refused = [], 0
    for _ in range(a.slow_bodies):
        try:
            s = socket.create_connection((host, port), timeout=5)
            s.sendall(b"POST /v2/models/token2wav_asr/infer HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{\"in")
            socks.append(s)
        except OSError:
            refused += 1
    payload = build_payload(codec.encode(TEXT), TEXT)
    t_end = time.time() + a.hold_s

    def client(_):
        ok = failed = 0
        while time.time() < t_end:
            good = answered(url, payload, timeout=10)
            ok, failed = ok + good, failed + (not good)
        return ok, failed

    with ThreadPoolExecutor(a.clients) as ex:
        results = list(ex.map(client, range(a.clients)))
    ok, failed = (sum(r[i] for r in results) for i in (0, 1))
    for s in socks:  # first: a server they fill could not answer /stats
        s.close()
    time.sleep(0.5)
    st = requests.get(f"{url}/v2/models/{DEFAULT_MODEL_NAME}/stats", timeout=10).json()
    print(f"{'slow-body connections opened':32s} {len(socks)} (refused {refused})")
    print(f"{'valid requests while held':32s} {ok} ok, {failed} failed/timed out ({a.clients} clients, "
          f"{a.hold_s:g} s); evicted slow bodies {st.get('connections_evicted_slow_body', 'absent')}, "
          f"refused {st.get('connections_refused')}, server_errors {st.get('server_errors')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=ROOT, help="checkout whose server to attack")
    ap.add_argument("--hold-s", type=float, default=40.0, help="how long the 1,100 connections are held")
    ap.add_argument("--connections", type=int, default=1100)
    ap.add_argument("--slow-bodies", type=int, default=1024, help="slow-body connections of the last attack")
    ap.add_argument("--clients", type=int, default=64, help="valid clients during the slow-body attack")
    a = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, a.connections + 500), hard))
    log = Path(tempfile.mkdtemp()) / "server.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, str(a.root / "token2wav_asr_server.py"), "--backend", "sim", "--port", "0"],
            cwd=a.root, stdout=f, stderr=subprocess.STDOUT,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024)))
    try:
        while "ready on http://" not in log.read_text():
            time.sleep(0.2)
        url = log.read_text().split("ready on ")[1].split()[0]
        host, port = url.removeprefix("http://").split(":")
        for desc, body in bodies().items():
            r = requests.post(url + infer_path(), data=body, headers={"Content-Type": "application/json"},
                              timeout=30)
            print(f"{desc:32s} HTTP {r.status_code}")
        st = requests.get(f"{url}/v2/models/{DEFAULT_MODEL_NAME}/stats", timeout=10).json()
        print(f"{'/stats server_errors':32s} {st.get('server_errors', 'absent')}")
        print(f"{'tracebacks in log so far':32s} {log.read_text().count('Traceback')}")
        socks, refused = [], 0
        for _ in range(a.connections):
            try:
                s = socket.create_connection((host, int(port)), timeout=5)
                s.sendall(b"POST /v2/models/x/infer HTTP/1.1\r\nHost: x\r\n")
                socks.append(s)
            except OSError:
                refused += 1
        ok = failed = 0
        latencies = []
        payload = build_payload(codec.encode(TEXT), TEXT)
        t_end = time.time() + a.hold_s
        while time.time() < t_end:
            t0 = time.time()
            good = answered(url, payload, timeout=5)
            ok, failed = ok + good, failed + (not good)
            latencies.append(time.time() - t0)
            time.sleep(0.2)
        print(f"{'partial connections opened':32s} {len(socks)} (refused {refused})")
        print(f"{'valid requests while held':32s} {ok} ok, {failed} failed/timed out, "
              f"max latency {max(latencies):.2f} s")
        for s in socks:
            s.close()
        slow_bodies(url, host, int(port), a)
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
    text = log.read_text(errors="replace")
    print(f"{'server log':32s} {log.stat().st_size} bytes, {text.count('Traceback')} tracebacks, "
          f"{text.count('Too many open files')} 'Too many open files'")
    for line in [x for x in text.splitlines() if " ERROR " in x][:3]:
        print(f"{'  error logged':32s} {line[:300]}")


if __name__ == "__main__":
    main()
