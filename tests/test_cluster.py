"""Attaching stage 2 to a running Ray cluster: ``GRPOConfig.ray_address``,
``--nnodes``, the variables forwarded to every node's workers (``ttsrl.train.cluster``).

Config tests (seconds) read the overrides back through verl 0.9.1's own Hydra config and
through what verl's ``run_ppo`` hands to ``ray.init``. The environment test (slow, about a
minute) attaches to a real two-raylet Ray cluster started from a clean environment in
another directory.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from helpers import cpu_config
from omegaconf import OmegaConf
from test_grpo import ROOT, composed

import train_grpo
from ttsrl.train import cluster
from ttsrl.train.grpo import GRPOConfig

ABS = ["--model-path", "/m/hf model", "--train-files", "/d/train.parquet", "--val-files", "/d/test.parquet",
       "--checkpoint-dir", "/runs/one/checkpoints"]
URLS = "http://10.0.0.1:8000,http://10.0.0.2:8000"
# a user's shell: what must reach the workers, what must not, and values that are hard to quote
ENVIRON = {
    "PATH": "/usr/bin", "HOME": "/home/u", "PYTHONPATH": "/opt/lib:/srv/x y",
    "TTSRL_REWARD_URL": URLS, "TTSRL_REWARD_RETRIES": "7",
    "HF_HOME": "/shared/hf", "NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0",
    "VLLM_LOGGING_LEVEL": "WARN", "WANDB_PROJECT": "it's $HOME", "TENSORBOARD_DIR": "/shared/tb",
    "TOKENIZERS_PARALLELISM": "false", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "TTSRL_REWARD_MODEL": "a=b,c\\'d\\", "RAY_AUTH_MODE": "token",
    "CUDA_VISIBLE_DEVICES": "0,1", "ROCR_VISIBLE_DEVICES": "0",
    "WANDB_API_KEY": "s3cret-wandb", "HF_TOKEN": "s3cret-hf", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER_X": "1",
    "SOME_OTHER": "x",
}
SECRETS = ("s3cret-wandb", "s3cret-hf")


def two_nodes(*flags: str, preset: str = "cpu", environ=ENVIRON, extra=()):
    argv = ["--preset", preset, *ABS, "--nnodes", "2", *flags, *(["--", *extra] if extra else [])]
    return train_grpo.build(argv, environ=dict(environ))


def env_vars(cfg) -> dict:
    return dict(cfg.ray_kwargs.ray_init.runtime_env.get("env_vars", {}))


def ray_init_kwargs(cfg) -> dict:
    """What verl 0.9.1's run_ppo passes to ray.init for this composed config (main_ppo.py,
    the branch taken when Ray is not initialised yet), minus the call itself."""
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    init = cfg.ray_kwargs.get("ray_init", {})
    runtime_env = OmegaConf.merge(get_ppo_ray_runtime_env(cfg), init.get("runtime_env", {}))
    return OmegaConf.to_container(OmegaConf.create({**init, "runtime_env": runtime_env}))


def test_a_two_node_attach_forwards_the_workers_environment_and_no_resources():
    run = two_nodes("--ray-address", "10.0.0.9:6379")
    forwarded = run.config.forwarded_env(ENVIRON)
    assert forwarded == cluster.forwarded_env(ENVIRON, run.config.env(ENVIRON))  # the one function
    assert forwarded["TTSRL_REWARD_URL"] == URLS and forwarded["VERL_USE_EXTERNAL_MODULES"] == "ttsrl.verl_plugin.plugin"
    assert forwarded["PYTHONPATH"] == f"{ROOT}:/opt/lib:/srv/x y" and forwarded["VERL_PLATFORM"] == "cpu"
    for name in ("HF_HOME", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "VLLM_LOGGING_LEVEL", "WANDB_PROJECT",
                 "TENSORBOARD_DIR", "TOKENIZERS_PARALLELISM", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "RAY_AUTH_MODE",
                 "TTSRL_REWARD_RETRIES", "TTSRL_REWARD_MODEL", "TQ_NUM_THREADS", "VERL_ENGINE_DEVICE"):
        assert name in forwarded, name
    for name in ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "WANDB_API_KEY", "HF_TOKEN", "PATH", "HOME",
                 "SOME_OTHER", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER_X"):
        assert name not in forwarded, name
    # verl's own config composes it: every value comes back exact
    cfg = composed(run.command[3:])
    assert env_vars(cfg) == forwarded
    assert cfg.ray_kwargs.ray_init.address == "10.0.0.9:6379" and cfg.ray_kwargs.ray_init.num_cpus is None
    assert "num_gpus" not in cfg.ray_kwargs.ray_init
    # ... and so does what run_ppo hands to ray.init: an attach Ray accepts, our variables in its runtime env
    kwargs = ray_init_kwargs(cfg)
    assert kwargs["address"] == "10.0.0.9:6379" and kwargs.get("num_cpus") is None and "num_gpus" not in kwargs
    assert {k: kwargs["runtime_env"]["env_vars"][k] for k in forwarded} == forwarded
    # one reward and one agent-loop worker per node on the CPU path; the rest of the CPU run stays
    assert cfg.reward.num_workers == 2 and cfg.actor_rollout_ref.rollout.agent.num_workers == 2
    assert cfg.trainer.nnodes == 2 and cfg.trainer.device == "cpu"
    # the verl process attaches with Ray's cluster switch as it is on Linux: not forced off
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in run.env
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in run.config.env(ENVIRON)
    assert not any(s in " ".join(run.command) for s in SECRETS)


def test_tricky_values_come_back_exact_through_verls_config():
    values = {"VAR_A": URLS, "VAR_B": "/a/b:/c d", "VAR_C": "it's", "VAR_D": "x$y $HOME $(id) `id`",
              "VAR_E": "back\\slash", "VAR_F": "end\\", "VAR_G": "", "VAR_H": "k=v=w",
              "VAR_I": "\\'", "VAR_J": "'quoted' \"double\"", "VAR_K": "a\nb\tc", "VAR_L": "[1,2]",
              "VAR_M": "{a: b}", "VAR_N": "null", "VAR_O": "007", "VAR_P": " padded ", "VAR_Q": "é→ü",
              "VAR_R": "#x", "VAR_S": "$\\{x}", "VAR_T": "true"}
    overrides = cluster.env_var_overrides(values)
    cfg = composed(overrides)
    got = env_vars(cfg)
    assert got == values and all(isinstance(v, str) for v in got.values())
    passed = ray_init_kwargs(cfg)["runtime_env"]["env_vars"]  # what ray.init gets from verl
    assert {k: passed[k] for k in values} == values
    assert cluster.forwarded_names(overrides) == list(values)


def test_a_value_verls_config_would_read_as_an_interpolation_is_refused_by_name():
    with pytest.raises(ValueError, match=r"TTSRL_REWARD_URL='http://\$\{host\}:8000' holds '\$\{'"):
        two_nodes(environ={**ENVIRON, "TTSRL_REWARD_URL": "http://${host}:8000"})


def test_the_gpu_path_scales_verls_workers_with_the_nodes():
    cfg = composed(two_nodes("--ray-address", "auto", preset="gpu8").command[3:])
    assert cfg.reward.num_workers == 16 and cfg.actor_rollout_ref.rollout.agent.num_workers == 16
    assert cfg.ray_kwargs.ray_init.address == "auto" and cfg.ray_kwargs.ray_init.num_cpus is None
    assert env_vars(cfg)["VERL_USE_EXTERNAL_MODULES"] == "ttsrl.verl_plugin.plugin"
    one = composed(GRPOConfig.from_preset("gpu8", model_path="/m", train_files="/t", val_files="/v",
                                          checkpoint_dir="/c", ray_address="h:1").to_overrides(ENVIRON))
    assert one.reward.num_workers == 8 and one.actor_rollout_ref.rollout.agent.num_workers == 8  # verl's own


@pytest.mark.parametrize("field", cluster.RELATIVE_PATH_FIELDS)
def test_a_relative_path_is_refused_on_several_nodes(field):
    paths = {"model_path": "/m", "train_files": "/t", "val_files": "/v", "checkpoint_dir": "/c",
             "reward_file": "/r.py", field: "data/rel"}
    for shape in ({"nnodes": 2}, {"ray_address": "10.0.0.9:6379"}):
        with pytest.raises(ValueError, match=rf"{field}='data/rel' is a relative path.*use an absolute path on a "
                                             "filesystem every node mounts"):
            cpu_config(**paths, **shape)
    cpu_config(**paths)  # one local node: the working directory is the driver's
    cpu_config(**{**paths, field: "hdfs://nn/data/rel"}, nnodes=2)  # not a local path


@pytest.mark.slow  # several train_grpo.build compositions of verl's config: ~6 s
def test_ray_address_comes_from_the_environment_and_the_flag_wins():
    argv = ["--preset", "cpu", *ABS]
    run = train_grpo.build(argv, environ={"RAY_ADDRESS": "10.0.0.5:6379"})
    assert run.config.ray_address == "10.0.0.5:6379" and run.config.multi_node
    assert "+ray_kwargs.ray_init.address='10.0.0.5:6379'" in run.command
    assert train_grpo.build([*argv, "--ray-address", "h:7"], environ={"RAY_ADDRESS": "x:1"}).config.ray_address == "h:7"
    with pytest.raises(ValueError, match="checkpoint_dir='exp/checkpoints' is a relative path"):
        train_grpo.build(argv[:-2], environ={"RAY_ADDRESS": "10.0.0.5:6379"})  # the default is relative
    # the user's own Ray switch is theirs to keep
    kept = two_nodes("--ray-address", "h:7", environ={**ENVIRON, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"})
    assert kept.env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "1"


def test_one_node_keeps_todays_command():
    """No forwarding, the local Ray's resources and one worker each: as before multi-node existed."""
    run = train_grpo.build(["--preset", "cpu", "--model-path", "m", "--train-files", "t", "--val-files", "v"],
                           environ=ENVIRON)
    cmd = run.command
    assert not run.config.multi_node and run.config.forwarded_env(ENVIRON) == {}
    assert not [o for o in cmd if "runtime_env" in o or "ray_init.address" in o]
    assert "+ray_kwargs.ray_init.num_gpus=1" in cmd and "ray_kwargs.ray_init.num_cpus=32" in cmd
    assert "reward.num_workers=1" in cmd and "actor_rollout_ref.rollout.agent.num_workers=1" in cmd
    assert run.env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert train_grpo.forwarding_note(run, ENVIRON) == ""


