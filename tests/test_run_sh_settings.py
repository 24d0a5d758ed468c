"""The preset contract, owned by run.sh: a preset sets what differs (each value as
``: "${VAR:=value}"``, so the environment wins, the same in every preset), run.sh derives the
rest from EXP_DIR, names every missing setting in one message, takes argument lists as bash
arrays and REWARD_EXTRA as shell words; and the install stamp that decides whether stage -2
installs again. Read through ``bash run.sh --config``, which runs nothing.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_run_sh import ROOT, run_sh


def _copy_installer(tmp_path: Path) -> list[str]:
    """Copy install.sh and every file its stamp hashes into ``tmp_path``; returns their paths."""
    files = ["scripts/install.sh", "pyproject.toml", "constraints-cpu.txt",
             *(p.name for p in ROOT.glob("requirements*.txt"))]
    for f in files:
        (tmp_path / f).parent.mkdir(exist_ok=True)
        shutil.copy(ROOT / f, tmp_path / f)
    return files


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
    from ttsrl.launch.settings import NUMERIC

    given.update({name: "0" if plain.get(name) == "1" else "1" for name in names  # a flag is 0 or 1
                  if NUMERIC.get(name, ("",))[0] == "flag"})
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


@pytest.mark.parametrize("preset", ["embedded.sh", "gpu8.sh", "gpu8_cosyvoice3.sh", "speech_cpu.sh"])
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


@pytest.mark.slow  # run.sh --config round trips: ~8 s
def test_reward_extra_keeps_a_quoted_value_one_argument(tmp_path):
    """gpu8 split REWARD_EXTRA unquoted; run.sh now splits it as the shell splits words, for
    every preset, and adds the words to the preset's REWARD_ARGS (what stage 1 passes)."""
    gpu8 = ROOT / "presets" / "gpu8.sh"
    plain = _config(preset=gpu8)["REWARD_ARGS"]
    # the reference-exact reward of the preset's header: REWARD names the variant, REWARD_EXTRA the rest
    got = _config({"REWARD_EXTRA": "--no-length-guard", "REWARD": "tanh_reference"}, preset=gpu8)
    assert got["REWARD_ARGS"] == [*plain, "--no-length-guard"] and got["REWARD"] == "tanh_reference"
    # the reward's identity travels one road: a --reward (--backend, --port) among the words is refused
    for flag, name in (("--reward tanh_reference", "REWARD"), ("--backend=sim", "REWARD_BACKEND"),
                       ("--port 9", "REWARD_PORT")):
        r = _config({"REWARD_EXTRA": flag}, preset=gpu8, ok=False)
        assert r.returncode == 2 and f"hold {flag.split()[0].split('=')[0]}: set {name} instead" in r.stderr, r.stderr
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


def test_install_stamp_covers_the_torch_pin_and_the_installer(tmp_path):
    """The stamp (what install.sh compares with the venv's record to decide whether to install
    again) changes with the CPU torch pin, now in requirements-torch-cpu.txt, and with
    install.sh itself; install.sh holds no torch version of its own."""
    files = _copy_installer(tmp_path)
    assert "requirements-torch-cpu.txt" in files

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


