"""verl 0.9.1 GRPO with verl's vLLM rollout (``rollout.name=vllm``: a vLLMHttpServer Ray
actor, server mode as on GPUs) for 2 steps on CPU, then stage 3 (merge) and stage 4
(infer_dataset.py with the vLLM engine) on the merged step.

The configuration is the GPU preset's own (``ttsrl.train.grpo.GRPOConfig`` defaults, the
builder behind ``train_grpo.py --preset gpu``) with only: ``device="cpu"`` (the CPU
platform overrides every CPU run needs), one logical GPU, tiny batch/length sizes,
``enable_sleep_mode=False`` (vLLM's CPU platform has no sleep mode) and
``load_format=dummy`` (vLLM starts from random weights, so rollout log-probs that
match the actor's prove that verl's weight sync reached vLLM). The model is a tiny
FAKE of CosyVoice2's weights pretrained for a few seconds (see tests/conftest.py);
the reward is the real reward function posting to the reward server (``sim``).
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
import pytest
from helpers import grpo_rows, parse_steps  # tests/helpers.py (tests/ is on sys.path)

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2
pytestmark = pytest.mark.slow  # a real verl GRPO run with the vLLM rollout (python -m verl.trainer.main_ppo): minutes


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


@pytest.fixture(scope="module")
def run(tmp_path_factory, sim_server_url):
    return _train(tmp_path_factory.mktemp("grpo_vllm"), sim_server_url, "cosyvoice2")


def _train(ws: Path, sim_server_url: str, family: str) -> tuple[Path, str]:
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


@pytest.fixture(scope="module")
def run_cosyvoice3(tmp_path_factory, sim_server_url):
    return _train(tmp_path_factory.mktemp("grpo_vllm_cv3"), sim_server_url, "cosyvoice3")


def test_grpo_steps_with_vllm_rollout_cosyvoice3(run_cosyvoice3):
    """The same run in CosyVoice3's layout: the bias-free head served by vLLM, its 200 stop ids
    (generation_config) ending rollouts, the <|endofprompt|> prompt from the chat template."""
    test_grpo_steps_with_vllm_rollout(run_cosyvoice3)
    ws, _ = run_cosyvoice3
    assert json.loads((ws / "hf_model" / "config.json").read_text())["speech_family"] == "cosyvoice3"


def test_grpo_steps_with_vllm_rollout(run):
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


@pytest.fixture(scope="module")
def merged(run):
    ws, _ = run
    cmd = [sys.executable, str(ROOT / "merge_checkpoints.py"), "--ckpt-dir", str(ws / "ckpt"),
           "--out-dir", str(ws / "merged"), "--base-model", str(ws / "hf_model")]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    step = ws / "merged" / f"step_{STEPS}"
    assert (step / "model.safetensors").is_file() and not (step / "model.safetensors.index.json").exists()
    return ws, step


def _stage4(ws: Path, engine: str, out: str, *extra: str, greedy: bool = True) -> dict:
    cmd = [sys.executable, str(ROOT / "infer_dataset.py"), "--start-model", str(ws / "hf_model"),
           "--merged-dir", str(ws / "merged"), "--steps", str(STEPS), "--out-dir", str(ws / out),
           "--test-set", f"tiny={ws / 'test.jsonl'}", "--engine", engine, "--device", "cpu",
           *(["--greedy"] if greedy else []), "--backend", "sim", *extra]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert f"engine {engine} on cpu" in p.stdout + p.stderr
    return json.loads((ws / out / f"step_{STEPS}" / "tiny" / "summary.json").read_text())


def test_stage4_vllm_engine_on_merged_step(merged):
    """Stage 4 serves the merged step with vLLM; greedy scores equal the transformers engine's."""
    ws, step = merged
    v = _stage4(ws, "vllm", "eval_vllm")
    h = _stage4(ws, "hf", "eval_hf")
    print(f"stage 4 greedy on merged step {STEPS}: CER vllm {v['cer']:.4f} / hf {h['cer']:.4f}, "
          f"failures {v['failures']}/{h['failures']}")
    assert v["n"] == h["n"] == 6 and v["failures"] == 0
    assert v["cer"] == pytest.approx(h["cer"]) and v["reward"] == pytest.approx(h["reward"])


@pytest.mark.slow
@pytest.mark.extended  # ~50 s; the rule in vLLM's logits processor: tests/gpu_stack/test_vllm_sampling.py
def test_stage4_vllm_engine_samples(merged):
    """Stage 4 samples on the vLLM engine (CosyVoice2's rule in its logits processor)."""
    ws, _ = merged
    v = _stage4(ws, "vllm", "eval_vllm_sampled", greedy=False)
    print(f"stage 4 sampled on merged step {STEPS} with vllm: CER {v['cer']:.4f}, failures {v['failures']}")
    assert v["n"] == 6 and v["failures"] == 0
