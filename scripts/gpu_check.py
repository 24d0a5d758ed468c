#!/usr/bin/env python
"""The GPU path on a tiny model, end to end, with numbers (run by scripts/gpu_check.sh).

1. GRPO: the GPU preset (``ttsrl.train.grpo.GRPOConfig`` defaults: vLLM rollout, its sampling,
   algorithm, lr schedule keys), scaled to one GPU and tiny sizes, for ``--steps`` steps
   against the ``sim`` reward server; prints each step's time, the rollout/actor
   log-prob correlation and verl's memory metrics.
2. Stage 3: merge the saved step.
3. Stage 4: infer_dataset.py with the vLLM engine (greedy) and the transformers engine
   (greedy, then CosyVoice2 sampling) on the merged step; prints CER of each.

``--device cpu`` runs the same on a CPU with the vLLM CPU build (.venv-vllm/): the
CPU platform overrides plus ``enable_sleep_mode=False``, so the script itself can be
checked where no GPU is. The model is a tiny FAKE of CosyVoice2's weights pretrained
for a few seconds on shipped sentences (no real weights needed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _rows(texts, split):
    return [{"data_source": "tiny_tts", "prompt": [{"role": "user", "content": t}], "ability": "tts",
             "reward_model": {"style": "rule", "ground_truth": t}, "extra_info": {"split": split, "index": i}}
            for i, t in enumerate(texts)]


def setup(ws: Path, n_train: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ttsrl.embedded.pretrain import PretrainConfig, build_base_model
    from ttsrl.embedded.tiny_model import TinyConfig
    from ttsrl.model.convert import cosyvoice_to_hf

    lines = (ROOT / "data/corpus/train.jsonl").read_text(encoding="utf-8").splitlines()[:n_train]
    test = (ROOT / "data/corpus/test.jsonl").read_text(encoding="utf-8").splitlines()[:16]
    (ws / "corpus.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (ws / "test.jsonl").write_text("\n".join(test) + "\n", encoding="utf-8")
    texts = [json.loads(x)["text"] for x in lines]
    t0 = time.time()
    tiny = TinyConfig(tokenizer_vocab=4096, num_attention_heads=1, num_key_value_heads=1)  # head_dim 64
    build_base_model(ws / "corpus.jsonl", ws / "cosyvoice",
                     PretrainConfig(model=tiny, steps=120, span_prob=0.0, random_prob=0.0, tone_noise=0.3,
                                    initial_noise=0.0), log=lambda s: None)
    cosyvoice_to_hf(ws / "cosyvoice", ws / "hf_model", log=lambda s: None)
    pq.write_table(pa.Table.from_pylist(_rows(texts, "train")), ws / "train.parquet")
    pq.write_table(pa.Table.from_pylist(_rows(texts[:8], "test")), ws / "test.parquet")
    print(f"[gpu_check] tiny base model + data in {time.time() - t0:.1f}s", flush=True)


def reward_server() -> tuple[subprocess.Popen, str]:
    from ttsrl.reward.health import launch_server

    try:
        return launch_server("--port", "0", "--backend", "sim", "--log-level", "WARNING")
    except RuntimeError as e:
        raise SystemExit(f"[gpu_check] {e}") from None


def grpo_config(ws: Path, device: str, steps: int, batch: int):
    from ttsrl.train.grpo import GRPOConfig

    extra = ["actor_rollout_ref.rollout.load_format=dummy"]  # only the weight sync gives vLLM real weights
    if device == "cpu":
        extra.append("+actor_rollout_ref.rollout.enable_sleep_mode=False")
    return GRPOConfig(model_path=str(ws / "hf_model"), train_files=str(ws / "train.parquet"),
                      val_files=str(ws / "test.parquet"), checkpoint_dir=str(ws / "ckpt"),
                      device="cpu" if device == "cpu" else "gpu", n_gpus_per_node=1,
                      train_batch_size=batch, ppo_mini_batch_size=batch, max_prompt_length=64,
                      max_response_length=64, total_training_steps=steps, save_freq=steps, test_freq=steps,
                      val_before_train=False, lr=1e-5, extra=extra)


def parse_steps(log: str) -> dict[int, dict[str, float]]:
    steps: dict[int, dict[str, float]] = {}
    for m in re.finditer(r"step:(\d+) - (.*)", log):
        for item in m.group(2).split(" - "):
            key, _, value = item.partition(":")
            value = re.sub(r"^np\.\w+\((.*)\)$", r"\1", value.strip())
            try:
                steps.setdefault(int(m.group(1)), {})[key.strip()] = float(value)
            except ValueError:
                pass
    return steps


def run(cmd, env=None, timeout=900, log_file=None) -> str:
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                       env={**os.environ, **(env or {})})
    if log_file:
        Path(log_file).write_text(p.stdout)
    if p.returncode != 0:
        print(p.stdout[-6000:])
        raise SystemExit(f"[gpu_check] FAILED ({p.returncode}): {' '.join(map(str, cmd[:3]))} ...")
    print(f"[gpu_check] {Path(str(cmd[1])).name} ... done in {time.time() - t0:.1f}s", flush=True)
    return p.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16, help="prompts per step (x n=4 samples, the preset's n)")
    a = ap.parse_args()
    if a.device == "cpu":  # vLLM's CPU KV cache in GiB (its default takes far more than a tiny model needs)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    ws = Path(a.workdir)
    ws.mkdir(parents=True, exist_ok=True)
    setup(ws, a.batch * a.steps)  # one epoch = --steps steps
    server, url = reward_server()
    try:
        cfg = grpo_config(ws, a.device, a.steps, a.batch)
        assert cfg.rollout == "vllm"
        env = {**cfg.env(), "TTSRL_REWARD_URL": url, "TTSRL_PLUGIN_LOADED_LOG": "1"}
        log = run([sys.executable, "-m", "verl.trainer.main_ppo", *cfg.to_overrides()], env=env, timeout=600,
                  log_file=ws / "train.log")
        pids = set(re.findall(r"\[ttsrl\.vllm_plugin\] registered \S+ in pid (\d+)", log))
        print(f"[gpu_check] vLLM plugin loaded in {len(pids)} process(es) of the run")
        if not pids:
            raise SystemExit("[gpu_check] FAILED: the ttsrl vLLM plugin never loaded inside verl's rollout")
        steps = parse_steps(log)
        for s in sorted(k for k in steps if k > 0):
            m = steps[s]
            def g(key, m=m):
                return m.get(key, float("nan"))

            print(f"[gpu_check] GRPO step {s}: {g('timing_s/step'):.1f}s, gen {g('timing_s/gen'):.1f}s, "
                  f"throughput {g('perf/throughput'):.0f} tok/s, rollout/actor prob pearson "
                  f"{g('training/rollout_actor_probs_pearson_corr'):.4f}, actor peak mem "
                  f"{g('perf/max_memory_allocated_gb'):.2f} GB, score {g('critic/score/mean'):.3f}")
        bad = [s for s in steps if s > 0 and steps[s].get("training/rollout_actor_probs_pearson_corr", 0) < 0.99]
        if len([s for s in steps if s > 0]) != a.steps or bad:
            raise SystemExit(f"[gpu_check] FAILED: steps {sorted(steps)}, low rollout/actor correlation at {bad}")
        run([sys.executable, str(ROOT / "merge_checkpoints.py"), "--ckpt-dir", str(ws / "ckpt"),
             "--out-dir", str(ws / "merged"), "--base-model", str(ws / "hf_model")])
        dev = "cpu" if a.device == "cpu" else "cuda"
        for engine, extra in (("vllm", ["--greedy"]), ("hf", ["--greedy"]), ("hf", []), ("vllm", [])):
            tag = f"{engine}{'_greedy' if extra else '_sampling'}"
            run([sys.executable, str(ROOT / "infer_dataset.py"), "--start-model", str(ws / "hf_model"),
                 "--merged-dir", str(ws / "merged"), "--steps", str(a.steps), "--out-dir", str(ws / f"eval_{tag}"),
                 "--test-set", f"tiny={ws / 'test.jsonl'}", "--engine", engine, "--device", dev, "--backend", "sim",
                 "--seed", "0", *extra])
            s = json.loads((ws / f"eval_{tag}" / f"step_{a.steps}" / "tiny" / "summary.json").read_text())
            print(f"[gpu_check] stage 4 {tag:12s}: CER {s['cer']:.4f} n {s['n']} failures {s['failures']} "
                  f"({s['seconds']:.1f}s)")
    finally:
        server.terminate()
        server.wait(15)
    print("[gpu_check] OK")


if __name__ == "__main__":
    main()
