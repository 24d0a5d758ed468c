"""The launcher under run.sh (``ttsrl.launch``), in-process where it can be:
the reward a run trains on is the one it asked for (refused otherwise, recorded, passed to stage 4),
every GRPO setting reachable from the environment and shown by ``--config``, an override that
would shadow a setting refused. Reward servers are real sim servers on loopback."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest
from helpers import ROOT, dead_url

from ttsrl.data.prompt_pool import pool_sha1, read_pool
from ttsrl.launch import roles, server, settings
from ttsrl.launch.__main__ import build_parser, parse, server_identity
from ttsrl.reward.protocol import ResponseError, build_response, parse_response

EMBEDDED = {"DEVICE": "cpu", "EXP_DIR": "exp/e", "COSYVOICE2_DIR": "exp/e/base", "TRAIN_FILE": "t.jsonl",
            "TEST_FILE": "v.jsonl", "MAX_PROMPT_LENGTH": "32", "REWARD_BACKEND": "sim", "EVAL_NPROC": "2"}
ARRAYS = {"REWARD_ARGS": [], "GRPO_ARGS": ["--preset", "embedded"], "EVAL_ARGS": ["--backend", "sim"]}


def resolve(env=None, arrays=None, argv=()):
    return settings.resolve({**EMBEDDED, **(env or {})}, {**ARRAYS, **(arrays or {})}, list(argv))


def config(env: dict | None = None) -> dict[str, str]:
    """`bash run.sh --config` of the embedded preset: NAME -> value as the shell reads it back."""
    r = subprocess.run(["bash", "run.sh", "--config"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, **(env or {})})
    assert r.returncode == 0 and not r.stderr, r.stdout + r.stderr
    return {k: " ".join(shlex.split(v)) for k, _, v in (line.partition("=") for line in r.stdout.splitlines())}


# ---------------------------------------------------------------------------- settings


def test_settings_derive_from_exp_dir_and_the_stage_range():
    assert [settings.parse_argv(a)[:2] for a in ([], ["1"], ["2", "2"])] == [(-2, 5), (1, 5), (2, 2)]
    r = resolve(argv=["1", "3", "--", "x.y=1"])
    assert (r.start, r.stop, r.lists["EXTRA_OVERRIDES"]) == (1, 3, ["x.y=1"])
    assert r["HF_MODEL_DIR"] == "exp/e/hf_model" and r["LOG_DIR"] == "exp/e/logs" and r["NNODES"] == "1"
    assert r["REWARD_URL"] == r["REWARD_URLS"] == r["TTSRL_REWARD_URL"] == "http://127.0.0.1:8000"
    for argv, message in [(["9"], "stage '9' is not one of"), (["3", "1"], r"START \(3\) is after STOP \(1\)"),
                          (["3", "4", "--", "a=1"], "overrides after '--' are for stage 2"),
                          (["--config", "2"], "--config takes no other argument")]:
        with pytest.raises(settings.SettingsError, match=message) as e:
            resolve(argv=argv)
        assert e.value.usage


def test_grpo_extra_words_come_last_so_they_win():
    """A GRPOConfig field could not be set from the environment (GRPO_ARGS is an array);
    GRPO_EXTRA is split as the shell splits words and follows the run's own arguments."""
    r = resolve({"GRPO_EXTRA": "--lr 5e-7 --model-path '/my model'"})
    args = r.lists["GRPO_ARGS"]
    assert args[:2] == ["--preset", "embedded"] and args[-4:] == ["--lr", "5e-7", "--model-path", "/my model"]
    assert args.index("--reward") < args.index("--lr") and args[args.index("--reward") + 1] == "tanh"
    with pytest.raises(settings.SettingsError, match="not words as the shell splits them"):
        resolve({"GRPO_EXTRA": "--lr '5e-7"})


def test_the_reward_travels_one_road():
    r = resolve({"REWARD": "exp_toneless", "REWARD_URLS": "http://a:1,http://b:2"})
    args = r.lists["GRPO_ARGS"]
    assert args[args.index("--reward") + 1] == "exp_toneless" and args[args.index("--reward-urls") + 1] == \
        "http://a:1,http://b:2"
    with pytest.raises(settings.SettingsError, match="hold --reward: set REWARD instead"):
        resolve({"REWARD_EXTRA": "--reward=toneless"})