def test_secret_names_are_recognised():
    for name in ("WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "VLLM_API_KEY", "VERL_DB_PASSWORD",
                 "NCCL_SECRET_X", "HF_TOKEN_PATH", "AWS_SECRET_ACCESS_KEY"):
        assert cluster.looks_secret(name), name
    for name in ("TOKENIZERS_PARALLELISM", "RAY_AUTH_MODE", "TTSRL_REWARD_URL", "HF_HOME", "WANDB_ENTITY",
                 "KEYBOARD", "TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        assert not cluster.looks_secret(name), name
    assert cluster.withheld_secrets(ENVIRON) == ["HF_TOKEN", "WANDB_API_KEY"]


def test_dry_run_shows_the_attach_and_the_launch_records_the_names(tmp_path, monkeypatch, capsys):
    """--dry-run prints the forwarded overrides and one line naming them; a launch (exec stopped
    here, as in test_grpo) records the names, never a secret."""
    for k, v in ENVIRON.items():
        if k not in ("PATH", "HOME"):
            monkeypatch.setenv(k, v)
    ckpt = tmp_path / "ck"
    argv = ["--preset", "cpu", *ABS[:-1], str(ckpt), "--nnodes", "2", "--ray-address", "10.0.0.9:6379"]
    train_grpo.main([*argv, "--dry-run"])
    out = capsys.readouterr().out
    shown = [line for line in out.splitlines() if not line.startswith(("export ", "# "))]
    words = shlex.split(" ".join(line.removesuffix(" \\") for line in shown))  # the command as a shell reads it
    assert words[1:3] == ["-m", "verl.trainer.main_ppo"]
    assert f"+ray_kwargs.ray_init.runtime_env.env_vars.TTSRL_REWARD_URL='{URLS}'" in words
    assert "+ray_kwargs.ray_init.address='10.0.0.9:6379'" in words
    assert not [w for w in words if "num_cpus" in w or "num_gpus" in w]
    note = next(line for line in out.splitlines() if "forwarded to every node's workers" in line)
    assert "TTSRL_REWARD_URL" in note and "PYTHONPATH" in note and "CUDA_VISIBLE_DEVICES" not in note
    assert "not forwarded (export on every node before `ray start`): HF_TOKEN, WANDB_API_KEY" in note
    assert not any(s in out for s in SECRETS) and not ckpt.exists()

    def stop_exec(path, command, env):  # the process would become verl here
        raise SystemExit(0)

    monkeypatch.setattr(train_grpo.os, "execvpe", stop_exec)
    with pytest.raises(SystemExit):
        train_grpo.main(argv)
    text = (ckpt / "ttsrl_run.json").read_text()
    record = json.loads(text)
    assert "TTSRL_REWARD_URL" in record["forwarded_env"] and "HF_TOKEN" not in record["forwarded_env"]
    assert record["config"]["ray_address"] == "10.0.0.9:6379" and record["config"]["nnodes"] == 2
    assert not any(s in text for s in SECRETS)


def test_help_shows_the_attach_option(capsys):
    with pytest.raises(SystemExit):
        train_grpo._parser().parse_args(["--help"])
    out = capsys.readouterr().out
    assert "--ray-address" in out and "$RAY_ADDRESS" in out


# ---------------------------------------------------------------------------
# the environment: a real two-raylet cluster

CLUSTER = r"""
import socket, sys
from ray.cluster_utils import Cluster

with socket.socket() as s:  # Ray's API server binds a port even without the dashboard: a free one, not 8265
    s.bind(("127.0.0.1", 0))
    free_port = s.getsockname()[1]
# two raylets with one logical GPU each (verl's pools put one group per node); the head is node 1
cluster = Cluster()
try:
    cluster.add_node(num_cpus=2, num_gpus=1, include_dashboard=False, dashboard_port=free_port)
    cluster.add_node(num_cpus=2, num_gpus=1)
    cluster.wait_for_nodes()
    print("ADDRESS " + cluster.address, flush=True)
    sys.stdin.read()  # until the test closes stdin (or dies)
finally:
    cluster.shutdown()
    print("SHUT DOWN", flush=True)
"""

DRIVER = r"""
import json, os, sys
sys.path.insert(0, os.environ.pop("TEST_REPO_ROOT"))  # train_grpo.py's own folder, as `python train_grpo.py` has it
mode, address, checkpoints = sys.argv[1:4]

import ray
import verl
from hydra import compose, initialize_config_dir
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from verl.trainer.main_ppo import run_ppo

import train_grpo

run = train_grpo.build(["--preset", "cpu", "--model-path", "/m", "--train-files", "/t", "--val-files", "/v",
                        "--checkpoint-dir", checkpoints, "--nnodes", "2", "--ray-address", address])
overrides = run.command[3:]
if mode == "without":  # the negative control: the same run, nothing forwarded
    overrides = [o for o in overrides if not o.startswith("+ray_kwargs.ray_init.runtime_env.env_vars.")]
os.environ.update(run.env)  # what train_grpo.py hands the verl process
with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                           version_base=None):
    config = compose(config_name="ppo_trainer", overrides=overrides)


@ray.remote(num_cpus=0)
class TaskRunner:  # stands in for verl's: run_ppo's own ray.init (attach + runtime env) is under test
    def run(self, config):
        return None


run_ppo(config, task_runner_class=TaskRunner)


@ray.remote(num_cpus=0)
class Probe:
    def report(self):
        import os, sys
        r = {k: os.environ.get(k) for k in ("TTSRL_REWARD_URL", "VERL_USE_EXTERNAL_MODULES", "PYTHONPATH",
                                            "CUDA_VISIBLE_DEVICES", "WANDB_API_KEY")}
        r.update(node=ray.get_runtime_context().get_node_id(), cwd=os.getcwd(), pid=os.getpid())
        try:
            import verl  # noqa: F401  (verl/__init__.py imports what VERL_USE_EXTERNAL_MODULES names)
            from verl.workers.rollout.replica import get_rollout_replica_class
            r["verl_import"] = "ok"
        except Exception as e:
            r["verl_import"] = repr(e)
        plugin = sys.modules.get("ttsrl.verl_plugin.plugin")
        r["plugin"] = getattr(plugin, "__file__", None)
        try:
            r["hf_rollout"] = get_rollout_replica_class("hf").__name__
        except Exception as e:
            r["hf_rollout"] = repr(e)[:200]
        return r


nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
probes = [Probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote() for n in nodes]
reports = ray.get([p.report.remote() for p in probes], timeout=900)
print("RESULT " + json.dumps({"driver_node": ray.get_runtime_context().get_node_id(), "nodes": nodes,
                              "reports": reports}), flush=True)
ray.shutdown()
"""


def _drain(stream, lines: list[str]) -> None:
    for line in stream:
        lines.append(line)


def _processes_under(folder: str) -> list:
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(folder in part for part in (p.info["cmdline"] or [])):
                found.append(p)
        except psutil.Error:
            continue
    return found


@pytest.fixture
def two_raylets(tmp_path):
    """(address, Ray temp folder) of a two-raylet cluster started by a process with a clean
    environment (PATH, HOME, RAY_TMPDIR only) in a folder of its own; shut down afterwards
    whatever happens, and checked to leave no process behind."""
    home, cwd = tmp_path / "home", tmp_path / "cluster-cwd"
    home.mkdir()
    cwd.mkdir()
    failures = []
    for _ in range(3):  # Ray gives a raylet 30 s to register: a loaded machine can miss that
        ray_tmp = tempfile.mkdtemp(prefix="ttsrl-ray-", dir="/tmp")  # short: Ray's socket paths live under it
        env = {"PATH": os.environ["PATH"], "HOME": str(home), "RAY_TMPDIR": ray_tmp}
        proc = subprocess.Popen([sys.executable, "-c", CLUSTER], cwd=cwd, env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        lines: list[str] = []
        threading.Thread(target=_drain, args=(proc.stdout, lines), daemon=True).start()
        try:
            deadline = time.monotonic() + 300
            while not any(line.startswith("ADDRESS ") for line in lines) and proc.poll() is None:
                assert time.monotonic() < deadline, "no cluster after 300 s:\n" + "".join(lines)[-4000:]
                time.sleep(0.5)
            if proc.poll() is None:
                address = next(line for line in lines if line.startswith("ADDRESS ")).split()[1]
                yield address, ray_tmp
                return
            failures.append("".join(lines)[-3000:])
        finally:
            _stop_cluster(proc, ray_tmp)
    pytest.fail("the cluster did not start in 3 tries:\n" + "\n---\n".join(failures))


def _stop_cluster(proc: subprocess.Popen, ray_tmp: str) -> None:
    """Shut the cluster process's nodes down (or kill its session) and check that nothing it
    started is left."""
    proc.stdin.close()  # the cluster process shuts its nodes down
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # its own session: our processes only
        proc.wait()
    deadline = time.monotonic() + 60
    while _processes_under(ray_tmp) and time.monotonic() < deadline:
        time.sleep(1)
    left = _processes_under(ray_tmp)
    for p in left:  # started by this test (their command lines name its temp folder)
        p.kill()
    shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not left, f"Ray processes left behind: {[(p.pid, p.info['cmdline'][:2]) for p in left]}"


def _drive(mode: str, address: str, ray_tmp: str, tmp_path: Path) -> dict:
    cwd = tmp_path / f"driver-{mode}"
    cwd.mkdir()
    script = cwd / "driver.py"
    script.write_text(DRIVER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != "PYTHONPATH"}
    env.update(TEST_REPO_ROOT=str(ROOT), RAY_TMPDIR=ray_tmp, TTSRL_REWARD_URL=URLS, CUDA_VISIBLE_DEVICES="7",
               WANDB_API_KEY="s3cret-wandb")
    r = subprocess.run([sys.executable, str(script), mode, address, str(tmp_path / "checkpoints")], cwd=cwd,
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "RESULT " in r.stdout, r.stdout[-4000:] + r.stderr[-6000:]
    result = json.loads(r.stdout.split("RESULT ", 1)[1].splitlines()[0])
    print(f"[{mode}] " + json.dumps(result, indent=1))  # shown with -s or on failure
    return result


@pytest.mark.slow
def test_workers_on_both_raylets_get_the_reward_urls_and_load_our_plugin(two_raylets, tmp_path):
    """verl's run_ppo attaches to a cluster whose raylets know nothing of the driver's
    environment; with our forwarded variables an actor pinned to each raylet sees the reward
    URLs and verl loads our plugin there (from this checkout); without them (the negative
    control) neither reaches any worker. (A venv with ttsrl installed imports ttsrl anyway;
    what the workers lack then is the switch that makes verl load the plugin.)"""
    address, ray_tmp = two_raylets
    plugin_file = str(ROOT / "ttsrl" / "verl_plugin" / "plugin.py")

    with_env = _drive("with", address, ray_tmp, tmp_path)
    reports = with_env["reports"]
    assert len(reports) == 2 and {r["node"] for r in reports} == set(with_env["nodes"])
    assert any(r["node"] != with_env["driver_node"] for r in reports)  # a raylet the driver is not on
    for r in reports:
        assert r["TTSRL_REWARD_URL"] == URLS, r
        assert r["VERL_USE_EXTERNAL_MODULES"] == "ttsrl.verl_plugin.plugin" and r["verl_import"] == "ok", r
        assert r["plugin"] == plugin_file and r["hf_rollout"] == "HFReplica", r
        assert r["PYTHONPATH"].split(":")[0] == str(ROOT) and not r["cwd"].startswith(str(ROOT)), r
        assert r["CUDA_VISIBLE_DEVICES"] != "7" and r["WANDB_API_KEY"] is None, r  # never forwarded

    without = _drive("without", address, ray_tmp, tmp_path)
    assert len(without["reports"]) == 2
    for r in without["reports"]:
        assert r["TTSRL_REWARD_URL"] is None and r["VERL_USE_EXTERNAL_MODULES"] is None, r
        assert r["PYTHONPATH"] is None and r["plugin"] is None and r["hf_rollout"] != "HFReplica", r
