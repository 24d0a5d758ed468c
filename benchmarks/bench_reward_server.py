#!/usr/bin/env python
"""Reward-server throughput: the reference client's pattern vs concurrent batched requests.

For each backend it starts ``token2wav_asr_server.py`` as a separate process on a free
loopback port and prints:
  * sequential: one blocking ``requests.post`` per sample, one after another
    (what the reference recipe's reward function does), in sequences/s;
  * concurrent: all samples in flight at once from an asyncio client (what
    ``reward_tts.compute_score`` under verl's async naive manager does), in sequences/s,
    with the server's mean batch size;
  * overhead at batch B: B concurrent requests against an idle server; wall time
    minus the server's backend time (token2wav + ASR + reward), as a share of backend time.

    python benchmarks/bench_reward_server.py                 # sim and whisper
    python benchmarks/bench_reward_server.py --backends sim --sim-n 2000
    python benchmarks/bench_reward_server.py --clients 64 [--server-root OLD_CHECKOUT]
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ttsrl.embedded import codec  # noqa: E402
from ttsrl.reward.health import launch_server  # noqa: E402
from ttsrl.reward.protocol import DEFAULT_MODEL_NAME as MODEL  # noqa: E402
from ttsrl.reward.protocol import build_payload, infer_path  # noqa: E402

TEXTS = ["今天天气很好，我们去公园散步。", "我想喝一杯热茶。", "这本书非常有意思。", "他在二零二三年去了北京。",
         "请把窗户关上，外面风很大。", "明天早上八点我们在学校门口见面。"]


def start_server(backend: str, max_batch: int, extra: list[str], root: Path | None = None) -> tuple[subprocess.Popen, str]:
    return launch_server("--backend", backend, "--port", "0", "--max-batch", str(max_batch), "--max-delay-ms", "10",
                         "--log-level", "WARNING", *extra, timeout=300, root=root)


def stats(url: str) -> dict:
    return requests.get(f"{url}/v2/models/{MODEL}/stats", timeout=10).json()


def workload(n: int) -> list[tuple[list[int], str]]:
    return [(codec.encode(TEXTS[i % len(TEXTS)]), TEXTS[i % len(TEXTS)]) for i in range(n)]


def sequential(url: str, jobs) -> float:
    t0 = time.perf_counter()
    for codes, text in jobs:
        r = requests.post(url + infer_path(MODEL), headers={"Content-Type": "application/json"},
                          json=build_payload(codes, text), timeout=600)
        r.raise_for_status()
        float(r.json()["outputs"][0]["data"][0])
    return len(jobs) / (time.perf_counter() - t0)


async def _concurrent(url: str, jobs) -> float:
    conn = aiohttp.TCPConnector(limit=512)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=1200)) as s:
        async def one(codes, text):
            async with s.post(url + infer_path(MODEL), json=build_payload(codes, text)) as r:
                r.raise_for_status()
                return (await r.json())["outputs"][0]["data"][0]

        t0 = time.perf_counter()
        await asyncio.gather(*(one(c, t) for c, t in jobs))
        return time.perf_counter() - t0


def concurrent(url: str, jobs) -> tuple[float, float]:
    before = stats(url)
    wall = asyncio.run(_concurrent(url, jobs))
    after = stats(url)
    batches = after["batches"] - before["batches"]
    return len(jobs) / wall, (after["items"] - before["items"]) / max(batches, 1)


def overhead(url: str, batch: int, repeats: int) -> tuple[float, float, float, float]:
    """Median (wall s, backend s, overhead share, mean batch size) of ``batch`` concurrent requests."""
    rows = []
    for _ in range(repeats):
        before = stats(url)
        wall = asyncio.run(_concurrent(url, workload(batch)))
        after = stats(url)
        backend = after["backend_seconds"] - before["backend_seconds"]
        nb = after["batches"] - before["batches"]
        rows.append((wall, backend, (wall - backend) / backend, batch / max(nb, 1)))
    return tuple(statistics.median(r[i] for r in rows) for i in range(4))  # type: ignore[return-value]


async def _clients(url: str, jobs, clients: int) -> list[float]:
    """``clients`` closed-loop clients (each sends its next request when the last one
    answered, like one rollout worker each) share ``jobs``; returns every request's latency."""
    queue: asyncio.Queue = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    latencies: list[float] = []
    conn = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=1200)) as s:
        async def client():
            while not queue.empty():
                codes, text = queue.get_nowait()
                t0 = time.perf_counter()
                async with s.post(url + infer_path(MODEL), json=build_payload(codes, text)) as r:
                    r.raise_for_status()
                    await r.json()
                latencies.append(time.perf_counter() - t0)

        await asyncio.gather(*(client() for _ in range(clients)))
    return latencies


