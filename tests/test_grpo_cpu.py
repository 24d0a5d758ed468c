"""End to end on CPU: real verl 0.9.1 GRPO (our plugin, the ``hf`` rollout) on the
tiny converted CosyVoice2 model for 3 steps, checkpoints, merge, reload.

One training run per session (Ray start-up dominates); about 2 minutes on 2 cores.
The reward is the real one: ``reward_tts.py`` posting to the reward server CLI
(``sim`` backend) on a loopback port. The tiny model (a fake of CosyVoice2's
weights, see conftest.py) is first pretrained for a few seconds on 12 sentences so
that its samples earn different rewards; learning over many steps is shown by the
embedded run (run.sh), not by this 3-step test.
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
import requests
import torch

ROOT = Path(__file__).resolve().parent.parent
STEPS, SAVE_FREQ = 3, 2
def _rows(texts: list[str], split: str) -> list[dict]:
    return [{"data_source": "tiny_tts", "prompt": [{"role": "user", "content": t}], "ability": "tts",
             "reward_model": {"style": "rule", "ground_truth": t}, "extra_info": {"split": split, "index": i}}
            for i, t in enumerate(texts)]


def parse_steps(log: str) -> dict[int, dict[str, float]]:
    """verl's console logger lines ``step:N - key:value - ...`` -> {N: metrics}."""
    steps: dict[int, dict[str, float]] = {}
    for m in re.finditer(r"step:(\d+) - (.*)", log):
        metrics = {}
        for item in m.group(2).split(" - "):
            key, _, value = item.partition(":")
            value = re.sub(r"^np\.\w+\((.*)\)$", r"\1", value.strip())  # np.float64(0.5) -> 0.5
            try:
                metrics[key.strip()] = float(value)
            except ValueError:
                continue
        steps.setdefault(int(m.group(1)), {}).update(metrics)
    return steps


@pytest.fixture(scope="module")
def run(tmp_path_factory, sim_server_url):
    from ttsrl.convert import cosyvoice_to_hf
    from ttsrl.pretrain import PretrainConfig, build_base_model
    from ttsrl.tiny_model import TinyConfig

    ws = tmp_path_factory.mktemp("grpo")
    # A few seconds of supervised pretraining on 12 shipped sentences, so that sampled
    # responses get different, non-zero sim rewards and GRPO has a signal.
    lines = (ROOT / "data" / "corpus" / "train.jsonl").read_text(encoding="utf-8").splitlines()[:12]
    (ws / "corpus.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    texts = [json.loads(x)["text"] for x in lines]
    cfg = PretrainConfig(model=TinyConfig(tokenizer_vocab=4096), steps=120, span_prob=0.0, random_prob=0.0,
                         tone_noise=0.3, initial_noise=0.0)
    build_base_model(ws / "corpus.jsonl", ws / "cosyvoice", cfg, log=lambda s: None)
    cosyvoice_to_hf(ws / "cosyvoice", ws / "hf_model", log=lambda s: None)
    pq.write_table(pa.Table.from_pylist(_rows(texts, "train")), ws / "train.parquet")
    pq.write_table(pa.Table.from_pylist(_rows(texts[:4], "test")), ws / "test.parquet")

    cmd = [sys.executable, str(ROOT / "train_grpo.py"), "--preset", "cpu",
           "--model-path", str(ws / "hf_model"), "--train-files", str(ws / "train.parquet"),
           "--val-files", str(ws / "test.parquet"), "--checkpoint-dir", str(ws / "ckpt"),
           "--reward-file", str(ROOT / "reward_tts.py"), "--train-batch-size", "4", "--ppo-mini-batch-size", "4",
           "--micro-batch-size-per-gpu", "4", "--max-prompt-length", "64", "--max-response-length", "32",
           "--total-training-steps", str(STEPS), "--save-freq", str(SAVE_FREQ), "--test-freq", str(STEPS),
           "--lr", "1e-3", "--loggers", "console,tensorboard", "--",
           "actor_rollout_ref.actor.optim.weight_decay=0.0"]
    env = {**os.environ, "TTSRL_REWARD_URL": sim_server_url, "TENSORBOARD_DIR": str(ws / "tensorboard")}
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=900, env=env)
    (ws / "train.log").write_text(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-6000:]
    stats = requests.get(f"{sim_server_url}/v2/models/token2wav_asr/stats", timeout=10).json()
    return ws, proc.stdout, stats


