"""Stage 4: batched generation (ttsrl.model.generate), test sets, scoring and the sweep
(ttsrl.eval.evaluate, infer_dataset.py), on the tiny random checkpoint of conftest.py."""

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ttsrl.data.testsets import TestSetError, Utterance, read_test_set
from ttsrl.embedded import codec
from ttsrl.eval.dist import shard
from ttsrl.eval.evaluate import EvalConfig, run_sweep, score
from ttsrl.eval.report import NO_SIM_NOTE, summarize
from ttsrl.model import vocab as V
from ttsrl.model.checkpoint import write_marker
from ttsrl.model.cosyvoice_lm import SamplingConfig
from ttsrl.model.generate import Generated, GenerationConfig, HFGenerator, Request, build_input_ids
from ttsrl.model.hf_model import load_speech_lm
from ttsrl.reward.backends import BackendConfig, build_pipeline

RULE_2026, RULE_2024 = "cosyvoice2-2026", "cosyvoice2-2024"  # CosyVoice2's rules (the tiny model's family)

ROOT = Path(__file__).resolve().parent.parent
TEXTS = ["你好", "今天天气很好", "银行的行长在行走。", "我用iPhone拍照，Hello world!", "重庆"]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matmuls, one thread


def requests_for(lm, texts, prefix="u"):
    return [Request(f"{prefix}{i}", tuple(lm.tokenizer.encode(t, add_special_tokens=False)))
            for i, t in enumerate(texts)]


def generate(lm, reqs, **kw):
    return HFGenerator(lm.model, lm.vocab, lm.tokenizer.pad_token_id).generate(reqs, GenerationConfig(**kw))


# ---------------------------------------------------------------------------
# generation


def test_greedy_equals_reference_inference(tiny_cosyvoice2, lm):
    """The conversion is exact, so batched HF greedy decoding must reproduce
    CosyVoice2's own ``Qwen2LM.inference(greedy=True)`` token for token."""
    _, ref = tiny_cosyvoice2
    reqs = requests_for(lm, TEXTS)
    got = generate(lm, reqs, greedy=True, batch_size=len(reqs))
    for r, g in zip(reqs, got):
        want = list(ref.inference(r.text_ids, greedy=True))
        assert g.error is None and g.codes == want


def test_zero_shot_prompt_layout_matches_reference(tiny_cosyvoice2, lm):
    _, ref = tiny_cosyvoice2
    sv = lm.vocab
    tok = lm.tokenizer
    prompt_text = tuple(tok.encode("今天天气很好", add_special_tokens=False))
    prompt_speech = (12, 7, 6560, 0, 4000)
    text_ids = tuple(tok.encode("你好", add_special_tokens=False))
    req = Request("z", text_ids, prompt_text, prompt_speech)
    assert build_input_ids(sv, req) == ([sv.sos_id, *prompt_text, *text_ids, sv.task_id]
                                        + sv.codes_to_ids(prompt_speech))
    # batched next to a plain request of another length: still the reference's output
    got = generate(lm, [req, requests_for(lm, ["银行的行长在行走。"])[0]], greedy=True, batch_size=2)
    want = list(ref.inference(text_ids, prompt_text, prompt_speech, greedy=True))
    assert got[0].codes == want
    # min/max length count the target text only: 20 x len(text_ids) codes at most
    assert len(got[0].codes) <= 20 * len(text_ids)


@pytest.mark.parametrize("greedy", [True, False])
def test_batch_equals_single(lm, greedy):
    reqs = requests_for(lm, TEXTS)
    assert len({len(r.text_ids) for r in reqs}) > 2  # really different lengths in one batch
    cfg = dict(greedy=greedy, seed=7, sampling=SamplingConfig(min_token_text_ratio=0, max_token_text_ratio=6))
    batched = generate(lm, reqs, batch_size=len(reqs), **cfg)
    single = generate(lm, reqs, batch_size=1, **cfg)
    assert [g.codes for g in batched] == [g.codes for g in single]
    assert all(g.codes for g in batched)


def test_sampling_is_seeded_per_item(lm):
    reqs = requests_for(lm, TEXTS[:3])
    cfg = dict(sampling=SamplingConfig(max_token_text_ratio=5))
    a = generate(lm, reqs, seed=1, **cfg)
    b = generate(lm, list(reversed(reqs)), seed=1, **cfg)[::-1]  # order does not matter
    c = generate(lm, reqs, seed=2, **cfg)
    assert [g.codes for g in a] == [g.codes for g in b]
    assert [g.codes for g in a] != [g.codes for g in c]


