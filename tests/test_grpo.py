"""Stage-2 configuration: our overrides are accepted by verl 0.9.1's own Hydra config.

No training here: ``ppo_trainer.yaml`` is composed with the generated overrides
through Hydra's compose API, and the values are read back.
"""

from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import verl
from helpers import cpu_config
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from ttsrl.train.grpo import GRPOConfig

ROOT = Path(__file__).resolve().parent.parent
VERL_CONFIG_DIR = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")


def composed(overrides: list[str]):
    """verl's ``ppo_trainer`` config with ``overrides``, resolved: a copy of the one composition of
    these overrides in this session (Hydra takes about 0.35 s a composition, and the preset and
    algorithm tests compose the same overrides again and again)."""
    return copy.deepcopy(_composed(tuple(overrides)))


@functools.cache
def _composed(overrides: tuple[str, ...]):
    with initialize_config_dir(config_dir=VERL_CONFIG_DIR, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=list(overrides))
    OmegaConf.resolve(cfg)
    return cfg


def gpu(preset: str = "gpu", **kw) -> GRPOConfig:
    return GRPOConfig.from_preset(preset, model_path="/m/hf model", train_files="/d/train.parquet",
                                  val_files="/d/test.parquet", **kw)


def test_gpu8_preset_is_the_reference_recipe():
    cfg = composed(gpu(preset="gpu8").to_overrides())
    a = cfg.actor_rollout_ref
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.algorithm.norm_adv_by_std_in_grpo is True
    assert cfg.data.train_batch_size == 32 and a.actor.ppo_mini_batch_size == 32
    assert a.actor.ppo_micro_batch_size_per_gpu == 4 and a.rollout.log_prob_micro_batch_size_per_gpu == 4
    assert a.actor.optim.lr == pytest.approx(1e-6)
    assert cfg.data.max_prompt_length == 1024 and cfg.data.max_response_length == 512
    assert a.actor.use_kl_loss is False and cfg.algorithm.use_kl_in_reward is False
    assert a.actor.kl_loss_coef == pytest.approx(0.001) and a.actor.kl_loss_type == "low_var_kl"
    assert a.model.enable_gradient_checkpointing is True
    assert a.model.trust_remote_code is True and a.model.use_fused_kernels is False
    assert a.model.path == "/m/hf model"
    r = a.rollout
    assert (r.name, r.tensor_model_parallel_size, r.gpu_memory_utilization, r.n) == ("vllm", 1, 0.6, 4)
    for s in (r, r.val_kwargs):
        assert (s.temperature, s.top_p, s.top_k) == (0.8, 0.95, 25)
    t = cfg.trainer
    assert (t.save_freq, t.test_freq, t.total_epochs, t.resume_mode) == (100, 100, 1, "auto")
    assert list(t.logger) == ["console"] and t.n_gpus_per_node == 8


def test_reward_keys_are_the_verl_091_ones():
    cfg = composed(gpu(reward_file="/r/reward_tts.py", reward_function="score").to_overrides())
    assert cfg.reward.custom_reward_function.path == "/r/reward_tts.py"
    assert cfg.reward.custom_reward_function.name == "score"
    assert cfg.reward.reward_manager.name == "naive"
    # the pre-0.9 keys exist in the yaml but main_ppo ignores them: we must not rely on them
    assert cfg.custom_reward_function.path is None


def test_default_reward_function_is_what_verl_loads_from_the_repo():
    """verl's own loader, on the composed default config, finds ttsrl's reward function in
    this checkout's reward_tts.py, by an absolute path (Ray workers run in other folders)."""
    from verl.trainer.ppo.reward import get_custom_reward_fn

    from ttsrl.reward.client import compute_score

    cfg = composed(gpu().to_overrides())
    path = cfg.reward.custom_reward_function.path
    assert os.path.isabs(path) and Path(path).samefile(ROOT / "reward_tts.py"), path
    loaded = get_custom_reward_fn(cfg)  # functools.partial(verl's caller, the function, kwargs)
    assert loaded.args[0] is compute_score