def test_training_steps_and_metrics(run):
    ws, log, stats = run
    steps = parse_steps(log)
    assert sorted(s for s in steps if s > 0) == list(range(1, STEPS + 1)), sorted(steps)
    assert "val-core/tiny_tts/reward/mean@1" in steps[0]  # validation before training
    assert "val-core/tiny_tts/reward/mean@1" in steps[STEPS]  # and at test_freq
    for s in range(1, STEPS + 1):
        m = steps[s]
        # the hf rollout computes the same log-probs as the actor: its weights follow the actor's
        assert m["training/rollout_actor_probs_pearson_corr"] > 0.99, m
        assert m["training/rollout_probs_diff_max"] < 1e-3, m
        assert 0.0 < m["critic/score/mean"] < 1.0 and m["response_length/max"] <= 32
    # every rollout was scored by the server: 3 steps x 4 prompts x n=4, plus 2 validations of 4
    assert stats["ok"] >= STEPS * 4 * 4 + 2 * 4, stats
    assert (ws / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == str(STEPS)
    # the TensorBoard logger (selectable with --loggers) wrote its event file where TENSORBOARD_DIR says
    assert list((ws / "tensorboard").glob("events.out.tfevents.*")), list(ws.iterdir())
    # the thread-count warning TransferQueue printed on every put/get (TQ_NUM_THREADS > cores) is gone
    assert "should not exceed total physical CPU cores" not in log


def _fsdp_tensor(actor: Path, name: str) -> torch.Tensor:
    state = torch.load(actor / "model_world_size_1_rank_0.pt", map_location="cpu", weights_only=False)
    t = state[name]
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).float()


def test_merge_and_reload(run):
    from transformers import AutoModelForCausalLM

    from ttsrl.merge import MARKER

    ws, _, _ = run
    out = ws / "merged"
    cmd = [sys.executable, str(ROOT / "merge_checkpoints.py"), "--ckpt-dir", str(ws / "ckpt"),
           "--out-dir", str(out), "--base-model", str(ws / "hf_model")]
    first = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    for step in (SAVE_FREQ, STEPS):
        assert (out / f"step_{step}" / MARKER).is_file()
        assert str((out / f"step_{step}").resolve()) in first.stdout
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stdout.count("already merged, skipped") == 2, again.stdout

    # a step without its marker (interrupted) is merged again
    (out / f"step_{SAVE_FREQ}" / MARKER).unlink()
    redo = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert redo.returncode == 0 and f"step {SAVE_FREQ}: merged" in redo.stdout, redo.stdout
    assert (out / f"step_{SAVE_FREQ}" / MARKER).is_file()

    step_dir = out / f"step_{STEPS}"
    for name in ("modeling_cosyvoice2.py", "tokenizer.json", "generation_config.json", "config.json"):
        assert (step_dir / name).is_file(), name
    cfg = json.loads((step_dir / "config.json").read_text())
    assert cfg["architectures"] == ["CosyVoice2Qwen2ForCausalLM"]

    merged = AutoModelForCausalLM.from_pretrained(step_dir, trust_remote_code=True)
    base = AutoModelForCausalLM.from_pretrained(ws / "hf_model", trust_remote_code=True)
    assert type(merged).__name__ == "CosyVoice2Qwen2ForCausalLM"
    lo, hi = cfg["speech_output_range"]
    trained_bias = _fsdp_tensor(ws / "ckpt" / f"global_step_{STEPS}" / "actor", "lm_head.bias")
    # the merged bias is the trained one (bf16-rounded by verl's merger) ...
    torch.testing.assert_close(merged.lm_head.bias.float(), trained_bias.bfloat16().float())
    # ... and training moved it
    assert (trained_bias[lo:hi] - base.lm_head.bias[lo:hi]).abs().max() > 1e-3

    # the merged folder reloads and generates speech tokens only, as the base model does
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(step_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "句子1 sentence 1"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    gen = merged.generate(**ids, max_new_tokens=8, do_sample=False)
    new = gen[0, ids["input_ids"].shape[1]:].tolist()
    assert new and all(lo <= t < hi for t in new), new