def biased_model(tiny_hf, hf_id: int, value: float, others: dict[int, float] | None = None):
    m = load_speech_lm(tiny_hf)
    with torch.no_grad():
        m.model.lm_head.bias[hf_id] += value
        for i, v in (others or {}).items():
            m.model.lm_head.bias[i] += v
    return m


@pytest.mark.parametrize("rule", (RULE_2026, RULE_2024))  # the tiny model is CosyVoice2
@pytest.mark.parametrize("stop_index", V.family("cosyvoice2").stop_indices)
@pytest.mark.parametrize("greedy", [True, False])
def test_stops_on_every_stop_id(tiny_hf, lm, stop_index, greedy, rule):
    """A model that always wants to stop: stops at once when allowed; the stop token
    itself is never part of the output. Before min_len: today's rule holds back the
    eos row (6561) only, so eos2/eos3 still end the item (as CosyVoice's
    Qwen2LM.inference does); the 2024 rule refuses every stop index (greedy) or gives
    up after max_trials stop draws (sampling)."""
    m = biased_model(tiny_hf, lm.vocab.to_hf(stop_index), 50.0)
    reqs = requests_for(m, TEXTS[:3])
    none = generate(m, reqs, greedy=greedy, sampling=SamplingConfig(min_token_text_ratio=0, rule=rule), batch_size=3)
    assert all(g.codes == [] and g.stopped and g.error is None for g in none)
    got = generate(m, reqs, greedy=greedy, sampling=SamplingConfig(min_token_text_ratio=1.0, rule=rule), batch_size=3)
    if rule == RULE_2026 and stop_index != V.family("cosyvoice2").eos_index:
        assert all(g.codes == [] and g.stopped and g.error is None for g in got)
    elif greedy or rule == RULE_2026:
        for r, g in zip(reqs, got):
            assert g.stopped and g.error is None
            assert len(g.codes) == len(r.text_ids)  # min_len = 1 x text tokens
            assert all(0 <= c < V.family("cosyvoice2").speech_token_size for c in g.codes)
    else:
        # the 2024 rule gives up after max_trials stop draws before min_len: that item
        # is reported as failed, the batch goes on
        assert all("only stop tokens" in g.error for g in got)


def test_max_length_keeps_the_last_token(tiny_hf, lm):
    """A model that never stops: exactly max_len codes, the last one kept."""
    sv = lm.vocab
    m = biased_model(tiny_hf, sv.to_hf(5), 50.0, {i: -50.0 for i in sv.stop_ids})
    reqs = requests_for(m, TEXTS[:2])
    got = generate(m, reqs, greedy=True, sampling=SamplingConfig(max_token_text_ratio=3.0), batch_size=2)
    for r, g in zip(reqs, got):
        assert not g.stopped
        assert g.codes == [5] * (3 * len(r.text_ids))


# ---------------------------------------------------------------------------
# test sets and scoring


def test_shard_covers_each_item_once():
    items = list(range(11))
    parts = [shard(items, r, 3) for r in range(3)]
    assert sorted(x for p in parts for x in p) == items
    assert [len(p) for p in parts] == [4, 4, 3]


def test_jsonl_reader_errors_name_file_and_line(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"text": "你好", "id": "a"}\n{"txt": "x"}\n', encoding="utf-8")
    with pytest.raises(TestSetError, match=r"t\.jsonl:2: expected a non-empty string 'text'"):
        read_test_set("t", p)
    p.write_text('{"text": "你好", "id": "a"}\n{"text": "好", "id": "a"}\n', encoding="utf-8")
    with pytest.raises(TestSetError, match="appears twice"):
        read_test_set("t", p)
    p.write_text('{"text": "你好", "prompt_text": "好", "prompt_speech_tokens": [1, 6561]}\n', encoding="utf-8")
    with pytest.raises(TestSetError, match="outside 0..6560"):
        read_test_set("t", p)


