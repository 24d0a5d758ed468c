#!/usr/bin/env python
"""How much of a GRPO training update survives stage 3's merge: fp32 vs bf16.

Trains the given converted model (default: the embedded preset's base model) with
``train_grpo.py --preset cpu`` for a few steps at the GPU preset's learning rate
(1e-6), merges the last step twice with ``merge_checkpoints.py`` (``--dtype auto``,
the fp32 master weights, and ``--dtype bf16``, what verl's own merger writes), and
prints for each merge, against the start model rounded to the merge's dtype
(definitions in ttsrl.train.merge.update_survival):

    survives        of the weights the update changed, the fraction whose merged value
                    differs from the (equally rounded) start value
    delta error     |(merged - rounded start) - update| / |update|
    error/update    |merged - master| / |update|
    changed         fraction of all weights the update changed

With ``--ckpt-dir`` it measures an existing run instead of training (e.g. the
embedded run's ``exp/embedded/checkpoints``, step 80 at lr 3e-4).

    python benchmarks/bench_merge_precision.py --port 8121               # lr 1e-6, 4 steps
    python benchmarks/bench_merge_precision.py --ckpt-dir exp/embedded/checkpoints --step 80
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def start_server(port: int) -> tuple[subprocess.Popen, str]:
    from ttsrl.reward.health import launch_server

    return launch_server("--backend", "sim", "--port", str(port), "--log-level", "WARNING")


def train(args, ws: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from test_grpo_cpu import _rows

    lines = (ROOT / "data" / "corpus" / "train.jsonl").read_text(encoding="utf-8").splitlines()
    texts = [json.loads(x)["text"] for x in lines[: args.batch * args.steps]]
    pq.write_table(pa.Table.from_pylist(_rows(texts, "train")), ws / "train.parquet")
    pq.write_table(pa.Table.from_pylist(_rows(texts[:4], "test")), ws / "test.parquet")
    server, url = start_server(args.port)
    try:
        cmd = [sys.executable, str(ROOT / "train_grpo.py"), "--preset", "cpu", "--model-path", str(args.model),
               "--train-files", str(ws / "train.parquet"), "--val-files", str(ws / "test.parquet"),
               "--checkpoint-dir", str(ws / "ckpt"), "--reward-file", str(ROOT / "reward_tts.py"),
               "--train-batch-size", str(args.batch), "--ppo-mini-batch-size", str(args.batch),
               "--micro-batch-size-per-gpu", str(args.batch * args.n), "--n", str(args.n),
               "--max-prompt-length", "64", "--max-response-length", "64",
               "--total-training-steps", str(args.steps), "--save-freq", str(args.steps), "--test-freq", "-1",
               "--val-before-train", "false", "--lr", str(args.lr)]
        t0 = time.time()
        proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "TTSRL_REWARD_URL": url})
        (ws / "train.log").write_text(proc.stdout)
        if proc.returncode != 0:
            sys.exit(f"training failed (exit {proc.returncode}); log: {ws / 'train.log'}")
        print(f"trained {args.steps} steps at lr {args.lr} in {time.time() - t0:.0f} s ({ws / 'train.log'})")
    finally:
        server.terminate()
        server.wait(15)
    return ws / "ckpt"


def master_state(actor: Path) -> dict:
    import torch

    files = sorted(actor.glob("model_world_size_*_rank_*.pt"))
    if len(files) != 1:
        sys.exit(f"{actor}: this benchmark reads world-size-1 checkpoints (found {len(files)} shards)")
    state = torch.load(files[0], map_location="cpu", weights_only=False)  # our own checkpoint
    return {k: (v._local_tensor if hasattr(v, "_local_tensor") else v) for k, v in state.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=ROOT / "exp" / "embedded" / "hf_model", help="start model (HF)")
    p.add_argument("--lr", type=float, default=1e-6, help="learning rate (GPU preset: 1e-6)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--port", type=int, default=8121, help="reward server port (loopback)")
    p.add_argument("--ckpt-dir", type=Path, default=None, help="measure this run instead of training")
    p.add_argument("--step", type=int, default=None, help="with --ckpt-dir: the step (default: latest)")
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args()

    from ttsrl.model.checkpoint import read_hf_tensors
    from ttsrl.train.merge import saved_steps, update_survival

    ws = args.workdir or Path(tempfile.mkdtemp(prefix="bench_merge_"))
    ws.mkdir(parents=True, exist_ok=True)
    ckpt = args.ckpt_dir or train(args, ws)
    steps = saved_steps(ckpt)
    step = args.step if args.step is not None else max(steps)
    base = read_hf_tensors(args.model)
    master = master_state(steps[step])
    print(f"checkpoint {steps[step]} (step {step}); start model {args.model}")
    for option in ("auto", "bf16"):
        out = ws / f"merged_{option}"
        cmd = [sys.executable, str(ROOT / "merge_checkpoints.py"), "--ckpt-dir", str(ckpt), "--out-dir", str(out),
               "--base-model", str(args.model), "--steps", str(step), "--dtype", option]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(proc.stdout + proc.stderr)
        merged = read_hf_tensors(out / f"step_{step}")
        r = update_survival(base, master, merged)
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in merged.values()})
        print(f"--dtype {option:4s} ({'/'.join(dtypes)}): survives {100 * r['survives']:6.2f}%   "
              f"delta error {r['delta_error']:8.3f}   error/update {r['error_vs_update']:8.3f}   "
              f"changed {100 * r['changed']:6.2f}%   |update| {r['update_norm']:.4g}   ({r['n_weights']} weights)")


if __name__ == "__main__":
    main()
