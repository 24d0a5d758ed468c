#!/usr/bin/env python
"""The full-size dress rehearsal's Python phases (run by scripts/rehearsal.sh, which also runs
the stage CLIs between them and times every phase).

Every model here has the released model's shapes and RANDOM weights (the released weights
cannot be had here). ``--family cosyvoice2`` (default): CosyVoice2-0.5B's: the LLM is
Qwen2.5-0.5B's body (24 layers, hidden 896, 14 heads / 2 KV heads, 151,936 text rows) with the
speech rows, flow and HiFT are the upstream cosyvoice2.yaml's (tests/cosyvoice2_tiny.py,
``size="full"``). ``--family cosyvoice3``: Fun-CosyVoice3-0.5B-2512's: the same body in upstream
CosyVoice3LM's layout (tests/cosyvoice3_tiny.py, ``size="full"``), flow (DiT) and HiFT of
upstream's cosyvoice3.yaml (tests/cosyvoice3_token2wav_tiny.py, ``size="full"``; built with a
CosyVoice source checkout's classes, ``--checkout``: without one the folder has the LLM only and
scripts/rehearsal.sh skips the phases that voice codes). Campplus and the speech tokenizer are
ONNX stand-ins with the real signatures. What is shrunk is only the work: few prompts, short
responses, 2 GRPO steps; never a layer size.

    python scripts/rehearsal.py build  --workdir W [--family F] [--checkout C]  the model folders, prompts, data
    python scripts/rehearsal.py vllm   --workdir W          (.venv-vllm) vLLM serves W/hf_model
    python scripts/rehearsal.py reward --workdir W --url U  the family's reward server at U
    python scripts/rehearsal.py grpo   --workdir W [--url U] [--rollout hf]  (.venv-vllm) 2 GRPO steps
    python scripts/rehearsal.py merged --workdir W          the merged step vs the FSDP master
    python scripts/rehearsal.py stage4 --workdir W --out O  what stage 4 wrote in W/O
    python scripts/rehearsal.py export --workdir W [--family F] [--checkout C]  (.venv) the family's LM
                                                            class loads it strict (EXPORTS)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # tests/: the random-weight folder builders

STEPS = 2  # GRPO steps (the checkpoint of the last one is merged, scored and exported)
RESPONSE = 48  # most speech codes per rollout response (about 2 s of speech at 25 Hz)
RATIO = 3.0  # stage 4's max codes per text token: a random model never stops, this bounds it
TEXTS = ["今天天气很好", "银行的行长在行走", "二零二四年三月五日", "重庆的重量很重要",
         "你好，世界", "我们去公园散步吧", "百分之五十的人", "还要还钱"]


def say(msg: str) -> None:
    print(f"[rehearsal] {msg}", flush=True)


def gib(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:.2f} GiB"


def folder_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def model_folder(w: Path, name: str) -> Path:
    """The family's random full-size model folder: named as its release (``Family.release``;
    scripts/rehearsal.sh asks the registry the same)."""
    from ttsrl.families import family

    return w / family(name).release


# ---------------------------------------------------------------- build
def cmd_build(a) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from cosyvoice2_tiny import write_tone_wav
    from helpers import grpo_rows

    w = Path(a.workdir)
    others = BUILDERS[a.family](w, a)
    model = model_folder(w, a.family)
    prompts = w / "prompts"
    prompts.mkdir(exist_ok=True)
    write_tone_wav(prompts / "spk_a.wav", 2.0, 16000, 170.0)
    write_tone_wav(prompts / "spk_b.wav", 1.5, 24000, 230.0)
    data = w / "data"
    data.mkdir(exist_ok=True)
    pq.write_table(pa.Table.from_pylist(grpo_rows(TEXTS, "train")), data / "train.parquet")
    pq.write_table(pa.Table.from_pylist(grpo_rows(TEXTS[:2], "test")), data / "test.parquet")
    (data / "test.jsonl").write_text("".join(json.dumps({"id": f"t{i}", "text": t}, ensure_ascii=False) + "\n"
                                             for i, t in enumerate(TEXTS[:4])), encoding="utf-8")
    say(f"{model} ({gib(folder_bytes(model))}), {''.join(f'{o}, ' for o in others)}2 prompt wavs, {len(TEXTS)} training texts, 4 test texts")


def _build_cosyvoice2(w: Path, a) -> list[str]:
    """CosyVoice2-0.5B (llm.pt, flow, HiFT, ONNX stand-ins) and the same with a pre-2025 yaml;
    returns the other folders' names."""
    from cosyvoice2_tiny import as_before_2025, build_tiny_cosyvoice2, write_random_llm

    model = model_folder(w, "cosyvoice2")
    t0 = time.time()
    build_tiny_cosyvoice2(model, size="full")
    say(f"flow.pt {gib((model / 'flow.pt').stat().st_size)}, hift.pt {gib((model / 'hift.pt').stat().st_size)} "
        f"(the upstream cosyvoice2.yaml's sizes), ONNX stand-ins: {time.time() - t0:.0f}s")
    t0 = time.time()
    write_random_llm(model)
    say(f"llm.pt {gib((model / 'llm.pt').stat().st_size)} (CosyVoice2-0.5B's shapes and keys): {time.time() - t0:.0f}s")
    old = w / "CosyVoice2-0.5B-pre2025"  # the same weights, the yaml of a download from before April 2025
    old.mkdir(exist_ok=True)
    for f in model.iterdir():
        if f.name != "cosyvoice2.yaml" and not (old / f.name).exists():
            (old / f.name).symlink_to(f)
    (old / "cosyvoice2.yaml").write_text(as_before_2025((model / "cosyvoice2.yaml").read_text()), encoding="utf-8")
    return [old.name]


