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
  OUT/report.md, OUT/summary.json, OUT/terms.png          the sweep
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
utterance K times and reports the mean and spread across seeds; --dev-seeds K the dev sets'
utterances (stage 5 chooses on their mean).

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
import dataclasses
import os
import sys

from ttsrl.cli import add_fields, group, parse_into
from ttsrl.data.testsets import TestSetError
from ttsrl.eval.evaluate import GEN, SCORING, EvalConfig, run_sweep
from ttsrl.model.checkpoint import FamilyMismatch
from ttsrl.model.cosyvoice_lm import add_sampling_args, sampling_from_args
from ttsrl.model.generate import GenerationConfig
from ttsrl.reward.backends.options import add_backend_args, backend_config


def parser() -> argparse.ArgumentParser:
    """One option per field of EvalConfig, GenerationConfig, SamplingConfig and BackendConfig."""
    # allow_abbrev=False: run.sh checks EVAL_ARGS' --sampling-rule by its whole name; an abbreviation would slip past
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_fields(p, EvalConfig)  # in its groups: models and outputs, generation, scoring backend
    add_fields(group(p, GEN), GenerationConfig)  # --greedy, --seed, --batch-size
    add_sampling_args(group(p, GEN))  # --sampling-rule, --top-p, --top-k, --win-size, --tau-r, --min/max-token-text-ratio
    add_backend_args(group(p, SCORING), cpu_threads=False)
    return p


def parse_args(argv=None) -> EvalConfig:
    p = parser()
    a = p.parse_args(argv)
    generation = parse_into(p, GenerationConfig, a, sampling=sampling_from_args(a))
    cfg = parse_into(p, EvalConfig, a, generation=generation)
    backend = backend_config(a, cpu_threads=cfg.threads)  # --threads sets the backend's threads too
    try:
        backend.validate()
    except ValueError as e:
        p.error(str(e))
    return dataclasses.replace(cfg, backend=backend)


def main(argv=None) -> int:
    cfg = parse_args(argv)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun rank, in a session of its own: die with torchrun
        from ttsrl.lifeline import die_with_parent

        die_with_parent()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one progress bar (ours), not one per model load
    try:
        run_sweep(cfg, log=lambda line: print(line, flush=True))
    except (TestSetError, FileNotFoundError, FamilyMismatch) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