def test_seedtts_layout_with_and_without_prompt_tokens(tmp_path):
    d = tmp_path / "zh"
    d.mkdir()
    (d / "meta.lst").write_text("u1|今天天气很好|prompt-wavs/u1.wav|你好\nu2|银行|prompt-wavs/u2.wav|重庆\n",
                                encoding="utf-8")
    ts = read_test_set("seed", d)
    assert ts.layout == "seedtts" and [u.id for u in ts.utterances] == ["u1", "u2"]
    assert ts.utterances[0] == Utterance("u1", "你好")  # no tokens file: plain TTS, and a note says so
    assert ts.notes and "prompt_speech_tokens.jsonl" in ts.notes[0]
    (d / "prompt_speech_tokens.jsonl").write_text('{"id": "u1", "prompt_speech_tokens": [1, 2]}\n'
                                                  '{"id": "u2", "prompt_speech_tokens": [3]}\n')
    ts = read_test_set("seed", d)
    assert ts.utterances[0] == Utterance("u1", "你好", "今天天气很好", (1, 2),
                                         str((d / "prompt-wavs/u1.wav").resolve())) and not ts.notes


def test_cv3_layout(tmp_path):
    d = tmp_path / "zero_shot_zh"
    d.mkdir()
    (d / "text").write_text("uttid_1 你好\nuttid_2 重庆\n", encoding="utf-8")
    (d / "prompt_text").write_text("uttid_1 今天天气很好\nuttid_2 银行\n", encoding="utf-8")
    (d / "prompt_wav.scp").write_text("uttid_1 w/1.wav\nuttid_2 w/2.wav\n")
    (d / "prompt_speech_tokens.jsonl").write_text('{"id": "uttid_1", "prompt_speech_tokens": [9]}\n'
                                                  '{"id": "uttid_2", "prompt_speech_tokens": [8]}\n')
    ts = read_test_set("cv3", d)
    assert ts.layout == "cv3"
    assert ts.utterances[1] == Utterance("uttid_2", "重庆", "银行", (8,), str((d / "w/2.wav").resolve()))


def test_missing_outputs_count_as_full_errors():
    pipeline = build_pipeline(BackendConfig(backend="sim"))
    utts = [Utterance("ok", "今天天气很好"), Utterance("empty", "银行的行长"), Utterance("broken", "你好吗")]
    gens = [Generated(codes=codec.encode("今天天气很好"), stopped=True), Generated(codes=[]),
            Generated(error="SamplingError: only stop tokens")]
    rows = score(pipeline, utts, gens)
    assert [r["failure"] for r in rows] == [False, True, True]
    assert rows[0]["cer_errors"] == 0 and rows[0]["reward"] == pytest.approx(1.0)
    for r, n in zip(rows[1:], (5, 3)):
        assert r["cer_errors"] == r["ref_len"] == n and r["reward"] == 0.0 and r["transcript"] == ""
    assert rows[2]["error"].startswith("SamplingError")
    s = summarize(rows)
    assert s["failures"] == 2 and s["failed_ids"] == ["empty", "broken"]
    assert s["cer"] == s["cer_pooled"] == pytest.approx(8 / 14)  # pooled: (0 + 5 + 3) / (6 + 5 + 3)
    # Seed-TTS convention: mean of per-utterance rates 0, 1, 1 (a failure is 100%)
    assert [r["utt_rate"] for r in rows] == [0.0, 1.0, 1.0]
    assert s["cer_utt_mean"] == pytest.approx(2 / 3) and s["above_50"] == pytest.approx(2 / 3)
    lo, hi = s["ci"]["cer_utt_mean"]
    assert 0.0 <= lo <= 2 / 3 <= hi <= 1.0


def test_summary_of_several_seeds_by_hand():
    def row(uid, seed, rate, errors, n):
        return {"id": uid, "seed": seed, "utt_rate": rate, "utt_unit": "char", "cer_errors": errors, "ref_len": n,
                "pinyin_errors": errors, "pinyin_ref_len": n, "failure": False, "reward": 0.5, "n_codes": 4,
                "stopped": True}

    rows = [row("a", 0, 0.5, 2, 4), row("a", 1, 0.0, 0, 4), row("b", 0, 1.0, 2, 2), row("b", 1, 0.5, 1, 2)]
    s = summarize(rows, resamples=200)
    assert (s["n"], s["decodes"], s["seeds"]) == (2, 4, [0, 1])
    # seed 0: mean(0.5, 1.0) = 0.75; seed 1: mean(0.0, 0.5) = 0.25; sd of (0.75, 0.25) = 0.3536
    sp = s["seed_spread"]["cer_utt_mean"]
    assert sp["per_seed"] == [0.75, 0.25] and sp["std"] == pytest.approx(0.5 ** 0.5 / 2)
    assert s["cer_utt_mean"] == pytest.approx(0.5)
    assert s["seed_spread"]["cer_pooled"]["per_seed"] == [4 / 6, 1 / 6] and s["cer_pooled"] == pytest.approx(5 / 12)
    assert s["above_50"] == pytest.approx(1 / 4)  # one decode of four is above 50%
    # no row has a speaker similarity: none reported
    assert (s["sim_mean"], s["sim_n"], s["sim_ci"]) == (None, 0, None)
    # SIM: each utterance the mean of its seeds' values (None left out), then the mean over utterances
    sims = {("a", 0): 0.8, ("a", 1): 0.6, ("b", 0): None, ("b", 1): 0.2}
    s = summarize([{**r, "sim": sims[(r["id"], r["seed"])]} for r in rows], resamples=200)
    assert s["sim_n"] == 2 and s["sim_mean"] == pytest.approx((0.7 + 0.2) / 2)
    assert 0.2 <= s["sim_ci"][0] <= s["sim_mean"] <= s["sim_ci"][1] <= 0.7


