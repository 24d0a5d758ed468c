#!/usr/bin/env python
"""What checking a merged step's sha256 costs (stage 3's skip, stage 4, stage 5).

Writes a merged-layout step of SIZE_MB of safetensors weights (the real CosyVoice2-0.5B
step is ~2 GB in fp32) with its MERGED.json, then times ``check_merged`` with the
size-only check and with the sha256 check, cold page cache not forced (a step that
was just written or read is usually in the cache).

    .venv/bin/python benchmarks/bench_marker_hash.py [--size-mb 512] [--repeat 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=int, default=512)
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()

    import torch
    from safetensors.torch import save_file

    from ttsrl.model.checkpoint import check_merged, write_marker

    with tempfile.TemporaryDirectory() as d:
        step = Path(d) / "step_1"
        step.mkdir()
        n = a.size_mb * (1 << 20) // 4
        save_file({"w": torch.randn(n)}, str(step / "model.safetensors"))
        (step / "config.json").write_text("{}")
        t0 = time.perf_counter()
        write_marker(step, {"step": 1})
        t_write = time.perf_counter() - t0
        for hashes in (False, True):
            best = float("inf")
            for _ in range(a.repeat):
                t0 = time.perf_counter()
                assert check_merged(step, hashes=hashes) is None
                best = min(best, time.perf_counter() - t0)
            gb = a.size_mb / 1024
            print(f"check_merged(hashes={hashes}): {best:.3f} s for {a.size_mb} MB "
                  f"({best / gb:.2f} s/GB)")
        print(f"write_marker (hashes every file once): {t_write:.3f} s")


if __name__ == "__main__":
    main()
