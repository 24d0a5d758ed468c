"""verl 0.9.1 GRPO with verl's vLLM rollout in CosyVoice2's layout for 2 steps on CPU
(``tests/gpu_stack/grpo_run.py``: the GPU preset with the fewest CPU changes, vLLM from dummy
weights so that agreement with the actor proves the weight sync), then stage 3 (merge) and
stage 4 (infer_dataset.py with the vLLM engine) on the merged step. CosyVoice3's run is
test_vllm_grpo_cosyvoice3.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_stack.grpo_run import STEPS, check_run, train_tiny

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # a real verl GRPO run with the vLLM rollout (python -m verl.trainer.main_ppo): minutes


@pytest.fixture(scope="module")
def run(tmp_path_factory, sim_server_url):
    return train_tiny(tmp_path_factory.mktemp("grpo_vllm"), sim_server_url, "cosyvoice2")


def test_grpo_steps_with_vllm_rollout(run):
    check_run(run)


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