def test_length_ratio_by_hand():
    """Codes generated / codes expected for the text, per utterance and its mean over a
    set. The simulated codec speaks 2 codes per syllable (codec.TOKEN_RATE = 9 codes/s at
    4.5 syllables/s): the codes codec.encode makes for a text without pauses."""
    from ttsrl.eval.report import format_table
    from ttsrl.reward.rewards import length_ratio

    pipeline = build_pipeline(BackendConfig(backend="sim"))
    assert pipeline.token_rate == codec.TOKEN_RATE == 9.0
    utts = [Utterance("normal", "今天天气很好"), Utterance("slow", "你好吗"), Utterance("clipped", "银行"),
            Utterance("none", "重庆")]
    assert codec.expected_len("今天天气很好") == 12  # 6 syllables
    gens = [Generated(codes=codec.encode("今天天气很好")),                  # 12 of 12 codes
            Generated(codes=codec.encode("你好吗") * 2),                   # 12 of 6: twice as long
            Generated(codes=codec.encode("银行")[:2]),                     # 2 of 4: cut in half
            Generated(codes=[])]                                        # a failure, no ratio
    rows = score(pipeline, utts, gens)
    assert [r["length_ratio"] for r in rows] == [pytest.approx(1.0), pytest.approx(2.0), pytest.approx(0.5), None]
    s = summarize(rows, resamples=200)
    assert s["length_ratio_mean"] == pytest.approx((1.0 + 2.0 + 0.5) / 3)  # 1.1667, the failure left out
    row = {"step": 0, "test_set": "t", "role": "test", "n": 4, **s}
    table = format_table([{**row, "reward": 0.0}])
    assert "| 0.000 | 1.17 | 4 | 1 |" in table
    # the sim backend has no speaker model: the report says why it has no SIM column
    assert NO_SIM_NOTE in table and "SIM (campplus)" not in table
    sim_row = {**row, "reward": 0.0, "sim_mean": 0.5, "sim_n": 3, "sim_ci": [0.4, 0.6]}
    with_sim = format_table([{**sim_row, "backend": "cosyvoice2"}])
    assert "SIM (campplus)" in with_sim and NO_SIM_NOTE not in with_sim
    # the column names the speaker model that measured it: the embedded world's is no campplus
    simulated = format_table([{**sim_row, "backend": "sim"}])
    assert "| SIM (simulated) [95% CI] |" in simulated and "SIM (campplus)" not in simulated
    assert "share of the generated codes in the prompt speaker's code book" in simulated
    assert "SIM (speaker model)" in format_table([sim_row, {**sim_row, "backend": "sim"}])  # unknown or mixed
    assert "| n/a | 4 | 1 |" in format_table([{**row, "reward": 0.0, "length_ratio_mean": None}])
    # CosyVoice2's speech tokens: 25 per second at 4.5 syllables/s, 3 syllables -> 16.67 expected
    assert length_ratio(25, "你好吗", token_rate=25.0) == pytest.approx(25 / (3 * 25 / 4.5))  # 1.5
    assert length_ratio(5, "。", token_rate=25.0) is None  # nothing to say, no expectation


