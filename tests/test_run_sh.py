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
from pathlib import Path
from urllib.parse import urlparse

import pytest
from conftest import start_reward_server, stop_process

ROOT = Path(__file__).resolve().parents[1]
SHELL_SCRIPTS = ["run.sh", "scripts/install.sh", "scripts/test.sh", "presets/embedded.sh", "presets/gpu8.sh"]


def run_sh(*args, env=None, timeout=300):
    return subprocess.run(["bash", str(ROOT / "run.sh"), *args], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_help_and_bad_arguments():
    r = run_sh("--help")
    assert r.returncode == 0 and "bash run.sh START STOP" in r.stdout
    # the override rule, and what a preset must set (from the list run.sh checks)
    assert "a setting given in the" in r.stdout and "environment wins" in r.stdout, r.stdout
    assert "A preset must set DEVICE EXP_DIR" in r.stdout and "the arrays REWARD_ARGS GRPO_ARGS EVAL_ARGS" in r.stdout
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


def test_shell_scripts_parse_and_pass_shellcheck():
    for script in SHELL_SCRIPTS:
        r = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True)
        assert r.returncode == 0, (script, r.stderr)
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (scripts/install.sh installs it with apt-get as root)")
    r = subprocess.run(["shellcheck", "-x", *SHELL_SCRIPTS], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


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
def hand_started_server():
    """A reward server started by hand (not by run.sh) on a free loopback port."""
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

    # a second run (a resume) appends to the log instead of overwriting it
    r = run_sh("2", "2", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    again = log.read_text()
    assert again.startswith(text) and again.count("stage 2 output follows") == 2


def test_server_of_a_crashed_run_is_adopted_and_stopped(hand_started_server, tmp_path):
    proc, port = hand_started_server
    exp, env = _dry_run_preset(tmp_path, port)
    exp.mkdir(parents=True)
    (exp / "reward_server.pid").write_text(f"{proc.pid}\n")  # as a run.sh killed mid-way leaves it
    r = run_sh("2", "2", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "started by an earlier run" in r.stdout and "reward server stopped" in r.stdout
    proc.wait(timeout=30)
    assert not (exp / "reward_server.pid").exists()


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


def test_failed_training_says_so(hand_started_server, tmp_path):
    _, port = hand_started_server
    exp, env = _dry_run_preset(tmp_path, port, grpo_args="(--preset cpu --no-such-option)")
    r = run_sh("2", "3", env=env)
    assert r.returncode == 1
    assert "stage 2 failed" in r.stderr and "--no-such-option" in r.stderr  # the log's end is shown
    assert "==== stage 3" not in r.stdout


# ---------------------------------------------------------------------------- the preset contract
def _config(env_extra: dict | None = None, preset: str | Path = "presets/embedded.sh",
            ok: bool = True) -> dict | subprocess.CompletedProcess:
    """`bash run.sh --config` for PRESET: the settings a run would use, NAME -> str (one value)
    or list (an argument list, its words as run.sh passes them)."""
    r = run_sh("--config", env={**os.environ, "PRESET": str(preset), **(env_extra or {})}, timeout=60)
    if not ok:
        return r
    assert r.returncode == 0 and not r.stderr, r.stdout + r.stderr
    settings = {}
    for line in r.stdout.splitlines():
        name, _, value = line.partition("=")
        if value.startswith("(") and value.endswith(")"):
            settings[name] = shlex.split(value[1:-1])
        else:
            settings[name] = "".join(shlex.split(value))
    return settings


def _preset_values(preset: Path) -> list[str]:
    """The names a preset sets one value to; each must be written `: "${NAME:=value}"`, the one
    form that lets the environment win."""
    names = []
    for number, line in enumerate(preset.read_text().splitlines(), 1):
        if m := re.match(r': "\$\{([A-Z0-9_]+):=', line):
            names.append(m.group(1))
        else:  # NAME=value at the start of a line would ignore the environment
            assert not re.match(r"[A-Z0-9_]+=[^(]", line), f"{preset.name}:{number}: {line}"
    return names


@pytest.mark.parametrize("preset", ["embedded.sh", "gpu8.sh"])
def test_the_environment_wins_over_every_preset_value(preset):
    """One rule for both presets (gpu8 used to honour some variables, embedded almost none):
    every value a preset sets yields to the environment, and so do run.sh's own defaults."""
    path = ROOT / "presets" / preset
    names = _preset_values(path)
    assert {"DEVICE", "EXP_DIR", "TRAIN_FILE", "TEST_FILE", "DEV_SIZE", "EVAL_NPROC"} <= set(names), names
    plain = _config(preset=path)
    given = {name: str(7000 + i) for i, name in enumerate(names)}  # numbers: DEV_SIZE is one
    got = _config(given, preset=path)
    words = {w for v in got.values() if isinstance(v, list) for w in v}
    for name, value in given.items():
        if name in got:
            assert got[name] == value != plain[name], (name, plain[name], got[name])
        else:  # a preset's own path (gpu8's PROMPT_DIR, ...) reaches its argument lists
            assert value in words or any(w.endswith("=" + value) for w in words), (name, got)
    # run.sh's defaults yield the same way
    got = _config({"HF_MODEL_DIR": "/elsewhere/hf", "REWARD_PORT": "8123", "LOGGERS": "console,tensorboard"},
                  preset=path)
    assert got["HF_MODEL_DIR"] == "/elsewhere/hf" and got["REWARD_PORT"] == "8123"
    assert got["GRPO_ARGS"][got["GRPO_ARGS"].index("--loggers") + 1] == "console,tensorboard"


@pytest.mark.parametrize("preset", ["embedded.sh", "gpu8.sh"])
def test_derived_settings_follow_exp_dir(preset, tmp_path):
    exp = str(tmp_path / "my exp")
    got = _config({"EXP_DIR": exp}, preset=ROOT / "presets" / preset)
    assert got["PRESET_NAME"] == preset.removesuffix(".sh")
    assert {k: got[k] for k in ("HF_MODEL_DIR", "DATA_DIR", "CKPT_DIR", "MERGED_DIR", "EVAL_DIR", "EXPORT_PATH",
                                "TENSORBOARD_DIR")} == {
        "HF_MODEL_DIR": f"{exp}/hf_model", "DATA_DIR": f"{exp}/data", "CKPT_DIR": f"{exp}/checkpoints",
        "MERGED_DIR": f"{exp}/merged", "EVAL_DIR": f"{exp}/eval", "EXPORT_PATH": f"{exp}/llm-new.pt",
        "TENSORBOARD_DIR": f"{exp}/tensorboard"}
    assert got["DEV_SET"] == f"{exp}/data/split/dev.jsonl"
    # a preference run keeps GRPO's results: its own folders under EXP_DIR/$TRAINER
    got = _config({"EXP_DIR": exp, "TRAINER": "kto"}, preset=ROOT / "presets" / preset)
    assert (got["MERGED_DIR"], got["EVAL_DIR"], got["EXPORT_PATH"], got["PAIRS_FILE"]) == (
        f"{exp}/kto/merged", f"{exp}/kto/eval", f"{exp}/llm-kto.pt", f"{exp}/pairs/pairs.parquet")


def test_a_preset_missing_settings_is_named_in_one_message(tmp_path):
    """A missing preset variable died with bash's "unbound variable" at the first one; now one
    message names every missing setting, every list that is not an array, and the preset."""
    preset = tmp_path / "mine.sh"
    text = (ROOT / "presets" / "embedded.sh").read_text()
    text = re.sub(r'^: "\$\{(DEVICE|EXP_DIR):=.*\n', "", text, flags=re.M)
    assert "DEVICE" not in text.split("GRPO_ARGS")[0] and "EXP_DIR:=" not in text
    preset.write_text(text + 'unset PREF_ARGS EVAL_ARGS; PREF_ARGS="--lr 1e-4 --beta 0.1"\n')
    for args in (("0", "0"), ("--config",)):
        r = run_sh(*args, env={**os.environ, "PRESET": str(preset)}, timeout=60)
        assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
        lines = r.stderr.splitlines()
        assert len(lines) == 2, r.stderr
        assert lines[0].startswith(f"{preset}: it does not set DEVICE EXP_DIR EVAL_ARGS (every preset sets"), lines
        assert lines[1] == f'{preset}: PREF_ARGS must be a bash array, e.g. PREF_ARGS=(--flag "a value")', lines
        assert "unbound variable" not in r.stderr
    # the environment may supply a required value
    r = run_sh("--config", env={**os.environ, "PRESET": str(preset), "DEVICE": "cpu", "EXP_DIR": str(tmp_path)})
    assert r.returncode == 2 and "does not set EVAL_ARGS (" in r.stderr, r.stderr


def test_preset_lists_must_be_arrays(tmp_path):
    for name in ("GRPO_ARGS", "REWARD_ARGS", "MINE_ARGS", "PREF_LAUNCH"):
        preset = tmp_path / f"{name}.sh"
        preset.write_text((ROOT / "presets" / "embedded.sh").read_text() + f'unset {name}; {name}="--a b"\n')
        r = run_sh("2", "2", env={**os.environ, "PRESET": str(preset)}, timeout=60)
        assert r.returncode == 2 and r.stderr == f"{preset}: {name} must be a bash array, " \
            f'e.g. {name}=(--flag "a value")\n', r.stderr
        assert "==== stage" not in r.stdout


def test_reward_extra_keeps_a_quoted_value_one_argument(tmp_path):
    """gpu8 split REWARD_EXTRA unquoted; run.sh now splits it as the shell splits words, for
    every preset, and adds the words to the preset's REWARD_ARGS (what stage 1 passes)."""
    gpu8 = ROOT / "presets" / "gpu8.sh"
    plain = _config(preset=gpu8)["REWARD_ARGS"]
    # the reference-exact reward of the preset's header
    got = _config({"REWARD_EXTRA": "--no-length-guard --reward tanh_reference"}, preset=gpu8)["REWARD_ARGS"]
    assert got == [*plain, "--no-length-guard", "--reward", "tanh_reference"]
    got = _config({"REWARD_EXTRA": "--no-length-guard --prompt-dir '/my prompts' --x \"a \\\"b\\\"\""},
                  preset=gpu8)["REWARD_ARGS"]
    assert got == [*plain, "--no-length-guard", "--prompt-dir", "/my prompts", "--x", 'a "b"'], got
    assert _config({"REWARD_EXTRA": "--log-level 'WARNING'"})["REWARD_ARGS"] == ["--log-level", "WARNING"]
    # nothing in it runs
    got = _config({"REWARD_EXTRA": f"$(touch {tmp_path}/ran) `touch {tmp_path}/ran`"})["REWARD_ARGS"]
    assert len(got) == 4 and not (tmp_path / "ran").exists(), got
    # a preset may give it as an array
    preset = tmp_path / "p.sh"
    preset.write_text(gpu8.read_text() + "REWARD_EXTRA=(--prompt-dir '/my prompts')\n")
    assert _config(preset=preset)["REWARD_ARGS"] == [*plain, "--prompt-dir", "/my prompts"]
    r = _config({"REWARD_EXTRA": "--prompt-dir '/my prompts"}, preset=gpu8, ok=False)
    assert r.returncode == 2 and r.stderr.startswith("REWARD_EXTRA (--prompt-dir '/my prompts): not words as the"
                                                     " shell splits them (ValueError: No closing quotation)"), r.stderr


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


def test_install_stamp_covers_the_torch_pin_and_the_installer(tmp_path):
    """The stamp (what install.sh compares with the venv's record to decide whether to install
    again) changes with the CPU torch pin, now in requirements-torch-cpu.txt, and with
    install.sh itself; install.sh holds no torch version of its own."""
    files = ["scripts/install.sh", "pyproject.toml", "constraints-cpu.txt",
             *(p.name for p in ROOT.glob("requirements*.txt"))]
    assert "requirements-torch-cpu.txt" in files
    for f in files:
        (tmp_path / f).parent.mkdir(exist_ok=True)
        shutil.copy(ROOT / f, tmp_path / f)

    def stamp() -> str:
        r = subprocess.run(["bash", str(tmp_path / "scripts" / "install.sh"), "--stamp"], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0 and re.fullmatch(r"[0-9a-f]{16}\n", r.stdout), r.stdout + r.stderr
        return r.stdout

    first = stamp()
    assert stamp() == first
    pin = tmp_path / "requirements-torch-cpu.txt"
    assert re.search(r"^torch==\S+$", pin.read_text(), flags=re.M), pin.read_text()
    pin.write_text(pin.read_text().replace("torch==", "torch==9"))
    second = stamp()
    assert second != first
    with (tmp_path / "scripts" / "install.sh").open("a") as f:
        f.write("# edited\n")
    assert stamp() not in (first, second)
    installer = (ROOT / "scripts" / "install.sh").read_text()
    assert "-r requirements-torch-cpu.txt" in installer and not re.search(r"torch==\d", installer)


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


def test_user_pairs_that_do_not_exist_stop_before_any_stage(tmp_path):
    """Issue 22: USER_PAIRS=/nonexistent stopped inside stage 2 with a traceback."""
    env = {**os.environ, "TRAINER": "dpo", "USER_PAIRS": str(tmp_path / "nonexistent.jsonl"),
           "EXP_DIR": str(tmp_path / "exp")}
    r = run_sh("2", "2", env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"USER_PAIRS={tmp_path / 'nonexistent.jsonl'}: no such readable file" in r.stderr
    assert "==== stage" not in r.stdout and "Traceback" not in r.stderr


def test_user_pairs_never_replace_mined_pairs_and_a_bad_file_says_stage_2_failed(tiny_hf, tmp_path):
    """Issue 22, findings 3 and 8: USER_PAIRS is converted into its own file; a bad one
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