def test_cpu_preset_overrides():
    c = cpu_config(model_path="m", train_files="t", val_files="v")
    cfg = composed(c.to_overrides())
    a = cfg.actor_rollout_ref
    assert cfg.ray_kwargs.ray_init.num_gpus == 1 and cfg.ray_kwargs.ray_init.num_cpus == 32
    assert cfg.transfer_queue.backend.SimpleStorage.num_data_storage_units == 1
    assert a.actor.strategy == "fsdp2" and a.ref.strategy == "fsdp2"
    assert a.model.override_config.attn_implementation == "eager"
    assert a.rollout.name == "hf" and a.rollout.calculate_log_probs is True
    assert cfg.trainer.n_gpus_per_node == 1 and list(cfg.trainer.logger) == ["console"]
    env = c.env()
    assert env["VERL_USE_EXTERNAL_MODULES"] == "ttsrl.verl_plugin.plugin" and env["VERL_PLATFORM"] == "cpu"
    assert env["VERL_ENGINE_DEVICE"] == "cuda" and env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)
    assert "VERL_PLATFORM" not in gpu().env()
    # world size 2 on one raylet: as many logical GPUs as FSDP ranks
    two = composed(cpu_config(model_path="m", train_files="t", val_files="v", n_gpus_per_node=2)
                   .to_overrides())
    assert two.ray_kwargs.ray_init.num_gpus == 2 and two.trainer.n_gpus_per_node == 2


def test_extra_overrides_win_and_loggers():
    """A raw override of a key no field owns is applied last (it wins over ttsrl's constant)."""
    c = gpu(loggers=("console", "wandb", "tensorboard"),
            extra=["actor_rollout_ref.actor.optim.weight_decay=0.05", "trainer.critic_warmup=2"])
    cfg = composed(c.to_overrides())
    assert cfg.actor_rollout_ref.actor.optim.weight_decay == pytest.approx(0.05) and cfg.trainer.critic_warmup == 2
    assert list(cfg.trainer.logger) == ["console", "wandb", "tensorboard"]


@pytest.mark.parametrize("override,field", [("actor_rollout_ref.actor.optim.lr=5e-7", "lr"),
                                            ("+trainer.save_freq=7", "save_freq"),
                                            ("actor_rollout_ref.rollout.val_kwargs.top_k=5", "top_k"),
                                            ("data.seed=3", "seed"),
                                            ("reward.custom_reward_function.reward_kwargs.urls=http://x:1", "reward_urls")])
def test_an_override_of_a_key_a_field_owns_is_refused_naming_the_field(override, field):
    """`run.sh 2 2 -- actor_rollout_ref.actor.optim.lr=5e-7` used to win over GRPOConfig.lr,
    skip its checks and leave ttsrl_run.json saying the preset's lr; now it is refused, naming the
    field and its flag (the key -> field map is read off the config itself, no list kept by hand)."""
    with pytest.raises(ValueError, match=rf"GRPOConfig\.{field} owns: give it as --{field.replace('_', '-')} VALUE"):
        gpu(extra=[override])
    owned = gpu().owned_keys()
    assert owned["actor_rollout_ref.actor.optim.lr"] == "lr" and owned["trainer.total_epochs"] == "total_epochs"
    assert "reward.num_workers" not in owned and "trainer.critic_warmup" not in owned  # consequences, constants


@pytest.mark.parametrize("bad", [dict(algorithm="ppo2"), dict(device="tpu"), dict(loggers=("mlflow",)),
                                 dict(train_batch_size=4, ppo_mini_batch_size=8), dict(n=0)])
def test_bad_config_is_rejected(bad):
    with pytest.raises(ValueError):
        gpu(**bad)


def test_a_mini_batch_that_micro_batches_do_not_divide_is_refused_before_verl():
    with pytest.raises(ValueError, match="12 rows, 12 a rank: not a multiple of micro_batch_size_per_gpu 8"):
        gpu(train_batch_size=8, ppo_mini_batch_size=3, n=4, micro_batch_size_per_gpu=8)
    assert gpu(train_batch_size=8, ppo_mini_batch_size=2, n=4, micro_batch_size_per_gpu=4).to_overrides()  # a divisor


def test_a_micro_batch_larger_than_a_ranks_mini_batch_is_the_whole_mini_batch():
    """A micro-batch only bounds memory: 16 over a rank's 8 rows is one pass of 8 (verl itself would assert)."""
    cfg = gpu(train_batch_size=8, ppo_mini_batch_size=2, n=4, micro_batch_size_per_gpu=16)
    assert cfg.micro_batch_size_per_gpu == 8
    assert "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8" in cfg.to_overrides()
    two_ranks = gpu(train_batch_size=8, ppo_mini_batch_size=2, n=4, micro_batch_size_per_gpu=16, n_gpus_per_node=2)
    assert two_ranks.micro_batch_size_per_gpu == 4