def test_the_plot_draws_every_measured_term_with_its_interval(tmp_path):
    """terms.png has a panel for the headline error rate, for SIM where a row has it, and for the length
    ratio; its intervals are the summaries' (length ratio's bootstrapped like SIM's); a term no row
    measured gets no panel."""
    from ttsrl.eval.report import plot_terms

    pipeline = build_pipeline(BackendConfig(backend="sim"))
    utts = [Utterance(f"u{i}", t) for i, t in enumerate(["今天天气很好", "你好吗", "银行", "重庆"])]
    rows = score(pipeline, utts, [Generated(codes=codec.encode(u.text) * (1 + i % 2)) for i, u in enumerate(utts)])
    s = summarize(rows, resamples=200)
    lo, hi = s["length_ratio_ci"]
    assert lo <= s["length_ratio_mean"] <= hi and lo < hi  # ratios 1 and 2: a real spread
    base = [{"step": st, "test_set": name, "role": role, "headline": "cer_utt_mean", **s}
            for st in (0, 5) for name, role in (("dev", "dev"), ("test", "test"))]
    assert plot_terms(base, tmp_path / "a.png", chosen=5) == ["cer_utt_mean", "length_ratio_mean"]
    with_sim = [{**r, "sim_mean": 0.8, "sim_ci": [0.7, 0.9]} for r in base]
    assert plot_terms(with_sim, tmp_path / "b.png") == ["cer_utt_mean", "sim_mean", "length_ratio_mean"]
    for f in ("a.png", "b.png"):
        assert (tmp_path / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_hypothesis_is_normalised_like_the_reference():
    """Scoring goes through ttsrl.text, which normalises BOTH sides: a transcript that
    differs from the reference only by punctuation and digits is error-free."""
    from ttsrl.text import error_counts

    assert error_counts("我有2个苹果。", "我有两个苹果", "char")[0] == 0
    assert error_counts("我有两个苹果", "我有2个苹果！", "char")[0] == 0


# ---------------------------------------------------------------------------
# the sweep


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t, "id": f"t{i}"}, ensure_ascii=False) + "\n"
                            for i, t in enumerate(texts)), encoding="utf-8")


@pytest.mark.slow
def test_two_ranks_decode_every_utterance_once(tiny_hf, tmp_path):
    """torchrun with 2 gloo ranks over 5 utterances (not a multiple of 2)."""
    test = tmp_path / "test.jsonl"
    write_jsonl(test, TEXTS)
    out = tmp_path / "eval"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "infer_dataset.py"), "--start-model", str(tiny_hf), "--out-dir", str(out),
           "--test-set", f"small={test}", "--greedy", "--max-token-text-ratio", "4", "--threads", "1",
           "--batch-size", "2"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "step_0" / "small" / "results.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"t{i}" for i in range(5)]
    summary = json.loads((out / "step_0" / "small" / "summary.json").read_text())
    assert summary["n"] == 5 and summary["ranks"] == 2
    # same outputs as one process decoding everything
    lm = load_speech_lm(tiny_hf)
    want = generate(lm, requests_for(lm, TEXTS, prefix="t"), greedy=True,
                    sampling=SamplingConfig(max_token_text_ratio=4))
    assert [r["n_codes"] for r in rows] == [len(g.codes) for g in want]
    assert "| 0 (start) | small |" in p.stdout


