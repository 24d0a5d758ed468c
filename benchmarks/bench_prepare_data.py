#!/usr/bin/env python3
"""Throughput and peak memory of stage 0 (prepare_data.py) on a large generated corpus.

Writes an N-line JSONL (default 1,000,000 rows: varied Mandarin sentences with an id
and a speaker column) into a temporary folder, runs ``prepare_data.py`` on it as a
child process and prints rows/s and the child's peak RSS (getrusage of the child).

    python benchmarks/bench_prepare_data.py                  # byte estimate of lengths
    python benchmarks/bench_prepare_data.py --tiny-tokenizer # also exact counts with a tokenizer
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SUBJECTS = ["我们", "他", "老师", "这家公司", "小明和小红", "银行行长", "重庆的朋友"]
VERBS = ["明天去", "昨天到了", "打算参观", "在", "从来没去过", "正在讨论"]
PLACES = ["北京", "上海的博物馆", "长城", "图书馆", "会议室", "iPhone发布会"]
ENDINGS = ["。", "吗？", "！", "，对吧？", "了。"]


def sentence(rng: random.Random, i: int) -> str:
    return (f"{rng.choice(SUBJECTS)}{rng.choice(VERBS)}{rng.choice(PLACES)}，"
            f"第{i}次花了{rng.randint(1, 9999)}元{rng.choice(ENDINGS)}")


def generate(path: Path, lines: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(lines):
            f.write(json.dumps({"id": f"utt{i:07d}", "text": sentence(rng, i), "spk": i % 50},
                               ensure_ascii=False) + "\n")


def build_tiny_tokenizer(out: Path) -> Path:
    from ttsrl.embedded.tiny_tokenizer import save_blank_en, train_tokenizer
    from ttsrl.model.vocab import extend_tokenizer
    rng = random.Random(0)
    tok = train_tokenizer([sentence(rng, i) for i in range(2000)], vocab_size=1024)
    extend_tokenizer(tok, "cosyvoice2")
    save_blank_en(tok, out)
    return out


def run(train: Path, test: Path, out: Path, extra: list[str]) -> tuple[float, float, str]:
    """Run prepare_data.py; returns (seconds, peak RSS MiB of the child, stdout)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, str(ROOT / "prepare_data.py"), "--train_file", str(train),
                          "--test_file", str(test), "--local_dir", str(out), "--quiet", *extra],
                         capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if res.returncode != 0:
        sys.exit(f"prepare_data.py failed:\n{res.stderr}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB on Linux, max over children
    if peak < before:
        peak = before
    return seconds, peak / 1024, res.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=1_000_000, help="rows of the generated train file")
    ap.add_argument("--chunk-size", type=int, default=10_000, help="passed to prepare_data.py")
    ap.add_argument("--tiny-tokenizer", action="store_true",
                    help="also run with a tiny tokenizer (exact prompt lengths)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench_prepare_data.") as tmp:
        tmp = Path(tmp)
        train, test = tmp / "train.jsonl", tmp / "test.jsonl"
        t0 = time.perf_counter()
        generate(train, args.lines, args.seed)
        generate(test, 1000, args.seed + 1)
        size_mb = train.stat().st_size / 2**20
        print(f"generated {args.lines} rows ({size_mb:.0f} MiB) in {time.perf_counter() - t0:.1f} s")

        variants = [("byte estimate", [])]
        if args.tiny_tokenizer:
            variants.append(("tiny tokenizer", ["--tokenizer", str(build_tiny_tokenizer(tmp / "tok"))]))
        for i, (name, extra) in enumerate(variants):
            out = tmp / f"out{i}"
            seconds, peak_mb, _ = run(train, test, out, extra + ["--chunk-size", str(args.chunk_size)])
            import pyarrow.parquet as pq
            meta = pq.ParquetFile(out / "train.parquet").metadata
            assert meta.num_rows == args.lines, meta.num_rows
            rows = args.lines + 1000
            print(f"{name:15s}: {rows} rows in {seconds:.1f} s = {rows / seconds:,.0f} rows/s, "
                  f"peak RSS {peak_mb:.0f} MiB, train.parquet {(out / 'train.parquet').stat().st_size / 2**20:.0f} MiB "
                  f"in {meta.num_row_groups} row groups")


if __name__ == "__main__":
    main()
