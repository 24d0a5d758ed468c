"""Are KServe-v2 reward servers ready?  ``python -m ttsrl.reward.health URL[,URL...] [--wait S] [--at-least N] [--pid P]``.

Exit status 0 when ``URL/v2/health/ready`` (``ttsrl.reward.protocol.READY_PATH``) answers 200 for every
listed server (or for at least ``N``) within ``--wait`` seconds; else 1, naming the servers not ready.
With ``--pid``, the wait ends (status 1) as soon as that process (the server being started) has exited.
With ``--expect FIELD=VALUE`` (reward, backend, model_dir, pid, prompt_pool, ...), a ready server that serves something
else gives status 3 (``model_dir``: the absolute model folder of a cosyvoice2 server, compared
as an absolute path; ``model_dir=`` for a backend without one) and a line naming what it serves and what was asked (run.sh adopts a server
only when it serves the run's reward and backend, and stops it only when it is the one it started).
URLs are comma-separated (as in ``TTSRL_REWARD_URL``) and/or separate arguments.
:func:`launch_server` starts the reward-server CLI as a user does and returns its URL once it
says it is ready (tests, benchmarks)."""

import argparse
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import requests

from ttsrl.cli import add_fields, option, parse_into
from ttsrl.reward.protocol import DEFAULT_MODEL_NAME, READY_PATH, split_urls


def ready(url: str, timeout: float = 2.0) -> bool:
    try:
        return requests.get(url.rstrip("/") + READY_PATH, timeout=timeout).status_code == 200
    except requests.RequestException:
        return False


def not_ready_reason(url: str, timeout: float = 2.0) -> str:
    """Why ``url`` is not ready, in a few words: nothing answers there, or what it answers."""
    try:
        r = requests.get(url.rstrip("/") + READY_PATH, timeout=timeout)
    except requests.ConnectionError:
        return "nothing answers there (connection refused or no such host)"
    except requests.RequestException as e:
        return f"no answer ({type(e).__name__})"
    return "it answers ready now" if r.status_code == 200 else f"it answers HTTP {r.status_code} to {READY_PATH}"


def wait_ready(url: str, seconds: float) -> bool:
    return wait_ready_all([url], seconds) == [url]


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not reaped yet, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def wait_ready_all(urls: list[str], seconds: float, at_least: int | None = None, pid: int | None = None,
                   on_slow: Callable[[list[str]], None] | None = None, slow_after: float = 5.0) -> list[str]:
    """Poll ``urls`` until all (or ``at_least`` of them) are ready, ``seconds`` pass or process ``pid``
    has exited; the ready ones. ``on_slow(not_ready)`` is called once, ``slow_after`` seconds in, when
    some are not ready yet (a wait of minutes on a URL where nothing listens says so early)."""
    need = len(urls) if at_least is None else at_least
    start = time.monotonic()
    deadline = start + seconds
    ready_urls: list[str] = []
    while True:
        ready_urls += [u for u in urls if u not in ready_urls and ready(u)]
        if len(ready_urls) >= need or time.monotonic() >= deadline or (pid is not None and not alive(pid)):
            return [u for u in urls if u in ready_urls]
        if on_slow is not None and time.monotonic() - start >= slow_after:
            on_slow([u for u in urls if u not in ready_urls])
            on_slow = None
        time.sleep(0.5)


READY_LINE = "ready on http://"  # what token2wav_asr_server.py prints once it serves

#: what a run asks of a server it adopts -> the model metadata field that says it
IDENTITY_FIELDS = {"reward": "reward", "backend": "backend_name", "model_dir": "model_dir", "sim_weight": "sim_weight",
                   "mos_weight": "mos_weight", "length_guard": "length_guard", "pid": "pid",
                   "prompt_pool": "prompt_pool_sha1", "family": "family"}


def metadata(url: str, model: str = DEFAULT_MODEL_NAME) -> dict:
    """The model metadata the server at ``url`` serves (raises ``requests.RequestException`` or
    ``ValueError`` when it gives none)."""
    meta = requests.get(f"{url.rstrip('/')}/v2/models/{model}", timeout=5).json()
    if not isinstance(meta, dict):
        raise ValueError(f"model metadata is not a JSON object: {str(meta)[:100]}")
    return meta