@pytest.mark.slow  # install.sh behind a 6 s lock
def test_a_second_installer_waits_for_the_first_then_finds_the_venv_up_to_date(tmp_path):
    """Every node of a multi-node run runs stage -2; on a shared checkout they would install
    into one venv at once. install.sh holds a lock per venv: the second waits, then finds the
    stamp current and installs nothing. (The venv is this machine's real Python, linked.)"""
    _copy_installer(tmp_path)
    installer = str(tmp_path / "scripts" / "install.sh")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").symlink_to(sys.executable)
    stamp = subprocess.run(["bash", installer, "--stamp"], capture_output=True, text=True, timeout=60).stdout.strip()
    (tmp_path / ".venv" / ".ttsrl-install-cpu").write_text(stamp)
    lock = tmp_path / ".install-cpu.lock"
    holder = subprocess.Popen(["flock", str(lock), "sleep", "6"])  # the first installer, still busy
    try:
        for _ in range(200):  # until the holder has the lock
            if lock.exists() and subprocess.run(["flock", "-n", str(lock), "true"]).returncode != 0:
                break
            time.sleep(0.05)
        r = subprocess.run(["bash", installer], capture_output=True, text=True, timeout=60)
        holder_done = holder.poll() is not None  # the installer returned only after the lock was let go
    finally:
        holder.wait(timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "another install into" in r.stdout and "is up to date" in r.stdout, r.stdout
    assert holder_done


def test_malformed_or_repeated_reward_urls_are_refused_with_the_settings():
    """A malformed or repeated REWARD_URLS raised ValueError in the launcher (a traceback at stage 1);
    now the settings refuse it before any stage, naming REWARD_URLS."""
    for urls, why in (("foo", "expected http://HOST:PORT"), ("http://a:1,http://a:1/", "listed twice"),
                      (" , ", "no reward server URL")):
        r = _config({"REWARD_URLS": urls}, ok=False)
        assert r.returncode == 2 and r.stderr.startswith(f"REWARD_URLS={urls!r}: "), r.stderr
        assert why in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow  # two servers + run.sh stage 1: ~8 s
def test_reward_urls_list_remote_servers_and_stage_1_waits_for_them(tmp_path):
    """REWARD_URLS names every reward server the clients use; when this machine's REWARD_URL is
    not among them stage 1 starts nothing and waits until all answer (two real sim servers)."""
    from ttsrl.reward.health import launch_server

    servers = [launch_server("--backend", "sim", "--port", "0") for _ in range(2)]
    try:
        urls = ",".join(url for _, url in servers)
        env = {**os.environ, "EXP_DIR": str(tmp_path / "exp"), "REWARD_PORT": "1", "REWARD_URLS": urls}
        assert _config({"REWARD_URLS": urls})["REWARD_URLS"] == urls
        r = run_sh("1", "1", env=env, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"reward servers answering at {urls} (not started here)" in r.stdout
        assert not (tmp_path / "exp" / "reward_server.pid").exists()  # nothing started here
    finally:
        for proc, _ in servers:
            proc.kill()
            proc.wait()


FAKE_VENV_PYTHON = """#!/bin/bash
# a venv's python that installs nothing: it records each pip / uv call; uv exits with UV_RC
if [[ $1 == -m && $2 == pip ]]; then a=("${@:3}"); echo "pip ${a[*]/--disable-pip-version-check}" | tr -s ' ' >> "$CALLS"; exit 0; fi
if [[ $1 == -m && $2 == uv ]]; then echo "uv ${*:3}" >> "$CALLS"; exit "$UV_RC"; fi
if [[ $1 == -c && $2 == *version_info* ]]; then echo 3.11; fi
exit 0
"""


@pytest.mark.parametrize("uv_rc", [0, 1])
def test_install_takes_uv_for_the_cpu_stack_and_pip_where_uv_fails(tmp_path, uv_rc):
    """Stage -2 installs torch with pip, then the CPU stack with uv; where uv fails (a mirror only
    pip is configured for) pip installs the same requirement files, and the venv is stamped either
    way. The venv's python is a fake that records the calls (nothing is installed)."""
    _copy_installer(tmp_path)
    venv_bin = tmp_path / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").write_text(FAKE_VENV_PYTHON)
    (venv_bin / "python").chmod(0o755)
    tools = tmp_path / "tools"  # the optional system tools, present, so that no apt-get runs
    tools.mkdir()
    for name in ("espeak-ng", "shellcheck"):
        (tools / name).write_text("#!/bin/sh\nexit 0\n")
        (tools / name).chmod(0o755)
    calls = tmp_path / "calls.log"
    env = {**os.environ, "PATH": f"{tools}:{os.environ['PATH']}", "CALLS": str(calls), "UV_RC": str(uv_rc)}
    env.pop("TTSRL_USE_PYTHON", None)
    r = subprocess.run(["bash", str(tmp_path / "scripts" / "install.sh")], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    made = calls.read_text().splitlines()
    uv_calls = [c for c in made if c.startswith("uv pip install")]
    pip_stack = [c for c in made if c.startswith("pip install") and "requirements-cpu.txt" in c]
    assert made.index(next(c for c in made if "requirements-torch-cpu.txt" in c)) < made.index(uv_calls[0])
    assert any(c.startswith("pip install uv==") for c in made)
    assert "-r requirements-cpu.txt -c constraints-cpu.txt" in uv_calls[0] and "--compile-bytecode" in uv_calls[0]
    if uv_rc == 0:
        assert len(uv_calls) == 2 and "--no-deps -r requirements-cosyvoice-cpu.txt" in uv_calls[1]
        assert not pip_stack and "uv failed" not in r.stdout
    else:
        assert len(uv_calls) == 1  # the first failure goes straight to pip
        assert pip_stack == ["pip install -r requirements-cpu.txt -c constraints-cpu.txt"]
        assert "pip install --no-deps -r requirements-cosyvoice-cpu.txt" in made
        assert "uv failed" in r.stdout and "installing with pip" in r.stdout
    stamp = subprocess.run(["bash", str(tmp_path / "scripts" / "install.sh"), "--stamp"], capture_output=True,
                           text=True, timeout=60).stdout.strip()
    assert (tmp_path / ".venv" / ".ttsrl-install-cpu").read_text().strip() == stamp


def test_the_cosyvoice3_gpu_preset_is_gpu8_with_cosyvoice3s_folder_backend_checkout_and_rule():
    cv3 = _config(preset=ROOT / "presets" / "gpu8_cosyvoice3.sh")
    cv2 = _config(preset=ROOT / "presets" / "gpu8.sh")
    assert (cv3["MODEL_FAMILY"], cv3["REWARD_BACKEND"], cv2["MODEL_FAMILY"]) == ("cosyvoice3", "cosyvoice3", "cosyvoice2")
    ev = cv3["EVAL_ARGS"]
    assert ev[ev.index("--backend") + 1] == "cosyvoice3" and ev[ev.index("--sampling-rule") + 1] == "cosyvoice3-2026"
    for name in ("REWARD_ARGS", "EVAL_ARGS", "CHECK_INPUTS_ARGS"):
        assert cv3[name][cv3[name].index("--cosyvoice-checkout") + 1] == "third_party/CosyVoice", name
    assert cv3["CHECK_INPUTS_ARGS"][-2:] == ["--backend", "cosyvoice3"]
    assert {k: cv3[k] for k in ("MINE_ARGS", "PREF_ARGS", "PREF_LAUNCH", "DEV_SIZE")} == \
        {k: cv2[k] for k in ("MINE_ARGS", "PREF_ARGS", "PREF_LAUNCH", "DEV_SIZE")}  # gpu8's, not a copy
    r = _config({"MODEL_FAMILY": "cosyvoice2"}, preset=ROOT / "presets" / "gpu8_cosyvoice3.sh", ok=False)
    assert r.returncode == 2 and "another family than MODEL_FAMILY=cosyvoice2" in r.stderr


def test_the_speech_preset_is_the_kokoro_family_s_data_backend_reward_and_rule():
    got = _config(preset=ROOT / "presets" / "speech_cpu.sh")
    assert (got["MODEL_FAMILY"], got["REWARD_BACKEND"], got["REWARD"], got["EVAL_NPROC"]) == (
        "kokoro", "kokoro", "cer_nll", "1")
    assert got["TRAIN_FILE"] == "data/kokoro/train.jsonl"  # (PROMPT_POOL: the tests' environment empties it)
    ev = got["EVAL_ARGS"]
    assert ev[ev.index("--backend") + 1] == "kokoro" and ev[ev.index("--sampling-rule") + 1] == "kokoro-2026"
    assert ev[ev.index("--tau-r") + 1] == "1.0" and "--whisper-fit-window" in ev and "--whisper-fit-window" in got["REWARD_ARGS"]
    assert got["BASE_MODEL_ARGS"][got["BASE_MODEL_ARGS"].index("--syllable-noise") + 1] == "0.2"
    assert got["BASE_MODEL_ARGS"][got["BASE_MODEL_ARGS"].index("--speaker-leak") + 1] == "0.15"
    r = _config({"MODEL_FAMILY": "cosyvoice2"}, preset=ROOT / "presets" / "speech_cpu.sh", ok=False)
    assert r.returncode == 2 and "another family than MODEL_FAMILY=cosyvoice2" in r.stderr


@pytest.mark.slow  # ~5.5 s: several run.sh --config round trips
def test_the_embedded_preset_is_zero_shot_by_default_and_text_only_on_request():
    """`bash run.sh` on a fresh clone trains zero-shot (the environment has no PROMPT_POOL:
    tests/conftest.py sets it empty for the suite's other run.sh tests, so it is removed here): rows,
    dev set, base model, reward server and stage 4 all take the embedded pool; `PROMPT_POOL=` is the
    text-only run of before, in its own EXP_DIR."""
    fresh = {k: v for k, v in os.environ.items() if k != "PROMPT_POOL"}

    def config(**extra) -> dict:
        r = run_sh("--config", env={**fresh, "PRESET": "presets/embedded.sh", **extra}, timeout=60)
        assert r.returncode == 0 and not r.stderr, r.stdout + r.stderr
        out = {}
        for line in r.stdout.splitlines():
            name, _, value = line.partition("=")
            out[name] = shlex.split(value[1:-1]) if value.startswith("(") and value.endswith(")") else value
        return out

    got = config()
    pool = "data/corpus/prompt_pool"
    assert got["PROMPT_POOL"] == pool and got["EXP_DIR"] == "exp/embedded"
    assert got["BASE_MODEL_ARGS"] == ["--prompt-prob", "0.7", "--prompt-from", "0.25"]
    # zero-shot trains on CER and SIM together (CER 1 + SIM 0.5, measured on this world); the environment still wins
    assert "--want-sim" in got["REWARD_ARGS"] and got["REWARD_WEIGHTS"] == "0.5"
    assert config(REWARD_WEIGHTS="cer")["REWARD_WEIGHTS"] == "cer"
    assert "embedded_test=data/corpus/test_zeroshot.jsonl" in got["EVAL_ARGS"]
    assert got["EVAL_ARGS"][got["EVAL_ARGS"].index("--prompt-dir") + 1] == pool
    # stage 5 chooses on four draws of the 64-row dev set
    assert got["EVAL_ARGS"][got["EVAL_ARGS"].index("--dev-seeds") + 1] == "4"
    # zero-shot GRPO: four updates a step, rollouts at temperature 1.0; a named SAMPLING still wins
    assert (got["GRPO.preset"], got["GRPO.ppo_mini_batch_size"], got["GRPO.temperature"], got["GRPO.lr"]) == \
        ("embedded_zeroshot", "4", "1.0", "0.0003")
    # 20 steps, a checkpoint every 10 (text-only keeps 80 and 40)
    assert (got["GRPO.total_training_steps"], got["GRPO.save_freq"]) == ("20", "10")
    # rollouts drawn by stage 4's rule (the family's current one); a named SAMPLING is its source's plain sampling
    assert got["GRPO.rollout_rule"] == "cosyvoice2-2026"
    assert config(MODEL_FAMILY="cosyvoice3")["GRPO.rollout_rule"] == "cosyvoice3-2026"
    reference = config(SAMPLING="reference")  # n=4: a mini-batch of 16 rows is one micro-batch
    assert (reference["GRPO.temperature"], reference["GRPO.micro_batch_size_per_gpu"]) == ("0.8", "16")
    assert reference["GRPO.rollout_rule"] == "none"
    assert config(GRPO_EXTRA="--rollout-rule none")["GRPO.rollout_rule"] == "none"
    # zero-shot DPO mining: 8 candidates, margin 0.01 (the reward is ~0.02 at the start's CER); text-only 4, 0.05
    mine = got["MINE_ARGS"]
    assert (mine[mine.index("--k") + 1], mine[mine.index("--min-margin") + 1]) == ("8", "0.01")
    text_only = config(PROMPT_POOL="")
    mine = text_only["MINE_ARGS"]
    assert (mine[mine.index("--k") + 1], mine[mine.index("--min-margin") + 1]) == ("4", "0.05")
    assert text_only["EXP_DIR"] == "exp/embedded_textonly" and text_only["BASE_MODEL_ARGS"] == []
    assert text_only["REWARD_WEIGHTS"] == "cer"  # no prompt, no SIM to weigh
    assert (text_only["GRPO.preset"], text_only["GRPO.ppo_mini_batch_size"], text_only["GRPO.temperature"]) == \
        ("embedded", "16", "0.8")
    assert (text_only["GRPO.total_training_steps"], text_only["GRPO.save_freq"]) == ("80", "40")
    assert text_only["GRPO.rollout_rule"] == "none"
    assert "--want-sim" not in text_only["REWARD_ARGS"] and "--prompt-dir" not in text_only["EVAL_ARGS"]
    assert "embedded_test=data/corpus/test.jsonl" in text_only["EVAL_ARGS"]
    # CosyVoice3's layout: zero-shot too, each mode in its own folder
    assert config(MODEL_FAMILY="cosyvoice3")["EXP_DIR"] == "exp/embedded_cosyvoice3"
    assert config(MODEL_FAMILY="cosyvoice3", PROMPT_POOL="")["EXP_DIR"] == "exp/embedded_cosyvoice3_textonly"


def test_pref_extra_adds_train_dpo_options_after_the_presets_so_they_win():
    """PREF_EXTRA grows PREF_ARGS by words, after the preset's (argparse keeps the last value): one
    run's loss or seed without a preset of its own, as scripts/compare_preference.sh runs them."""
    plain = _config({"TRAINER": "dpo"})["PREF_ARGS"]
    got = _config({"TRAINER": "dpo", "PREF_EXTRA": "--loss-type ipo --beta 0.5 --seed 2"})["PREF_ARGS"]
    assert got == [*plain, "--loss-type", "ipo", "--beta", "0.5", "--seed", "2"] and "--beta" in plain


def test_a_path_byte_that_is_not_utf8_goes_through_with_pythonioencoding_utf8(tmp_path):
    """EXP_DIR with a \\xff byte and PYTHONIOENCODING=utf-8 (strict errors, as on a UTF-8 locale) raised
    UnicodeEncodeError in the launcher; now every Python run.sh starts writes such bytes back as they came."""
    exp = os.fsencode(tmp_path) + b"/run\xff1"
    env = {**os.environb, b"EXP_DIR": exp, b"PYTHONIOENCODING": b"utf-8"}
    r = subprocess.run(["bash", str(ROOT / "run.sh"), "--config"], cwd=ROOT, capture_output=True, env=env,
                       timeout=60)
    assert r.returncode == 0 and b"Traceback" not in r.stderr, r.stderr.decode(errors="replace")
    assert b"EXP_DIR=" + exp + b"\n" in r.stdout or b"EXP_DIR='" + exp + b"'\n" in r.stdout, r.stdout[:400]
