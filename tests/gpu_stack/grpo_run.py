"""The vLLM-rollout GRPO run the two families' test files share (test_vllm_grpo.py and
test_vllm_grpo_cosyvoice3.py): one file a family, so the two runs (3 min each on 2 cores)
go to the two pytest-xdist workers of ``bash scripts/test.sh`` side by side.

verl 0.9.1 GRPO with verl's vLLM rollout (``rollout.name=vllm``: a vLLMHttpServer Ray
actor, server mode as on GPUs) for 2 steps on CPU. The configuration is the GPU preset's own
(``ttsrl.train.grpo.GRPOConfig`` defaults, the builder behind ``train_grpo.py --preset gpu``)
with only: ``device="cpu"`` (the CPU platform overrides every CPU run needs), one logical GPU,
tiny batch/length sizes, ``enable_sleep_mode=False`` (vLLM's CPU platform has no sleep mode)
and ``load_format=dummy`` (vLLM starts from random weights, so rollout log-probs that match
the actor's prove that verl's weight sync reached vLLM). The model is a tiny FAKE of the
family's weights pretrained for a few seconds (see tests/conftest.py); the reward is the real
reward function posting to the reward server (``sim``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from helpers import grpo_rows, parse_steps  # tests/helpers.py (tests/ is on sys.path)

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2


def gpu_preset_for_cpu(ws: Path):
    """The GPU preset (rollout vllm, its sampling, lr, algorithm, ...) with the fewest
    changes that let it run on 2 CPU cores with a tiny model."""
    from ttsrl.train.grpo import GRPOConfig

    cfg = GRPOConfig(
        model_path=str(ws / "hf_model"), train_files=str(ws / "train.parquet"), val_files=str(ws / "test.parquet"),
        checkpoint_dir=str(ws / "ckpt"),
        device="cpu", n_gpus_per_node=1,  # CPU platform, one logical GPU
        train_batch_size=4, ppo_mini_batch_size=4, micro_batch_size_per_gpu=4,  # tiny sizes
        max_prompt_length=64, max_response_length=32,
        total_training_steps=STEPS, save_freq=STEPS, test_freq=STEPS, lr=1e-3,
        extra=["+actor_rollout_ref.rollout.enable_sleep_mode=False",  # not on vLLM's CPU platform
               "actor_rollout_ref.rollout.load_format=dummy"])
    assert cfg.rollout == "vllm"  # the GPU preset's rollout
    return cfg


def train_tiny(ws: Path, sim_server_url: str, family: str) -> tuple[Path, str]:
    """Pretrain a tiny base model of ``family`` for a few seconds, convert it, GRPO 2 steps."""
    from ttsrl.embedded.pretrain import PretrainConfig, build_base_model
    from ttsrl.embedded.tiny_model import TinyConfig
    from ttsrl.model.convert import cosyvoice_to_hf

    lines = (ROOT / "data" / "corpus" / "train.jsonl").read_text(encoding="utf-8").splitlines()[:12]
    (ws / "corpus.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    texts = [json.loads(x)["text"] for x in lines]
    # head_dim 64 (one head of 64): vLLM's CPU attention has no kernel for head_dim 16
    tiny = TinyConfig(tokenizer_vocab=4096, num_attention_heads=1, num_key_value_heads=1)
    pcfg = PretrainConfig(model=tiny, steps=120, span_prob=0.0, random_prob=0.0,
                          tone_noise=0.3, initial_noise=0.0, family=family)
    build_base_model(ws / "corpus.jsonl", ws / "cosyvoice", pcfg, log=lambda s: None)
    cosyvoice_to_hf(ws / "cosyvoice", ws / "hf_model", log=lambda s: None)
    pq.write_table(pa.Table.from_pylist(grpo_rows(texts, "train")), ws / "train.parquet")
    pq.write_table(pa.Table.from_pylist(grpo_rows(texts[:4], "test")), ws / "test.parquet")
    (ws / "test.jsonl").write_text("\n".join(lines[:6]) + "\n", encoding="utf-8")

    cfg = gpu_preset_for_cpu(ws)
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *cfg.to_overrides()]
    env = {**os.environ, **cfg.env(), "TTSRL_REWARD_URL": sim_server_url, "TTSRL_PLUGIN_LOADED_LOG": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=1200, env=env)
    (ws / "train.log").write_text(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-8000:]
    return ws, proc.stdout


def check_run(run: tuple[Path, str]) -> None:
    """What every vLLM-rollout run must show: the plugin loaded in verl's vLLM processes, every step
    logged, vLLM's probabilities the actor's (weights synced), a checkpoint of the last step."""
    ws, log = run
    # the plugin ran inside verl's vLLM processes (not in the trainer process: it has no vLLM engine)
    loaded = re.findall(r"\[ttsrl\.model\.vllm_plugin\] registered CosyVoice2Qwen2ForCausalLM in pid (\d+) "
                        r"\(cpu oneDNN repacking off: True\)", log)
    assert loaded, log[-4000:]
    assert "vLLMHttpServer" in log
    steps = parse_steps(log)
    assert sorted(s for s in steps if s > 0) == list(range(1, STEPS + 1)), sorted(steps)
    for s in range(1, STEPS + 1):
        m = steps[s]
        # vLLM started from dummy weights: agreement with the actor means the weights were
        # synced; agreement every step means the synced weights are the current ones
        corr = m["training/rollout_actor_probs_pearson_corr"]
        print(f"step {s}: rollout/actor prob pearson {corr:.5f}, diff max {m['training/rollout_probs_diff_max']:.3e}, "
              f"step time {m.get('timing_s/step', float('nan')):.1f}s, score {m['critic/score/mean']:.3f}")
        assert corr > 0.99, m
        assert 0.0 < m["critic/score/mean"] < 1.0 and m["response_length/max"] <= 32
    assert (ws / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == str(STEPS)
