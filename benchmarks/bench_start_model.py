#!/usr/bin/env python
"""Where the embedded start model's zero-shot errors come from, for a build recipe and several seeds.

Builds the embedded preset's start model (``ttsrl.embedded.pretrain``: the preset's options, any
``--set FIELD=VALUE`` on top) once per seed, then samples every zero-shot test row once
(``data/corpus/test_zeroshot.jsonl`` with its pool prompts) three ways and prints the utterance-mean
CER of each, decoded exactly by the simulated codec (no simulated ASR misreads, so about 3 points
under what stage 4 reports):

- ``rule``: the family's sampling rule, as stage 4 samples;
- ``no-redraw``: the same without repetition-aware redraws (``tau_r`` above 1);
- ``top-1``: the most likely code each step (the model's own reading errors).

The gaps between them say how much of the start CER the rule's sampling adds. The build depends on
the seed and the thread count (torch's kernels split sums by thread), so compare recipes over several
seeds on one machine, never one build each. About 7 min a build on one thread of a 2-core machine.

    .venv/bin/python benchmarks/bench_start_model.py --seeds 1234 99 --set tone_noise=0.1 --out /tmp/probe
    .venv/bin/python benchmarks/bench_start_model.py --set model.num_hidden_layers=6 --out /tmp/probe6
"""

import argparse
import dataclasses
import json
from pathlib import Path

import torch
from transformers import AutoTokenizer

from ttsrl.embedded import speakers
from ttsrl.embedded.pretrain import PretrainConfig, build_base_model, zero_shot_counts
from ttsrl.model.cosyvoice_lm import Qwen2LM, SamplingConfig

ROOT = Path(__file__).resolve().parents[1]
PRESET = {"prompt_prob": 0.7, "prompt_from": 0.25}  # presets/embedded.sh's BASE_MODEL_ARGS
MODES = {"rule": {}, "no-redraw": {"tau_r": 10.0}, "top-1": {"top_k": 1, "tau_r": 10.0}}


def _scalars(obj) -> list[str]:
    return sorted(f.name for f in dataclasses.fields(obj) if isinstance(getattr(obj, f.name), (bool, int, float, str)))


def recipe(sets: list[str], seed: int, threads: int) -> PretrainConfig:
    """The preset's recipe with ``FIELD=VALUE`` overrides: a PretrainConfig field, or ``model.FIELD`` for the
    tiny model's shape (``model.num_hidden_layers=6``)."""
    defaults = PretrainConfig()
    names = _scalars(defaults) + [f"model.{n}" for n in _scalars(defaults.model)]
    values, shape = {**PRESET, "seed": seed, "threads": threads}, {}
    for item in sets:
        name, _, text = item.partition("=")
        if name not in names or not text:
            raise SystemExit(f"--set {item}: expected FIELD=VALUE with FIELD one of {', '.join(names)}")
        owner, key, into = (defaults.model, name[6:], shape) if name.startswith("model.") else (defaults, name, values)
        default = getattr(owner, key)
        into[key] = text.lower() in ("1", "true") if isinstance(default, bool) else type(default)(text)
    return PretrainConfig(**values, model=dataclasses.replace(defaults.model, **shape))


def zero_shot_cer(model_dir: Path, rows: list[dict], pool: dict, mode: dict) -> float:
    """Utterance-mean CER of one sampled pass over ``rows`` with the family's rule changed by ``mode``."""
    model = Qwen2LM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir / "CosyVoice-BlankEN")
    rule = SamplingConfig(min_token_text_ratio=0.0, rule=model.family.default_rule, **mode)
    counts = zero_shot_counts(model, tok, rows, pool, seed=0, sampling=rule)
    return sum(e / n for e, n, _ in counts) / len(counts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1234], help="one build per seed (1234: the preset's)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a PretrainConfig field over the preset's recipe, or model.FIELD for the tiny model's "
                         "shape (repeatable)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each build")
    ap.add_argument("--out", type=Path, required=True, help="folder for the builds (one per seed; reused if built)")
    args = ap.parse_args()
    pool = speakers.read_pool(speakers.POOL_DIR)
    rows = [json.loads(x) for x in speakers.ZERO_SHOT_TEST_FILE.read_text(encoding="utf-8").splitlines()]
    for seed in args.seeds:
        cfg = recipe(args.set, seed, args.threads)
        where = args.out / f"seed{seed}"
        info = build_base_model(ROOT / "data" / "corpus" / "train.jsonl", where, cfg, log=lambda s: None)
        torch.set_num_threads(args.threads)
        cers = {name: zero_shot_cer(where, rows, pool, mode) for name, mode in MODES.items()}
        print(json.dumps({"seed": seed, "set": args.set, "weights_sha256": info["weights_sha256"][:16],
                          "rows": len(rows), **{k: round(v, 4) for k, v in cers.items()}}), flush=True)


if __name__ == "__main__":
    main()
