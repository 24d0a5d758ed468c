"""One bad text must not fail its neighbours.

A real reward server on loopback (the CLI, and a BackgroundServer with a backend
that fails on one input), a real client with retries.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import unicodedata
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from helpers import start_reward_server, stop_process

from ttsrl.embedded import codec
from ttsrl.reward.backends import SpeechPipeline
from ttsrl.reward.backends.sim import SimASR, SimToken2Wav
from ttsrl.reward.client import RequestFailed, RewardClientConfig, request_reward
from ttsrl.reward.server import BackgroundServer, ServerConfig
from ttsrl.text import normalize, pinyin, unreadable

MODEL = "token2wav_asr"
VALID = ["今天天气很好，我们去公园散步。", "我想喝一杯热茶。", "这本书非常有意思。", "他在二零二三年去了北京。"]
# digits of non-Latin scripts: Arabic-Indic, extended Arabic-Indic, Devanagari, Thai, Bengali
POISON = ["价格是٣٤元", "价格是۳۴元", "一共३४个人", "第๓๔页", "房间১২号"]


def payload(codes: list[int], text: str) -> dict:
    return {"inputs": [
        {"name": "TOKENS", "shape": [1, len(codes)], "datatype": "INT32", "data": codes},
        {"name": "TOKEN_LENS", "shape": [1, 1], "datatype": "INT32", "data": [len(codes)]},
        {"name": "GT_TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [text]},
    ]}


def post_all(url: str, jobs: list[tuple[list[int], str]]) -> list[requests.Response]:
    """Send every job at the same moment (one batch on the server)."""
    barrier = threading.Barrier(len(jobs))

    def one(job):
        barrier.wait()
        return requests.post(f"{url}/v2/models/{MODEL}/infer", json=payload(*job), timeout=60)

    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(one, jobs))


# ---------------------------------------------------------------------------
# the normaliser never raises


def test_normalise_reads_digits_of_every_script():
    assert normalize("价格是٣٤元") == normalize("价格是34元") == "价格是三十四元"
    assert normalize("一共३४个人") == "一共三十四个人"
    assert pinyin("第๓๔页") == pinyin("第34页")


def test_normalise_never_raises_on_any_unicode_number_or_a_sample_of_letters():
    numbers = [chr(cp) for cp in range(sys.maxunicode + 1) if unicodedata.category(chr(cp))[0] == "N"]
    letters = [chr(cp) for cp in range(0, sys.maxunicode + 1, 97) if unicodedata.category(chr(cp))[0] == "L"]
    for ch in numbers + letters:
        for text in (ch, f"价格是{ch}{ch}元", f"1{ch}2", f"{ch}.{ch}%", f"{ch}:{ch}{ch}"):
            normalize(text)
            unreadable(text)


def test_unreadable_flags_numbers_left_as_symbols_and_nothing_to_speak():
    assert unreadable("价格是٣٤元") is None
    assert unreadable("hello 42") is None
    why = unreadable("第〡名")  # U+3021 HANGZHOU NUMERAL ONE: no rule reads it
    assert why and "U+3021" in why and "cannot read" in why
    assert "nothing to speak" in unreadable("。。！")


# ---------------------------------------------------------------------------
# a real server: 20 valid + 5 poison requests at once


@pytest.fixture(scope="module")
def batching_server():
    proc, url = start_reward_server("--backend", "sim", "--max-batch", "64", "--max-delay-ms", "300",
                                    "--log-level", "WARNING")
    yield url
    stop_process(proc)


def test_twenty_valid_and_five_poison_requests_at_once(batching_server):
    valid = [(codec.encode(VALID[i % 4]), VALID[i % 4]) for i in range(20)]
    poison = [(codec.encode(normalize(t)), t) for t in POISON]
    jobs = valid[:10] + poison + valid[10:]
    rsps = post_all(batching_server, jobs)
    codes = [r.status_code for r in rsps]
    assert codes[:10] + codes[15:] == [200] * 20, [r.text[:200] for r in rsps]
    for r in rsps[:10] + rsps[15:]:
        assert r.json()["outputs"][0]["data"][0] == pytest.approx(1.0)
    # the poison texts are read (digits of any script): each gets its own correct answer
    for r in rsps[10:15]:
        assert r.status_code == 200 and r.json()["outputs"][0]["data"][0] == pytest.approx(1.0)
    stats = requests.get(f"{batching_server}/v2/models/{MODEL}/stats", timeout=5).json()
    assert stats["backend_errors"] == 0 and stats["max_batch_size"] > 1


def test_a_text_the_normaliser_cannot_read_gets_422_alone(batching_server):
    bad = ("第〡名", [5, 6, 7, 8])
    jobs = [(codec.encode(VALID[i % 4]), VALID[i % 4]) for i in range(6)] + [(bad[1], bad[0])]
    rsps = post_all(batching_server, jobs)
    assert [r.status_code for r in rsps] == [200] * 6 + [422]
    assert "U+3021" in rsps[-1].json()["error"]


# ---------------------------------------------------------------------------
# a backend that fails on one input: only that item fails, and is not retried

BOOM = [7] * 13  # the codes this backend cannot voice


class Fragile(SimToken2Wav):
    def __init__(self, exc: type[Exception]):
        super().__init__()
        self.exc = exc

    def synthesize(self, batch, prompts):
        if any(list(c) == BOOM for c in batch):
            raise self.exc("cannot voice these codes")
        return super().synthesize(batch, prompts)


@pytest.mark.parametrize("exc,status", [(ValueError, 422), (RuntimeError, 500)])
def test_an_item_whose_scoring_raises_fails_alone(exc, status):
    cfg = ServerConfig(port=0, max_batch=64, max_delay_ms=300)
    with BackgroundServer(cfg, pipelines=[SpeechPipeline(Fragile(exc), SimASR())]) as srv:
        jobs = [(codec.encode(VALID[i % 4]), VALID[i % 4]) for i in range(20)]
        jobs[7:7] = [(BOOM, "坏的请求")] * 5
        rsps = post_all(srv.url, jobs)
        got = [r.status_code for r in rsps]
        assert got == [200] * 7 + [status] * 5 + [200] * 13, got
        assert "cannot voice these codes" in rsps[7].json()["error"]


def test_a_batch_split_by_one_bad_item_is_counted():
    """A batch of 32 where one item's synthesis raises. Only that item
    gets its error; the 31 others their rewards; the batch that was scored item by item is
    counted in /stats (split_batches) and in /metrics (ttsrl_batches_split_total)."""
    from prometheus_client.parser import text_string_to_metric_families

    cfg = ServerConfig(port=0, max_batch=32, max_delay_ms=2000)
    with BackgroundServer(cfg, pipelines=[SpeechPipeline(Fragile(RuntimeError), SimASR())]) as srv:
        jobs = [(codec.encode(VALID[i % 4]), VALID[i % 4]) for i in range(31)]
        jobs.insert(13, (BOOM, "坏的请求"))
        rsps = post_all(srv.url, jobs)
        got = [r.status_code for r in rsps]
        assert got == [200] * 13 + [500] + [200] * 18, got
        assert all(r.json()["outputs"][0]["data"][0] == pytest.approx(1.0) for i, r in enumerate(rsps) if i != 13)
        stats = requests.get(f"{srv.url}/v2/models/{MODEL}/stats", timeout=5).json()
        assert stats["max_batch_size"] == 32 and stats["split_batches"] == 1, stats
        metrics = requests.get(f"{srv.url}/metrics", timeout=5).text
        values = {s.name: s.value for f in text_string_to_metric_families(metrics) for s in f.samples}
        assert values["ttsrl_batches_split_total"] == 1, metrics


def test_the_client_does_not_retry_an_answer_that_will_never_change():
    cfg = ServerConfig(port=0, max_batch=8, max_delay_ms=0)
    with BackgroundServer(cfg, pipelines=[SpeechPipeline(Fragile(ValueError), SimASR())]) as srv:
        ccfg = RewardClientConfig(url=srv.url, retries=3, backoff_s=0.01)
        with pytest.raises(RequestFailed) as ei:
            asyncio.run(request_reward(BOOM, "坏的请求", ccfg))
        assert ei.value.refused and "HTTP 422" in str(ei.value)
        stats = requests.get(f"{srv.url}/v2/models/{MODEL}/stats", timeout=5).json()
        assert stats["requests"] == 1  # one attempt, no retries


def test_the_server_has_the_readers_length_limits(batching_server):
    """The same limits as stage 0 and the pair readers (ttsrl.limits)."""
    from ttsrl.limits import MAX_SPEECH_CODES, MAX_TEXT_CHARS

    url = f"{batching_server}/v2/models/{MODEL}/infer"
    r = requests.post(url, json=payload(codec.encode("你好"), "好" * (MAX_TEXT_CHARS + 1)), timeout=60)
    assert r.status_code == 422 and f"more than the limit of {MAX_TEXT_CHARS}" in r.json()["error"]
    r = requests.post(url, json=payload([1] * (MAX_SPEECH_CODES + 1), "你好"), timeout=60)
    assert 400 <= r.status_code < 500 and str(MAX_SPEECH_CODES) in r.json()["error"]
    r = requests.post(url, json=payload(codec.encode("好" * MAX_TEXT_CHARS)[:MAX_SPEECH_CODES], "好" * MAX_TEXT_CHARS),
                      timeout=60)
    assert r.status_code == 200


def test_a_grpo_step_with_eight_poison_rows_among_64_trains(batching_server):
    """The issue's GRPO scenario: verl's reward function over one step's 64 responses,
    8 of them for a reference text with Arabic-Indic digits. None fails."""
    from ttsrl.reward.client import score_all

    rows = [(codec.encode(VALID[i % 4]), VALID[i % 4]) for i in range(56)]
    rows += [(codec.encode(normalize(POISON[i % 5])), POISON[i % 5]) for i in range(8)]
    cfg = RewardClientConfig(url=batching_server, retries=1, backoff_s=0.01, max_fail_fraction=0.1)
    out = asyncio.run(score_all(rows, cfg))
    assert [r["reward_failed"] for r in out] == [0.0] * 64
    assert all(r["score"] == pytest.approx(1.0) for r in out)


def test_a_step_failed_by_refused_requests_blames_the_data_not_the_server():
    from ttsrl.reward.client import RewardServiceError, score_all

    cfg = ServerConfig(port=0, max_batch=64, max_delay_ms=100)
    with BackgroundServer(cfg, pipelines=[SpeechPipeline(Fragile(ValueError), SimASR())]) as srv:
        rows = [(codec.encode(VALID[i % 4]), VALID[i % 4]) for i in range(56)] + [(BOOM, "坏的请求")] * 8
        ccfg = RewardClientConfig(url=srv.url, retries=2, backoff_s=0.01, max_fail_fraction=0.1,
                                  fail_window=64)  # judged over these 64: 8 refused is over 10%
        with pytest.raises(RewardServiceError) as ei:
            asyncio.run(score_all(rows, ccfg))
        assert "refused that request as invalid" in str(ei.value) and "坏的请求" in str(ei.value)
        assert "Is the reward server" not in str(ei.value)
        stats = requests.get(f"{srv.url}/v2/models/{MODEL}/stats", timeout=5).json()
        assert stats["requests"] == 64  # the refused ones were not retried
