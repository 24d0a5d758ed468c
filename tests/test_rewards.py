"""A reward's needs are declared with it (``REWARDS[name].needs_asr_logprob``) and read by the
server and stage 4; stage 4 scores with the reward it is given."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import requests

from ttsrl.embedded import codec
from ttsrl.eval.evaluate import EvalConfig, scoring_backend
from ttsrl.reward.backends import SpeechPipeline
from ttsrl.reward.backends.sim import SimASR, SimToken2Wav
from ttsrl.reward.protocol import build_payload, infer_path
from ttsrl.reward.rewards import LENGTH_BAND, REWARDS, Reward
from ttsrl.reward.server import BackgroundServer, RewardServer
from ttsrl.text import pinyin_error_rate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import infer_dataset  # noqa: E402
import token2wav_asr_server  # noqa: E402

LOGPROB = -0.25  # what the scoring ASR below gives every reference


class ScoringSimASR(SimASR):
    """The simulated ASR that also scores a reference text (as Whisper does), with a fixed value."""

    supports_score = True

    def score(self, audios, ref_texts):
        return [LOGPROB] * len(audios)


def _confidence_only(ref: str, hyp: str, asr_logprob: float | None):
    if asr_logprob is None:
        raise ValueError("confidence_only needs asr_logprob")
    return math.exp(asr_logprob), 0.0, math.exp(asr_logprob)


@pytest.fixture
def new_reward(monkeypatch):
    """A reward registered as a user would add one: one entry in REWARDS, nothing else changed."""
    monkeypatch.setitem(REWARDS, "confidence_only",
                        Reward(_confidence_only, "exp(ASR log-probability)", needs_asr_logprob=True))
    return "confidence_only"


def test_only_cer_nll_needs_the_asr_logprob_today():
    assert {n for n, r in REWARDS.items() if r.needs_asr_logprob} == {"cer_nll"}


def test_a_new_reward_with_the_need_gets_the_logprob_path_in_the_server(new_reward):
    cfg = token2wav_asr_server.parse_args(["--backend", "sim", "--reward", new_reward, "--port", "0",
                                           "--no-length-guard"])
    assert cfg.reward == new_reward and not cfg.backend.want_score
    assert RewardServer.backend_config(cfg).want_score  # the server asks its ASR to score
    # the real server with the sim backend (an ASR that cannot score) refuses to start, naming the reward
    with pytest.raises(ValueError, match=f"reward {new_reward} needs the ASR's log-probability"):
        with BackgroundServer(cfg):
            pass
    # with an ASR that scores, the log-probability reaches the reward over HTTP
    want = RewardServer.backend_config(cfg).want_score
    with BackgroundServer(cfg, pipeline_factory=lambda dev: SpeechPipeline(SimToken2Wav(), ScoringSimASR(), dev,
                                                                           want_score=want)) as srv:
        text = "今天天气很好"
        got = requests.post(srv.url + infer_path(cfg.model_name), json=build_payload(codec.encode(text), text),
                            timeout=30).json()
    reward = next(o for o in got["outputs"] if o["name"] == "REWARDS")["data"][0]
    assert reward == pytest.approx(math.exp(LOGPROB), rel=1e-5)


def test_stage_4_asks_the_asr_for_what_the_reward_needs(new_reward, tmp_path):
    def cfg(reward):
        return EvalConfig(start_model="m", out_dir=str(tmp_path), test_sets=[("t", "x.jsonl")], reward=reward)

    assert scoring_backend(cfg(new_reward)).want_score and scoring_backend(cfg("cer_nll")).want_score
    assert not scoring_backend(cfg("tanh")).want_score and not scoring_backend(cfg("exp_toneless")).want_score


def test_stage_4_scores_with_exp_toneless(tiny_hf, tmp_path):
    """``infer_dataset.py --reward exp_toneless`` (today's stage 4 refused it) scores every utterance
    with exp(-12 c^1.5) of the tone-free pinyin error rate c, times the length guard."""
    texts = ["今天天气很好", "我想喝一杯热茶", "这本书非常有意思", "他去了北京"]
    test = tmp_path / "test.jsonl"
    test.write_text("".join(json.dumps({"text": t, "id": f"t{i}"}, ensure_ascii=False) + "\n"
                            for i, t in enumerate(texts)), encoding="utf-8")
    out = tmp_path / "eval"
    rc = infer_dataset.main(["--start-model", str(tiny_hf), "--out-dir", str(out), "--test-set", f"t={test}",
                             "--backend", "sim", "--reward", "exp_toneless", "--engine", "hf", "--device", "cpu",
                             "--threads", "1", "--resamples", "200", "--seed", "1", "--max-token-text-ratio", "6"])
    assert rc == 0
    rows = [json.loads(line) for line in (out / "step_0" / "t" / "results.jsonl").read_text().splitlines()]
    assert json.loads((out / "step_0" / "t" / "summary.json").read_text())["reward"] >= 0
    scored = [r for r in rows if not r["failure"]]
    assert scored, "the tiny model made no speech at all"
    lo, hi = LENGTH_BAND
    by_id = dict(zip((f"t{i}" for i in range(len(texts))), texts))
    tanh_would_give = []
    for r in scored:
        c = pinyin_error_rate(by_id[r["id"]], r["transcript"], tones=False)
        ratio = r["length_ratio"]
        guard = min(1.0, ratio / lo, hi / ratio) ** 2
        assert r["reward"] == pytest.approx(math.exp(-12.0 * c ** 1.5) * guard, abs=1e-9), r
        tanh_would_give.append(max(0.0, 1.0 - math.tanh(3.0 * c)) * guard)
    assert [r["reward"] for r in scored] != pytest.approx(tanh_would_give)  # not the default reward