def _build_cosyvoice3(w: Path, a) -> list[str]:
    """Fun-CosyVoice3-0.5B's LLM half (llm.pt in upstream CosyVoice3LM's keys, CosyVoice-BlankEN/)
    and, with ``--checkout``, its token2wav half at the released flow/HiFT shapes."""
    from cosyvoice3_tiny import write_random_llm3

    model = model_folder(w, "cosyvoice3")
    t0 = time.time()
    write_random_llm3(model, size="full")
    say(f"llm.pt {gib((model / 'llm.pt').stat().st_size)} (Fun-CosyVoice3-0.5B's shapes, upstream CosyVoice3LM's "
        f"keys): {time.time() - t0:.0f}s")
    if not a.checkout:
        say("no CosyVoice checkout (TTSRL_COSYVOICE_CHECKOUT): the token2wav half (cosyvoice3.yaml, flow.pt, "
            "hift.pt) is not built; CosyVoice3's classes are not in the PyPI package")
        return []
    from cosyvoice3_token2wav_tiny import build_cosyvoice3_token2wav

    t0 = time.time()
    build_cosyvoice3_token2wav(model, a.checkout, size="full")  # leaves llm.pt and CosyVoice-BlankEN/ as they are
    say(f"flow.pt {gib((model / 'flow.pt').stat().st_size)}, hift.pt {gib((model / 'hift.pt').stat().st_size)} "
        f"(the upstream cosyvoice3.yaml's sizes, classes from {a.checkout}), ONNX stand-ins: {time.time() - t0:.0f}s")
    return []