def test_cli_builds_command_with_extras(capsys):
    import train_grpo

    argv = ["--preset", "cpu", "--model-path", "/m", "--train-files", "/t", "--val-files", "/v",
            "--train-batch-size", "8", "--ppo-mini-batch-size", "8", "--val-before-train", "false",
            "--loggers", "console,tensorboard", "--algorithm", "rloo", "--", "trainer.critic_warmup=3"]
    cfg, cmd, env, preset, dry = train_grpo.build(argv)
    assert (preset, dry) == ("cpu", False)
    assert cmd[1:3] == ["-m", "verl.trainer.main_ppo"]
    assert cfg.device == "cpu" and cfg.train_batch_size == 8 and cfg.val_before_train is False
    assert cfg.loggers == ("console", "tensorboard") and cmd[-1] == "trainer.critic_warmup=3"
    composed(cmd[3:])  # verl accepts the whole command line
    train_grpo.main(argv[:-2] + ["--dry-run", "--", "trainer.critic_warmup=3"])
    out = capsys.readouterr().out
    assert "export VERL_PLATFORM=cpu" in out and "trainer.critic_warmup=3" in out


def test_plugin_registers_rollout_and_platform():
    from verl.plugin.platform import PlatformRegistry
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import get_rollout_replica_class

    import ttsrl.verl_plugin.plugin  # noqa: F401  (what VERL_USE_EXTERNAL_MODULES imports)

    assert get_rollout_replica_class("hf").__name__ == "HFReplica"
    assert get_rollout_class("hf", "async").__name__ == "HFServerAdapter"
    assert PlatformRegistry.get("cpu")().current_device() == "cpu"


def test_backend_dedup():
    from ttsrl.verl_plugin.patches import dedup_backend

    assert dedup_backend("cpu:gloo,cpu:gloo") == "cpu:gloo"
    assert dedup_backend("cpu:gloo,cuda:nccl") == "cpu:gloo,cuda:nccl"
    assert dedup_backend("gloo") == "gloo"
    with pytest.raises(ValueError):
        dedup_backend("cpu:gloo,cpu:mpi")


def test_hf_rollout_sampling_params():
    from ttsrl.verl_plugin.hf_rollout import parse_sampling

    s = parse_sampling({"temperature": 0.8, "top_p": 0.95, "top_k": 25, "logprobs": True,
                        "repetition_penalty": 1.0}, default_max_tokens=512, room=100)
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens, s.want_logprobs) == (0.8, 0.95, 25, 100, True)
    g = s.generation_config(eos_ids=[7, 8, 9], pad_id=0)
    # generate's greedy step over our draw (tests/test_hf_rollout_sampling.py)
    assert not g.do_sample and g.eos_token_id == [7, 8, 9] and g.output_logits
    assert g.max_new_tokens == 100 and len(s.logits_processors()) == 1
    greedy = parse_sampling({"temperature": 0, "top_k": -1, "top_p": 1.0, "max_tokens": 5}, 512, 100)
    assert greedy.greedy and greedy.max_tokens == 5
    assert not greedy.generation_config([7], 0).do_sample and greedy.logits_processors() == []


