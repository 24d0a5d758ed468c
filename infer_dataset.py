#!/usr/bin/env python
"""Stage 4: synthesise held-out test sets with the start model and every merged
GRPO step, score them (CER, pinyin error, reward) and write the sweep report.

    python -m torch.distributed.run --standalone --nproc_per_node N infer_dataset.py \\
        --start-model HF_DIR --merged-dir MERGED_DIR --out-dir EVAL_DIR \\
        --backend sim --test-set embedded_test=data/corpus/test.jsonl

Also runs as plain ``python infer_dataset.py ...`` (one rank). Under torchrun each
rank decodes utterances rank::N of every test set (each exactly once; one rank per
GPU) and rank 0 gathers the results.

Outputs (see ttsrl/eval/evaluate.py):
  OUT/step_N/<set>/results.jsonl, summary.json, wavs/   per model and dev/test set
  OUT/report.md, OUT/summary.json, OUT/cer.png          the sweep
Models already scored with the same settings are skipped unless --force.

Several nodes (each runs its own `torchrun --standalone` with the same arguments and the
same --out-dir on a shared filesystem; no torch rendezvous across nodes):
  --node-share R/N      this node (R in 0..N-1) scores only its share of the models: index i
                        of the sorted steps with i % N == R, so the shares are disjoint and no
                        two nodes write the same files. It writes no sweep report; when its share
                        is done it writes the marker OUT/shares/R-of-N.json (steps, their model
                        fingerprints, test sets, settings, host, time).
  --wait-shares SECONDS the head node (with --node-share 0/N): after its own share, wait until
                        every other share's marker exists and matches this run's models and
                        settings (a stale marker of an earlier run does not count), naming the
                        missing shares every 30 s; then score whatever is still unscored (all of
                        a missing share's models after a timeout) and write the report as usual.
                        At most 18000 s (5 h: the head's other ranks wait in a collective).

Error rates, two conventions (both in every row; --headline picks the one report.md
leads with and stage 5 chooses by):
  cer_utt_mean   Seed-TTS eval (seed-tts-eval's run_wer.py + average_wer.py): punctuation
                 removed (zhon + ASCII, apostrophe kept), transcript -> simplified, zh split
                 into characters / en lower-cased words, jiwer per utterance, MEAN of the
                 rates; above_50 = share of utterances above 50%. WER on English sets.
  cer_pooled     total errors / total reference characters (our normaliser; `cer` too)
Each has a bootstrap 95% interval over utterances; each step is compared with the start
model on the same utterances (paired bootstrap: interval of the difference and
P(better), the share of resamples where the step is better). --seeds K decodes every
utterance K times and reports the mean and spread across seeds.

Dev sets (--dev-set NAME=PATH) are scored like test sets; stage 5 chooses the step to
export on them only. Test sets are reported for every step and never used to choose.

Test sets (--test-set NAME=PATH, repeatable):
  a JSONL file          {"text": ..., "id"?, "prompt_text"?, "prompt_speech_tokens"?: [codes]}
  a Seed-TTS dir        meta.lst with lines utt|prompt_text|prompt_wav|text
  a CV3-Eval dir        Kaldi-style text, prompt_text, prompt_wav.scp
For the two directory layouts, zero-shot prompts need DIR/prompt_speech_tokens.jsonl
({"id": utt, "prompt_speech_tokens": [...]} per line, made with CosyVoice's speech
tokenizer); without it they run as plain TTS and the log says so.

Sampling defaults are CosyVoice2's: top-p 0.8, top-k 25, repetition-aware sampling
(window 10, tau 0.1), min/max 2x/20x the text tokens; --greedy for argmax decoding.
"""

from __future__ import annotations

import argparse
import os
import sys

from ttsrl.data.testsets import TestSetError, parse_test_set_arg
from ttsrl.eval.dist import COLLECTIVE_TIMEOUT_S
from ttsrl.eval.evaluate import EvalConfig, run_sweep
from ttsrl.eval.report import HEADLINES
from ttsrl.eval.shares import MAX_WAIT_S, NodeShare
from ttsrl.model.cosyvoice_lm import add_sampling_args, sampling_from_args
from ttsrl.model.generate import GenerationConfig
from ttsrl.reward.backends.options import add_backend_args, backend_config
from ttsrl.stats import DEFAULT_RESAMPLES