def test_sweep_report_summary_plot_and_skip(tiny_hf, tmp_path, capsys):
    test = tmp_path / "test.jsonl"
    write_jsonl(test, TEXTS[:3])
    merged = tmp_path / "merged"
    shutil.copytree(tiny_hf, merged / "step_2")
    write_marker(merged / "step_2", {"step": 2})  # as stage 3 leaves a finished step
    (merged / "step_4").mkdir()  # no marker: an unfinished merge, not a model
    out = tmp_path / "eval"
    cfg = EvalConfig(start_model=str(tiny_hf), merged_dir=str(merged), out_dir=str(out),
                     test_sets=[("a", str(test)), ("b", str(test))], dev_sets=[("d", str(test))], engine="hf",
                     device="cpu", threads=1, resamples=200,
                     generation=GenerationConfig(sampling=SamplingConfig(max_token_text_ratio=3), seed=3))
    logs = []
    rows = run_sweep(cfg, log=logs.append)
    assert [(r["step"], r["test_set"]) for r in rows] == [(0, "d"), (0, "a"), (0, "b"), (2, "d"), (2, "a"), (2, "b")]

    summary = json.loads((out / "summary.json").read_text())
    assert summary == rows
    for r in summary:
        assert set(r) >= {"step", "test_set", "cer", "pinyin_error", "reward", "n", "failures", "role",
                          "cer_pooled", "cer_utt_mean", "above_50", "ci"}
        assert r["n"] == 3 and isinstance(r["failures"], int) and 0 <= r["reward"] <= 1
        assert r["role"] == ("dev" if r["test_set"] == "d" else "test") and r["cer"] == r["cer_pooled"]
        for m in ("cer_utt_mean", "cer_pooled"):
            assert r["ci"][m][0] <= r[m] <= r["ci"][m][1]
        # which rule and length ratios produced the row
        assert (r["rule"], r["min_ratio"], r["max_ratio"]) == (RULE_2026, 2.0, 3)
        # the sweep row carries the pair's mean length ratio, over the decodes that made speech
        res = [json.loads(x) for x in (out / f"step_{r['step']}" / r["test_set"] / "results.jsonl").read_text().splitlines()]
        got = [x["length_ratio"] for x in res if not x["failure"]]
        assert r["length_ratio_mean"] == (pytest.approx(sum(got) / len(got)) if got else None)
        # the simulated codec has no speaker model: no SIM anywhere
        assert all(x["sim"] is None for x in res) and (r["sim_mean"], r["sim_n"], r["sim_ci"]) == (None, 0, None)
    # step_2 is a copy of the start model and sampling is seeded per utterance: same scores,
    # and the paired comparison with the start model sees exactly no difference
    assert summary[0]["cer"] == summary[3]["cer"] and summary[0]["cer_utt_mean"] == summary[3]["cer_utt_mean"]
    vs = summary[3]["vs_start"]["cer_utt_mean"]
    assert (vs["diff"], vs["lo"], vs["hi"], vs["p_better"], vs["n"]) == (0.0, 0.0, 0.0, 0.0, 3)
    assert "vs_start" not in summary[0]
    report = (out / "report.md").read_text()
    assert report.count("\n| ") == 1 + 6 and "| 2 | b | test |" in report  # header + 6 rows
    assert report.count(f"| {RULE_2026} | 2.0/3 |") == 6
    assert "| mean reward | length ratio | n |" in report
    assert "SIM (campplus)" not in report and NO_SIM_NOTE in report  # no column, and why
    # a tie on the dev set goes to the earlier step; the report says which set chose
    assert "Stage 5 exports step 0: the lowest cer_utt_mean on the dev set(s) d" in report
    assert report.count(" * |") == 1 and "| 0 (start) | d | dev |" in report
    assert (out / "terms.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    per = out / "step_2" / "a"
    assert (per / "results.jsonl").is_file() and json.loads((per / "summary.json").read_text())["step"] == 2

    # a second run scores nothing again
    before = {p: p.stat().st_mtime_ns for p in out.rglob("results.jsonl")}
    logs.clear()
    rows2 = run_sweep(cfg, log=logs.append)
    assert rows2 == rows
    assert sum("already scored" in line for line in logs) == 6
    assert {p: p.stat().st_mtime_ns for p in out.rglob("results.jsonl")} == before
    # ... unless the settings change (or --force)
    cfg.generation = GenerationConfig(greedy=True, sampling=SamplingConfig(max_token_text_ratio=3))
    cfg.steps = [2]
    logs.clear()
    run_sweep(cfg, log=logs.append)
    assert not any("already scored" in line for line in logs)
    assert (out / "step_2" / "a" / "results.jsonl").stat().st_mtime_ns != before[out / "step_2" / "a" / "results.jsonl"]
    # step 2 is now greedy, the start model sampled: no paired comparison across settings
    again = json.loads((out / "summary.json").read_text())
    assert "vs_start" not in again[4] and "other settings" in again[4]["vs_start_note"]


def test_several_seeds_report_mean_and_spread(tiny_hf, tmp_path):
    test = tmp_path / "test.jsonl"
    write_jsonl(test, TEXTS[:2])
    out = tmp_path / "eval"
    cfg = EvalConfig(start_model=str(tiny_hf), out_dir=str(out), test_sets=[("a", str(test))], engine="hf",
                     device="cpu", threads=1, seeds=3, resamples=200,
                     generation=GenerationConfig(sampling=SamplingConfig(max_token_text_ratio=20), seed=5))
    run_sweep(cfg, log=lambda _: None)
    res = [json.loads(line) for line in (out / "step_0" / "a" / "results.jsonl").read_text().splitlines()]
    assert [(r["id"], r["seed"]) for r in res] == [(f"t{i}", k) for i in range(2) for k in (5, 6, 7)]
    # each seed is its own draw: the outputs differ between seeds
    assert any(len({(r["n_codes"], r["transcript"]) for r in res if r["id"] == u}) > 1 for u in ("t0", "t1"))
    s = json.loads((out / "step_0" / "a" / "summary.json").read_text())
    assert (s["n"], s["decodes"], s["seeds"]) == (2, 6, [5, 6, 7])
    per_seed = [sum(r["utt_rate"] for r in res if r["seed"] == k) / 2 for k in (5, 6, 7)]
    sp = s["seed_spread"]["cer_utt_mean"]
    assert sp["per_seed"] == pytest.approx(per_seed) and sp["mean"] == pytest.approx(sum(per_seed) / 3)
    assert s["cer_utt_mean"] == pytest.approx(sp["mean"])
    assert "sd/seed" in (out / "report.md").read_text()


def test_dev_seeds_decode_the_dev_sets_more_often_than_the_test_sets(tiny_hf, tmp_path):
    """--dev-seeds K: each dev utterance is decoded K times (stage 5 chooses on the mean), the test sets
    keep --seeds; the summaries say so, and a rerun with the same settings scores nothing again."""
    test = tmp_path / "test.jsonl"
    write_jsonl(test, TEXTS[:2])
    out = tmp_path / "eval"
    cfg = EvalConfig(start_model=str(tiny_hf), out_dir=str(out), test_sets=[("a", str(test))],
                     dev_sets=[("d", str(test))], engine="hf", device="cpu", threads=1, dev_seeds=3, resamples=200,
                     generation=GenerationConfig(sampling=SamplingConfig(max_token_text_ratio=20), seed=5))
    rows = run_sweep(cfg, log=lambda _: None)
    by_set = {r["test_set"]: r for r in rows}
    assert (by_set["d"]["role"], by_set["d"]["seeds"], by_set["d"]["n"]) == ("dev", [5, 6, 7], 2)
    assert (by_set["a"]["role"], by_set["a"]["seeds"], by_set["a"]["n"]) == ("test", [5], 2)
    dev = [json.loads(x) for x in (out / "step_0" / "d" / "results.jsonl").read_text().splitlines()]
    assert [(r["id"], r["seed"]) for r in dev] == [(f"t{i}", k) for i in range(2) for k in (5, 6, 7)]
    assert by_set["d"]["cer_utt_mean"] == pytest.approx(sum(r["utt_rate"] for r in dev) / 6)
    logs = []
    run_sweep(cfg, log=logs.append)
    assert sum("already scored" in line for line in logs) == 2
    logs.clear()
    run_sweep(replace(cfg, dev_seeds=2), log=logs.append)  # another K: both sets scored again (one settings record)
    assert not any("already scored" in line for line in logs)
    d = json.loads((out / "step_0" / "d" / "summary.json").read_text())
    assert (d["seeds"], d["settings"]["dev_seeds"]) == ([5, 6], 2)


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="needs espeak-ng")
def test_wavs_written_when_the_backend_makes_audio(tmp_path):
    """espeak-ng voices the codes (real audio), the sim ASR reads the codes back."""
    import wave

    pipeline = build_pipeline(BackendConfig(backend="whisper", asr="sim"))
    utts = [Utterance("a/1", "今天天气很好"), Utterance("b", "你好")]
    gens = [Generated(codes=codec.encode(u.text), stopped=True) for u in utts[:1]] + [Generated()]
    rows = score(pipeline, utts, gens, wav_dir=tmp_path / "wavs")
    assert rows[0]["cer_errors"] == 0 and rows[1]["failure"]
    assert rows[0]["reading_error"] is None  # a codec's tokens have no one right reading to check
    wavs = sorted(p.name for p in (tmp_path / "wavs").iterdir())
    assert wavs == ["a_1.wav"]  # a failure has no audio; ids are made file-safe
    with wave.open(str(tmp_path / "wavs" / "a_1.wav")) as w:
        assert w.getnframes() > 0


