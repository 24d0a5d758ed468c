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


def test_a_skipped_phase_says_why_and_is_neither_a_pass_nor_a_failure():
    r, _ = _run('phase "one" 5 true\nphase_skip "two" "no checkout: X=DIR"\nphases_summary')
    assert r.returncode == 0, r.stdout + r.stderr
    assert "two: SKIPPED (no checkout: X=DIR)" in r.stdout and r.stdout.count("s  passed") == 1, r.stdout
    assert [line.split()[0] for line in r.stdout.splitlines() if "SKIPPED" in line] == ["[phase", "two"], r.stdout


def test_phase_memory_reports_the_peak_in_use_while_the_phase_ran(tmp_path):
    """PHASE_MEMORY=1 (scripts/rehearsal.sh): the peak of MemTotal - MemAvailable while the phase
    ran, and the value at its start, in its own line and in the summary. A fake meminfo file
    (PHASE_MEMINFO) makes it exact: 1 GiB in use at the start, 5 GiB for 1.5 s inside the phase,
    2 GiB for its last second. Without PHASE_MEMORY, no memory column; on the real /proc/meminfo the peak
    is a number at least the start's."""
    import re

    info = tmp_path / "meminfo"

    def meminfo(used_gib: int) -> str:
        return f"MemTotal:       {16 << 20} kB\\nMemFree:     0 kB\\nMemAvailable:   {(16 - used_gib) << 20} kB\\n"

    info.write_text(meminfo(1).replace("\\n", "\n"))
    body = f"""export PHASE_MEMORY=1 PHASE_MEMINFO={info}
grows() {{ printf '{meminfo(5)}' > {info}; sleep 1.5; printf '{meminfo(2)}' > {info}; sleep 1; }}
export -f grows
phase grows 30 grows
phases_summary"""
    r, _ = _run(body)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"grows: passed in \d+s, peak memory in use 5.0 GiB \(1.0 at start\)\n", r.stdout), r.stdout
    assert re.search(r"\n  grows\s+\d+s  5.0 GiB \(1.0 at start\)  passed\n", r.stdout), r.stdout

    r, _ = _run("PHASE_MEMORY=1\nphase real 5 sleep 1\nphases_summary")
    peak, start = map(float, re.findall(r"real\s+\d+s\s+([\d.]+) GiB \(([\d.]+) at start\)\s+passed", r.stdout)[0])
    assert peak >= start > 0, r.stdout
    r, _ = _run("phase quiet 5 true\nphases_summary")
    assert "GiB" not in r.stdout and re.search(r"quiet\s+\d+s  passed", r.stdout), r.stdout
