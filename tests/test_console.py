"""Stage 2's console filter (ttsrl/console.py) on lines in verl's own format.

The metric lines are made by verl 0.9.1's console logger itself
(``concat_dict_to_str``), so a change of verl's format fails here.
"""

import io
import signal
import subprocess
import sys
from pathlib import Path

from verl.utils.logger.aggregate_logger import concat_dict_to_str

from ttsrl.console import ProgressLines, StepConsole, parse_metrics

ROOT = Path(__file__).resolve().parents[1]


def _metrics(step: int, reward: float, extra: dict | None = None) -> dict:
    m = {"actor/entropy": 1.2, "critic/score/mean": reward, "critic/score/max": 1.0,
         "response_length/mean": 40.0 + step, "timing_s/step": 5.0, "perf/throughput": 123.4}
    return {**m, **(extra or {})}


def test_parse_verl_console_line():
    line = concat_dict_to_str(_metrics(3, 0.25, {"note": "text is skipped"}), step=3)
    step, m = parse_metrics(line)
    assert step == 3 and m["critic/score/mean"] == 0.25 and m["timing_s/step"] == 5.0
    assert "note" not in m
    assert parse_metrics("(WorkerDict pid=12) step:3 is not a metric line") is None
    # verl's trainer runs in a Ray actor: its lines reach the driver coloured and prefixed
    for prefix in ("\x1b[36m(TaskRunnerV1 pid=4987)\x1b[0m ", "(TaskRunnerV1 pid=4987, ip=10.0.0.2) "):
        assert parse_metrics(prefix + line) == (step, m)


def test_one_compact_line_per_step_with_eta():
    console = StepConsole()
    assert console.feed("[train_grpo] verl command: python -m verl.trainer.main_ppo trainer.total_training_steps=80 x=1")
    assert console.total == 80
    val0 = console.feed(concat_dict_to_str({"val-core/embedded/reward/mean@1": 0.2}, step=0))
    assert val0.startswith("step  0/80") and "val reward 0.200" in val0 and "(validation)" in val0
    assert console.feed("(WorkerDict pid=7) some worker chatter") is None
    line = console.feed("\x1b[36m(TaskRunnerV1 pid=9)\x1b[0m " + concat_dict_to_str(_metrics(10, 0.4), step=10))
    assert line == "step 10/80  reward 0.400  len  50.0    5.0 s/step  ETA 5m50s", line
    last = console.feed(concat_dict_to_str(_metrics(80, 0.5, {"val-core/embedded/reward/mean@1": 0.45}), step=80))
    assert "val reward 0.450" in last and "ETA" not in last
    assert console.summary() == ("train reward 0.400 (step 10) -> 0.500 (step 80); "
                                 "val reward 0.200 (step 0) -> 0.450 (step 80)")


def test_cli_logs_everything_and_survives_ctrl_c(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("the killed run's log\n")
    proc = subprocess.Popen([sys.executable, "-m", "ttsrl.console", "--log", str(log)], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    # no sleeps: the banner is printed after the SIGINT handler is set, and the step line
    # comes back only once the filter has read and logged its input
    assert proc.stdout.readline().startswith("[console] one line per step here")
    proc.stdin.write(concat_dict_to_str(_metrics(1, 0.3), step=1) + "\n")
    proc.stdin.flush()
    assert proc.stdout.readline().startswith("step   1  reward 0.300")
    proc.send_signal(signal.SIGINT)  # Ctrl-C: verl is still printing while it shuts down
    proc.stdin.write("Training Progress:  1%|   | 1/80 [00:05<06:35]\rafter ctrl-c\n")
    proc.stdin.close()
    out = proc.stdout.read()
    assert proc.wait(timeout=30) == 0
    assert out == "train reward 0.300 (step 1) -> 0.300 (step 1)\n", out  # the summary, nothing else
    text = log.read_text()
    assert text.startswith("the killed run's log\n")  # appended, not overwritten
    assert "critic/score/mean:0.3" in text and "after ctrl-c" in text


def test_progress_lines_at_the_first_step_every_30_s_and_the_last():
    now = [100.0]
    out = io.StringIO()
    progress = ProgressLines(total=10, label="build", every_s=30.0, out=out, clock=lambda: now[0])
    shown = []
    for step, t in enumerate([1.0, 20.0, 31.5, 40.0, 62.0, 63.0, 64.0, 65.0, 66.0, 67.0], start=1):
        now[0] = 100.0 + t
        if progress.update(step, loss=2.0 / step):
            shown.append(step)
    assert shown == [1, 3, 5, 10]  # t = 1 s, 31.5 s (>= 30 s after 1 s), 62 s, and the last step
    lines = out.getvalue().splitlines()
    assert lines[0] == "build: step  1/10  loss 2.000  elapsed 1s  ETA 9s"
    assert lines[1] == "build: step  3/10  loss 0.667  elapsed 32s  ETA 1m14s"  # 31.5 s / 3 steps x 7 left
    assert lines[-1] == "build: step 10/10  loss 0.200  elapsed 1m07s"


def test_why_finds_the_cause_above_pages_of_warnings(tmp_path):
    """On a full disk the tail of stage 2's log is warnings; --why prints the
    line that says Errno 28 (and the exception's last line), from the last run only."""
    log = tmp_path / "train_grpo.log"
    old_run = "==== 2026-12-01 stage 2 output follows\nValueError: from an earlier run\n"
    this_run = ("==== 2026-12-03 stage 2 output follows\nstep:1 - critic/score/mean:0.5\n"
                "(TaskRunner pid=42) OSError: [Errno 28] No space left on device: '/ckpt/global_step_2'\n"
                + "".join(f"(pid=7) UserWarning: something deprecated {i}\n" for i in range(40))
                + "ray.exceptions.RayTaskError(OSError): [Errno 28] No space left on device\n")
    log.write_text(old_run + this_run)
    r = subprocess.run([sys.executable, "-m", "ttsrl.console", "--why", str(log)], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "  OSError: [Errno 28] No space left on device: '/ckpt/global_step_2'", lines
    assert "from an earlier run" not in r.stdout and "Warning" not in r.stdout and len(lines) == 2