def test_multi_node_settings_and_ray_ports_of_ranks_on_one_host(tmp_path):
    env = {"NODE_IPS": "127.0.0.2,127.0.0.3", "EXP_DIR": str(tmp_path), "RAY_PORT": "26379",
           "RAY_WORKER_PORTS": "26400-26999"}
    ranks = [resolve({**env, "NODE_RANK": str(k)}) for k in (0, 1)]
    assert [r["NODE_IP"] for r in ranks] == ["127.0.0.2", "127.0.0.3"] and ranks[1]["REWARD_URL"] == \
        "http://127.0.0.3:8000"
    assert ranks[1].lists["REWARD_ARGS"] == ["--host", "127.0.0.3"]
    assert ranks[1]["LOG_DIR"] == f"{tmp_path}/logs/node1" and ranks[1]["RAY_AUTH_MODE"] == "token"
    args = [roles.ray_node_args(roles.Cluster.from_env(r.values)) for r in ranks]

    def flag(a, name):
        return a[a.index(name) + 1]
    # two loopback ranks: 10 fixed ports each from RAY_NODE_PORT, half of the worker range each, own temp dirs
    assert [flag(a, "--node-manager-port") for a in args] == ["26380", "26390"]
    assert [(flag(a, "--min-worker-port"), flag(a, "--max-worker-port")) for a in args] == [
        ("26400", "26699"), ("26700", "26999")]
    assert [flag(a, "--temp-dir") for a in args] == ["/tmp/ray/node0", "/tmp/ray/node1"]
    assert "--head" in args[0] and flag(args[1], "--address") == "127.0.0.2:26379"
    # one rank per host: the whole range, Ray's own temp dir
    one = settings.resolve({**EMBEDDED, "NODE_IPS": "10.0.0.1,10.0.0.2", "NODE_RANK": "1", "EXP_DIR": "/x"},
                           ARRAYS, [])
    a = roles.ray_node_args(roles.Cluster.from_env(one.values))
    assert (flag(a, "--min-worker-port"), flag(a, "--max-worker-port")) == ("10002", "19999") and "--temp-dir" not in a


# ---------------------------------------------------------------------------- --config and stage 2's settings


def test_config_prints_grpo_resolved_values_and_grpo_extra_reaches_them():
    """`run.sh --config` printed GRPO_ARGS=(--preset embedded ...), not the lr a run uses."""
    plain = config()
    assert float(plain["GRPO.lr"]) == 3e-4 and plain["GRPO.preset"] == "embedded" and plain["GRPO.n"] == "8"
    assert plain["GRPO.reward"] == "tanh" and plain["GRPO.reward_urls"] == "http://127.0.0.1:8000"
    got = config({"GRPO_EXTRA": "--lr 5e-7 --n 4", "REWARD": "exp_toneless"})
    assert float(got["GRPO.lr"]) == 5e-7 and got["GRPO.n"] == "4" and got["GRPO.reward"] == "exp_toneless"


