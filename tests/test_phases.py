"""scripts/phases.sh, the phase runner of scripts/gpu_check.sh: every phase runs under its own
limit, a failed or timed-out one is recorded and the next one still runs, and the summary at the
end says what passed (exit 1 when something did not). Real commands and real timeouts."""

import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(body: str) -> tuple[subprocess.CompletedProcess, float]:
    script = f"set -euo pipefail\ncd {ROOT}\nsource scripts/phases.sh\n{body}\n"
    t0 = time.monotonic()
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120)
    return r, time.monotonic() - t0


def test_each_phase_is_recorded_and_the_next_runs_after_a_failure_or_a_timeout():
    r, took = _run("""
export GREETING=hello
says() { echo "$GREETING from a phase"; return "$1"; }
export -f says
phase "first" 10 true
phase "hangs" 1 sleep 60
phase "fails" 10 says 3
phase "last" 10 says 0
phases_summary""")
    assert r.returncode == 1, r.stdout + r.stderr
    assert took < 30  # the hanging phase was stopped at its limit
    lines = [line.split() for line in r.stdout.splitlines() if line.startswith("  ")]
    assert [(w[0], w[-1]) for w in lines] == [("first", "passed"), ("hangs", "1s)"), ("fails", "3)"),
                                             ("last", "passed")], r.stdout
    assert "hangs  " in r.stdout and "TIMED OUT (limit 1s)" in r.stdout and "FAILED (exit 3)" in r.stdout
    assert r.stdout.count("hello from a phase") == 2  # a shell function sees the exported settings


def test_all_passed_exits_zero():
    r, _ = _run('phase "one" 5 true\nphase "two" 5 bash -c "exit 0"\nphases_summary')
    assert r.returncode == 0 and r.stdout.count("s  passed") == 2, r.stdout + r.stderr