@pytest.mark.slow  # espeak-ng audio and DNSMOS for a two-step sweep of three texts, the plot, the page: 10-13 s on a 2-core AMD EPYC
@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="needs espeak-ng")
def test_dnsmos_column_plot_panel_and_listening_page(tmp_path):
    """Real audio (espeak-ng) gets DNSMOS scores per utterance, a column with its interval and Δ in
    the report, a panel in the plot, and a listening page that plays stage 4's wavs side by side."""
    from ttsrl.eval.listen import write_listening_page
    from ttsrl.eval.report import (
        RESULTS_FILE,
        SUMMARY_FILE,
        format_table,
        plot_terms,
        write_json,
        write_jsonl,
        write_sweep,
    )

    pipeline = build_pipeline(BackendConfig(backend="whisper", asr="sim", want_mos=True))
    utts = [Utterance("a/1", "今天天气很好"), Utterance("b<2>", "你好"), Utterance("c", "银行")]
    for step, n in ((0, 1), (5, 2)):  # step 5 says each text twice
        gens = [Generated(codes=codec.encode(u.text) * n, stopped=True) for u in utts]
        where = tmp_path / f"step_{step}" / "test"
        rows = score(pipeline, utts, gens, wav_dir=where / "wavs")
        assert all(1.0 <= r["mos_ovrl"] <= 5.0 and r["mos_sig"] and r["mos_bak"] for r in rows)
        write_jsonl(where / RESULTS_FILE, rows)
        write_json(where / SUMMARY_FILE, {**summarize(rows, resamples=200), "step": step, "test_set": "test",
                                          "settings": {"backend": "whisper"}})
    models = {0: tmp_path, 5: tmp_path}
    swept = write_sweep(tmp_path, models, ["test"], resamples=200)
    assert swept[1]["mos_ovrl_n"] == 3 and swept[1]["mos_ovrl_ci"][0] <= swept[1]["mos_ovrl_mean"]
    assert "mos_ovrl_vs_start" in swept[1] and "DNSMOS OVRL [95% CI]" in format_table(swept)
    assert "DNSMOS P.835" in (tmp_path / "report.md").read_text()
    assert "mos_ovrl_mean" in plot_terms(swept, tmp_path / "t.png")
    page = (tmp_path / "listen.html").read_text()
    assert page.count("<audio") == 6 and "step 5 (the last)" in page
    for src in ("step_0/test/wavs/a_1.wav", "step_5/test/wavs/b_2_.wav"):
        assert f'src="{src}"' in page and (tmp_path / src).is_file()
    # no start-model audio (the simulated codec): no page
    assert write_listening_page(tmp_path, ["dev_only"], None, 5) is None


