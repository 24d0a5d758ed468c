"""Stage 4's processes die with run.sh: a shell that started torchrun through
``python -m ttsrl.lifeline`` is killed with SIGKILL, and torchrun and both of its ranks (real
torchrun, ranks in sessions of their own, each calling ``die_with_parent`` as infer_dataset.py
does) are gone within seconds; without the lifeline they survive (the check that the test can fail)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

RANK = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    if os.environ.get("LIFELINE") == "1":
        from ttsrl.lifeline import die_with_parent
        die_with_parent()
    Path(sys.argv[1], f"rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))
    time.sleep(120)
""")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False


def start_and_kill_the_shell(tmp_path: Path, lifeline: bool) -> list[int]:
    """Pids of torchrun and its two ranks, 8 s after SIGKILL of the shell that started them."""
    (tmp_path / "rank.py").write_text(RANK)
    wrap = f'"{sys.executable}" -m ttsrl.lifeline ' if lifeline else ""
    script = (f'{wrap}"{sys.executable}" -m torch.distributed.run --standalone --nproc_per_node 2 '
              f'"{tmp_path / "rank.py"}" "{tmp_path}" & echo $! > "{tmp_path / "torchrun.pid"}"; wait')
    env = {**os.environ, "LIFELINE": "1" if lifeline else "0", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    shell = subprocess.Popen(["bash", "-c", script], env=env, start_new_session=True)
    pids: list[int] = []
    try:
        deadline = time.time() + 90
        while time.time() < deadline and not all((tmp_path / f"rank{r}.pid").is_file() for r in (0, 1)):
            time.sleep(0.2)
        pids = [int((tmp_path / n).read_text()) for n in ("torchrun.pid", "rank0.pid", "rank1.pid")]
        shell.kill()  # SIGKILL: no trap, nothing forwarded
        shell.wait(10)
        time.sleep(8)
        return [p for p in pids if alive(p)]
    finally:
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.slow  # torchrun with two ranks: ~10 s
def test_torchrun_and_its_ranks_die_with_the_shell(tmp_path):
    assert start_and_kill_the_shell(tmp_path, lifeline=True) == []


@pytest.mark.slow  # torchrun with two ranks: ~10 s
def test_without_the_lifeline_they_survive_the_shell(tmp_path):
    assert len(start_and_kill_the_shell(tmp_path, lifeline=False)) == 3
