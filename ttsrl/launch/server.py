"""The reward servers of a run: this machine's started, adopted or used, and every one checked.

:func:`up` (stages 1 and 2, DPO mining): when ``REWARD_URLS`` lists this machine's server
(``url``), a server that answers there already is

* **refused** when it serves another reward, backend, model folder, family or prompt pool (the
  digest of the prompt ids it knows) than the run asks for
  (``expect``: what the run's server would publish in its model metadata), naming both; with
  ``any_server`` it is used anyway, and said so;
* **adopted** when the pid file names the process answering there and that process is a reward
  server (one an earlier, killed ``run.sh`` started): this run's own from then on (run.sh stops it,
  or leaves it running when the run ends at stage 1, as one it started);
* else **used** and left running (one started by hand); a stale pid file is removed.

Otherwise the server command is started in a session of its own, its pid written to the pid file,
and waited for (``timeout``); a server that exits or does not come up stops the stage with its
log's tail. Then every server of the list must answer ready (or ``at_least`` of them) and serve
what the run asks for. :func:`down` stops the pid file's process, only when it is a reward server.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from ttsrl.reward.health import identity_problem, not_ready_reason, ready, wait_ready_all
from ttsrl.reward.protocol import split_urls

SERVER_SCRIPT = "token2wav_asr_server.py"


def is_reward_server(pid: int) -> bool:
    """Process ``pid`` runs the reward server (a pid file can outlive its process, and the pid
    be reused by another)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(a.endswith(SERVER_SCRIPT.encode()) for a in args)


def read_pid(pid_file: Path) -> int | None:
    try:
        text = pid_file.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _say(text: str) -> None:
    print(f"     {text}", flush=True)


def _fail(text: str) -> int:
    print(text, file=sys.stderr, flush=True)
    return 1


def local_up(url: str, pid_file: Path, log: Path, timeout: float, expect: dict[str, str], any_server: bool,
             command: list[str], ours: bool = False) -> int:
    """This machine's server at ``url``: refused, adopted, used or started (see the module doc)."""
    if ready(url):
        problem = identity_problem(url, expect)
        if problem and not any_server:
            asked = ", ".join(f"{k} {v!r}" for k, v in expect.items())
            return _fail(f"{problem}; this run asks for {asked}: stop that server, set REWARD, REWARD_BACKEND, PROMPT_POOL "
                         "or MODEL_FAMILY (or REWARD_PORT) to match, or REWARD_ANY_SERVER=1 to use it anyway")
        if problem:
            _say(f"REWARD_ANY_SERVER=1: using it anyway: {problem}")
        pid = read_pid(pid_file)
        if ours and pid is not None:
            _say(f"reward server of stage 1 answering at {url}")
        elif pid is not None and is_reward_server(pid) and not identity_problem(url, {"pid": str(pid)}):
            # taken over as this run's own: run.sh stops it, or leaves it running and says so, as one it started
            _say(f"reward server already answering at {url} (pid {pid}, started by an earlier run: this run takes "
                 "it over as its own)")
        else:
            pid_file.unlink(missing_ok=True)  # stale: its process is gone or another, or not the one answering
            _say(f"reward server already answering at {url} (not started by run.sh: used, and left running)")
        return 0
    pid_file.unlink(missing_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    pid_file.write_text(f"{proc.pid}\n")
    if not wait_ready_all([url], timeout, pid=proc.pid):
        state = f"exited with status {proc.poll()}" if proc.poll() is not None else f"waited up to {timeout:g}s"
        stop_started(proc, pid_file)  # ours: a server that comes up after the stage failed is never left behind
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        return _fail(f"reward server did not come up ({state}: REWARD_START_TIMEOUT_S); it was stopped; see "
                     f"{log}\n{tail}")
    _say(f"reward server pid {proc.pid} at {url} (log {log})")
    return 0


def stop_started(proc: subprocess.Popen, pid_file: Path, grace: float = 10.0) -> None:
    """Stop a server this call started (its whole session: the server may have spawned workers)
    and forget its pid file."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except OSError:
            pass
    pid_file.unlink(missing_ok=True)


def up(urls: str, url: str, pid_file: Path, log: Path, timeout: float, expect: dict[str, str],
       any_server: bool, command: list[str], at_least: int | None = None, ours: bool = False) -> int:
    """Every server of ``urls`` ready and serving ``expect`` (this machine's ``url`` started when
    listed); 0, or 1 with a message naming what is wrong."""
    listed = split_urls(urls)
    if url in listed:
        rc = local_up(url, pid_file, log, timeout, expect, any_server, command, ours)
        if rc or listed == (url,):
            return rc
    others = [u for u in listed if u != url]
    if url not in listed:  # nothing is started here: say what the stage waits for, and early when nothing answers
        _say(f"waiting up to {timeout:g}s (REWARD_START_TIMEOUT_S) for the reward servers of REWARD_URLS to answer "
             f"ready: {', '.join(others)} (this machine's REWARD_URL {url} is not listed: nothing is started here)")

    def slow(not_ready: list[str]) -> None:
        for u in not_ready:
            _say(f"not ready yet at {u}: {not_ready_reason(u)}; still waiting")
    up_ = wait_ready_all(list(listed), timeout, at_least, on_slow=slow)
    need = len(listed) if at_least is None else at_least
    if len(up_) < need:
        missing = [u for u in listed if u not in up_]
        return _fail(f"reward servers {urls} are not ready: {len(up_)} of {len(listed)} answered within {timeout:g}s, "
                     f"{need} needed; not ready: {', '.join(missing)}")
    problems = [p for p in (identity_problem(u, expect) for u in up_) if p]
    if problems and not any_server:
        return _fail("\n".join(problems) + "\n(every reward server of REWARD_URLS must serve this run's reward; "
                                           "REWARD_ANY_SERVER=1 uses them anyway)")
    if url not in listed:
        _say(f"reward servers answering at {urls} (not started here)")
    return 0


def down(pid_file: Path) -> None:
    """Stop the server the pid file names, if that process is a reward server; remove the file."""
    pid = read_pid(pid_file)
    if pid is None:
        return
    if is_reward_server(pid):
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
    pid_file.unlink(missing_ok=True)
    _say("reward server stopped")