def identity_problem(url: str, expect: dict[str, str], model: str = DEFAULT_MODEL_NAME) -> str | None:
    """None when the server at ``url`` serves what ``expect`` names (keys of IDENTITY_FIELDS: the
    reward variant, backend name, CosyVoice model folder (absolute; "" for backends without one),
    SIM weight, MOS weight, length guard, its process id, the sha1 of its prompt pool's sorted ids:
    ``ttsrl.reward.backends.base.prompt_pool_sha1``, so a zero-shot run can require a server whose
    PROMPT_IDs are its rows'), else a sentence naming what it serves and what was asked."""
    try:
        meta = metadata(url, model)
    except (requests.RequestException, ValueError) as e:
        return f"{url} gave no model metadata ({type(e).__name__}: {e})"
    wrong = identity_mismatches(meta, expect)
    return f"the reward server at {url} serves {', '.join(wrong)}" if wrong else None


def identity_mismatches(meta: dict, expect: dict[str, str]) -> list[str]:
    """What a server's model metadata ``meta`` serves unlike ``expect`` (keys of IDENTITY_FIELDS),
    one phrase each: the one comparison of a server's identity, before any training (the launcher
    adopting a server, train_grpo.py before verl starts)."""
    expect = {k: os.path.abspath(v) if k == "model_dir" and v else v for k, v in expect.items()}
    return [f"{k} {meta.get(IDENTITY_FIELDS[k])!r} (this run asks for {v!r})" for k, v in expect.items()
            if not _same(k, meta.get(IDENTITY_FIELDS[k]), v)]


def _same(key: str, served, asked: str) -> bool:
    if key == "mos_weight" and served is None:  # a server older than the MOS term scores without it
        served = 0.0
    if key in ("sim_weight", "mos_weight"):  # a number however it was spelled (0, 0.0, "0.1")
        try:
            return float(served) == float(asked)
        except (TypeError, ValueError):
            return False
    return str(served) == asked


def launch_server(*args: str, timeout: float = 120.0, root: Path | None = None) -> tuple[subprocess.Popen, str]:
    """Start ``token2wav_asr_server.py ARGS`` (pass ``--port 0`` for any free port) and
    return (process, URL) once it prints that it is ready. Its output keeps being drained
    so a full pipe never blocks it; RuntimeError with what it printed if it does not start.
    ``root``: the checkout whose server to start (default this one; benchmarks compare commits)."""
    script = (Path(root) if root else Path(__file__).resolve().parents[2]) / "token2wav_asr_server.py"
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


def parse_expect(item: str) -> tuple[str, str]:
    """``--expect FIELD=VALUE`` -> (FIELD, VALUE), FIELD one of IDENTITY_FIELDS."""
    key, sep, value = item.partition("=")
    if not sep or key not in IDENTITY_FIELDS:
        raise ValueError(f"--expect {item!r}: expected FIELD=VALUE with FIELD one of {', '.join(IDENTITY_FIELDS)}")
    return key, value


@dataclass
class HealthCheck:
    """What ``python -m ttsrl.reward.health`` checks; each field is also its argument."""
    urls: list[str] = option(positional=True, append=True, metavar="URL",
                             help="base URL(s) of reward servers, comma-separated or separate")
    wait: float = option(0.0, help="keep trying this many seconds")
    at_least: int | None = option(None, metavar="N", help="succeed once N servers are ready (none: all of them)")
    expect: list[tuple[str, str]] = option(
        [], append=True, parse=parse_expect, metavar="FIELD=VALUE",
        help=f"also check that the server serves this ({', '.join(IDENTITY_FIELDS)}; repeatable): exit 3 naming "
             "what it serves instead")
    pid: int | None = option(None, help="the server process being started: stop waiting once it has exited")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_fields(p, HealthCheck)
    a = parse_into(p, HealthCheck, p.parse_args(argv))
    try:
        urls = list(split_urls(",".join(a.urls)))
    except ValueError as e:
        p.error(str(e))
    if a.at_least is not None and not 1 <= a.at_least <= len(urls):
        p.error(f"--at-least {a.at_least}: expected 1..{len(urls)} (the number of URLs)")
    expect = dict(a.expect)
    up = wait_ready_all(urls, a.wait, a.at_least, a.pid)
    need = len(urls) if a.at_least is None else a.at_least
    if len(up) >= need:
        problems = [w for w in (identity_problem(u, expect) for u in up) if w] if expect else []
        for w in problems:
            print(w, file=sys.stderr)
        return 3 if problems else 0
    if a.pid is not None and not alive(a.pid):
        print(f"the reward server (pid {a.pid}) exited before it was ready", file=sys.stderr)
    missing = [u for u in urls if u not in up]
    print(f"{len(up)} of {len(urls)} reward servers ready, {need} needed; not ready: {', '.join(missing)}",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
