#!/usr/bin/env python
"""The hf rollout's batch size and draw: 128 sequences (the embedded run's 16 prompts x n=8)
generated as one ``generate`` call or in batches of 64, on a random model of the embedded base
model's size (Qwen2, hidden 128, 4 layers, 7,808-row vocabulary), with the rollout's sampling
settings (temperature 0.8, top-k 25, top-p 0.95) and per-token logits kept (what the hf rollout
asks for); each token drawn by transformers' sampler, by ttsrl's (``ttsrl.verl_plugin.sampling``:
the same distribution over the top-k only), or by CosyVoice's rule (``rule``: ``RuleDraw``, what
``--rollout-rule`` draws by, at temperature 1.0 over the last 6,564 rows as the family's outputs).
Prints seconds per variant, repeated.

    python benchmarks/bench_hf_rollout_batch.py --tokens 64 --batches 128 --repeats 2
    python benchmarks/bench_hf_rollout_batch.py --tokens 64 --batches 128 --draws ttsrl,rule
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from ttsrl.families import family
from ttsrl.model.cosyvoice_lm import SamplingConfig
from ttsrl.verl_plugin.sampling import RuleDraw, Sampling


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sequences", type=int, default=128)
    p.add_argument("--batches", default="64,128", help="comma-separated batch sizes to compare")
    p.add_argument("--tokens", type=int, default=32, help="new tokens per sequence (forced: no early stop)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--draws", default="transformers,ttsrl", help="comma-separated: transformers, ttsrl, rule")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=7808, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg).eval()
    prompts = torch.randint(10, 4000, (a.sequences, 12))
    ours = Sampling(temperature=0.8, top_p=0.95, top_k=25, repetition_penalty=1.0, max_tokens=a.tokens,
                    want_logprobs=True, ignore_eos=True)
    draws = {
        "transformers": (GenerationConfig(do_sample=True, temperature=0.8, top_p=0.95, top_k=25,
                                          max_new_tokens=a.tokens, min_new_tokens=a.tokens, eos_token_id=[7800],
                                          pad_token_id=0, return_dict_in_generate=True, output_logits=True),
                         list),
        "ttsrl": (ours.generation_config(eos_ids=[7800], pad_id=0), ours.logits_processors),
        "rule": (ours.generation_config(eos_ids=[7800], pad_id=0), lambda: at_one.logits_processors(rule)),
    }
    fam = family("cosyvoice2")
    rule = RuleDraw(SamplingConfig(rule="cosyvoice2-2026", min_token_text_ratio=0.0), 7808 - fam.num_outputs,
                    fam.num_outputs, fam.eos_index)
    at_one = Sampling(temperature=1.0, top_p=0.95, top_k=25, repetition_penalty=1.0, max_tokens=a.tokens,
                      want_logprobs=True, ignore_eos=True)
    sizes = [int(x) for x in a.batches.split(",")]
    print(f"{a.sequences} sequences x {a.tokens} new tokens, torch threads {torch.get_num_threads()}")
    with torch.no_grad():
        for rep in range(a.repeats):
            for name in a.draws.split(","):
                gen, processors = draws[name]  # a fresh processor list a call: the rule's reads the prompt width
                if rep == 0:  # warm-up
                    model.generate(input_ids=prompts[:2], attention_mask=torch.ones_like(prompts[:2]),
                                   generation_config=gen, logits_processor=processors())
                for bs in sizes:
                    t0 = time.perf_counter()
                    for start in range(0, a.sequences, bs):
                        x = prompts[start:start + bs]
                        model.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=gen,
                                       logits_processor=processors())
                    print(f"  repeat {rep + 1}: {name:12s} draw, batches of {bs:4d}: "
                          f"{time.perf_counter() - t0:6.2f} s", flush=True)


if __name__ == "__main__":
    main()
