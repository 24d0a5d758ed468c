#!/usr/bin/env python
"""CPU GRPO numbers: Ray start-up, median step time, rollout/actor log-prob agreement.

Builds the tiny converted model (as tests/test_grpo_cpu.py does), runs
``train_grpo.py --preset cpu`` for ``--steps`` steps and prints numbers read from
verl's console metrics. Example:

    python benchmarks/bench_grpo_cpu.py --steps 8 --batch 4 --n 4 --response 32
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=4, help="prompts per step")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--response", type=int, default=32, help="max response tokens")
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args()

    import pyarrow as pa
    import pyarrow.parquet as pq
    from test_grpo_cpu import REWARD, _rows, parse_steps

    from ttsrl.embedded.tiny_model import TinyConfig, make_tiny_cosyvoice2
    from ttsrl.model.convert import cosyvoice_to_hf

    ws = args.workdir or Path(tempfile.mkdtemp(prefix="bench_grpo_"))
    corpus = ["今天天气很好 the weather is nice today", "我们一起去公园 let us go to the park"] * 40
    make_tiny_cosyvoice2(ws / "cosyvoice", corpus, TinyConfig(tokenizer_vocab=400))
    cosyvoice_to_hf(ws / "cosyvoice", ws / "hf_model", log=lambda s: None)
    texts = [f"句子{i} sentence {i}" for i in range(args.batch * args.steps)]
    pq.write_table(pa.Table.from_pylist(_rows(texts, "train")), ws / "train.parquet")
    pq.write_table(pa.Table.from_pylist(_rows(texts[:4], "test")), ws / "test.parquet")
    (ws / "reward.py").write_text(REWARD)

    cmd = [sys.executable, str(ROOT / "train_grpo.py"), "--preset", "cpu",
           "--model-path", str(ws / "hf_model"), "--train-files", str(ws / "train.parquet"),
           "--val-files", str(ws / "test.parquet"), "--checkpoint-dir", str(ws / "ckpt"),
           "--reward-file", str(ws / "reward.py"), "--train-batch-size", str(args.batch),
           "--ppo-mini-batch-size", str(args.batch), "--micro-batch-size-per-gpu", str(args.batch),
           "--n", str(args.n), "--max-prompt-length", "64", "--max-response-length", str(args.response),
           "--total-training-steps", str(args.steps), "--save-freq", "-1", "--test-freq", "-1",
           "--val-before-train", "false", "--lr", "1e-4"]
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log, first_progress = [], None
    for line in proc.stdout:
        log.append(line)
        if first_progress is None and "Training Progress:   0%" in line:
            first_progress = time.time() - t0
    proc.wait()
    wall = time.time() - t0
    text = "".join(log)
    (ws / "bench.log").write_text(text)
    if proc.returncode != 0:
        sys.exit(f"training failed (exit {proc.returncode}); log: {ws / 'bench.log'}")
    steps = {k: v for k, v in parse_steps(text).items() if k > 0}
    times = [m["timing_s/step"] for m in steps.values() if "timing_s/step" in m]
    gen = [m["timing_s/gen"] for m in steps.values() if "timing_s/gen" in m]
    corr = [m["training/rollout_actor_probs_pearson_corr"] for m in steps.values()
            if "training/rollout_actor_probs_pearson_corr" in m]
    diff = [m["training/rollout_probs_diff_max"] for m in steps.values() if "training/rollout_probs_diff_max" in m]
    ray_init = re.search(r"Started a local Ray instance", text)
    print(f"workdir                 {ws}")
    print(f"shape                   batch {args.batch} x n {args.n}, response <= {args.response}, {len(steps)} steps")
    print(f"start-up (to step 1)    {first_progress:.1f} s" if first_progress else "start-up: not seen")
    print(f"wall total              {wall:.1f} s")
    print(f"step time median        {statistics.median(times):.2f} s (min {min(times):.2f}, max {max(times):.2f})")
    print(f"generation median       {statistics.median(gen):.2f} s")
    print(f"pearson rollout/actor   min {min(corr):.4f}, median {statistics.median(corr):.4f}")
    print(f"max |dp| rollout/actor  {max(diff):.2e}")
    print(f"ray instance started    {'yes' if ray_init else 'not seen'}")


if __name__ == "__main__":
    main()