def parse_args(argv=None) -> EvalConfig:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("models and outputs")
    g.add_argument("--start-model", required=True, help="converted start model (HF dir) = step 0")
    g.add_argument("--merged-dir", default=None, help="merged steps MERGED_DIR/step_N (stage 3); optional")
    g.add_argument("--steps", default=None, help="comma-separated steps to score (default: 0 and every merged step)")
    g.add_argument("--out-dir", required=True, help="where results, report.md, summary.json, cer.png go")
    g.add_argument("--test-set", action="append", required=True, metavar="NAME=PATH",
                   help="a test set (JSONL file, Seed-TTS dir or CV3-Eval dir); repeatable")
    g.add_argument("--dev-set", action="append", default=[], metavar="NAME=PATH",
                   help="a dev set (same layouts): stage 5 chooses the step on dev sets only; repeatable")
    g.add_argument("--headline", choices=("utt_mean", "pooled"), default="utt_mean",
                   help="convention report.md leads with and stage 5 chooses by (default: utt_mean, Seed-TTS)")
    g.add_argument("--resamples", type=int, default=DEFAULT_RESAMPLES, help="bootstrap resamples per interval")
    g.add_argument("--limit", type=int, default=None, help="only the first N utterances of each test set")
    g.add_argument("--force", action="store_true", help="re-score models that are already scored")
    g.add_argument("--no-wavs", action="store_true", help="do not write wavs (backends that make audio)")
    g.add_argument("--node-share", default=None, metavar="R/N",
                   help="score only node R's share of the models (of N nodes); no report, a marker OUT/shares/R-of-N.json")
    g.add_argument("--wait-shares", type=float, default=None, metavar="SECONDS",
                   help="head node (--node-share 0/N): wait up to SECONDS for the other shares' markers, "
                        "score what is still unscored, write the report")

    g = p.add_argument_group("generation")
    g.add_argument("--engine", choices=("auto", "hf", "vllm"), default="auto",
                   help="auto: vLLM for --greedy on a GPU when installed, else transformers; "
                        "vllm: greedy or CosyVoice2 sampling (same rule as transformers, other random numbers)")
    g.add_argument("--device", default="auto", help="auto (one GPU per rank, else cpu), cpu or cuda")
    g.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="weights dtype of the transformers engine")
    g.add_argument("--batch-size", type=int, default=8, help="utterances per batch (transformers engine)")
    g.add_argument("--greedy", action="store_true", help="argmax decoding instead of CosyVoice2 sampling")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (per utterance: seed + id)")
    g.add_argument("--seeds", type=int, default=1,
                   help="decode every utterance K times (seeds SEED .. SEED+K-1); mean and spread across seeds")
    add_sampling_args(g)  # --sampling-rule, --top-p, --top-k, --win-size, --tau-r, --min/max-token-text-ratio
    g.add_argument("--gpu-memory-utilization", type=float, default=0.8, help="vLLM engine")
    g.add_argument("--threads", type=int, default=0, help="torch CPU threads per rank (0 = this machine's cores / its ranks, GPU ranks too)")

    g = p.add_argument_group("scoring backend (as token2wav_asr_server.py)")
    add_backend_args(g, cpu_threads=False)  # --threads sets the backend's threads too
    g.add_argument("--reward", default="tanh", choices=("tanh", "tanh_reference", "toneless"),
                   help="reward variant reported per utterance (default %(default)s)")
    g.add_argument("--no-length-guard", action="store_true", help="report rewards without the length guard")
    a = p.parse_args(argv)

    try:
        test_sets = [parse_test_set_arg(t) for t in a.test_set]
        dev_sets = [parse_test_set_arg(t) for t in a.dev_set]
        steps = [int(x) for x in a.steps.split(",")] if a.steps else None
        node_share = NodeShare.parse(a.node_share) if a.node_share is not None else None
    except ValueError as e:
        p.error(str(e))
    if a.wait_shares is not None and (node_share is None or node_share.rank != 0):
        p.error(f"--wait-shares is for the head node: it needs --node-share 0/N (got --node-share {a.node_share})")
    if a.wait_shares is not None and not 0 <= a.wait_shares <= MAX_WAIT_S:
        p.error(f"--wait-shares must be 0 .. {MAX_WAIT_S:.0f} seconds (the head's other ranks wait in a collective "
                f"with a {COLLECTIVE_TIMEOUT_S / 3600:.0f} h timeout), got {a.wait_shares:g}")
    if a.batch_size < 1 or a.seeds < 1 or (a.limit is not None and a.limit < 1):
        p.error("--batch-size, --seeds and --limit must be >= 1")
    if a.resamples < 100:
        p.error("--resamples must be >= 100")
    backend = backend_config(a, cpu_threads=a.threads)
    try:
        backend.validate()
    except ValueError as e:
        p.error(str(e))
    sampling = sampling_from_args(a)
    return EvalConfig(start_model=a.start_model, out_dir=a.out_dir, test_sets=test_sets, dev_sets=dev_sets,
                      merged_dir=a.merged_dir, seeds=a.seeds, headline=HEADLINES[a.headline], resamples=a.resamples,
                      steps=steps, backend=backend,
                      generation=GenerationConfig(greedy=a.greedy, sampling=sampling, seed=a.seed,
                                                  batch_size=a.batch_size),
                      engine=a.engine, device=a.device, dtype=a.dtype, reward=a.reward,
                      length_guard=not a.no_length_guard, save_wavs=not a.no_wavs, force=a.force,
                      limit=a.limit, gpu_memory_utilization=a.gpu_memory_utilization, threads=a.threads,
                      node_share=node_share, wait_shares=a.wait_shares)


def main(argv=None) -> int:
    cfg = parse_args(argv)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun rank, in a session of its own: die with torchrun
        from ttsrl.lifeline import die_with_parent

        die_with_parent()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one progress bar (ours), not one per model load
    try:
        run_sweep(cfg, log=lambda line: print(line, flush=True))
    except (TestSetError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