def closed_loop(backend: str, clients: int, n: int, extra: list[str], root: Path | None) -> None:
    """Requests/s and latency percentiles of ``clients`` closed-loop clients, ``n`` requests."""
    proc, url = start_server(backend, 32, extra, root)
    try:
        asyncio.run(_clients(url, workload(min(n, clients)), clients))  # warm-up
        t0 = time.perf_counter()
        lat = sorted(asyncio.run(_clients(url, workload(n), clients)))
        wall = time.perf_counter() - t0
        pct = {q: lat[min(len(lat) - 1, int(q / 100 * len(lat)))] * 1000 for q in (50, 99)}
        where = f" (server of {root})" if root else ""
        print(f"[{backend}] {clients} clients, {n} requests{where}: {n / wall:8.1f} requests/s, "
              f"p50 {pct[50]:8.1f} ms, p99 {pct[99]:8.1f} ms")
        sys.stdout.flush()
    finally:
        proc.terminate()
        proc.wait(30)


def bench(backend: str, n_seq: int, n_conc: int, batch: int, repeats: int, extra: list[str]) -> None:
    proc, url = start_server(backend, 32, extra)
    try:
        sequential(url, workload(2))  # warm up connections and caches
        seq = sequential(url, workload(n_seq))
        conc, mean_batch = concurrent(url, workload(n_conc))
        wall, backend_s, share, ob = overhead(url, batch, repeats)
        print(f"[{backend}] sequential (reference pattern): {seq:9.1f} seq/s   (n={n_seq})")
        print(f"[{backend}] concurrent (batched):           {conc:9.1f} seq/s   (n={n_conc}, "
              f"mean batch {mean_batch:.1f}, speed-up x{conc / seq:.1f})")
        print(f"[{backend}] batch {batch}: wall {wall * 1000:.1f} ms, backend {backend_s * 1000:.1f} ms, "
              f"server overhead {100 * share:.1f}% of backend time (mean batch {ob:.1f}, median of {repeats})")
        sys.stdout.flush()
    finally:
        proc.terminate()
        proc.wait(30)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="sim,whisper", help="comma-separated: sim, whisper (cosyvoice2: --clients only)")
    p.add_argument("--sim-n", type=int, default=500, help="requests per sim measurement")
    p.add_argument("--whisper-n", type=int, default=8, help="requests per whisper measurement")
    p.add_argument("--whisper-batch", type=int, default=8, help="batch size of the whisper overhead measurement")
    p.add_argument("--repeats", type=int, default=5, help="repeats of the overhead measurement (sim)")
    p.add_argument("--cpu-threads", type=int, default=0, help="threads for the whisper backend (0 = all cores)")
    p.add_argument("--clients", type=int, default=0,
                   help="instead: this many closed-loop clients (e.g. 64), requests/s and p50/p99 latency")
    p.add_argument("--client-requests", type=int, default=10, help="requests per client in --clients mode")
    p.add_argument("--server-root", type=Path, default=None,
                   help="start the server of this checkout (e.g. a git worktree of an older commit)")
    p.add_argument("--server-args", default="",
                   help="more server arguments in --clients mode, e.g. for --backends cosyvoice2: "
                        "'--cosyvoice-model-dir D --prompt-dir P --asr whisper [--cosyvoice-batch-flow]'")
    a = p.parse_args(argv)
    extras = {"sim": [], "whisper": ["--cpu-threads", str(a.cpu_threads)], "cosyvoice2": []}
    if a.clients:
        for name in extras:
            extras[name] = extras[name] + shlex.split(a.server_args)
        for backend in a.backends.split(","):
            closed_loop(backend, a.clients, a.clients * a.client_requests, extras[backend], a.server_root)
        return
    for backend in a.backends.split(","):
        if backend == "sim":
            bench("sim", a.sim_n, a.sim_n, 32, a.repeats, [])
        elif backend == "whisper":
            bench("whisper", a.whisper_n, a.whisper_n, a.whisper_batch, 1, extras["whisper"])
        else:
            p.error(f"unknown backend {backend}")


if __name__ == "__main__":
    main()