# ---------------------------------------------------------------- vllm
def cmd_vllm(a) -> None:
    """vLLM loads the converted full-size checkpoint through the plugin; greedy codes and
    per-token log-probs against the transformers class; generation speed of both engines."""
    import torch
    from vllm import SamplingParams

    from ttsrl.model.cosyvoice_lm import SamplingConfig
    from ttsrl.model.generate import GenerationConfig, HFGenerator, Request, VLLMGenerator, build_input_ids
    from ttsrl.model.hf_model import load_speech_lm

    hf = Path(a.workdir) / "hf_model"
    t0 = time.time()
    lm = load_speech_lm(hf, device=a.device)
    say(f"transformers loaded {hf.name} in {time.time() - t0:.1f}s "
        f"({sum(p.numel() for p in lm.model.parameters()) / 1e6:.0f}M parameters, {lm.model.dtype})")
    t0 = time.time()
    gen = VLLMGenerator(str(hf), lm.vocab, seed=0, dtype="float32", enforce_eager=a.device == "cpu",
                        gpu_memory_utilization=0.3, max_model_len=512)
    say(f"vLLM engine up in {time.time() - t0:.1f}s (the ttsrl plugin's class, fp32; {lm.vocab.family.name})")
    reqs = [Request(f"u{i}", tuple(lm.tokenizer.encode(t, add_special_tokens=False))) for i, t in enumerate(TEXTS)]
    rule = lm.vocab.family.default_rule  # the family of the converted checkpoint (its tokenizer)
    greedy = GenerationConfig(greedy=True, sampling=SamplingConfig(max_token_text_ratio=RATIO, rule=rule))
    sampled = GenerationConfig(greedy=False, seed=0, sampling=SamplingConfig(max_token_text_ratio=RATIO, rule=rule))
    runs = {}
    for name, engine in (("vllm", gen), ("transformers", HFGenerator(lm.model, lm.vocab))):
        for tag, cfg in (("greedy", greedy), ("sampled", sampled)):
            t0 = time.time()
            out = engine.generate(reqs, cfg)
            secs = time.time() - t0
            bad = [o.error for o in out if o.error]
            n = sum(len(o.codes) for o in out)
            runs[name, tag] = out
            say(f"{name:12s} {tag:7s}: {len(reqs)} requests, {n} codes in {secs:.1f}s = {n / secs:.1f} codes/s"
                + (f", ERRORS {bad[:2]}" if bad else ""))
            if bad:
                raise SystemExit(f"[rehearsal] FAILED: {name} {tag} generation errors")
    differ = [r.key for r, x, y in zip(reqs, runs["vllm", "greedy"], runs["transformers", "greedy"])
              if x.codes != y.codes]
    say(f"greedy codes, vLLM vs transformers: {len(reqs) - len(differ)}/{len(reqs)} requests identical"
        + (f" (differ: {differ})" if differ else ""))

    # log-probs: vLLM's top-20 at every position of its greedy path against transformers' log-softmax
    prompts = [build_input_ids(lm.vocab, r) for r in reqs]
    sp = SamplingParams(temperature=0.0, max_tokens=RESPONSE, logprobs=20, ignore_eos=True, detokenize=False)
    outs = gen.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    worst_pick = worst_top = 0.0
    n_tok = 0
    for p, o in zip(prompts, outs):
        toks = list(o.outputs[0].token_ids)
        ids = torch.tensor([p + toks], device=a.device)
        with torch.no_grad():
            ref = lm.model(ids).logits[0, len(p) - 1:-1].float().cpu().log_softmax(-1)
        for i, (t, lps) in enumerate(zip(toks, o.outputs[0].logprobs)):
            worst_pick = max(worst_pick, abs(lps[t].logprob - ref[i, t].item()))
            worst_top = max(worst_top, max(abs(lp.logprob - ref[i, k].item()) for k, lp in lps.items()))
        n_tok += len(toks)
    gen.close()
    say(f"log-probs over {n_tok} greedy positions: max |vLLM - transformers| {worst_pick:.2e} at the picked "
        f"token, {worst_top:.2e} over each position's top 20")
    tol = 1e-4 if a.device == "cpu" else 5e-3  # the stated tolerances (tests/gpu_stack/test_vllm_engine.py)
    if worst_top > tol or (a.device == "cpu" and differ):
        raise SystemExit(f"[rehearsal] FAILED: vLLM and transformers disagree beyond {tol:g} (or greedy codes differ)")