def test_cli_dev_sets_seeds_and_headline(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from infer_dataset import parse_args

    base = ["--start-model", "m", "--out-dir", str(tmp_path), "--test-set", "t=a.jsonl"]
    cfg = parse_args(base + ["--dev-set", "d=b.jsonl", "--seeds", "3", "--headline", "pooled"])
    assert cfg.dev_sets == [("d", "b.jsonl")] and cfg.test_sets == [("t", "a.jsonl")]
    assert (cfg.seeds, cfg.dev_seeds, cfg.headline) == (3, None, "cer_pooled")
    assert parse_args(base + ["--dev-set", "d=b.jsonl", "--dev-seeds", "4"]).dev_seeds == 4
    assert (parse_args(base).headline, parse_args(base).dev_sets) == ("cer_utt_mean", [])
    for bad in (["--seeds", "0"], ["--dev-seeds", "0"], ["--resamples", "10"], ["--headline", "wer"]):
        with pytest.raises(SystemExit):
            parse_args(base + bad)


def test_a_dev_row_naming_an_unknown_prompt_id_is_one_message_before_any_model_loads(tiny_hf, tmp_path, capsys,
                                                                                   monkeypatch):
    """A DEV_FILE row naming a prompt_id the scoring backend's pool lacks raised UnknownPromptId mid-scoring
    (a traceback per rank, after the start model was decoded); now stage 4 stops first, exit 2, one message
    naming the file, the id and the pool."""
    monkeypatch.syspath_prepend(str(ROOT))
    from infer_dataset import main

    pool = ROOT / "data" / "corpus" / "prompt_pool"
    dev = tmp_path / "dev.jsonl"
    dev.write_text(json.dumps({"text": "你好", "prompt_id": "spk0_01"}) + "\n"
                   + json.dumps({"text": "重庆", "prompt_id": "spk9_99"}) + "\n", encoding="utf-8")
    rc = main(["--start-model", str(tiny_hf), "--out-dir", str(tmp_path / "eval"), "--dev-set", f"dev={dev}", "--test-set", f"t={dev}",
               "--backend", "sim", "--prompt-dir", str(pool), "--engine", "hf", "--device", "cpu", "--threads", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"error: {dev} (dev): 1 of its 2 rows name a prompt_id"), err
    assert "('spk9_99')" in err and f"--prompt-dir {pool}: 16, e.g. 'spk0_01'" in err and "PROMPT_POOL" in err
    assert "Traceback" not in err and not (tmp_path / "eval" / "step_0").exists()
