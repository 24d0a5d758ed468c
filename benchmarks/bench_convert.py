#!/usr/bin/env python
"""Conversion speed and memory at full size (CosyVoice2-0.5B shape).

Builds a RANDOM CosyVoice2 checkpoint of the real shape (Qwen2-0.5B inner model,
vocab 151936, a synthetic tokenizer of Qwen2's exact size) in a temp dir, then times
llm.pt -> HF and HF -> llm.pt, each in a child process whose peak RSS is read from
the kernel (ru_maxrss). Needs ~8 GB of disk and RAM.

    .venv/bin/python benchmarks/bench_convert.py [--workdir DIR]
"""

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build(d: Path) -> float:
    """The random full-size llm.pt + CosyVoice-BlankEN/ (tests/cosyvoice2_tiny.py); its size in GiB."""
    sys.path.insert(0, str(ROOT / "tests"))
    from cosyvoice2_tiny import write_random_llm

    return write_random_llm(d).stat().st_size / 2**30


def timed(cmd: list[str]) -> tuple[float, float]:
    """Run ``cmd`` under a fresh wrapper process; returns (seconds, peak RSS in GiB)."""
    wrapper = [sys.executable, "-c", "import resource,subprocess,sys; subprocess.run(sys.argv[1:], check=True, "
               "stdout=subprocess.DEVNULL); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"]
    t0 = time.time()
    out = subprocess.run(wrapper + cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return time.time() - t0, int(out.strip().splitlines()[-1]) / 2**20  # KiB -> GiB


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", help="where to put the ~6 GB of checkpoints (default: a temp dir)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(dir=a.workdir) as tmp:
        d = Path(tmp)
        t0 = time.time()
        size = build(d / "cosyvoice2")
        print(f"random full-size llm.pt: {size:.2f} GiB (built in {time.time() - t0:.0f}s)")
        py = sys.executable
        secs, rss = timed([py, "pretrained_to_huggingface.py", "--pretrained-cosyvoice2-path", str(d / "cosyvoice2"),
                           "--save-path", str(d / "hf")])
        print(f"llm.pt -> HF : {secs:6.1f} s, peak RSS {rss:.2f} GiB ({rss / size:.2f}x the checkpoint)")
        secs, rss = timed([py, "huggingface_to_pretrained.py", "--hf-cosyvoice2-llm-path", str(d / "hf"),
                           "--output-path", str(d / "llm-back.pt")])
        print(f"HF -> llm.pt : {secs:6.1f} s, peak RSS {rss:.2f} GiB ({rss / size:.2f}x the checkpoint)")


if __name__ == "__main__":
    main()