def test_an_override_shadowing_a_setting_stops_the_run_before_any_stage(tmp_path):
    """The README's own `run.sh 2 2 -- actor_rollout_ref.actor.optim.lr=5e-7` was applied after
    GRPOConfig and the record still said lr 3e-4; now it is refused, naming the field."""
    r = subprocess.run(["bash", "run.sh", "0", "2", "--", "actor_rollout_ref.actor.optim.lr=5e-7"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, env={**os.environ, "EXP_DIR": str(tmp_path)})
    assert r.returncode == 2 and "GRPOConfig.lr owns: give it as --lr VALUE" in r.stderr, r.stdout + r.stderr
    assert "==== stage" not in r.stdout and not any(tmp_path.iterdir())


# ---------------------------------------------------------------------------- the reward's identity


def test_server_identity_is_read_with_the_servers_own_parser(tmp_path):
    got = server_identity(["py", "token2wav_asr_server.py", "--backend", "cosyvoice2", "--cosyvoice-model-dir",
                           "m", "--reward", "toneless", "--want-sim"])
    assert got == {"reward": "toneless", "backend": "cosyvoice2", "model_dir": os.path.abspath("m"),
                   "sim_weight": "0.0", "mos_weight": "0.0", "length_guard": "True", "family": "cosyvoice2",
                   "prompt_pool": pool_sha1([])}  # no --prompt-dir: no prompt id
    # the pool's digest as the server would publish it: sim's from the jsonl's ids, a family's from its wavs
    pool = ROOT / "data" / "corpus" / "prompt_pool"
    assert server_identity(["p", "token2wav_asr_server.py", "--prompt-dir", str(pool)])["prompt_pool"] == \
        read_pool(pool, need_text=False).sha1
    (tmp_path / "spk_b.wav").write_bytes(b""), (tmp_path / "spk_a.wav").write_bytes(b"")
    assert server_identity(["p", "token2wav_asr_server.py", "--backend", "cosyvoice2", "--cosyvoice-model-dir", "m",
                            "--prompt-dir", str(tmp_path)])["prompt_pool"] == pool_sha1(["spk_a", "spk_b"])
    assert server_identity(["p", "token2wav_asr_server.py", "--family", "cosyvoice3"])["family"] == "cosyvoice3"
    assert server_identity(["p", "token2wav_asr_server.py", "--no-length-guard"])["length_guard"] == "False"
    assert server_identity(["p", "token2wav_asr_server.py", "--mos-weight", "0.2"])["mos_weight"] == "0.2"
    assert server_identity(["p", "/x/token2wav_asr_server.py", "--backend", "sim"])["model_dir"] == ""


@pytest.fixture(scope="module")
def tanh_server(sim_server_url):
    """A sim server serving tanh: the session's (conftest), whose reward is the default, tanh."""
    return sim_server_url


def test_a_server_serving_another_model_folder_or_reward_is_refused_unless_asked(tanh_server, tmp_path, capsys):
    """A server answering at the run's URL is checked on reward, backend, model folder, SIM and MOS weights."""
    pid_file, log = tmp_path / "server.pid", tmp_path / "server.log"
    ident = {"reward": "tanh", "backend": "sim", "model_dir": "", "sim_weight": "0.0", "length_guard": "True"}
    never = ["false"]  # a command that would fail if it were started: an answering server is never started over
    assert server.local_up(tanh_server, pid_file, log, 10, ident, False, never) == 0
    assert "not started by run.sh: used, and left running" in capsys.readouterr().out
    for key, value in (("model_dir", "/models/CosyVoice2-0.5B"), ("reward", "exp_toneless"), ("sim_weight", "0.1"),
                       ("mos_weight", "0.2"), ("length_guard", "False")):
        assert server.local_up(tanh_server, pid_file, log, 10, {**ident, key: value}, False, never) == 1
        err = capsys.readouterr().err
        assert f"serves {key} " in err and "REWARD_ANY_SERVER=1" in err, err
    assert server.local_up(tanh_server, pid_file, log, 10, {**ident, "reward": "toneless"}, True, never) == 0
    assert "REWARD_ANY_SERVER=1: using it anyway" in capsys.readouterr().out
    assert not pid_file.exists() and not log.exists()


def test_options_before_the_double_dash_are_the_launchers_the_words_after_it_the_command():
    """``server up --ours -- CMD``: argparse's REMAINDER took ``--ours`` into CMD, so stage 2 never
    knew stage 1 had started its server (it said "started by an earlier run")."""
    a = parse(build_parser(), ["server", "up", "--ours", "--expect", "reward=tanh", "--", "py", "s.py", "--port", "1"])
    assert (a.action, a.ours, a.expect, a.command) == ("up", True, ["reward=tanh"], ["py", "s.py", "--port", "1"])
    assert parse(build_parser(), ["server", "up", "--", "py"]).ours is False
    # only the first -- splits: run.sh's own arguments keep theirs
    a = parse(build_parser(), ["--ray-arg=--num-cpus=2", "settings", "--arrays", "f", "--", "2", "2", "--", "k=v"])
    assert (a.ray_arg, a.arrays, a.argv) == (["--num-cpus=2"], "f", ["2", "2", "--", "k=v"])
    assert parse(build_parser(), ["grpo", "--", "py", "train_grpo.py", "--", "x=1"]).command == \
        ["py", "train_grpo.py", "--", "x=1"]


def test_up_starts_the_local_server_waits_for_it_and_down_stops_it(tmp_path, capsys):
    url = dead_url()
    port = url.rsplit(":", 1)[1]
    pid_file, log = tmp_path / "p" / "server.pid", tmp_path / "logs" / "server.log"
    cmd = [sys.executable, str(ROOT / "token2wav_asr_server.py"), "--backend", "sim", "--port", port]
    ident = server_identity(cmd)
    try:
        assert server.up(url, url, pid_file, log, 120, ident, False, cmd) == 0
        pid = int(pid_file.read_text())
        assert server.is_reward_server(pid) and f"reward server pid {pid} at {url}" in capsys.readouterr().out
        # a second run.sh adopts it (its pid file names the process answering), another reward is refused
        assert server.up(url, url, pid_file, log, 10, ident, False, ["false"]) == 0
        assert "started by an earlier run: this run takes it over as its own" in capsys.readouterr().out
        assert server.up(url, url, pid_file, log, 10, {**ident, "reward": "cer_nll"}, False, ["false"]) == 1
    finally:
        server.down(pid_file)
    assert not pid_file.exists() and "reward server stopped" in capsys.readouterr().out
    # a server that cannot start: its log's tail, the status it exited with
    assert server.up(url, url, pid_file, log, 30, ident, False, [sys.executable, "-c", "import sys; "
                     "print('no model here'); sys.exit(3)"]) == 1
    assert "exited with status 3" in (err := capsys.readouterr().err) and "no model here" in err, err


def test_every_answer_names_its_reward_and_a_run_refuses_another():
    answer = build_response("token2wav_asr", 0.5, "ni hao", 0.1, reward_name="tanh")
    assert answer["parameters"]["reward"] == "tanh"
    assert parse_response(answer, "token2wav_asr", "tanh").reward == 0.5
    with pytest.raises(ResponseError, match="scored with reward 'tanh', not the 'exp_toneless' this run trains on"):
        parse_response(answer, "token2wav_asr", "exp_toneless")
    with pytest.raises(ResponseError, match="scored with reward None"):  # an older server that does not say
        parse_response(build_response("token2wav_asr", 0.5, "", 0.1), "token2wav_asr", "tanh")


def test_the_reward_function_refuses_a_server_with_another_reward(tanh_server, monkeypatch):
    """What verl calls, with the reward_kwargs stage 2 passes: a server scoring with another
    reward never gives a training reward."""
    import asyncio

    from ttsrl.model.vocab import SpeechVocab
    from ttsrl.reward.client import compute_score

    text = SpeechVocab.codes_to_text([1, 2, 3, 4])
    monkeypatch.setenv("TTSRL_REWARD_RETRIES", "0")
    monkeypatch.setenv("TTSRL_REWARD_MAX_FAIL_FRACTION", "1.0")
    ok = asyncio.run(compute_score("tts", text, "你好", urls=tanh_server, expect_reward="tanh"))
    assert ok["reward_failed"] == 0.0
    refused = asyncio.run(compute_score("tts", text, "你好", urls=tanh_server, expect_reward="toneless"))
    assert refused["reward_failed"] == 1.0 and refused["score"] == 0.0


def test_the_run_record_holds_the_reward_and_what_each_server_serves(tanh_server, tmp_path, monkeypatch):
    """ttsrl_run.json did not hold the reward variant; now the reward, backend, servers and
    their metadata as served. A server serving another reward stops the launch before verl."""
    import train_grpo

    monkeypatch.setattr(train_grpo.os, "execvpe", lambda *a: (_ for _ in ()).throw(SystemExit(0)))
    ckpt = tmp_path / "ckpt"
    argv = ["--preset", "embedded", "--model-path", "/m", "--train-files", "/t", "--val-files", "/v",
            "--checkpoint-dir", str(ckpt), "--reward-backend", "sim", "--reward-urls", tanh_server]
    with pytest.raises(SystemExit) as e:
        train_grpo.main([*argv, "--reward", "exp_toneless"])
    assert "serves reward 'tanh' (this run asks for 'exp_toneless')" in str(e.value.code)
    assert not ckpt.exists()
    with pytest.raises(SystemExit):
        train_grpo.main([*argv, "--reward", "tanh"])
    record = json.loads((ckpt / "ttsrl_run.json").read_text())
    assert record["reward"]["reward"] == "tanh" and record["reward"]["urls"] == [tanh_server]
    served = record["reward"]["served"][tanh_server]
    assert served["reward"] == "tanh" and served["backend_name"] == "sim" and served["model_dir"] == ""
    overrides = record["verl_overrides"]
    assert f"+reward.custom_reward_function.reward_kwargs.urls={tanh_server}" in overrides or any(
        o.startswith("+reward.custom_reward_function.reward_kwargs.urls=") and tanh_server in o for o in overrides)
    assert "+reward.custom_reward_function.reward_kwargs.expect_reward=tanh" in overrides


# ---------------------------------------------------------------------------- markers


def test_head_markers_and_a_workers_wait(tmp_path, capsys):
    c = roles.Cluster(ips=["127.0.0.2", "127.0.0.3"], rank=0, ray_port=1, ray_node_port=2, worker_ports=(3, 4),
                      gpus_per_node=1, nodes_dir=tmp_path / "nodes", log_dir=tmp_path / "logs")
    roles.mark_head(c, "merged")  # no run yet: the head makes one, which workers read
    rid = roles.run_id(c)
    assert rid and (c.nodes_dir / "merged").read_text().strip() == rid
    worker = roles.Cluster(**{**c.__dict__, "rank": 1})
    assert roles.await_head(worker, "merged", "every step merged", 5) == 0
    roles.mark_failed(c, 7, "3")
    (c.nodes_dir / "merged").unlink()
    assert roles.await_head(worker, "merged", "every step merged", 5) == 1
    assert "stopped with status 7 in stage 3" in capsys.readouterr().err


def test_model_family_is_checked_and_the_sampling_rule_must_be_its_own():
    """MODEL_FAMILY names a family of ttsrl.model.vocab; EVAL_ARGS sampling with another family's
    rule stops the run before any stage (the generators would refuse it only in stage 4)."""
    assert resolve().values["MODEL_FAMILY"] == "cosyvoice2" and resolve().values["LLM_FILE"] == "llm.pt"
    cv3 = resolve({"MODEL_FAMILY": "cosyvoice3"}, {"EVAL_ARGS": ["--sampling-rule", "cosyvoice3-2026"]})
    assert cv3.values["MODEL_FAMILY"] == "cosyvoice3"
    with pytest.raises(settings.SettingsError, match="MODEL_FAMILY=cosyvoice4: expected one of"):
        resolve({"MODEL_FAMILY": "cosyvoice4"})
    with pytest.raises(settings.SettingsError, match="another family than MODEL_FAMILY=cosyvoice3"):
        resolve({"MODEL_FAMILY": "cosyvoice3"}, {"EVAL_ARGS": ["--sampling-rule=cosyvoice2-2026"]})


# ---------------------------------------------------------------------------- numbers and the servers a run starts


@pytest.mark.parametrize("name,value", [("NODE_RANK", "٠"), ("DEV_SIZE", "١"), ("REWARD_PORT", "0"),
                                        ("REWARD_PORT", "３９０７０"), ("REWARD_PORT", "99999"), ("RAY_PORT", "²"),
                                        ("MAX_PROMPT_LENGTH", "３２"), ("EXPORT_STEP", "4x"),
                                        ("REWARD_START_TIMEOUT_S", "٣"), ("ALLOW_LEAK", "true")])
def test_every_numeric_setting_is_ascii_digits_in_its_range(name, value):
    """`NODE_RANK='٠'` passed Python's isdigit, bash arithmetic then failed and stage 0 was "skipped
    (not the head)", exit 0; `DEV_SIZE='١'` skipped the dev split; REWARD_PORT was never checked
    (0, '３９０７０', 99999 each left a server running or an OverflowError in its log); ALLOW_LEAK=true
    was ignored. Each is refused up front, naming the setting."""
    with pytest.raises(settings.SettingsError) as e:
        resolve({name: value})
    assert any(line.startswith(f"run.sh: {name}=") or line.startswith(f"{name}=") for line in e.value.lines), e.value
    assert resolve({"REWARD_PORT": "65535", "EXPORT_STEP": "", "ALLOW_LEAK": "1"}).values["REWARD_PORT"] == "65535"


def test_a_server_this_run_started_is_stopped_when_it_does_not_come_up_in_time(tmp_path, capsys):
    """`REWARD_START_TIMEOUT_S=1`: the stage failed (rc 1) and the server, which came up later, kept
    running with nothing to stop it (run.sh only learns of it from the pid file after success)."""
    url = dead_url()
    pid_file, log = tmp_path / "server.pid", tmp_path / "server.log"
    late = [sys.executable, "-c", "import time; time.sleep(600)"]  # a server still loading its models
    assert server.local_up(url, pid_file, log, 1, {}, False, late) == 1
    err = capsys.readouterr().err
    assert "did not come up (waited up to 1s" in err and "it was stopped" in err, err
    assert not pid_file.exists()
    out = subprocess.run(["pgrep", "-f", "import time; time.sleep(600)"], capture_output=True, text=True).stdout
    assert out.strip() == "", f"the late server still runs: {out}"


def test_a_list_given_in_the_environment_as_a_string_is_refused_naming_its_extra():
    """`GRPO_ARGS="--lr 1e-9" bash run.sh --config` said GRPO.lr=0.0003 with no message (the preset's
    array won); RAY_START_ARGS=--foo was refused blaming the preset."""
    for name, hint in (("GRPO_ARGS", 'GRPO_EXTRA="--flag value"'), ("EVAL_ARGS", "EVAL_EXTRA"),
                       ("MINE_ARGS", "a preset of your own"), ("RAY_START_ARGS", "a preset of your own")):
        with pytest.raises(settings.SettingsError) as e:
            settings.resolve({**EMBEDDED, name: "--lr 1e-9"}, ARRAYS, [], frozenset({name, "PATH"}))
        assert f"{name} is given in the environment as a string" in e.value.lines[0] and hint in e.value.lines[0]
    r = subprocess.run(["bash", "run.sh", "--config"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "GRPO_ARGS": "--lr 1e-9"})
    assert r.returncode == 2 and "GRPO_EXTRA" in r.stderr, r.stdout + r.stderr


def test_abbreviations_do_not_pass_the_one_road():
    """`REWARD_EXTRA='--rew toneless'`: the banner said tanh, the server served toneless (argparse
    took --rew for --reward). run.sh refuses an abbreviation of a flag it owns; the stage CLIs
    take no abbreviation at all."""
    for words, owner in ((["--rew", "toneless"], "REWARD"), (["--sim-w", "0.1"], "REWARD_WEIGHTS"),
                         (["--weig=glm_tts"], "REWARD_WEIGHTS")):
        with pytest.raises(settings.SettingsError, match=f"set {owner} instead"):
            resolve({}, {"REWARD_ARGS": words})
    with pytest.raises(SystemExit):
        server_identity(["p", "token2wav_asr_server.py", "--no-length"])
    assert server_identity(["p", "token2wav_asr_server.py", "--no-length-guard"])["length_guard"] == "False"


def test_reward_weights_is_a_named_weighting_or_the_sim_weight_itself():
    """REWARD_WEIGHTS=glm_tts reaches the server as --weights and train_grpo.py as --reward-weights; a
    number is the SIM weight itself (a sweep over weights needs no name for each), --sim-weight to both,
    and the server started with it publishes that weight as its identity; a negative or NaN weight is
    refused before anything starts."""
    named = resolve({"REWARD_WEIGHTS": "glm_tts"})
    assert named.lists["WEIGHT_ARGS"] == ["--weights", "glm_tts"]
    grpo = named.lists["GRPO_ARGS"]
    assert grpo[grpo.index("--reward-weights") + 1] == "glm_tts" and "--sim-weight" not in grpo
    own = resolve({"REWARD_WEIGHTS": "0.25"})
    assert own.lists["WEIGHT_ARGS"] == ["--sim-weight", "0.25"]
    grpo = own.lists["GRPO_ARGS"]
    assert grpo[grpo.index("--sim-weight") + 1] == "0.25" and "--reward-weights" not in grpo
    assert server_identity(["p", "token2wav_asr_server.py", *own.lists["WEIGHT_ARGS"]])["sim_weight"] == "0.25"
    for bad in ("-0.1", "nan", "inf"):
        with pytest.raises(settings.SettingsError, match=f"REWARD_WEIGHTS={bad}: expected a named weighting"):
            resolve({"REWARD_WEIGHTS": bad})