def test_reading_the_run_environment_imports_neither_verl_nor_ray():
    """GRPOConfig.env() only names environment variables; the plugin is installed by
    importing ttsrl.verl_plugin.plugin (what verl does), never as a side effect."""
    code = ("import sys; from ttsrl.train.grpo import GRPOConfig; import ttsrl.verl_plugin; "
            "env = GRPOConfig.from_preset('cpu', model_path='m', train_files='t', val_files='v').env(); "
            "assert env['VERL_USE_EXTERNAL_MODULES'] == 'ttsrl.verl_plugin.plugin'; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('verl', 'ray')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_every_train_grpo_option_has_typed_help():
    import train_grpo

    actions = [a for a in train_grpo._parser()._actions if a.option_strings and a.dest != "help"]
    assert len(actions) >= 30
    for a in actions:
        assert a.help and len(a.help) > 15, a.option_strings
        if a.nargs != 0:  # takes a value: says which kind
            assert a.choices or a.metavar in ("INT", "FLOAT", "STR", "BOOL") or "," in (a.metavar or ""), \
                (a.option_strings, a.metavar)


def test_verl_model_setup_survives_trl_without_value_head():
    """TRL 1.16 (installed for DPO/KTO) has no AutoModelForCausalLMWithValueHead; verl 0.9.1's
    apply_monkey_patch imported it whenever TRL was installed, which killed every GRPO
    actor at init. After the plugin's compat install verl's own patch runs cleanly."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("trl") is None:
        pytest.skip("TRL not installed")
    import verl.utils.model as model_utils
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from verl.models.transformers import monkey_patch
    from verl.utils.import_utils import is_trl_available

    from ttsrl.verl_plugin import trl_compat

    for mod in (monkey_patch, model_utils):  # verl's own check (another test may have installed ours)
        mod.is_trl_available = is_trl_available

    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    if not trl_compat.trl_value_head_available():  # the TRL this project pins: verl alone fails
        with pytest.raises(ImportError, match="AutoModelForCausalLMWithValueHead"):
            monkey_patch.apply_monkey_patch(model)
    trl_compat.install()
    monkey_patch.apply_monkey_patch(model)
    assert monkey_patch.is_trl_available() == trl_compat.trl_value_head_available()


# ---------------------------------------------------------------------------
# the CLI is the dataclass: options, help and presets declared once in ttsrl/train/grpo.py

REQUIRED_ARGV = ["--model-path", "/m", "--train-files", "/t", "--val-files", "/v"]


def test_every_config_field_is_an_option_with_its_declared_help():
    import dataclasses

    import train_grpo

    by_dest = {a.dest: a for a in train_grpo._parser()._actions}
    for f in dataclasses.fields(GRPOConfig):
        if f.name == "extra":  # the raw overrides after --
            assert f.name not in by_dest
            continue
        assert f.name in by_dest, f"GRPOConfig.{f.name} has no train_grpo.py option"
        assert by_dest[f.name].help.startswith(f.metadata["help"].replace("%", "%%")), f.name


def test_embedded_preset_is_the_embedded_run():
    """The values presets/embedded.sh passed as flags before they moved into PRESETS (literal numbers)."""
    import train_grpo

    cfg, *_ = train_grpo.build(["--preset", "embedded", *REQUIRED_ARGV])
    assert (cfg.device, cfg.rollout, cfg.n_gpus_per_node, cfg.experiment_name) == ("cpu", "hf", 1, "embedded")
    assert (cfg.train_batch_size, cfg.ppo_mini_batch_size, cfg.micro_batch_size_per_gpu, cfg.n) == (16, 16, 32, 8)
    assert cfg.lr == 3e-4 and cfg.max_response_length == 64
    assert (cfg.total_epochs, cfg.total_training_steps, cfg.save_freq, cfg.test_freq) == (4, 80, 40, -1)
    # the speed settings: none changes what is learned
    assert (cfg.val_before_train, cfg.gradient_checkpointing, cfg.bypass_old_log_prob) == (False, False, True)
    assert cfg.max_prompt_length == 1024 and cfg.loggers == ("console",)  # run.sh gives the prompt length


def test_gpu8_preset_has_eight_gpus_and_the_bare_gpu_path_one():
    import train_grpo

    assert train_grpo.build(["--preset", "gpu8", *REQUIRED_ARGV])[0].n_gpus_per_node == 8
    bare, *_ = train_grpo.build(REQUIRED_ARGV)  # --preset gpu: the field defaults
    assert (bare.device, bare.n_gpus_per_node, bare.lr, bare.train_batch_size) == ("gpu", 1, 1e-6, 32)


def test_flags_win_over_the_preset():
    import train_grpo

    cfg, cmd, *_ = train_grpo.build(["--preset", "embedded", *REQUIRED_ARGV, "--lr", "1e-5", "--n", "4",
                                    "--total-training-steps", "7", "--experiment-name", "mine"])
    assert (cfg.lr, cfg.n, cfg.total_training_steps, cfg.experiment_name) == (1e-5, 4, 7, "mine")
    assert cfg.train_batch_size == 16  # the rest stays the preset's
    assert "actor_rollout_ref.actor.optim.lr=1e-05" in cmd and "trainer.total_training_steps=7" in cmd


def test_unknown_preset_lists_the_known_ones(capsys):
    import train_grpo

    with pytest.raises(ValueError, match="unknown GRPO preset 'gpu4'; known presets: gpu, cpu, gpu8, embedded"):
        GRPOConfig.from_preset("gpu4", model_path="m", train_files="t", val_files="v")
    with pytest.raises(SystemExit):
        train_grpo.build(["--preset", "gpu4", *REQUIRED_ARGV])
    assert "'gpu8'" in capsys.readouterr().err


def test_dry_run_prints_the_preset_values(capsys):
    import train_grpo

    train_grpo.main(["--preset", "embedded", *REQUIRED_ARGV, "--dry-run"])
    out = capsys.readouterr().out
    for override in ("data.train_batch_size=16", "actor_rollout_ref.actor.optim.lr=0.0003",
                     "actor_rollout_ref.rollout.n=8", "trainer.total_training_steps=80", "trainer.save_freq=40",
                     "algorithm.rollout_correction.bypass_mode=True"):
        assert override in out, override


def test_kl_loss_settings_reach_verl_and_every_kl_type_is_verls():
    import torch
    from verl.trainer.ppo.core_algos import kl_penalty

    import train_grpo

    cfg, cmd, *_ = train_grpo.build(["--preset", "gpu8", *REQUIRED_ARGV, "--use-kl-loss", "true",
                                    "--kl-loss-coef", "0.04", "--kl-loss-type", "k3+"])
    actor = composed(cmd[3:]).actor_rollout_ref.actor
    assert (actor.use_kl_loss, actor.kl_loss_coef, actor.kl_loss_type) == (True, pytest.approx(0.04), "k3+")
    logp, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    field = next(f for f in __import__("dataclasses").fields(GRPOConfig) if f.name == "kl_loss_type")
    for kind in field.metadata["choices"]:  # each one verl's estimator computes
        assert torch.isfinite(kl_penalty(logp, ref, kind)).all(), kind


@pytest.mark.slow  # three train_grpo.main launches, each composing verl's config: ~8 s
def test_a_launch_records_settings_knobs_and_overrides(tmp_path, monkeypatch):
    """train_grpo.py writes <checkpoint_dir>/ttsrl_run.json before it becomes verl (exec stopped here)."""
    import json

    import train_grpo

    launched = []

    def fake_exec(path, command, env):  # the process would be replaced by verl here
        launched.append(env)
        raise SystemExit(0)

    monkeypatch.setattr(train_grpo.os, "execvpe", fake_exec)
    monkeypatch.setenv("TTSRL_REWARD_RETRIES", "7")
    ckpt = tmp_path / "run one" / "checkpoints"
    argv = ["--preset", "embedded", *REQUIRED_ARGV, "--checkpoint-dir", str(ckpt), "--lr", "2e-4", "--", "x.y=1"]
    train_grpo.main([*argv[:-2], "--dry-run", *argv[-2:]])
    assert not ckpt.exists()  # a dry run writes nothing
    with pytest.raises(SystemExit):
        train_grpo.main(argv)
    record = json.loads((ckpt / "ttsrl_run.json").read_text())
    assert record["preset"] == "embedded" and record["config"]["lr"] == 2e-4
    assert record["config"]["train_batch_size"] == 16 and record["config"]["extra"] == ["x.y=1"]
    assert record["knobs"]["TTSRL_REWARD_RETRIES"] == 7 and record["knobs"]["TTSRL_HF_ROLLOUT_MAX_BATCH"] == 128
    assert "TTSRL_USE_PYTHON" not in record["knobs"]  # shell-only knobs are not the run's
    assert "actor_rollout_ref.actor.optim.lr=0.0002" in record["verl_overrides"] and record["verl_overrides"][-1] == "x.y=1"
    assert record["env"]["VERL_PLATFORM"] == "cpu" and launched[0]["VERL_PLATFORM"] == "cpu"
    assert [p.name for p in ckpt.iterdir()] == ["ttsrl_run.json"]  # no temp file left
    assert record["earlier_launches"] == [] and record["resumes_from_step"] is None
    # a second launch (a resume with another lr) keeps the first one's record
    with pytest.raises(SystemExit):
        train_grpo.main([a if a != "2e-4" else "1e-4" for a in argv])
    again = json.loads((ckpt / "ttsrl_run.json").read_text())
    assert again["config"]["lr"] == 1e-4 and [r["config"]["lr"] for r in again["earlier_launches"]] == [2e-4]
    assert again["earlier_launches"][0]["launched_at"] == record["launched_at"]


def test_paths_reach_verl_exactly_with_spaces_quotes_and_backslashes():
    """Every value the recipe renders is read back by verl's own config as written (a backslash
    inside a quoted path used to come back doubled)."""
    odd = {"model_path": "/m/it's a\\b model", "train_files": "/d/tr,ain (1).parquet",
           "val_files": "/d/$HOME/test.parquet", "checkpoint_dir": "/c/a=b [x]\\"}
    cfg = composed(GRPOConfig.from_preset("gpu", **odd).to_overrides())
    assert cfg.actor_rollout_ref.model.path == odd["model_path"]
    assert cfg.data.train_files == odd["train_files"] and cfg.data.val_files == odd["val_files"]
    assert cfg.trainer.default_local_dir == odd["checkpoint_dir"]
