#!/usr/bin/env python
"""Stage-4 generation throughput: the vLLM engine against the transformers engine on one
converted checkpoint, greedy and sampled by CosyVoice2's rule (``--sampling-rule``; vLLM
through its logits processor, ttsrl/model/vllm_sampling.py); prints speech tokens per
second, whether the greedy outputs of both engines agree, and the sampled speed-up.

    .venv-vllm/bin/python benchmarks/bench_vllm_engine.py --model DIR [--device cpu|cuda]

Without --model a tiny random checkpoint of the real layout is built (a fake of
CosyVoice2's weights, like the tests'). Run in an environment with vLLM (.venv-vllm/ on
CPU, the --gpu install on a GPU). Numbers only, no pass/fail.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TEXTS = ["今天天气很好，我们去公园散步吧。", "银行的行长在行走。",
         "二零二四年三月五日，百分之五十。", "你好，一个不是很长的句子。",
         "重庆的重量很重要，还要还钱。", "我用iPhone拍照，Hello world!"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="converted or merged HF checkpoint (default: a tiny fake)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--n", type=int, default=48, help="utterances (the texts repeated)")
    p.add_argument("--batch-size", type=int, default=16, help="transformers engine batch")
    p.add_argument("--sampling-rule", default="cosyvoice2-2026", choices=("cosyvoice2-2026", "cosyvoice2-2024"))
    a = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch

    from ttsrl.model.cosyvoice_lm import SamplingConfig
    from ttsrl.model.generate import GenerationConfig, HFGenerator, Request, VLLMGenerator
    from ttsrl.model.hf_model import load_speech_lm

    model = a.model
    if model is None:
        from ttsrl.embedded.tiny_model import TinyConfig, make_tiny_cosyvoice2
        from ttsrl.model.convert import cosyvoice_to_hf

        tmp = Path(tempfile.mkdtemp(prefix="bench_vllm_"))
        make_tiny_cosyvoice2(tmp / "cv", TEXTS * 8, TinyConfig(num_attention_heads=1, num_key_value_heads=1))
        cosyvoice_to_hf(tmp / "cv", tmp / "hf", log=lambda _: None)
        model = tmp / "hf"
    lm = load_speech_lm(model, device=a.device)
    reqs = [Request(key=f"u{i}", text_ids=tuple(lm.tokenizer.encode(TEXTS[i % len(TEXTS)], add_special_tokens=False)))
            for i in range(a.n)]
    sampling = SamplingConfig(max_token_text_ratio=10.0, rule=a.sampling_rule)
    greedy = GenerationConfig(greedy=True, sampling=sampling, batch_size=a.batch_size)
    sample = GenerationConfig(greedy=False, sampling=sampling, batch_size=a.batch_size, seed=0)

    def timed(name, gen, cfg):
        t0 = time.time()
        out = gen.generate(reqs, cfg)
        dt = time.time() - t0
        n = sum(len(g.codes) for g in out)
        print(f"{name:36s} {n:6d} tokens {dt:7.2f}s {n / dt:9.1f} tokens/s", flush=True)
        return out, n / dt

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    hf = HFGenerator(lm.model, lm.vocab)
    h_greedy, _ = timed(f"transformers greedy ({a.device})", hf, greedy)
    _, h_rate = timed(f"transformers {a.sampling_rule} ({a.device})", hf, sample)
    t0 = time.time()
    v = VLLMGenerator(str(model), lm.vocab, dtype="float32", enforce_eager=a.device == "cpu",
                      gpu_memory_utilization=0.3, max_model_len=1024)
    print(f"vLLM engine start {time.time() - t0:.1f}s", flush=True)
    timed(f"vLLM greedy ({a.device}, warm-up)", v, greedy)
    v_greedy, _ = timed(f"vLLM greedy ({a.device})", v, greedy)
    same = sum(x.codes == y.codes for x, y in zip(v_greedy, h_greedy))
    print(f"greedy outputs identical: {same}/{len(reqs)}")
    v_sampled, v_rate = timed(f"vLLM {a.sampling_rule} ({a.device})", v, sample)
    failed = sum(g.error is not None for g in v_sampled)
    print(f"sampled by the rule: vLLM {v_rate:.1f} vs transformers {h_rate:.1f} tokens/s "
          f"({v_rate / h_rate:.2f}x), vLLM failures {failed}/{len(reqs)}")
    if a.device == "cuda":
        print(f"peak torch CUDA memory in this process: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    v.close()


if __name__ == "__main__":
    main()