# ---------------------------------------------------------------- reward
def cmd_reward(a) -> None:
    """A GRPO step's worth of requests (8 responses of RESPONSE random codes, all in flight at
    once) against the running reward server of ``--family``; ``--batches`` times."""
    import asyncio

    import numpy as np

    from ttsrl.families import family
    from ttsrl.reward.client import RewardClientConfig, score_all

    cfg = RewardClientConfig(url=a.url)
    fam = family(a.family)  # the server's family (rehearsal.sh starts it with --family)
    rng = np.random.default_rng(0)
    for rep in range(a.batches):
        before = server_seconds(a.url)
        rows = [(rng.integers(0, fam.speech_token_size, RESPONSE).tolist(), t) for t in TEXTS[:a.requests]]
        t0 = time.time()
        res = asyncio.run(score_all(rows, cfg))
        secs = time.time() - t0
        failed = [r for r in res if r.get("reward_failed")]
        audio_s = len(rows) * RESPONSE / fam.token_rate_hz
        say(f"reward batch {rep + 1}: {len(rows)} requests in {secs:.1f}s ({audio_s / secs:.2f} s of speech a second), "
            f"failed {len(failed)}, rewards {[round(r['score'], 3) for r in res]}")
        after = server_seconds(a.url)
        d = {k: after[k] - before.get(k, 0.0) for k in after}
        say(f"  the server's time by stage (GET /metrics), {d.pop('batches', 0):.0f} batch(es): "
            + ", ".join(f"{k} {v:.1f}s" for k, v in sorted(d.items())))
        if failed:
            raise SystemExit(f"[rehearsal] FAILED: {len(failed)} reward requests failed: {failed[:2]}")


