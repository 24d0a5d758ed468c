"""reward_tts.compute_score against a live reward server, through verl's own loader and
naive reward manager, and against a dead port (loud failure past the threshold)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import dead_url

from ttsrl.embedded import codec
from ttsrl.model.vocab import SpeechVocab
from ttsrl.reward.client import (
    ENV_FAIL_WINDOW,
    ENV_MAX_FAIL,
    ENV_URL,
    FailureWindow,
    RewardClientConfig,
    RewardServiceError,
    compute_score,
)
from ttsrl.reward.server import BackgroundServer, ServerConfig

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["今天天气很好，我们去公园散步。", "我想喝一杯热茶。", "这本书非常有意思。", "他在二零二三年去了北京。"]
KEYS = {"score", "error_rate", "transcript", "reward_failed", "sim", "sim_measured", "cer", "length", "unfinished",
        "mos", "mos_measured"}


@pytest.fixture(scope="module")
def server():
    with BackgroundServer(ServerConfig(port=0, max_delay_ms=20)) as srv:
        yield srv



def cfg_for(url: str, **kw) -> RewardClientConfig:
    base = dict(url=url, retries=2, backoff_s=0.01, timeout_s=30.0, fail_window=20)  # judged per 20 requests
    base.update(kw)
    return RewardClientConfig(**base)


def speech(text: str) -> str:
    return SpeechVocab.codes_to_text(codec.encode(text))


async def gather_scores(items, cfg):
    return await asyncio.gather(*(compute_score("tts", s, gt, {}, config=cfg) for s, gt in items),
                                return_exceptions=True)


def test_compute_score_against_live_server(server):
    cfg = cfg_for(server.url)
    out = asyncio.run(gather_scores([(speech(t), t) for t in TEXTS] + [(speech(TEXTS[0]), TEXTS[1])], cfg))
    for r in out[:4]:
        assert set(r) == KEYS and r["score"] == pytest.approx(1.0) and r["reward_failed"] == 0.0 and r["sim"] == 0.0
        assert r["error_rate"] == 0.0 and isinstance(r["transcript"], str) and r["transcript"]
    assert out[4]["score"] < 0.3 and out[4]["error_rate"] > 0.5
    # no speech tokens: reward 0 by definition, not a failure
    r = asyncio.run(compute_score("tts", "", TEXTS[0], config=cfg))
    assert set(r) == KEYS and r["score"] == 0.0 and r["reward_failed"] == 0.0


def test_reads_url_and_threshold_from_environment(monkeypatch, server):
    monkeypatch.setenv(ENV_URL, server.url + "/")
    monkeypatch.setenv(ENV_MAX_FAIL, "0.25")
    monkeypatch.setenv(ENV_FAIL_WINDOW, "32")
    cfg = RewardClientConfig.from_env()
    assert cfg.url == server.url and cfg.max_fail_fraction == 0.25 and cfg.fail_window == 32
    assert asyncio.run(compute_score("tts", speech(TEXTS[1]), TEXTS[1]))["score"] == pytest.approx(1.0)
    monkeypatch.setenv(ENV_MAX_FAIL, "2")
    with pytest.raises(ValueError, match=ENV_MAX_FAIL):
        RewardClientConfig.from_env()
    monkeypatch.setenv(ENV_MAX_FAIL, "0.25")
    monkeypatch.setenv(ENV_URL, f"{server.url}, {server.url}/")
    with pytest.raises(ValueError, match=f"{ENV_URL}: a reward server URL is listed twice"):
        RewardClientConfig.from_env()


def test_dead_server_fails_the_step_loudly():
    cfg = cfg_for(dead_url(), max_fail_fraction=0.1)
    out = asyncio.run(gather_scores([(speech(t), t) for t in TEXTS * 5], cfg))
    errors = [r for r in out if isinstance(r, BaseException)]
    assert errors and all(isinstance(e, RewardServiceError) for e in errors)
    msg = str(errors[0])
    assert "of the last 20 reward requests failed" in msg and ENV_URL in msg and cfg.url in msg
    # the first 10% of the window's 20 were flagged (never a silent 0.0), the rest raised
    flagged = [r for r in out if isinstance(r, dict)]
    assert len(flagged) == 2 and all(r["reward_failed"] == 1.0 and r["score"] == 0.0 for r in flagged)


def test_failures_under_the_threshold_are_flagged_not_raised(server):
    cfg = cfg_for(server.url, max_fail_fraction=0.1)
    # one request in 20 is refused by the server (empty GT_TEXT: 400, not retried)
    items = [(speech(t), t) for t in TEXTS * 5]
    items[7] = (items[7][0], " ")
    out = asyncio.run(gather_scores(items, cfg))
    assert not any(isinstance(r, BaseException) for r in out)
    assert [r["reward_failed"] for r in out].count(1.0) == 1 and out[7]["reward_failed"] == 1.0
    assert all(r["score"] == pytest.approx(1.0) for i, r in enumerate(out) if i != 7)
    # three in 20 (15%) is over the 10% limit: that step fails
    for i in (3, 11):
        items[i] = (items[i][0], "")
    out = asyncio.run(gather_scores(items, cfg))
    assert any(isinstance(r, RewardServiceError) for r in out)


def test_failure_window_counts_the_last_requests():
    w = FailureWindow(4)
    assert [w.record(f) for f in (True, False, False, True)] == [1, 1, 1, 2]
    assert w.record(False) == 1  # the first failure left the window
    assert [w.record(False) for _ in range(3)] == [1, 1, 0]  # the second one leaves last


@pytest.mark.slow  # waits out Retry-After: ~5 s
def test_server_retry_after_is_honoured():
    """A tiny queue that answers 503: the client retries and every reward arrives."""
    from ttsrl.reward.backends import SpeechPipeline
    from ttsrl.reward.backends.sim import SimASR, SimToken2Wav

    class Slow(SimToken2Wav):
        def synthesize(self, batch, prompts):
            import time
            time.sleep(0.05)
            return super().synthesize(batch, prompts)

    with BackgroundServer(ServerConfig(port=0, max_batch=2, max_delay_ms=0, max_queue=2),
                          pipelines=[SpeechPipeline(Slow(), SimASR())]) as srv:
        cfg = cfg_for(srv.url, retries=30, backoff_s=0.05, max_fail_fraction=0.0)
        out = asyncio.run(gather_scores([(speech(t), t) for t in TEXTS * 3], cfg))
        assert all(isinstance(r, dict) and r["score"] == pytest.approx(1.0) for r in out), out
        import requests
        assert requests.get(f"{srv.url}/v2/models/token2wav_asr/stats").json()["rejected_queue_full"] > 0


# ---------------------------------------------------------------------------
# through verl 0.9.1's own loader and naive reward manager


def _tokenizer():
    """A tiny tokenizer extended by the vocabulary module, exactly as the converter does."""
    from ttsrl.embedded.tiny_tokenizer import train_tokenizer
    from ttsrl.model.vocab import extend_tokenizer

    tok = train_tokenizer(TEXTS * 5, 300)
    return tok, extend_tokenizer(tok, "cosyvoice2")


def _verl_scores(tok, sv, server_url, monkeypatch):
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager
    from verl.trainer.ppo.reward import get_custom_reward_fn

    monkeypatch.setenv(ENV_URL, server_url)
    config = OmegaConf.create({"reward": {"custom_reward_function": {
        "path": str(ROOT / "reward_tts.py"), "name": "compute_score", "reward_kwargs": {}}}})
    fn = get_custom_reward_fn(config)
    manager = NaiveRewardManager(config, tok, fn)
    assert manager.is_async_reward_score

    pairs = [(t, codec.encode(t)) for t in TEXTS] + [(TEXTS[0], codec.encode(TEXTS[2]))]
    prompt_len, resp_len = 4, max(len(c) for _, c in pairs) + 2
    prompts = torch.zeros(len(pairs), prompt_len, dtype=torch.long)
    responses = torch.full((len(pairs), resp_len), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(pairs), prompt_len + resp_len, dtype=torch.long)
    mask[:, :prompt_len] = 1
    for i, (_, codes) in enumerate(pairs):
        ids = sv.codes_to_ids(codes) + [sv.eos_id]
        responses[i, :len(ids)] = torch.tensor(ids)
        mask[i, prompt_len:prompt_len + len(ids)] = 1
    data = DataProto.from_dict(
        tensors={"prompts": prompts, "responses": responses, "attention_mask": mask},
        non_tensors={"data_source": np.array(["tts"] * len(pairs), dtype=object),
                     "reward_model": np.array([{"ground_truth": t} for t, _ in pairs], dtype=object),
                     "extra_info": np.array([{"index": i} for i in range(len(pairs))], dtype=object)})

    async def step():  # what RewardLoopWorker.compute_score_batch does
        return await asyncio.gather(*(manager.run_single(data[i:i + 1]) for i in range(len(data))))

    return manager.loop.run_until_complete(step())


def test_through_verl_naive_reward_manager(server, monkeypatch):
    tok, sv = _tokenizer()
    # verl decodes responses with skip_special_tokens=True: speech tokens must survive it
    assert tok.decode(sv.codes_to_ids([1, 2]) + [sv.eos_id], skip_special_tokens=True) == "<|s_1|><|s_2|>"
    outs = _verl_scores(tok, sv, server.url, monkeypatch)
    scores = [o["reward_score"] for o in outs]
    assert scores[:4] == pytest.approx([1.0] * 4) and scores[4] < 0.3
    assert all(set(o["reward_extra_info"]) == KEYS for o in outs)  # same keys for every sample
    # what verl's reward loop does with the extra info: one column per key
    cols = {k: np.array([o["reward_extra_info"][k] for o in outs]) for k in KEYS}
    assert cols["transcript"].dtype.kind == "U" and cols["error_rate"].dtype == np.float64


def test_by_hand_cli(server, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": t, "code": codec.encode(t)}, ensure_ascii=False) + "\n"
                            for t in TEXTS[:3]) +
                    json.dumps({"text": TEXTS[0], "code": []}, ensure_ascii=False) + "\n", encoding="utf-8")
    res = subprocess.run([sys.executable, str(ROOT / "reward_tts.py"), "--input", str(rows), "--url", server.url],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 4
    assert all("reward 1.0000" in line for line in lines[:3]) and "reward 0.0000" in lines[3]
    assert all("\tsim -\t" in line for line in lines)  # the sim backend measures no SIM: absent, not 0.000
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "你好", "code": [1, 2]}\n{"text": "你好"}\n', encoding="utf-8")
    res = subprocess.run([sys.executable, str(ROOT / "reward_tts.py"), "--input", str(bad), "--url", server.url],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "bad.jsonl:2" in res.stderr
    # a dead server: every line reported FAILED, non-zero exit
    res = subprocess.run([sys.executable, str(ROOT / "reward_tts.py"), "--input", str(rows), "--url", dead_url()],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "TTSRL_REWARD_RETRIES": "1", "TTSRL_REWARD_BACKOFF_S": "0.01"})
    assert res.returncode == 1 and res.stdout.count("FAILED") == 3