def server_seconds(url: str) -> dict[str, float]:
    """The reward server's cumulative seconds per stage (token2wav, asr, scoring) and batches."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(requests.get(f"{url}/metrics", timeout=30).text):
        for smp in fam.samples:
            if smp.name == "ttsrl_stage_seconds_sum":
                out[smp.labels["stage"]] = smp.value
            elif smp.name == "ttsrl_batch_size_count":
                out["batches"] = smp.value
    return out


# ---------------------------------------------------------------- stage4
def cmd_stage4(a) -> None:
    """What stage 4 wrote for the start model and the merged step: utterances, failures, the
    codes generated and scored a second (generation + token2wav + ASR), CER (meaningless on
    random weights: the check is that every utterance went through)."""
    out = Path(a.workdir) / a.out
    bad = []
    for summary in sorted(out.glob("*/rehearsal/summary.json")):
        s = json.loads(summary.read_text())
        rows = [json.loads(x) for x in (summary.parent / "results.jsonl").read_text().splitlines() if x.strip()]
        codes = sum(r.get("n_codes", 0) for r in rows)
        say(f"{a.out} {summary.parent.parent.name}: {s['n']} utterances, {s['failures']} failures, {codes} codes in "
            f"{s['seconds']:.1f}s ({codes / max(s['seconds'], 1e-9):.1f} codes/s), CER {s['cer']:.3f}")
        if s["failures"] or s["n"] != 4:
            bad.append(summary.parent.parent.name)
    if bad or not list(out.glob("*/rehearsal/summary.json")):
        raise SystemExit(f"[rehearsal] FAILED: stage 4 in {out}: {bad or 'no summaries'}")


# ---------------------------------------------------------------- grpo
def cmd_grpo(a) -> None:
    """2 GRPO steps of the GPU preset (its sampling, algorithm and lr keys; ``--rollout vllm``
    as on GPUs, or ``hf``, the CPU path's transformers rollout) on the full-size model; the last
    step is saved. Rewards from ``--url`` (the full-size cosyvoice2 server, on a GPU) or,
    without it, from a ``sim`` server this phase starts.

    Memory on a 24 GB CPU machine, measured (2026-12-02): the actor holds 12.0 GB in its update
    (642M fp32 weights, gradients and Adam state: 10.3 GB), vLLM's worker 4.1 GB and verl's
    other processes ~5 GB: Ray stopped the vLLM-rollout run at 98% of memory in use in the
    first update, even without the 1.7 GB reward server and with the settings below. So
    scripts/rehearsal.sh takes the ``hf`` rollout below 32 GB of memory."""
    from ttsrl.reward.health import launch_server
    from ttsrl.train.grpo import GRPOConfig

    w = Path(a.workdir)
    extra = []  # trainer.val_before_train: GRPOConfig's val_before_train below owns it
    if a.rollout == "vllm":
        extra.append("actor_rollout_ref.rollout.load_format=dummy")  # vLLM gets real weights only by verl's sync
    if a.device == "cpu" and a.rollout == "vllm":
        extra += ["+actor_rollout_ref.rollout.enable_sleep_mode=False",  # not on vLLM's CPU platform
                  # the CPU preset's fp32 rollout (bf16 on a CPU without AVX-512 BF16 is emulated:
                  # vLLM's start-up profile run had not ended after 14 min), eager (no inductor
                  # compile: minutes and memory) and a 1,024-token profile run (its default 8,192)
                  "actor_rollout_ref.rollout.enforce_eager=True",
                  "actor_rollout_ref.rollout.max_num_batched_tokens=1024",
                  # the actor -> vLLM weight copy in 600 MB of shared memory: verl's default bucket,
                  # 2,048 MB, is what the first weight sync after an update ran out of; the
                  # largest tensor (the fp32 embedding, 158,336 x 896: 567 MB) must fit in one
                  "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=600"]
    cfg = GRPOConfig(model_path=str(w / "hf_model"), train_files=str(w / "data/train.parquet"),
                     val_files=str(w / "data/test.parquet"), checkpoint_dir=str(w / "ckpt"),
                     device="cpu" if a.device == "cpu" else "gpu", n_gpus_per_node=1,
                     train_batch_size=2, ppo_mini_batch_size=2, micro_batch_size_per_gpu=2,
                     max_prompt_length=64, max_response_length=RESPONSE, total_training_steps=STEPS,
                     save_freq=STEPS, test_freq=-1, val_before_train=False, lr=1e-5, rollout=a.rollout,
                     extra=extra)
    assert cfg.n == 4  # the GPU preset's group size
    server = None
    if not a.url:
        server, a.url = launch_server("--port", "0", "--backend", "sim", "--log-level", "WARNING")
    try:
        _grpo(a, w, cfg)
    finally:
        if server is not None:
            server.terminate()
            server.wait(15)


def _grpo(a, w: Path, cfg) -> None:
    from helpers import parse_steps

    env = {**os.environ, **cfg.env(), "TTSRL_REWARD_URL": a.url, "TTSRL_PLUGIN_LOADED_LOG": "1"}
    if a.device == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # Ray stops workers at 95% of memory in use; the actor's first Adam step peaks near it here
        env.setdefault("RAY_memory_usage_threshold", "0.98")
    say(f"GRPO ({cfg.rollout} rollout): {STEPS} steps x {cfg.train_batch_size} prompts x n {cfg.n}, "
        f"responses <= {RESPONSE} codes, "
        f"micro-batch {cfg.micro_batch_size_per_gpu}, lr {cfg.lr:g}, reward {a.url}")
    t0 = time.time()
    log_file = w / "train_grpo.log"
    with open(log_file, "w") as f:
        rc = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", *cfg.to_overrides()], cwd=ROOT,
                            stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    log = log_file.read_text(errors="replace")
    say(f"verl main_ppo exit {rc} in {time.time() - t0:.0f}s (log {log_file})")
    if rc != 0:
        print(log[-6000:])
        raise SystemExit("[rehearsal] FAILED: GRPO")
    pids = set(re.findall(r"registered CosyVoice2Qwen2ForCausalLM in pid (\d+)", log))
    steps = parse_steps(log)
    for s in sorted(k for k in steps if k > 0):
        m = steps[s]

        def g(key, m=m):
            return m.get(key, float("nan"))

        say(f"step {s}: {g('timing_s/step'):.1f}s (gen {g('timing_s/gen'):.1f}, update {g('timing_s/update_actor'):.1f}, "
            f"old log-prob {g('timing_s/old_log_prob'):.1f}), {g('perf/throughput'):.1f} tokens/s, "
            f"response length {g('response_length/mean'):.0f}, rollout/actor prob pearson "
            f"{g('training/rollout_actor_probs_pearson_corr'):.4f}, score {g('critic/score/mean'):.3f}, "
            f"machine memory used after the update {g('actor/perf/cpu_memory_used_gb'):.1f} GB (verl's psutil)")
    done = sorted(k for k in steps if k > 0)
    low = [s for s in done if steps[s].get("training/rollout_actor_probs_pearson_corr", 0) < 0.99]
    if done != list(range(1, STEPS + 1)) or low or (cfg.rollout == "vllm" and not pids):
        raise SystemExit(f"[rehearsal] FAILED: steps {done}, low rollout/actor correlation at {low}, "
                         f"plugin loaded in {len(pids)} vLLM process(es)")
    say((f"the ttsrl vLLM plugin served the rollout (pids {sorted(pids)}); " if pids else "") + "checkpoint "
        f"{w / 'ckpt' / f'global_step_{STEPS}'} ({gib(folder_bytes(w / 'ckpt' / f'global_step_{STEPS}'))})")


# ---------------------------------------------------------------- merged
def cmd_merged(a) -> None:
    """Stage 3's fp32 merge is the FSDP master weights bit for bit (read independently of
    merge_checkpoints.py), and the 2 steps moved them away from the start model."""
    import torch
    from helpers import fsdp_full_state

    from ttsrl.model.checkpoint import read_hf_tensors
    from ttsrl.train.merge import update_survival

    w = Path(a.workdir)
    master = fsdp_full_state(w / "ckpt" / f"global_step_{STEPS}" / "actor")
    merged = read_hf_tensors(w / "merged" / f"step_{STEPS}")
    base = read_hf_tensors(w / "hf_model")
    unequal = [k for k, t in master.items() if k not in merged or not torch.equal(merged[k], t)]
    extra = sorted(set(merged) - set(master))
    n = sum(t.numel() for t in master.values())
    dtypes = sorted({str(t.dtype) for t in merged.values()})
    surv = update_survival(base, master, merged)
    say(f"merged step {STEPS}: {len(merged)} tensors ({n / 1e6:.0f}M values, {dtypes}); equal to the FSDP master "
        f"bit for bit: {len(master) - len(unequal)}/{len(master)}; weights the steps changed "
        f"{surv['changed']:.1%}, update kept {surv['survives']:.1%}")
    if unequal or extra or dtypes != ["torch.float32"] or surv["changed"] <= 0:
        raise SystemExit(f"[rehearsal] FAILED: unequal {unequal[:5]}, not in the master {extra[:5]}, dtypes {dtypes}")


# ---------------------------------------------------------------- export
def cmd_export(a) -> None:
    """The exported llm.pt loads strict in the family's LM class: ``_export_cosyvoice2`` or
    ``_export_cosyvoice3``."""
    EXPORTS[a.family](a)


def _export_cosyvoice2(a) -> None:
    """The exported llm.pt loads strict in CosyVoice's own Qwen2LM (the installed CosyVoice code:
    what CosyVoice's inference loads it into) at full size, and its speech logits equal the
    merged step's under the transformers class (the model vLLM served):
    ``ttsrl.model.convert.verify_export(reference="cosyvoice")``."""
    import importlib.metadata as md

    import transformers

    from ttsrl.model import vocab as V
    from ttsrl.model.convert import CosyVoiceDecodeMismatch, verify_export

    w = Path(a.workdir)
    try:
        worst = verify_export(w / "merged" / f"step_{STEPS}", w / "llm_exported.pt", reference="cosyvoice")
    except CosyVoiceDecodeMismatch as e:
        if int(transformers.__version__.split(".")[0]) < 5:  # CosyVoice's own environment: a real fault
            raise SystemExit(f"[rehearsal] FAILED: {e}") from None
        say(f"known, not the export's fault: {e}")  # ttsrl's venv: the loop, not the weights
        worst = verify_export(w / "merged" / f"step_{STEPS}", w / "llm_exported.pt", reference="cosyvoice",
                              decode_steps=0)
    dist = md.packages_distributions().get("cosyvoice", ["?"])[0]  # the registry package that ships it
    say(f"CosyVoice's own Qwen2LM (cosyvoice.llm.llm from {dist} {md.version(dist)}) loaded llm_exported.pt "
        f"strict; speech logits vs transformers on merged step {STEPS}: max |diff| {worst:.2e} "
        f"(4 random probes of 10 text + 30 speech tokens, every position, {V.NUM_OUTPUTS} classes)")
    if worst > 1e-4:
        raise SystemExit("[rehearsal] FAILED: the exported llm.pt does not compute the merged step's logits")


def _export_cosyvoice3(a) -> None:
    """The exported llm.pt loads strict in ttsrl's ``CosyVoice3LM`` (CosyVoice's PyPI code has no
    CosyVoice3LM) and, with ``--checkout``, in upstream's ``cosyvoice.llm.llm.CosyVoice3LM`` from
    that checkout; under each its speech logits equal the merged step's under the transformers
    class (the model vLLM served): ``verify_export`` with references "ttsrl" and "cosyvoice"."""
    from ttsrl.families import family
    from ttsrl.model import vocab as V
    from ttsrl.model.convert import verify_export
    from ttsrl.reward.backends.cosyvoice_code import import_cosyvoice

    w = Path(a.workdir)
    merged, pt = w / "merged" / f"step_{STEPS}", w / "llm_exported.pt"
    probes = f"4 random probes of 10 text + 30 speech tokens, every position, {V.COSYVOICE3.num_outputs} classes"
    worst = verify_export(merged, pt, reference="ttsrl")
    say(f"ttsrl's CosyVoice3LM loaded llm_exported.pt strict; speech logits vs transformers on merged step "
        f"{STEPS}: max |diff| {worst:.2e} ({probes})")
    if a.checkout:
        import_cosyvoice(a.checkout, family("cosyvoice3").token2wav)  # the checkout's cosyvoice package, not the PyPI one
        up = verify_export(merged, pt, reference="cosyvoice")
        say(f"upstream's CosyVoice3LM (cosyvoice.llm.llm, checkout {a.checkout}) loaded llm_exported.pt strict; "
            f"speech logits vs transformers: max |diff| {up:.2e} ({probes})")
        worst = max(worst, up)
    else:
        say("upstream's CosyVoice3LM: not checked (no CosyVoice checkout: TTSRL_COSYVOICE_CHECKOUT; the PyPI "
            "package has no CosyVoice3LM)")
    if worst > 1e-4:
        raise SystemExit("[rehearsal] FAILED: the exported llm.pt does not compute the merged step's logits")


#: each family's builder and export check: they build its released shapes with the test helpers
#: (tests/*_tiny.py, ``size="full"``), which stay in tests, not in the family's folder
BUILDERS = {"cosyvoice2": _build_cosyvoice2, "cosyvoice3": _build_cosyvoice3}
EXPORTS = {"cosyvoice2": _export_cosyvoice2, "cosyvoice3": _export_cosyvoice3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=("build", "vllm", "reward", "grpo", "merged", "stage4", "export"))
    ap.add_argument("--workdir", required=True, help="the rehearsal's folder (about 17 GB at the end)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--family", default="cosyvoice2", choices=tuple(BUILDERS),
                    help="build, export, reward: the model family (run.sh's MODEL_FAMILY)")
    from ttsrl import knobs

    ap.add_argument("--checkout", default=knobs.get("TTSRL_COSYVOICE_CHECKOUT") or None,
                    help="cosyvoice3: a CosyVoice source checkout (build: the token2wav half; export: upstream's "
                         "CosyVoice3LM too); default TTSRL_COSYVOICE_CHECKOUT")
    ap.add_argument("--url", help="the family's reward server (reward; grpo: without it, a sim server)")
    ap.add_argument("--rollout", default="vllm", choices=("vllm", "hf"), help="grpo: the rollout engine")
    ap.add_argument("--batches", type=int, default=1, help="reward: batches of requests, one after the other")
    ap.add_argument("--requests", type=int, default=len(TEXTS), help="reward: requests in a batch (a GRPO step's 8)")
    ap.add_argument("--out", default="eval", help="stage4: the stage-4 output folder under --workdir")
    a = ap.parse_args()
    if a.phase == "reward" and not a.url:
        ap.error("reward needs --url")
    globals()[f"cmd_{a.phase}"](a)


if __name__ == "__main__":
    main()
